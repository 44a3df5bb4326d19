"""Attention kernels over the paged KV cache (see tandem.engine.batch for the layout): a torch
reference, an optimised torch path for CPU, and a triton kernel for GPUs."""
