"""A worker without an internal secret serves its gRPC port (Drain, KV reservations) to whoever
reaches it: it starts that way on a loopback host, elsewhere only when the operator says so."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from tandem.config import load_settings
from tandem.errors import StartupError
from tandem.worker.internal_grpc import check_internal_secret, is_loopback_host
from tandem.worker.parts import build_worker_parts


@pytest.fixture(autouse=True)
def no_secret_settings_from_the_environment(monkeypatch):
    for name in ("TANDEM_INTERNAL_SECRET", "TANDEM_ALLOW_INSECURE_INTERNAL", "TANDEM_HOST"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def switch_interval_restored():
    """build_worker_parts sets the process's GIL switch interval (TANDEM_GIL_SWITCH_INTERVAL_MS):
    this test process keeps its own for the tests after these."""
    saved = sys.getswitchinterval()
    yield
    sys.setswitchinterval(saved)


LOOPBACK = ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"]
REACHABLE = ["0.0.0.0", "::", "", "10.0.0.7", "192.168.1.20", "fe80::1", "decode-0", "localhost.example.com"]


@pytest.mark.parametrize("host", LOOPBACK)
def test_a_loopback_host_may_run_without_a_secret(host):
    assert is_loopback_host(host)
    check_internal_secret(host, "", is_insecure_allowed=False)


@pytest.mark.parametrize("host", REACHABLE)
def test_a_reachable_host_without_a_secret_refuses_to_start_naming_what_to_set(host):
    assert not is_loopback_host(host)
    with pytest.raises(StartupError) as refused:
        check_internal_secret(host, "", is_insecure_allowed=False)
    assert "TANDEM_INTERNAL_SECRET" in str(refused.value) and "TANDEM_ALLOW_INSECURE_INTERNAL=1" in str(refused.value)


@pytest.mark.parametrize("host", REACHABLE)
def test_a_reachable_host_with_a_secret_starts(host):
    check_internal_secret(host, "s3cret", is_insecure_allowed=False)


def test_running_without_a_secret_off_loopback_when_allowed_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.worker.internal_grpc"):
        check_internal_secret("0.0.0.0", "", is_insecure_allowed=True)
    assert any("TANDEM_ALLOW_INSECURE_INTERNAL" in record.getMessage() for record in caplog.records)


def test_the_allowance_is_off_by_default_and_read_from_its_variable(monkeypatch):
    assert load_settings().allow_insecure_internal is False
    monkeypatch.setenv("TANDEM_ALLOW_INSECURE_INTERNAL", "1")
    assert load_settings().allow_insecure_internal is True


def test_a_worker_checks_its_secret_before_anything_else(tmp_path: Path):
    settings = load_settings(host="0.0.0.0", model_path=tmp_path / "no-such-model.gguf")
    with pytest.raises(StartupError, match="TANDEM_INTERNAL_SECRET"):
        build_worker_parts("decode", settings)
    with pytest.raises(StartupError) as later:  # with a secret it gets as far as the model
        build_worker_parts("decode", load_settings(host="0.0.0.0", model_path=tmp_path / "no-such-model.gguf", internal_secret="s"))
    assert "TANDEM_INTERNAL_SECRET" not in str(later.value)
