import os
from pathlib import Path

import pydantic
import pytest

from tandem.config import ApiKey, Settings, Tier, load_settings, parse_api_keys
from tandem.errors import StartupError


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path: Path):
    """Settings read the real environment and ./tandem.toml; start each test from neither."""
    for name in [n for n in os.environ if n.startswith("TANDEM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TANDEM_CONFIG", str(tmp_path / "absent.toml"))


def test_api_keys_parse_into_user_and_tier():
    keys = parse_api_keys("key1=user1:plus, key2=user2:free")
    assert keys == {"key1": ApiKey("user1", Tier.PLUS), "key2": ApiKey("user2", Tier.FREE)}


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ("key1=user1", "'key1=user1' must look like key=user:tier"),
        ("key1:plus", "must look like key=user:tier"),
        ("key1=user1:gold", "unknown tier 'gold'"),
        ("k=a:free,k=b:plus", "key 'k' is listed twice"),
        ("k=a b:free", "must look like"),
    ],
)
def test_malformed_api_keys_fail_with_one_line_naming_the_setting(monkeypatch, spec, complaint):
    monkeypatch.setenv("TANDEM_API_KEYS", spec)
    with pytest.raises(StartupError) as caught:
        load_settings()
    message = str(caught.value)
    assert message.startswith("TANDEM_API_KEYS: ")
    assert complaint in message
    assert "\n" not in message


def test_settings_come_from_env_then_toml(monkeypatch, tmp_path: Path):
    toml = tmp_path / "tandem.toml"
    toml.write_text('nats_url = "nats://from-toml:4222"\nredis_url = "redis://from-toml:6379/0"\n')
    monkeypatch.setenv("TANDEM_CONFIG", str(toml))
    monkeypatch.setenv("TANDEM_REDIS_URL", "redis://from-env:6379/1")
    settings = load_settings()
    assert settings.nats_url == "nats://from-toml:4222"
    assert settings.redis_url == "redis://from-env:6379/1"


def test_role_defaults_apply_until_a_port_is_set(monkeypatch):
    assert load_settings().http_port_for("chat") == 8080
    assert load_settings().http_port_for("decode") == 8084
    monkeypatch.setenv("TANDEM_HTTP_PORT", "9999")
    assert load_settings().http_port_for("chat") == 9999


@pytest.mark.parametrize(
    ("name", "value", "complaint"),
    [
        ("TANDEM_HTTP_PORT", "70000", "TANDEM_HTTP_PORT: 70000 is not a TCP port"),
        ("TANDEM_HTTP_PORT", "eighty", "TANDEM_HTTP_PORT: "),
        ("TANDEM_LOG_LEVEL", "chatty", "TANDEM_LOG_LEVEL: "),
        ("TANDEM_HEARTBEAT_INTERVAL_S", "60", "TANDEM_HEARTBEAT_INTERVAL_S: 60.0 s is outside"),
    ],
)
def test_bad_values_name_the_variable(monkeypatch, name, value, complaint):
    monkeypatch.setenv(name, value)
    with pytest.raises(StartupError, match=complaint):
        load_settings()


def test_settings_are_frozen():
    settings = load_settings()
    with pytest.raises(pydantic.ValidationError):
        settings.nats_url = "nats://elsewhere:4222"


def test_others_dial_the_advertised_host_not_a_wildcard(monkeypatch):
    import socket

    assert load_settings().reachable_host() == "127.0.0.1"
    monkeypatch.setenv("TANDEM_HOST", "0.0.0.0")
    assert load_settings().reachable_host() == socket.gethostname()
    monkeypatch.setenv("TANDEM_ADVERTISE_HOST", "decode")
    assert load_settings().reachable_host() == "decode"


def test_an_empty_model_path_means_the_embedded_model(monkeypatch):
    monkeypatch.setenv("TANDEM_MODEL_PATH", "")
    assert load_settings().model_path is None
    monkeypatch.setenv("TANDEM_MODEL_PATH", "/models/qwen.gguf")
    assert load_settings().model_path == Path("/models/qwen.gguf")


def test_the_readme_names_every_setting():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    missing = [f"TANDEM_{field.upper()}" for field in Settings.model_fields if f"`TANDEM_{field.upper()}`" not in readme]
    assert not missing, f"README.md does not mention {missing}"
