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
from typing import Any, Protocol, runtime_checkable

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
    """alt-profanity-check's trained model; loading it takes about a second, so it loads once.

    Its classifier (scikit-learn's CalibratedClassifierCV: five sigmoid-calibrated linear SVMs,
    averaged) is applied as the arithmetic it is, from the fitted model's own arrays: one sparse
    product with the five weight vectors, then the five sigmoids' mean. scikit-learn's
    `predict_proba` validates its input once per fold, milliseconds of Python for one short text
    against the product's microseconds; the result is the same (tests/unit/test_safety.py compares them).
    A model of another shape is scored by `predict_proba` itself."""

    name = PROFANITY_CHECK

    def __init__(self) -> None:
        from profanity_check import predict_prob, profanity_check  # scikit-learn and the model load here

        self._predict_prob: Callable[[Sequence[str]], Sequence[float]] = predict_prob
        self._vectorizer = profanity_check.vectorizer
        self._linear = CalibratedLinear.of(profanity_check.model)

    def score(self, texts: Sequence[str]) -> list[float]:
        if self._linear is None:
            return [float(p) for p in self._predict_prob(list(texts))]
        return self._linear.positive_probability(self._vectorizer.transform(list(texts)))


@dataclass(frozen=True)
class CalibratedLinear:
    """A binary CalibratedClassifierCV over linear models with sigmoid calibration, as arrays:
    P(positive) = mean over folds of 1 / (1 + exp(a * (x . w + c) + b))."""

    weights: Any  # (features, folds)
    intercepts: Any  # (folds,)
    slopes: Any  # a, (folds,)
    offsets: Any  # b, (folds,)

    @classmethod
    def of(cls, model: object) -> CalibratedLinear | None:
        """The arrays of `model`, or None when it is not exactly that shape (then scikit-learn
        scores it)."""
        import numpy as np

        try:  # scikit-learn's own names, private ones among them: another version may lack them
            from sklearn.calibration import CalibratedClassifierCV, _SigmoidCalibration
            from sklearn.linear_model._base import LinearClassifierMixin
        except ImportError:
            return None
        if not isinstance(model, CalibratedClassifierCV) or list(model.classes_) != [0, 1]:
            return None
        weights, intercepts, slopes, offsets = [], [], [], []
        for fold in model.calibrated_classifiers_:
            estimator, calibrators = fold.estimator, fold.calibrators
            coef = getattr(estimator, "coef_", None)
            if (
                fold.method != "sigmoid"
                or coef is None
                or np.ndim(coef) != 2
                or coef.shape[0] != 1
                or len(calibrators) != 1
                or type(calibrators[0]) is not _SigmoidCalibration
                or type(estimator).decision_function is not LinearClassifierMixin.decision_function
            ):
                return None
            weights.append(np.asarray(coef[0], dtype=np.float64))
            intercepts.append(float(np.ravel(estimator.intercept_)[0]))
            slopes.append(float(calibrators[0].a_))
            offsets.append(float(calibrators[0].b_))
        if not weights:
            return None
        return cls(np.stack(weights, axis=1), np.array(intercepts), np.array(slopes), np.array(offsets))

    def positive_probability(self, features: Any) -> list[float]:
        import numpy as np
        from scipy.special import expit

        decisions = np.asarray(features @ self.weights) + self.intercepts  # (texts, folds)
        return [float(p) for p in expit(-(self.slopes * decisions + self.offsets)).mean(axis=1)]


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
