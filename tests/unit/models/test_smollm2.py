"""The embedded SmolLM2-135M-Instruct GGUF loads into a model that answers correctly."""

from __future__ import annotations

import pytest
from reference_model import reference_greedy

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_config_comes_from_the_gguf_metadata(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152 and c.max_position_embeddings == 8192
    assert c.tie_word_embeddings and smollm2.model.lm_head is None
    assert c.rope_theta == 100000.0 and c.rope_scaling is None and c.rms_norm_eps == pytest.approx(1e-5)
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)  # <|im_start|>, <|im_end|>


def test_greedy_answer_names_paris(smollm2):
    """Only a correct dequantisation and Q/K un-permutation produce a right answer."""
    prompt = smollm2.tokenizer.encode_chat(QUESTION)
    answer = reference_greedy(smollm2.model, prompt, max_new_tokens=12, eos_ids=smollm2.eos_token_ids)
    assert "Paris" in smollm2.tokenizer.decode(answer)


def test_paged_decode_of_the_real_model_matches_reference_greedy(smollm2, paged_runner, paged_sequence):
    """Nine query heads over three KV heads at real size, prompt in two chunks, then decode."""
    prompt = smollm2.tokenizer.encode_chat(QUESTION)
    expected = reference_greedy(smollm2.model, prompt, max_new_tokens=6)
    runner = paged_runner(smollm2.model, num_blocks=8, block_size=16)
    seq = paged_sequence(list(prompt), block_ids=[6, 1, 4])
    runner.step([(seq, 20)])
    logits = runner.step([(seq, len(prompt) - 20)])[0]
    generated = []
    for _ in expected:
        generated.append(int(logits[-1].argmax()))
        seq.token_ids.append(generated[-1])
        logits = runner.step([(seq, 1)])[0]
    assert generated == expected
