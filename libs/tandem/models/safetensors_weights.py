"""A Hugging Face model folder: config.json plus *.safetensors (one file, or shards listed in
model.safetensors.index.json). Reading yields Hugging Face-named tensors not yet read, of which
the loader reads only its rank's slices (`get_slice`: the bytes of those rows or columns, no more).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class SafetensorsSlice:
    """One tensor of an open safetensors file (checkpoint_names.TensorSource)."""

    tensor: Any  # safetensors' PySafeSlice

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.get_shape())

    def read(self, dim: int, start: int, end: int) -> torch.Tensor:
        if len(self.shape) == 1 or dim == 0:
            return self.tensor[start:end]
        return self.tensor[:, start:end]


def read_safetensors(folder: Path, device: torch.device | str = "cpu") -> Iterator[tuple[str, SafetensorsSlice]]:
    """Every tensor of the folder, unread, file by file; a slice read from one lands on `device`.
    Use each before asking for the next: its file closes when the iteration moves on."""
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt", device=str(device)) as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, SafetensorsSlice(shard.get_slice(name))
