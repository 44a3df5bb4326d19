"""`tandem generate` streams a real answer from the embedded SmolLM2 through the engine."""

import subprocess
import sys

from helpers import REPO


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tandem.cli", "generate", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_greedy_answer_names_paris():
    result = _generate("What is the capital of France?", "--max-tokens", "24")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_bad_sampling_is_one_clear_line():
    result = _generate("Hi", "--top-p", "0")
    assert result.returncode == 2
    assert result.stderr.strip() == "tandem generate: error: top_p must be in (0, 1], got 0.0"
