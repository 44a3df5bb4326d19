"""A Hugging Face model folder: config.json plus *.safetensors (one file, or shards listed in
model.safetensors.index.json). Reading yields Hugging Face-named tensors one at a time; writing
produces a folder this module (and Hugging Face) reads back.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.models.config import ModelConfig

SHARD_INDEX = "model.safetensors.index.json"


def read_hf_config(folder: Path) -> ModelConfig:
    """config.json, with end-of-sequence ids from generation_config.json added: instruct models
    often list their end-of-turn token only there."""
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    generation = folder / "generation_config.json"
    if not generation.is_file():
        return config
    eos = json.loads(generation.read_text()).get("eos_token_id")
    extra = [] if eos is None else (eos if isinstance(eos, list) else [eos])
    eos_ids = tuple(dict.fromkeys([*config.eos_token_ids, *(int(e) for e in extra)]))
    return dataclasses.replace(config, eos_token_ids=eos_ids)


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / SHARD_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    return sorted(folder.glob("*.safetensors"))


def read_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, shard.get_tensor(name)
