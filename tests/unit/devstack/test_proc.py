import signal
import sys

from tandem.devstack.proc import ChildProcess, describe_exit

PRINT_THEN_WAIT = "import sys, time; print('one'); print('ready at 42', flush=True); sys.stdin.read() if False else time.sleep(60)"
IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ignoring', flush=True); time.sleep(60)"


def test_waits_for_a_line_and_captures_groups():
    child = ChildProcess("t", [sys.executable, "-c", PRINT_THEN_WAIT])
    child.start()
    try:
        match = child.wait_for_line(r"ready at (\d+)", timeout_s=30)
        assert match is not None and match[1] == "42"
        assert child.wait_for_line(r"ready", timeout_s=0.1, since=child.num_lines) is None
    finally:
        assert child.stop(timeout_s=5) == -signal.SIGTERM


def test_returns_none_when_the_output_ends_without_the_line():
    child = ChildProcess("t", [sys.executable, "-c", "print('bye')"])
    child.start()
    assert child.wait_for_line("never", timeout_s=30) is None
    assert child.wait() == 0
    assert child.recent_output() == "bye"


def test_stop_kills_what_ignores_sigterm():
    child = ChildProcess("t", [sys.executable, "-c", IGNORE_TERM])
    child.start()
    assert child.wait_for_line("ignoring", timeout_s=30) is not None
    assert child.stop(timeout_s=0.5) == -signal.SIGKILL


def test_exit_descriptions():
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(-9) == "killed by SIGKILL"
