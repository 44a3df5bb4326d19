"""The safety check on text, one interface for what users send (chat) and what the model writes
(relay): a check scores texts from 0 (fine) to 1 (refuse), and a text scoring at least the
threshold is refused. A deployment names its check by a setting:

- `profanity-check`: the linear model trained on profanity and abuse that the
  `alt-profanity-check` wheel ships (a TF-IDF vectorizer and a calibrated linear SVM);
- `blocklist:word|other word`: a deployment's own list of terms, matched as whole words,
  case-insensitively (1 when one occurs, else 0);
- `none`: no check;
- `module:function`: a deployment's own moderation model; `function()` returns a TextCheck.

Scoring is synchronous and CPU-bound (milliseconds): callers run it in a thread."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tandem.plugins import load_plugin

NONE = "none"
PROFANITY_CHECK = "profanity-check"
BLOCKLIST_PREFIX = "blocklist:"


@runtime_checkable
class TextCheck(Protocol):
    name: str  # in metrics and logs

    def score(self, texts: Sequence[str]) -> list[float]:
        """Each text's score, 0 (fine) to 1 (refuse)."""
        ...


@dataclass(frozen=True)
class Verdict:
    flagged: bool
    score: float
    check: str  # the check's name


def judge(check: TextCheck, text: str, threshold: float) -> Verdict:
    score = float(check.score([text])[0])
    return Verdict(flagged=score >= threshold, score=score, check=check.name)


class ProfanityCheck:
    """alt-profanity-check's trained model; loading it takes about a second, so it loads once."""

    name = PROFANITY_CHECK

    def __init__(self) -> None:
        from profanity_check import predict_prob  # scikit-learn and the model load here

        self._predict_prob: Callable[[Sequence[str]], Sequence[float]] = predict_prob

    def score(self, texts: Sequence[str]) -> list[float]:
        return [float(p) for p in self._predict_prob(list(texts))]


class Blocklist:
    name = "blocklist"

    def __init__(self, terms: Sequence[str]) -> None:
        words = sorted({t.strip().lower() for t in terms if t.strip()}, key=len, reverse=True)
        if not words:
            raise ValueError("a blocklist needs at least one term (blocklist:word|other word)")
        self._pattern = re.compile(r"(?<!\w)(?:" + "|".join(re.escape(w) for w in words) + r")(?!\w)", re.IGNORECASE)

    def score(self, texts: Sequence[str]) -> list[float]:
        return [1.0 if self._pattern.search(text) else 0.0 for text in texts]


def load_check(spec: str) -> TextCheck | None:
    """The check a setting names (see the module's docstring); None for `none`. Raises
    ValueError for a spec that names nothing it can load."""
    spec = spec.strip()
    if spec in ("", NONE):
        return None
    if spec == PROFANITY_CHECK:
        return ProfanityCheck()
    if spec.startswith(BLOCKLIST_PREFIX):
        return Blocklist(spec[len(BLOCKLIST_PREFIX) :].split("|"))
    return load_plugin(spec, TextCheck, "safety check", "profanity-check, blocklist:word|word, none")  # type: ignore[type-abstract]
