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
    """One tensor of a safetensors file (checkpoint_names.TensorSource). Each read opens the file
    anew: safetensors maps the file, and the pages a read touched stay in the process's resident
    memory until the file closes, so a file kept open while a layer's slices are read would hold
    the layer's bytes beside the model (measured with bench/big_model.py)."""

    file: Path
    name: str
    shape: tuple[int, ...]
    device: str

    def read(self, dim: int, start: int, end: int) -> torch.Tensor:
        """Indices [start, end) of dimension `dim`; a tensor of no dimensions (a scale) whole."""
        with safe_open(self.file, framework="pt", device=self.device) as shard:
            if not self.shape:
                return shard.get_tensor(self.name)
            tensor = shard.get_slice(self.name)
            return tensor[start:end] if len(self.shape) == 1 or dim == 0 else tensor[:, start:end]


def read_safetensors(folder: Path, device: torch.device | str = "cpu") -> Iterator[tuple[str, SafetensorsSlice]]:
    """Every tensor of the folder, unread, file by file; a slice read from one lands on `device`."""
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt") as shard:
            shapes = {name: tuple(shard.get_slice(name).get_shape()) for name in shard.keys()}  # noqa: SIM118 (no __iter__)
        for name, shape in shapes.items():
            yield name, SafetensorsSlice(file, name, shape, str(device))
