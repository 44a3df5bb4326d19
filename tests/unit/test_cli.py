"""The `tandem` command line: every setting is a flag of `tandem serve <role>` (pydantic-settings'
own CLI), over its TANDEM_ variable, over tandem.toml; `--help` lists them with their defaults;
`tandem --version`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from services.router.app import build_app as build_router_app
from tandem import cli
from tandem.config import Settings, load_settings
from tandem.devstack.proc import free_ports
from tandem.errors import StartupError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path: Path):
    """Settings read the real environment and ./tandem.toml; start each test from neither."""
    for name in [n for n in os.environ if n.startswith("TANDEM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TANDEM_CONFIG", str(tmp_path / "absent.toml"))
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps help to the terminal


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def test_version_is_the_installed_package_version(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"tandem {metadata.version('tandem-serve')}"


def test_serve_help_lists_every_setting_as_a_flag_with_its_default_and_variable(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "decode", "--help"])
    assert exited.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: tandem serve decode ")
    entries = help_entries(help_text)
    for field in Settings.model_fields:
        assert flag(field) in entries, f"{flag(field)} missing from --help"
        assert entries[flag(field)].endswith(f"[env: TANDEM_{field.upper()}]"), entries[flag(field)]
    assert "an explicit override; unset: sized by gpu_memory_utilization" in entries["--kv-cache-mib"]
    assert entries["--kv-cache-mib"].endswith("else 1024 (default: None) [env: TANDEM_KV_CACHE_MIB]")
    assert "unset: 512 on a CPU, 8192 on a GPU (default: None)" in entries["--max-num-batched-tokens"]


def help_entries(help_text: str) -> dict[str, str]:
    """argparse's option lines, each flag's (wrapped) description joined into one line."""
    entries: dict[str, list[str]] = {}
    current: list[str] = []
    for line in help_text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            name, *rest = line.split()
            current = entries[name.rstrip(",")] = rest
        else:
            current.extend(line.split())
    return {name: " ".join(words) for name, words in entries.items()}


def test_a_flag_beats_its_variable_which_beats_the_toml_file(monkeypatch, tmp_path: Path):
    toml = tmp_path / "tandem.toml"
    toml.write_text("kv_cache_mib = 256\nmax_num_seqs = 4\nhost = '10.0.0.1'\n")
    monkeypatch.setenv("TANDEM_CONFIG", str(toml))
    monkeypatch.setenv("TANDEM_KV_CACHE_MIB", "512")
    monkeypatch.setenv("TANDEM_MAX_NUM_SEQS", "8")
    settings = load_settings(["--kv-cache-mib", "2048", "--host", "0.0.0.0"])
    assert (settings.kv_cache_mib, settings.max_num_seqs, settings.host) == (2048, 8, "0.0.0.0")
    assert load_settings([]).kv_cache_mib == 512
    monkeypatch.delenv("TANDEM_KV_CACHE_MIB")
    assert load_settings([]).kv_cache_mib == 256


def test_flags_parse_like_their_variables():
    settings = load_settings(["--api-keys", "k1=alice:plus,k2=bob:free", "--model-path", "", "--http-port", "9000", "--device", "cpu"])
    assert {key: api_key.user_id for key, api_key in settings.api_keys.items()} == {"k1": "alice", "k2": "bob"}
    assert settings.model_path is None
    assert settings.http_port_for("decode") == 9000
    assert settings.device == "cpu"


def test_a_bad_flag_value_names_the_flag_and_a_bad_variable_names_the_variable(monkeypatch):
    monkeypatch.setenv("TANDEM_MAX_NUM_SEQS", "0")
    with pytest.raises(StartupError) as caught:
        load_settings(["--kv-cache-mib", "0", "--api-keys", "alice:plus"])
    problems = str(caught.value).split("; ")
    assert sorted(problems) == [
        "--api-keys: entry 'alice:plus' must look like key=user:tier (tier one of free, plus, pro)",
        "--kv-cache-mib: Input should be greater than or equal to 1",
        "TANDEM_MAX_NUM_SEQS: Input should be greater than or equal to 1",
    ]


def test_serve_stops_on_a_bad_flag_in_one_line_before_the_service_starts(capsys):
    assert cli.main(["serve", "decode", "--max-num-batched-tokens", "0"]) == 2
    assert capsys.readouterr().err == "tandem serve: error: --max-num-batched-tokens: Input should be greater than or equal to 1\n"


def test_serve_rejects_an_unknown_flag_with_the_usage(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "decode", "--kv-cache-gib", "2"])
    assert exited.value.code == 2
    assert "tandem serve decode: error: unrecognized arguments: --kv-cache-gib" in capsys.readouterr().err


def test_serve_runs_the_roles_service_with_the_settings_its_flags_gave(monkeypatch):
    started = []
    monkeypatch.setattr(cli, "run_service", lambda role, build_app, settings: started.append((role, build_app, settings)))
    monkeypatch.setenv("TANDEM_REDIS_URL", "redis://from-env:6379/0")
    cli.main(["serve", "router", "--http-port", "9123", "--host", "0.0.0.0", "--heartbeat-interval-s", "0.5"])
    [(role, build_app, settings)] = started
    assert (role, build_app) == ("router", build_router_app)
    assert (settings.http_port, settings.host, settings.heartbeat_interval_s) == (9123, "0.0.0.0", 0.5)
    assert settings.redis_url == "redis://from-env:6379/0"


def test_a_service_module_reads_its_own_flags():
    """`python -m services.<role> --flag`, as a container's command would run it."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("TANDEM_")}
    result = subprocess.run(
        [sys.executable, "-m", "services.router", "--heartbeat-interval-s", "60"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().endswith("tandem router: error: --heartbeat-interval-s: 60.0 s is outside 0.05-10 s")


def test_up_refuses_a_taken_chat_instance_port_naming_it_before_anything_starts(capsys):
    first = free_ports(2)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", first + 1))
        held.listen()
        assert cli.main(["up", "--port", str(first), "--chat-instances", "2"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"tandem up: error: chat-1: port {first + 1} on 127.0.0.1 is in use"), error


def test_up_takes_vllms_model_flag_as_the_model_path_setting(capsys, tmp_path: Path):
    missing = tmp_path / "missing.gguf"
    assert cli.main(["up", "--model", str(missing)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("tandem up: error: ") and f"{missing}: no such file or folder" in error, error


def test_up_refuses_model_and_model_path_together(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["up", "--model", "/models/a", "--model-path", "/models/b"])
    assert exited.value.code == 2
    assert "--model and --model-path name the same setting" in capsys.readouterr().err
