"""The difficulty classifier behind `model: "auto"`: the built-in feature model, the fallback rule,
loading a deployment's own, and the judge's deadline."""

import asyncio
import threading

import pytest
from helpers import wait_until

from services.chat.difficulty import (
    DifficultyJudge,
    FeatureClassifier,
    fallback_is_small,
    features_of,
    load_classifier,
    open_judge,
)
from tandem.errors import StartupError

GREETING = "Hello! How are you today?"
CODE_QUESTION = """I am getting an error in this function and I do not understand why. Can you explain what is
wrong, and show me a fixed version?

```python
def average(rows):
    total = 0
    for row in rows:
        total += row["value"]
    return total / len(rows)

print(average([{"value": 1}, {"value": 2}, 3]))
```

Traceback (most recent call last):
  File "avg.py", line 7, in <module>
    print(average([{"value": 1}, {"value": 2}, 3]))
  File "avg.py", line 4, in average
    total += row["value"]
TypeError: 'int' object is not subscriptable
"""


def test_a_short_greeting_scores_low_and_a_long_code_question_high():
    classifier = FeatureClassifier()
    assert classifier.score(GREETING) < 0.15
    assert classifier.score("What is the capital of France?") < 0.15
    assert classifier.score(CODE_QUESTION) > 0.9


def test_the_score_follows_the_message_not_a_constant():
    classifier = FeatureClassifier()
    prose = "The fox jumps over the dog. "
    scores = [classifier.score(prose * n) for n in (1, 5, 10, 20, 40)]
    assert scores == sorted(scores) and scores[-1] - scores[0] > 0.4  # longer reads harder
    plain = "Tell me about sorting algorithms."
    reasoning = "Explain step by step why quicksort is fast on average, and compare it with merge sort."
    assert classifier.score(reasoning) > classifier.score(plain) + 0.3
    assert classifier.score("Solve 3x^2 + 2x - 1 = 0") > classifier.score("Say hello to x")
    parts = "1. What is DNS?\n2. What is TCP?\n3. How do they differ?"
    assert classifier.score(parts) > 0.5
    programming = "Explain the difference between a list and a tuple in Python, and say when I would use each."
    everyday = "Explain the difference between baking soda and baking powder, and say when I would use each."
    assert classifier.score(programming) >= 0.5 > classifier.score(everyday)  # a programming question in prose
    assert all(0.0 <= classifier.score(text) <= 1.0 for text in ("", "?", "x" * 10_000, CODE_QUESTION * 20))


def test_features_name_what_they_saw():
    f = features_of(CODE_QUESTION)
    assert f.has_code_fence and f.has_stack_trace and f.has_code
    assert f.num_reasoning_words >= 2  # explain, why
    assert f.num_questions == 1
    g = features_of(GREETING)
    assert not g.has_code and not g.has_maths and g.num_tokens == 7 and g.num_sentences == 2
    braces = features_of('int main() {\n  printf("hi");\n  return 0;\n}')
    assert braces.has_code and not braces.has_code_fence and braces.code_line_share == 1.0


def test_the_fallback_rule_sends_short_messages_without_code_small():
    assert fallback_is_small(GREETING, num_tokens=7, max_small_tokens=200)
    assert not fallback_is_small("a long essay", num_tokens=200, max_small_tokens=200)  # 200 is not shorter than 200
    assert fallback_is_small("a long essay", num_tokens=199, max_small_tokens=200)
    assert not fallback_is_small("why?\n```\nx = 1\n```", num_tokens=10, max_small_tokens=200)  # a fence is code
    assert not fallback_is_small("TypeError: 'int' object is not subscriptable", num_tokens=9, max_small_tokens=200)


class Constant:
    def __init__(self, value: float) -> None:
        self.value = value

    def score(self, text: str) -> float:
        return self.value


def constant_classifier():  # a deployment's factory, named module:function
    return Constant(0.25)


def not_a_classifier():
    return object()


def test_a_deployment_names_its_own_classifier_or_none():
    assert isinstance(load_classifier("features"), FeatureClassifier)
    assert load_classifier("none") is None and load_classifier("") is None
    own = load_classifier(f"{__name__}:constant_classifier")
    assert own is not None and own.score("anything") == 0.25
    for bad in ("nonsense", f"{__name__}:missing", f"{__name__}:not_a_classifier", "no_such_module_xyz:make"):
        with pytest.raises(ValueError):
            load_classifier(bad)
    with pytest.raises(StartupError, match="TANDEM_DIFFICULTY_CLASSIFIER"):
        open_judge("nonsense", 0.05)


class Raising:
    def score(self, text: str) -> float:
        raise RuntimeError("the model server is down")


class OutOfRange:
    def score(self, text: str) -> float:
        return 7.0


class Blocking:
    """Holds each call until released (a classifier that hangs)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.num_started = 0

    def score(self, text: str) -> float:
        self.num_started += 1
        self.release.wait(10)
        return 0.9


async def test_the_judge_gives_a_score_or_says_why_there_is_none():
    assert (await DifficultyJudge(Constant(0.75), timeout_s=1).score("x")).score == 0.75
    assert (await DifficultyJudge(None, timeout_s=1).score("x")).why_not == "none"
    raised = await DifficultyJudge(Raising(), timeout_s=1).score("x")
    assert (raised.score, raised.why_not) == (None, "error")
    assert (await DifficultyJudge(OutOfRange(), timeout_s=1).score("x")).why_not == "error"


async def test_a_slow_classifier_misses_its_deadline_and_a_hung_one_is_passed_over():
    blocking = Blocking()
    judge = DifficultyJudge(blocking, timeout_s=0.05, max_in_flight=2)
    try:
        slow = await asyncio.wait_for(judge.score("x"), 2)
        assert (slow.score, slow.why_not) == (None, "timeout")
        assert (await asyncio.wait_for(judge.score("x"), 2)).why_not == "timeout"
        # Two calls still hang on the classifier's threads: the next is not even started.
        assert (await asyncio.wait_for(judge.score("x"), 2)).why_not == "busy"
        assert blocking.num_started == 2
        blocking.release.set()  # the hung calls end: the judge takes calls again
        judge.classifier = Constant(0.1)

        async def scored_again() -> float | None:
            return (await judge.score("x")).score

        assert await wait_until(scored_again, timeout_s=5, interval_s=0.01) == 0.1
    finally:
        blocking.release.set()
        judge.close()
