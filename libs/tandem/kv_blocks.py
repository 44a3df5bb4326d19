"""The KV cache's block: its size in tokens, the unit of the KV cache (tandem.kernels.metadata),
the prefix cache and its block keys, and the KV handoff. A leaf module of its own, without torch,
because the router computes block keys in an image that has no torch."""

BLOCK_SIZE = 16
