"""A GGUF written the way llama.cpp's converter writes one (reversed shapes, permuted Q/K rows,
quantised matrices) loads back into the weights it was made from."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from reference_model import random_model, reference_logits, tiny_config
from tokenizers import pre_tokenizers

from tandem.errors import StartupError
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.models.checkpoint_names import hf_state_dict, load_hf_weights
from tandem.models.config import ModelConfig
from tandem.models.llama import LlamaForCausalLM
from tandem.models.loader import load_model

Q = gguf.GGMLQuantizationType
# Largest error each storage type may add to a weight of std <= 0.2 (quantisation step / 2, and margin).
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.Q8_0: 5e-3, Q.Q4_1: 6e-2}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _storage(gguf_name: str) -> gguf.GGMLQuantizationType:
    if gguf_name.endswith("norm.weight"):
        return Q.F32
    if gguf_name == "blk.0.ffn_up.weight":
        return Q.Q4_1
    return Q.F16 if "attn" in gguf_name else Q.Q8_0


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf: str) -> str:
    if hf in _GGUF_NAMES:
        return _GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def write_gguf(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """What convert_hf_to_gguf.py does for a llama model, in miniature."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [*SPECIALS, *byte_chars, "Ġt", "he", "Ġthe", "<custom>"]
    tokens += [f"<unused{i}>" for i in range(config.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(byte_chars) + 3) + [4] + [1] * (len(tokens) - len(byte_chars) - 7))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(TEMPLATE)
    for hf, tensor in weights.items():
        name = _gguf_name(hf)
        data = tensor.numpy()
        if ".self_attn.q_proj." in hf:
            data = llama_cpp_permute(data, config.num_heads)
        elif ".self_attn.k_proj." in hf:
            data = llama_cpp_permute(data, config.num_kv_heads)
        storage = _storage(name)
        if storage == Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        elif storage == Q.F16:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), storage), raw_dtype=storage)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path: Path):
    config = tiny_config(tie_word_embeddings=False, max_position_embeddings=64)
    original = random_model(config, seed=3, attention=paged_attention_reference)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, config, hf_state_dict(original))
    return path, original


def test_every_weight_comes_back_within_its_quantisation_error(tiny_gguf):
    path, original = tiny_gguf
    loaded = load_model(path, torch.float32, "cpu", paged_attention_reference, pack=False)  # its weights by name
    assert loaded.config == original.config
    expected, actual = hf_state_dict(original), hf_state_dict(loaded.model)
    for name, tensor in expected.items():
        tolerance = TOLERANCE[_storage(_gguf_name(name))]
        torch.testing.assert_close(actual[name], tensor, atol=tolerance, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    # The loader builds on the meta device; derived state (the rotary table) must still be right:
    # the same weights in a model built the ordinary way give the same logits.
    rebuilt = LlamaForCausalLM(original.config, paged_attention_reference)
    load_hf_weights(rebuilt, actual.items())
    tokens = [5, 80, 200, 31, 7, 9]
    torch.testing.assert_close(reference_logits(loaded.model, tokens), reference_logits(rebuilt, tokens), atol=0, rtol=0)


def test_gguf_tokenizer_from_the_vocabulary_and_merges(tiny_gguf):
    tokenizer = load_model(tiny_gguf[0], torch.float32, "cpu", paged_attention_reference).tokenizer
    the = tokenizer.token_to_id("Ġthe")
    assert tokenizer.encode(" the") == [the]  # both merge levels applied
    assert tokenizer.encode("<|im_start|>user<custom>") == [1, *tokenizer.encode("user"), tokenizer.token_to_id("<custom>")]
    assert tokenizer.decode([1, the, tokenizer.token_to_id("<custom>"), 2]) == " the<custom>"  # control tokens dropped
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (1, (2,))


def test_a_tensor_the_model_has_no_place_for_is_refused(tmp_path: Path):
    config = tiny_config(max_position_embeddings=64)
    weights = hf_state_dict(random_model(config, seed=0, attention=paged_attention_reference))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # harmless for a tied model
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(config.hidden_size)
    write_gguf(tmp_path / "extra.gguf", config, weights)
    with pytest.raises(StartupError, match=r"unexpected tensors \['model.layers.0.self_attn.o_proj.bias'\]"):
        load_model(tmp_path / "extra.gguf", torch.float32, "cpu", paged_attention_reference)
