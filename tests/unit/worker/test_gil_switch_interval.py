"""A worker sets its process's GIL switch interval from TANDEM_GIL_SWITCH_INTERVAL_MS before it
loads anything or starts a thread; 0 leaves Python's own."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.config import load_settings
from tandem.errors import StartupError
from tandem.worker.parts import build_worker_parts


@pytest.fixture
def python_default() -> Iterator[float]:
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(saved)


def _start(tmp_path: Path, **settings: object) -> None:
    """A decode worker's start up to its model, which is missing: StartupError after the interval is set."""
    with pytest.raises(StartupError):
        build_worker_parts("decode", load_settings(host="127.0.0.1", model_path=tmp_path / "no-such-model.gguf", **settings))


def test_a_worker_takes_its_interval_from_the_setting(tmp_path: Path, python_default: float) -> None:
    _start(tmp_path, gil_switch_interval_ms=0.25)
    assert sys.getswitchinterval() == pytest.approx(0.00025)


def test_by_default_a_worker_switches_every_tenth_of_a_millisecond(tmp_path: Path, python_default: float, monkeypatch) -> None:
    monkeypatch.delenv("TANDEM_GIL_SWITCH_INTERVAL_MS", raising=False)
    _start(tmp_path)
    assert sys.getswitchinterval() == pytest.approx(0.0001)


def test_zero_leaves_python_s_own_interval(tmp_path: Path, python_default: float) -> None:
    _start(tmp_path, gil_switch_interval_ms=0)
    assert sys.getswitchinterval() == python_default


@pytest.mark.parametrize("value", [-1, 101])
def test_an_interval_out_of_range_is_refused(value: float) -> None:
    with pytest.raises(StartupError, match="TANDEM_GIL_SWITCH_INTERVAL_MS"):
        load_settings(gil_switch_interval_ms=value)
