"""Decode steps replayed as CUDA graphs: one launch a step instead of a few hundred.

A decode-only step of n sequences runs the graph captured for the smallest batch size B >= n
(SIZES, up to the engine's max_num_seqs). Every input the graph reads lives in a
static buffer that a step overwrites: token ids, positions, KV slots, context lengths and block
tables. The B - n padding rows are sequences of one token at position 0 in a scratch block of
the KV cache that no sequence owns (the cache's last block, which the engine allocates beside
the blocks it manages), so they write only there, read only finite values, and each real row is
computed as it would be in an eager step of B rows. The graph ends with the logits of all B rows;
the step samples the first n.

With `capture` False (a CPU) the same buffers, padding and bucket choice run eagerly, which is
how the tests check the padding on a machine without a GPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence as SequenceOf
from typing import Any

import torch

from tandem.kernels.metadata import AttentionMetadata
from tandem.models.llama import LlamaForCausalLM

# Batch sizes a graph is captured for (vLLM's list, cut at max_num_seqs): every size up to 4,
# then multiples of 8 (16 up to 64, 32 up to 256) so padding wastes at most ~1/8 of a step.
SIZES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(
        self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int, max_batch: int, max_context: int, capture: bool
    ) -> None:
        """`kv_cache`'s last block is the padding rows' scratch block; `max_context`: the longest
        context a graph serves (its block tables' width); `capture` False runs eagerly."""
        self._model = model
        self._kv_cache = kv_cache
        self._block_size = block_size
        self._scratch_slot = (kv_cache.shape[0] - 1) * block_size
        self.sizes = tuple(sorted({size for size in SIZES if size <= max_batch} | {max_batch}))
        self.max_blocks = -(-max_context // block_size)
        biggest = self.sizes[-1]
        device = kv_cache.device
        # [input ids | positions | slots] of `biggest` rows each (int64), the context lengths
        # (int32, as AttentionMetadata has them) and the block tables: three copies a step
        self._host = torch.zeros(3 * biggest, dtype=torch.int64, pin_memory=capture)
        self._inputs = torch.zeros(3 * biggest, dtype=torch.int64, device=device)
        self._host_lens = torch.zeros(biggest, dtype=torch.int32, pin_memory=capture)
        self._lens = torch.zeros(biggest, dtype=torch.int32, device=device)
        self._host_tables = torch.zeros(biggest, self.max_blocks, dtype=torch.int32, pin_memory=capture)
        self._tables = torch.zeros(biggest, self.max_blocks, dtype=torch.int32, device=device)
        self._query_start_loc = torch.arange(biggest + 1, dtype=torch.int32, device=device)  # one token a sequence
        self._biggest = biggest
        self._logits: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, Any] = {}
        self.num_steps = 0  # steps run through here
        if capture:
            self._capture_all()

    def graph_for(self, num_seqs: int) -> Any:
        """The captured graph a step of `num_seqs` rows replays (None when not captured), for benches."""
        return self._graphs.get(self._size_for(num_seqs)) if self.serves(num_seqs, 0) else None

    def serves(self, num_seqs: int, max_num_blocks: int) -> bool:
        return 0 < num_seqs <= self._biggest and max_num_blocks <= self.max_blocks

    def run(self, token_ids: SequenceOf[int], positions: SequenceOf[int], block_tables: SequenceOf[list[int]]) -> torch.Tensor:
        """(n, vocab) float32 logits of n decode rows: row i is token_ids[i] at positions[i] of the
        sequence whose blocks are block_tables[i] (serves() must hold)."""
        n = len(token_ids)
        self.num_steps += 1
        size = self._size_for(n)
        self._stage(size, token_ids, positions, block_tables)
        graph = self._graphs.get(size)
        if graph is None:
            return self._forward(size, max(positions) + 1)[:n]
        graph.replay()
        return self._logits[size][:n]

    def _size_for(self, num_seqs: int) -> int:
        """The smallest captured batch size that holds `num_seqs` rows."""
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def _stage(self, size: int, token_ids: SequenceOf[int], positions: SequenceOf[int], block_tables: SequenceOf[list[int]]) -> None:
        n, b, bs = len(token_ids), self._biggest, self._block_size
        host = self._host
        host.zero_()
        host[:n] = torch.tensor(token_ids, dtype=torch.int64)
        pos = torch.tensor(positions, dtype=torch.int64)
        host[b : b + n] = pos
        widest = max(len(table) for table in block_tables)
        tables = torch.tensor([table + [0] * (widest - len(table)) for table in block_tables], dtype=torch.int32)
        blocks = tables.gather(1, (pos // bs).unsqueeze(1)).squeeze(1).long()
        host[2 * b : 2 * b + n] = blocks * bs + pos % bs
        host[2 * b + n : 2 * b + size] = self._scratch_slot  # padding rows: position 0 of the scratch block
        self._host_lens[:n] = pos + 1
        self._host_lens[n:size] = 1
        self._host_tables[:n, :widest] = tables
        self._host_tables[n:size, 0] = self._scratch_slot // bs
        self._inputs.copy_(host, non_blocking=True)
        self._lens.copy_(self._host_lens, non_blocking=True)
        self._tables[:size, : max(widest, 1)].copy_(self._host_tables[:size, : max(widest, 1)], non_blocking=True)

    def _forward(self, size: int, max_seq_len: int) -> torch.Tensor:
        """The first `size` rows' logits; `max_seq_len` bounds their context lengths (a graph's: the
        tables' width)."""
        b = self._biggest
        meta = AttentionMetadata(
            slot_mapping=self._inputs[2 * b : 2 * b + size],
            query_start_loc=self._query_start_loc[: size + 1],
            seq_lens=self._lens[:size],
            block_tables=self._tables[:size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            is_decode_only=True,
        )
        hidden = self._model(self._inputs[:size], self._inputs[b : b + size], self._kv_cache, meta)
        return self._model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Each size's graph, biggest first, in one memory pool; the warm-up and captured runs are
        all padding rows, so they write only the scratch block."""
        pool = torch.cuda.graph_pool_handle()
        max_seq_len = self.max_blocks * self._block_size  # the tables' width: any context they serve
        for size in reversed(self.sizes):
            self._stage(size, [0], [0], [[self._scratch_slot // self._block_size]])
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # triton's compile, cuBLAS's workspace: not inside the capture
                    self._forward(size, max_seq_len)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread of the worker (its bus, UCX) may touch CUDA meanwhile
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._logits[size] = self._forward(size, max_seq_len)
            self._graphs[size] = graph
        torch.cuda.synchronize()
