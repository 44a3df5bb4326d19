"""Prefix-cache keys: a stable 64-bit hash per full KV block, chained from its parent block.

The router computes the same keys for an incoming prompt and matches them against the KV events
workers publish, so the hash must be identical in every process and on every machine: blake2b
over an explicit byte layout, never Python's `hash()` (salted per process for str).

Byte layout hashed (all little-endian):
    parent: b"\\x00" for the first block, else b"\\x01" + parent hash as uint64
    namespace: its UTF-8 length as uint32, then the UTF-8 bytes
    tokens: the block's token ids, each as uint32

Namespaces keep tenants apart: blocks wholly inside the server's public system prefix use
PUBLIC_NAMESPACE (shared by everyone); every other block uses the tenant, so one tenant can never
hit, or time, another tenant's cached text. Because keys chain, a tenant block's key also differs
from any other tenant's even where the tokens match.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence as SequenceOf

PUBLIC_NAMESPACE = "public"


def block_hash(parent_hash: int | None, token_ids: SequenceOf[int], namespace: str) -> int:
    """The key of one full block: an unsigned 64-bit int, the same in every process."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"\x00" if parent_hash is None else b"\x01" + struct.pack("<Q", parent_hash))
    encoded = namespace.encode()
    digest.update(struct.pack("<I", len(encoded)) + encoded)
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(digest.digest(), "little")


def block_namespace(block_index: int, block_size: int, num_public_prefix_tokens: int, tenant: str) -> str:
    """PUBLIC_NAMESPACE for a block wholly inside the public prefix, else the tenant."""
    return PUBLIC_NAMESPACE if (block_index + 1) * block_size <= num_public_prefix_tokens else tenant


def prefix_block_hashes(
    token_ids: SequenceOf[int],
    *,
    tenant: str,
    num_public_prefix_tokens: int,
    block_size: int,
    num_blocks: int | None = None,
    parent_hash: int | None = None,
    first_block_index: int = 0,
) -> list[int]:
    """Chained keys of the full blocks of `token_ids` (the first `num_blocks` of them if given).

    `parent_hash` and `first_block_index` continue an existing chain: pass the key of block
    first_block_index - 1 and the tokens from first_block_index * block_size on.
    """
    num_full = len(token_ids) // block_size
    if num_blocks is not None:
        num_full = min(num_full, num_blocks)
    hashes: list[int] = []
    for i in range(num_full):
        index = first_block_index + i
        namespace = block_namespace(index, block_size, num_public_prefix_tokens, tenant)
        parent_hash = block_hash(parent_hash, token_ids[i * block_size : (i + 1) * block_size], namespace)
        hashes.append(parent_hash)
    return hashes
