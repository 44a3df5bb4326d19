"""Tandem: disaggregated LLM serving over a message bus."""

__version__ = "0.1.0"
