"""Errors that stop a process at start with one line saying what to fix."""


class StartupError(Exception):
    """Bad configuration or a missing dependency; the message tells the operator what to change."""
