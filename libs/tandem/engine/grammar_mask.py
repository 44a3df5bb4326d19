"""The tokens each row's grammar allows next, as a [rows, vocab] bool mask for the sampler.

llguidance writes one bitmask row per matcher (bit t % 32 of 32-bit word t // 32 is token t),
computing the rows in parallel on its own threads; numpy's unpackbits turns the words' bytes
(little-endian: tokens in order) into one byte per token in a single C loop, about 0.1 ms for 32
rows of a 49,152-token vocabulary, where a torch gather through a byte table or 32 shifts per word
took 1-10 ms on a busy host (bench/structured_output.py measures the whole mask step).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence as SequenceOf

import llguidance
import numpy as np
import torch


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """One pool of mask threads per process, made when the first grammar asks for a mask."""
    return llguidance.LLExecutor()


def allowed_tokens(matchers: SequenceOf[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """Row i: True at the tokens matchers[i] allows next (a CPU bool tensor, len(matchers) x vocab_size)."""
    num_words = (vocab_size + 31) // 32
    bitmask = torch.zeros((len(matchers), num_words), dtype=torch.int32)
    _executor().unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), num_words * 4, len(matchers))
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)
