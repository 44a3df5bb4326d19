"""A GGUF of each architecture, written from transformers' own tiny checkpoint the way llama.cpp's
convert_hf_to_gguf writes one (tensor names from gguf-py's per-architecture tables, llama's Q/K
rows permuted, Gemma 2's norms stored as 1 + w, Phi-3's fused projections and longrope factor
tensors, each architecture's metadata keys), loads through Tandem to transformers' logits."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from hf_models import hf_logits, hf_model

from tandem.kernels.attention_reference import paged_attention_reference
from tandem.models.gguf_weights import read_gguf
from tandem.models.loader import load_model
from tandem.models.tokenizer_spm import BYTE_PIECES

PROMPT = [1, 17, 300, 42, 42, 9, 250, 77, 5, 130, 64, 200, 33, 3, 480, 91]
LOGITS_ATOL = 2e-4
# What a GGUF can say of each architecture: llama.cpp's llama arch (Mistral's too) has no sliding
# window, and a Gemma 2 GGUF's attention scale is the head size's (llama.cpp's rule below 27B).
GGUF_EXPRESSIBLE: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},
    "qwen3": {},
    "gemma2": {"query_pre_attn_scalar": 16},
    "phi3": {},
}
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "phi3": "phi3"}


def llama_cpp_permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute: each head's rotary halves interleaved."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_converted_gguf(path: Path, model: Any) -> None:
    config = model.config
    arch = GGUF_ARCH[config.model_type]
    gguf_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(gguf_arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, arch)
    _write_metadata(writer, config, arch)
    _write_vocabulary(writer, config.vocab_size)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        if arch == "gemma2" and hf_name.endswith("norm.weight"):
            data = data + 1
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        writer.add_tensor(name, np.ascontiguousarray(data.numpy()))
    if arch == "phi3":
        rope = config.rope_parameters
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_metadata(writer: gguf.GGUFWriter, config: Any, arch: str) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "head_dim", None) is not None:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch != "gemma2":  # llama.cpp's Gemma 2 converter writes no rope base: its default 10000 holds
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if arch == "phi3":
        rope = config.rope_parameters
        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_sliding_window(config.sliding_window or 0)


def _write_vocabulary(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """A SentencePiece vocabulary of the model's size (its text is not what this test checks)."""
    tokens = ["<unk>", "<s>", "</s>", *BYTE_PIECES]
    tokens += [f"▁w{i}" for i in range(vocab_size - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types([2, 3, 3] + [6] * len(BYTE_PIECES) + [1] * (len(tokens) - 3 - len(BYTE_PIECES)))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


@pytest.mark.parametrize("architecture", GGUF_EXPRESSIBLE)
def test_converted_gguf_gives_transformers_logits(tmp_path: Path, architecture: str, paged_runner, paged_sequence):
    reference = hf_model(architecture, seed=3, **GGUF_EXPRESSIBLE[architecture])
    path = tmp_path / f"{architecture}.gguf"
    write_converted_gguf(path, reference)
    loaded = load_model(path, torch.float32, "cpu", paged_attention_reference, pack=False)
    assert loaded.config.architecture == GGUF_ARCH[architecture]
    runner = paged_runner(loaded.model, num_blocks=16, block_size=4)
    seq = paged_sequence(token_ids=list(PROMPT), block_ids=[9, 2, 14, 5, 11])
    logits = torch.cat([runner.step([(seq, n)])[0] for n in (7, 9)])
    torch.testing.assert_close(logits, hf_logits(reference, PROMPT), atol=LOGITS_ATOL, rtol=0)


def test_phi3_gguf_reads_longrope_and_gemma2_its_differences(tmp_path: Path):
    write_converted_gguf(tmp_path / "phi3.gguf", phi3 := hf_model("phi3", seed=1))
    config = read_gguf(tmp_path / "phi3.gguf").config()
    rope = phi3.config.rope_parameters
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "longrope"
    assert config.rope_scaling.long_factor == pytest.approx(rope["long_factor"])
    assert config.rope_scaling.short_factor == pytest.approx(rope["short_factor"])
    assert config.rope_scaling.original_max_position_embeddings == rope["original_max_position_embeddings"]
    assert config.sliding_window == phi3.config.sliding_window and config.sliding_layers is None

    write_converted_gguf(tmp_path / "gemma2.gguf", gemma := hf_model("gemma2", seed=1, query_pre_attn_scalar=16))
    config = read_gguf(tmp_path / "gemma2.gguf").config()
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (
        gemma.config.attn_logit_softcapping,
        gemma.config.final_logit_softcapping,
    )
    assert config.sliding_layers == tuple(kind == "sliding_attention" for kind in gemma.config.layer_types)
    assert config.norm_weight_offset == 0.0 and config.tie_word_embeddings


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen3"])
def test_transformers_reads_the_converted_gguf_as_the_checkpoint_it_came_from(tmp_path: Path, architecture: str):
    """The writer above is llama.cpp's layout as transformers' own GGUF reader understands it (its
    Gemma 2 and Phi-3 readers skip the soft-caps, sliding window and longrope keys, so those two are
    left out; Qwen3's reader skips key_length, given here)."""
    import transformers

    reference = hf_model(architecture, seed=3, **GGUF_EXPRESSIBLE[architecture])
    write_converted_gguf(tmp_path / "model.gguf", reference)
    extra = {"head_dim": reference.config.head_dim} if architecture == "qwen3" else {}
    read = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.float32, **extra)
    torch.testing.assert_close(hf_logits(read, PROMPT), hf_logits(reference, PROMPT), atol=1e-5, rtol=0)  # its default attention, not eager
