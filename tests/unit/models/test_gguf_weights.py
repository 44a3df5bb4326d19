"""A GGUF's header reads as gguf's own reader reads it; its tensors come back in Hugging Face's
layout and names."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

from tandem.models.gguf_weights import GgufTensor, hf_name, read_gguf, unpermute_rotary


def llama_cpp_permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim apart from numpy -> torch."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


@pytest.mark.parametrize(("num_heads", "head_dim"), [(9, 64), (3, 64), (4, 16)])
def test_unpermute_inverts_llama_cpp_rotary_permutation(num_heads, head_dim):
    weight = torch.randn(num_heads * head_dim, 40)
    permuted = llama_cpp_permute(weight, num_heads)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rotary(permuted, num_heads), weight)
    bias = torch.randn(num_heads * head_dim)
    assert torch.equal(unpermute_rotary(llama_cpp_permute(bias, num_heads), num_heads), bias)


def test_unpermuted_rows_pair_i_with_i_plus_half_head():
    """What the permutation means: llama.cpp's adjacent rotary pairs (2i, 2i+1) of a head are
    Hugging Face's rows (i, i + head_dim/2)."""
    head_dim = 8
    hf_rows = torch.arange(2 * head_dim, dtype=torch.float32).unsqueeze(1)  # two heads, row = its index
    gguf_rows = llama_cpp_permute(hf_rows, 2).squeeze(1).tolist()
    assert gguf_rows[:head_dim] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert gguf_rows[head_dim:] == [8, 12, 9, 13, 10, 14, 11, 15]


@pytest.mark.parametrize(
    ("gguf", "hf"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.12.ffn_norm.weight", "model.layers.12.post_attention_layernorm.weight"),
        ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight"),
        ("blk.3.attn_k.bias", "model.layers.3.self_attn.k_proj.bias"),
        ("blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.29.ffn_gate.weight", "model.layers.29.mlp.gate_proj.weight"),
        ("blk.29.ffn_up.weight", "model.layers.29.mlp.up_proj.weight"),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),
        ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_gate_exps.weight"),  # unknown: left for the loader to refuse
    ],
)
def test_gguf_names_map_to_hugging_face_names(gguf, hf):
    assert hf_name(gguf) == hf


def _gguf_reader_value(field: ReaderField) -> object:
    """A metadata value as gguf's own reader gives it (what read_gguf's header reading replaced)."""
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data]).tolist() if field.data else []
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]][0]
    return float(str(value)) if kind == GGUFValueType.FLOAT32 else value.item()


def test_the_header_reads_as_gguf_s_reader_reads_it(tmp_path: Path):
    """Every metadata value (strings, arrays, floats, bools) and every tensor's type, shape and bytes
    (float32, float16 and quantized blocks), on a file written by gguf's writer."""
    path = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list(["<s>", "héllo", ""])
    writer.add_token_scores([0.5, -1.25, 3.0])
    writer.add_bool("test.flag", True)
    writer.add_array("test.ints", [1, -2, 3])
    rows = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("a.weight", rows)
    writer.add_tensor("b.weight", rows.astype(np.float16))
    writer.add_tensor("c.weight", gguf.quants.quantize(rows, GGMLQuantizationType.Q4_1), raw_dtype=GGMLQuantizationType.Q4_1)
    writer.add_tensor("d.weight", rows[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = read_gguf(path), GGUFReader(path)
    expected = {name: _gguf_reader_value(field) for name, field in theirs.fields.items() if not name.startswith("GGUF.")}
    assert ours.metadata == expected and [type(v) for v in ours.metadata.values()] == [type(v) for v in expected.values()]
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert (mine.tensor_type, mine.shape, mine.n_elements) == (tensor.tensor_type, tuple(tensor.shape.tolist()), tensor.n_elements)
        assert mine.data.dtype == tensor.data.dtype and np.array_equal(mine.data, tensor.data), tensor.name


@pytest.mark.parametrize(
    "tensor_type", [GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1]
)
def test_a_slice_reads_as_the_same_slice_of_the_whole_tensor(tmp_path: Path, tensor_type):
    """Rows, whole-block columns (only their blocks dequantized) and columns inside blocks."""
    path = tmp_path / "w.gguf"
    rows = np.random.default_rng(2).standard_normal((6, 128)).astype(np.float32)
    data = {GGMLQuantizationType.F32: rows, GGMLQuantizationType.F16: rows.astype(np.float16)}.get(tensor_type)
    writer = gguf.GGUFWriter(path, "llama")
    if data is None:
        writer.add_tensor("w.weight", gguf.quants.quantize(rows, tensor_type), raw_dtype=tensor_type)
    else:
        writer.add_tensor("w.weight", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    source = GgufTensor(read_gguf(path).tensors["w.weight"])
    whole = source.read(0, 0, 6)
    assert whole.shape == (6, 128) and whole.dtype == torch.float32
    if tensor_type == GGMLQuantizationType.F32:
        assert torch.equal(whole, torch.from_numpy(rows))
    assert torch.equal(source.read(0, 2, 5), whole[2:5])
    for start, end in [(32, 96), (64, 128), (16, 48)]:
        assert torch.equal(source.read(1, start, end), whole[:, start:end]), (start, end)


def test_rope_freqs_are_read_as_the_config_s_frequency_factors(tmp_path: Path):
    path = tmp_path / "rope.gguf"
    factors = np.array([1.0, 1.5, 4.0, 8.0], dtype=np.float32)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("rope_freqs.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_gguf(path).rope_freq_factors() == (1.0, 1.5, 4.0, 8.0)
    assert read_gguf(path).tensors["rope_freqs.weight"].n_elements == 4
