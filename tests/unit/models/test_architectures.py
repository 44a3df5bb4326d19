"""Every architecture Tandem serves against transformers, the reference implementation: a tiny
random checkpoint written by transformers loads through Tandem's loader, and over a paged KV cache
(chunked prefill, then one token a step) its logits match transformers' and its greedy tokens are
transformers' own, for prompts longer than any sliding window, through every attention backend."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hf_models import ARCHITECTURES, hf_greedy, hf_logits, write_hf_checkpoint

from tandem.kernels import cpu_extension
from tandem.kernels.attention_cpu import paged_attention_cpu
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.kernels.attention_torch import paged_attention_torch
from tandem.kernels.metadata import AttentionFn
from tandem.models.llama import LlamaForCausalLM
from tandem.models.loader import load_model

PROMPT = [1, 17, 300, 42, 42, 9, 250, 77, 5, 130, 64, 200, 33, 3, 480, 91]  # longer than SLIDING_WINDOW twice over
NEW_TOKENS = 10
# fp32 logits: the same operations in another order (fused matmuls, paged attention) differ by
# rounding only; the architectures' differences move them by units
LOGITS_ATOL = 2e-4

BACKENDS: dict[str, AttentionFn] = {
    "reference": paged_attention_reference,
    "torch": paged_attention_torch,
    "cpu": paged_attention_cpu,
}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, object]:
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, write_hf_checkpoint(request.param, folder, seed=3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_and_logits_are_transformers(checkpoint, backend, paged_runner, paged_sequence):
    architecture, folder, reference = checkpoint
    if backend == "cpu" and not cpu_extension.load():
        pytest.skip("the C++ kernels do not build here")
    loaded = load_model(folder, torch.float32, "cpu", BACKENDS[backend], pack=backend == "cpu")
    assert loaded.config.architecture == architecture
    expected_logits = hf_logits(reference, PROMPT)
    expected_tokens = hf_greedy(reference, PROMPT, NEW_TOKENS)

    runner = paged_runner(loaded.model, num_blocks=16, block_size=4)
    seq = paged_sequence(token_ids=list(PROMPT), block_ids=[9, 2, 14, 5, 11, 0, 7, 3])
    logits = torch.cat([runner.step([(seq, n)])[0] for n in (5, 7, len(PROMPT) - 12)])
    torch.testing.assert_close(logits, expected_logits, atol=LOGITS_ATOL, rtol=0)
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < NEW_TOKENS:
        seq.token_ids.append(tokens[-1])
        tokens.append(int(runner.step([(seq, 1)])[0][-1].argmax()))
    assert tokens == expected_tokens


@pytest.mark.parametrize(
    "architecture, dropped",
    [
        ("mistral", {"sliding_window": None}),
        ("qwen3", {"qk_norm": False}),
        ("gemma2", {"attn_logit_softcap": None, "final_logit_softcap": None}),
        ("gemma2", {"sliding_window": None, "sliding_layers": None}),
    ],
)
def test_dropping_a_difference_departs_from_transformers(tmp_path, architecture, dropped, paged_runner, paged_sequence):
    """The comparison above can fail: the same weights with one of the architecture's differences
    dropped give logits far from transformers'."""
    reference = write_hf_checkpoint(architecture, tmp_path, seed=3)
    loaded = load_model(tmp_path, torch.float32, "cpu", paged_attention_reference, pack=False)
    plain = LlamaForCausalLM(replace(loaded.model.config, **dropped), paged_attention_reference)
    plain.load_state_dict(loaded.model.state_dict(), strict=False)  # a dropped q_norm's weights go unused
    seq = paged_sequence(token_ids=list(PROMPT), block_ids=[9, 2, 14, 5, 11])
    logits = paged_runner(plain, num_blocks=16, block_size=4).step([(seq, len(PROMPT))])[0]
    assert (logits - hf_logits(reference, PROMPT)).abs().max() > 100 * LOGITS_ATOL
