"""The converted copy of a GGUF gives what the GGUF gives, and a copy that is missing, broken or
unwritable only means the GGUF is read."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tandem.models import gguf_cache
from tandem.models.files import open_model
from tandem.models.gguf_weights import GgufCheckpoint, read_gguf
from tandem.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def embedded() -> tuple[Path, GgufCheckpoint]:
    path = open_model(None).path
    return path, read_gguf(path)


@pytest.mark.real_model
def test_a_converted_copy_gives_the_gguf_s_config_tokenizer_and_weight_bits(embedded, tmp_path):
    path, gguf = embedded
    config = gguf.config()
    assert gguf_cache.read_converted(path, tmp_path) is None

    converted = gguf_cache.convert(path, gguf, config, tmp_path)

    assert converted is not None and converted == gguf_cache.read_converted(path, tmp_path)
    assert converted.config() == config
    assert converted.metadata == gguf.metadata
    text = "Hello <|im_start|>user\nNaïve café, 2 + 2 = 4?"
    assert Tokenizer.from_gguf(converted.metadata).encode(text) == Tokenizer.from_gguf(gguf.metadata).encode(text)
    expected = dict(gguf.weights(config))
    got = dict(converted.weights())
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), name


def _fake_copy(root: Path, name: str, source: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / gguf_cache.SOURCE_FILE).write_text(source)
    return folder


@pytest.mark.real_model
def test_writing_a_copy_removes_other_copies_of_the_same_file_and_copies_of_files_that_are_gone(embedded, tmp_path):
    path, gguf = embedded
    older = _fake_copy(tmp_path, "model-older", str(path.resolve()))
    orphan = _fake_copy(tmp_path, "model-orphan", str(tmp_path / "deleted-venv" / "model.gguf"))
    other_file = tmp_path / "other.gguf"
    other_file.write_bytes(b"GGUF")
    kept = _fake_copy(tmp_path, "other-copy", str(other_file))

    converted = gguf_cache.convert(path, gguf, gguf.config(), tmp_path)

    assert converted is not None and converted.folder.is_dir()
    assert not older.exists() and not orphan.exists()
    assert kept.is_dir()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no scratch folder left


@pytest.mark.real_model
def test_a_truncated_copy_is_not_read(embedded, tmp_path, caplog):
    path, gguf = embedded
    converted = gguf_cache.convert(path, gguf, gguf.config(), tmp_path)
    assert converted is not None
    weights = converted.folder / gguf_cache.WEIGHTS_FILE
    with weights.open("r+b") as file:
        file.truncate(100)

    with caplog.at_level(logging.WARNING, logger="tandem.models.gguf_cache"):
        assert gguf_cache.read_converted(path, tmp_path) is None
    assert "cannot be read" in caplog.text


def test_a_cache_folder_that_is_a_file_means_no_copy_and_no_error(embedded, tmp_path):
    path, gguf = embedded
    root = tmp_path / "cache"
    root.write_text("not a folder")
    assert gguf_cache.convert(path, gguf, gguf.config(), root) is None
    assert gguf_cache.read_converted(path, root) is None


def test_a_model_over_the_size_limit_is_not_converted(embedded, tmp_path):
    path, gguf = embedded
    assert gguf_cache.convert(path, gguf, gguf.config(), tmp_path, max_bytes=100 << 20) is None  # SmolLM2: 538 MB
    assert list(tmp_path.iterdir()) == []
