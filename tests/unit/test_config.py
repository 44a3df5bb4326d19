import html
import importlib
import os
import re
import sys
import types
import typing
from pathlib import Path

import pydantic
import pytest

from tandem.config import ApiKey, Settings, Tier, load_settings, parse_api_keys
from tandem.errors import StartupError

DOCS = Path(__file__).resolve().parents[2] / "docs"


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


def settings_page_rows() -> dict[str, list[list[str]]]:
    """The generated settings page's table rows, as their cells, by the setting each one names."""
    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        markdown = importlib.import_module("settings_page").render_settings(Settings)
    finally:
        sys.path.remove(str(DOCS / "hooks"))
    rows: dict[str, list[list[str]]] = {}
    for line in markdown.splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        if anchor := re.match(r'<a id="(\w+)"></a>', cells[0] if cells else ""):
            rows.setdefault(anchor[1], []).append(cells)
    return rows


def as_read(cell: str) -> str:
    """A Markdown cell as a reader sees it: escapes undone."""
    return html.unescape(re.sub(r"\\(.)", r"\1", cell))


def test_the_generated_settings_page_lists_every_setting_once_with_its_variable_type_default_and_docstring():
    rows = settings_page_rows()
    assert sorted(rows) == sorted(Settings.model_fields), "one row per setting, and none for anything else"
    kinds = {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path", pydantic.SecretStr: "secret string"}
    for name, field in Settings.model_fields.items():
        assert len(rows[name]) == 1, f"{name} has {len(rows[name])} rows"
        setting, kind, default, description = rows[name][0]
        assert f"`TANDEM_{name.upper()}`" in setting and f"`--{name.replace('_', '-')}`" in setting, f"{name}: {setting}"
        base = (
            typing.get_args(field.annotation)[0]
            if typing.get_origin(field.annotation) in (typing.Union, types.UnionType)
            else field.annotation
        )
        if typing.get_origin(base) is typing.Literal:
            assert all(f"`{choice}`" in kind for choice in typing.get_args(base)), f"{name}: {kind}"
        elif base in kinds and name != "api_keys":
            assert kind.startswith(kinds[base]), f"{name}: {kind}"
        value = field.default.get_secret_value() if isinstance(field.default, pydantic.SecretStr) else field.default
        expected = (
            "unset" if value is None else "empty" if value in ("", {}) else f"`{str(value).lower() if isinstance(value, bool) else value}`"
        )
        assert default == expected, f"{name}: {default} != {expected}"
        assert as_read(description) == " ".join((field.description or "").split()), name


def test_no_hand_written_docs_page_has_a_settings_table():
    generated = {DOCS / "reference" / "settings.md"}
    names = {f"tandem_{name}" for name in Settings.model_fields} | {f"--{name.replace('_', '-')}" for name in Settings.model_fields}
    names |= set(Settings.model_fields)
    offenders = []
    for page in sorted(set(DOCS.rglob("*.md")) - generated):
        table_rows = [line for line in page.read_text().splitlines() if line.lstrip().startswith("|")]
        first_cells = [re.split(r"(?<!\\)\|", row.strip())[1].strip().strip("`").lower() for row in table_rows if row.count("|") > 1]
        naming_a_setting = [cell for cell in first_cells if cell in names]
        if len(naming_a_setting) >= 3:
            offenders.append(f"{page.relative_to(DOCS)}: {naming_a_setting}")
    assert not offenders, f"settings are listed once, in the generated reference/settings.md; link to it instead: {offenders}"


def test_every_setting_has_a_description_for_its_flag_and_the_settings_page():
    undescribed = [name for name, field in Settings.model_fields.items() if not (field.description or "").strip()]
    assert not undescribed, f"settings without a docstring: {undescribed}"
