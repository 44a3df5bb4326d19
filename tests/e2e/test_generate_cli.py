"""`tandem generate` streams a real answer from the embedded SmolLM2 through the engine."""

import subprocess
import sys

import pytest
from helpers import REPO
from hf_models import ARCHITECTURES, SLIDING_WINDOW, hf_greedy, write_hf_checkpoint
from reference_model import write_tokenizer
from tokenizers import Tokenizer


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


def test_over_three_ranks_stdout_holds_the_answer_and_nothing_else():
    """fp32, where three ranks answer as one (bench/tp_agreement.py's smoke test compares them token
    for token); gloo's own chatter stays off stdout."""
    result = _generate("What is the capital of France?", "--max-tokens", "12", "--dtype", "fp32", "--tensor-parallel-size", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "The capital of France is Paris.\n", result.stdout


def test_a_size_the_model_does_not_split_over_is_one_clear_line():
    result = _generate("Hi", "--tensor-parallel-size", "2")
    assert result.returncode == 2
    assert "TANDEM_TENSOR_PARALLEL_SIZE=2" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_raw_greedy_text_is_what_transformers_generates(architecture, tmp_path):
    """`tandem generate --model DIR --raw --dtype fp32` over a tiny random checkpoint that
    transformers wrote prints the text transformers generates greedily from the same prompt (its
    BOS first, as the model's config names it)."""
    folder = tmp_path / architecture
    folder.mkdir()
    write_tokenizer(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    reference = write_hf_checkpoint(architecture, folder, seed=5, vocab_size=tokenizer.get_vocab_size())
    prompt = "the quick brown fox jumps over the lazy dog"
    prompt_ids = [reference.config.bos_token_id, *tokenizer.encode(prompt, add_special_tokens=False).ids]
    expected = tokenizer.decode(hf_greedy(reference, prompt_ids, 12), skip_special_tokens=True)
    assert expected.strip() and len(prompt_ids) + 12 > 2 * SLIDING_WINDOW  # text to compare, read past the window
    result = _generate(prompt, "--model", str(folder), "--raw", "--dtype", "fp32", "--max-tokens", "12", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
