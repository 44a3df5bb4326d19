"""ModelConfig comes from the checkpoint's own description, in either format."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from reference_model import tiny_config

from tandem.errors import StartupError
from tandem.models.config import ModelConfig, RopeScaling
from tandem.models.rotary import inverse_frequencies

LLAMA_3_1_8B = {  # Meta-Llama-3.1-8B-Instruct's config.json, abridged
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def test_hf_config_of_llama_3_1():
    config = ModelConfig.from_hf(LLAMA_3_1_8B)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (32, 32, 8, 128)
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert config.max_position_embeddings == 131072 and not config.tie_word_embeddings
    assert config.bos_token_id == 128000 and config.eos_token_ids == (128001, 128008, 128009)


def test_hf_config_round_trips():
    for config in (ModelConfig.from_hf(LLAMA_3_1_8B), tiny_config(attention_bias=True)):
        assert ModelConfig.from_hf(config.to_hf()) == config


def test_llama3_scaling_slows_only_long_wavelengths():
    plain = inverse_frequencies(ModelConfig.from_hf({**LLAMA_3_1_8B, "rope_scaling": None}))
    scaled = inverse_frequencies(ModelConfig.from_hf(LLAMA_3_1_8B))
    wavelength = 2 * math.pi / plain
    short = wavelength < 8192 / 4.0  # under original window / high_freq_factor: kept
    long = wavelength > 8192 / 1.0  # over original window / low_freq_factor: divided by factor
    assert torch.equal(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8.0)
    between = ~short & ~long
    assert between.any() and ((scaled[between] < plain[between]) & (scaled[between] > plain[between] / 8.0)).all()


def test_gguf_metadata_with_tied_embeddings_and_qkv_bias():
    metadata = {
        "general.architecture": "qwen2",
        "qwen2.block_count": 2,
        "qwen2.context_length": 32768,
        "qwen2.embedding_length": 64,
        "qwen2.feed_forward_length": 128,
        "qwen2.attention.head_count": 4,
        "qwen2.attention.head_count_kv": 2,
        "qwen2.rope.freq_base": 1000000.0,
        "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.tokens": ["a"] * 300,
        "tokenizer.ggml.eos_token_id": 7,
    }
    config = ModelConfig.from_gguf(metadata, ["token_embd.weight", "blk.0.attn_q.bias"])
    assert config.vocab_size == 300 and config.head_dim == 16 and config.max_position_embeddings == 32768
    assert config.tie_word_embeddings and config.attention_bias
    assert config.bos_token_id is None and config.eos_token_ids == (7,)
    untied = ModelConfig.from_gguf(metadata, ["token_embd.weight", "output.weight"])
    assert not untied.tie_word_embeddings and not untied.attention_bias


def test_gguf_rope_freqs_divide_the_frequencies():
    base = tiny_config()
    factors = tuple(float(i + 1) for i in range(base.head_dim // 2))
    divided = inverse_frequencies(dataclasses.replace(base, rope_freq_factors=factors))
    torch.testing.assert_close(divided, inverse_frequencies(base) / torch.tensor(factors, dtype=torch.float64))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ModelConfig.from_gguf({"general.architecture": "falcon"}, []), "architecture 'falcon'"),
        (lambda: ModelConfig.from_hf({**LLAMA_3_1_8B, "model_type": "mixtral"}), "model_type 'mixtral'"),
        (lambda: ModelConfig.from_hf({**LLAMA_3_1_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4}}), "'yarn'"),
    ],
)
def test_unsupported_checkpoints_are_refused_by_name(build, message):
    with pytest.raises(StartupError, match=message):
        build()
