"""A GGUF checkpoint read once: its metadata as JSON and its weights dequantized to float32
safetensors, in the user's cache folder, found again by the file's path, size and mtime.

Reading the embedded SmolLM2 GGUF costs seconds of CPU: the gguf reader walks its ~150,000
metadata parts (the vocabulary and merges) one numpy view at a time, and 135 M weights are
dequantized in numpy. Every worker and chat instance start paid it, and on a shared machine a
restarting worker took it from the workers still serving. The converted copy is read in a
fraction of a second and gives the same config, tokenizer and weight bits (tests/unit/models/
test_gguf_cache.py).

The folder is `$XDG_CACHE_HOME/tandem/gguf` (`~/.cache/tandem/gguf`). A copy is written to a
temporary folder and renamed into place, so a reader sees a whole copy or none, and processes
starting together each write their own and one rename wins. A copy that cannot be written or
read is not an error: the GGUF is read as before and the reason logged. A model over
MAX_CONVERTED_BYTES of float32 weights is not converted. Writing a copy removes
older copies of the same file (another size or mtime) and copies of files that are gone."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open, save_file

from tandem.models.config import ModelConfig
from tandem.models.gguf_weights import GgufCheckpoint

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when what a copy holds, or how weights are converted, changes
METADATA_FILE = "metadata.json"
WEIGHTS_FILE = "model.safetensors"
SOURCE_FILE = "source"  # the GGUF's resolved path
# A model whose float32 weights are larger is not converted (a 7B GGUF would take 28 GB of disk,
# and as much memory while it is written): it is read from the GGUF every time.
MAX_CONVERTED_BYTES = 4 << 30


@dataclass(frozen=True)
class ConvertedGguf:
    """What the loader needs from a GGUF, without the GGUF."""

    folder: Path
    metadata: dict[str, Any]
    tensor_names: tuple[str, ...]  # the GGUF's own tensor names (the config reads them)
    rope_freq_factors: tuple[float, ...] | None

    def config(self) -> ModelConfig:
        return ModelConfig.from_gguf(self.metadata, self.tensor_names, self.rope_freq_factors)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor), one at a time, as GgufCheckpoint.weights gives them."""
        with safe_open(self.folder / WEIGHTS_FILE, framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, weights.get_tensor(name)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tandem" / "gguf"


def folder_for(path: Path, root: Path | None = None) -> Path:
    source = path.resolve()
    stat = source.stat()
    key = hashlib.sha256(f"{FORMAT_VERSION}\0{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:20]
    return (root or cache_root()) / f"{source.stem}-{key}"


def read_converted(path: Path, root: Path | None = None) -> ConvertedGguf | None:
    """The converted copy of the GGUF at `path`, or None when there is none (or it is unreadable)."""
    try:
        folder = folder_for(path, root)
        if not (folder / METADATA_FILE).is_file():
            return None
        saved = json.loads((folder / METADATA_FILE).read_text())
        factors = saved["rope_freq_factors"]
        with safe_open(folder / WEIGHTS_FILE, framework="pt"):
            pass  # the header reads: the file is whole
        return ConvertedGguf(
            folder=folder,
            metadata=saved["metadata"],
            tensor_names=tuple(saved["tensor_names"]),
            rope_freq_factors=None if factors is None else tuple(factors),
        )
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        log.warning("the converted copy of %s cannot be read (%s: %s); reading the GGUF", path, type(exc).__name__, exc)
        return None


def convert(
    path: Path, gguf: GgufCheckpoint, config: ModelConfig, root: Path | None = None, max_bytes: int = MAX_CONVERTED_BYTES
) -> ConvertedGguf | None:
    """Writes the converted copy of `gguf` (read from `path`) and returns it; None when it cannot
    be written, or the model is too large to convert (the caller reads the GGUF's weights itself)."""
    num_bytes = 4 * sum(int(tensor.n_elements) for tensor in gguf.tensors.values())
    if num_bytes > max_bytes:
        log.info("%s is not converted: its float32 weights would take %.1f GiB", path, num_bytes / 2**30)
        return None
    scratch: Path | None = None
    try:
        folder = folder_for(path, root)
        folder.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".writing-"))
        save_file(dict(gguf.weights(config)), str(scratch / WEIGHTS_FILE))
        factors = gguf.rope_freq_factors()
        saved = {"metadata": gguf.metadata, "tensor_names": list(gguf.tensors), "rope_freq_factors": factors}
        (scratch / METADATA_FILE).write_text(json.dumps(saved))
        (scratch / SOURCE_FILE).write_text(str(path.resolve()))
        try:
            scratch.rename(folder)
            scratch = None
        except OSError:
            if not (folder / METADATA_FILE).is_file():
                raise
            # another process renamed its copy into place first: that one is read
        _remove_stale_copies(folder)
    except (OSError, ValueError, TypeError, SafetensorError) as exc:
        log.warning("no converted copy of %s could be written (%s: %s); it is read from the GGUF", path, type(exc).__name__, exc)
        return None
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return read_converted(path, root)


def _remove_stale_copies(current: Path) -> None:
    """Copies of the same file at another size or mtime, and copies whose file is gone (a deleted
    virtual environment's), are removed."""
    source = (current / SOURCE_FILE).read_text()
    for other in current.parent.iterdir():
        if other == current or not other.is_dir() or other.name.startswith("."):
            continue
        try:
            other_source = (other / SOURCE_FILE).read_text()
        except OSError:
            continue  # not a copy, or one being removed
        if other_source == source or not Path(other_source).exists():
            shutil.rmtree(other, ignore_errors=True)
