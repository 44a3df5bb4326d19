"""A Hugging Face folder (config.json, safetensors, tokenizer files) loads into the same model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from reference_model import random_model, reference_logits, save_safetensors_folder, tiny_config, write_tokenizer
from safetensors.torch import save_file

from tandem.errors import StartupError
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.models.checkpoint_names import hf_state_dict
from tandem.models.loader import load_model
from tandem.models.packed import pack_model
from tandem.models.safetensors_weights import SHARD_INDEX

TOKENS = [7, 300, 42, 511, 3, 99, 100]


@pytest.mark.parametrize("tied", [True, False])
def test_saved_folder_loads_back_to_the_same_logits(tmp_path: Path, tied: bool):
    original = random_model(tiny_config(tie_word_embeddings=tied), seed=5, attention=paged_attention_reference)
    save_safetensors_folder(original, tmp_path)
    write_tokenizer(tmp_path)
    loaded = load_model(tmp_path, torch.float32, "cpu", paged_attention_reference)
    assert loaded.config.eos_token_ids == (2, 0)  # config.json's, then generation_config.json's
    expected = reference_logits(pack_model(copy.deepcopy(original)), TOKENS)  # packed as the loader packs, where the CPU serves it
    torch.testing.assert_close(reference_logits(loaded.model, TOKENS), expected, atol=0, rtol=0)
    ids = loaded.tokenizer.encode("<|im_start|>the fox<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and loaded.tokenizer.decode(ids) == "the fox"
    assert loaded.tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"
    assert (loaded.tokenizer.bos_token_id, loaded.tokenizer.eos_token_ids) == (1, (2,))


def test_sharded_folder_with_index(tmp_path: Path):
    original = random_model(tiny_config(), seed=6, attention=paged_attention_reference)
    save_safetensors_folder(original, tmp_path)
    write_tokenizer(tmp_path)
    weights = hf_state_dict(original)
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    (tmp_path / "model.safetensors").unlink()
    for file, shard_names in shards.items():
        save_file({n: weights[n] for n in shard_names}, str(tmp_path / file))
    (tmp_path / "stray.safetensors").write_bytes(b"not listed in the index, never read")
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (tmp_path / SHARD_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = load_model(tmp_path, torch.bfloat16, "cpu", paged_attention_reference)
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(loaded.model.model.embed_tokens.weight, original.model.embed_tokens.weight.bfloat16())


def test_a_missing_tensor_is_named(tmp_path: Path):
    original = random_model(tiny_config(), seed=7, attention=paged_attention_reference)
    save_safetensors_folder(original, tmp_path)
    write_tokenizer(tmp_path)
    weights = hf_state_dict(original)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(StartupError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_model(tmp_path, torch.float32, "cpu", paged_attention_reference)
