"""How hard a message is, for `model: "auto"`: a classifier scores it from 0 (easy: the small model
will do) to 1 (hard: the large model), and a message scoring at least the threshold goes large.

The classifier is an interface (`score(text) -> float`). A deployment names one with the
`difficulty_classifier` setting: `features` (the default here), `none`, or `module:function`
(its own model; `function()` returns an object with `score(text)`).

The default, `FeatureClassifier`, is a logistic model with hand-set weights over features of the
message (`Features`): z = BIAS + sum(weight * feature), score = 1 / (1 + e^-z).

    feature            value                                                   weight
    length             log2(1 + tokens / 16), tokens counted by a word/symbol    0.8
                       split (about a subword tokenizer's count for English)
    code_fence         a ``` fence                                               2.0
    code_lines         the share of lines that read as code (a keyword such      2.5
                       as def/class/function/import/#include/return, or ending
                       in ; { or }), up to 1
    stack_trace        a traceback or an exception frame                         2.0
    maths              LaTeX, maths symbols, or formulas (x^2, 3*x + 1 = 7)       1.5
    technical          distinct programming and systems terms (Python, SQL,      0.6 each
                       tuple, hash table, join, compiler, latency ...), up to 3
    reasoning          distinct reasoning words (explain, why, prove, compare,   0.8 each
                       step by step, derive, solve, trade-off ...), up to 3
    parts              numbered or lettered items of a multi-part question,      0.5 each
                       up to 4
    questions          question marks beyond the first, up to 4                  0.4 each
    sentences          sentences beyond the third, up to 10                      0.05 each
    BIAS                                                                        -3.0

So a greeting or a short factual question scores about 0.07, prose crosses 0.5 at about 140
tokens (0.62 at 200), "explain step by step why ... and compare it with ..." about 0.6, a
programming question in prose ("the difference between a list and a tuple in Python") about 0.7,
and a question with a code block or a stack trace above 0.9. The weights were set by hand, against the
split the fallback rule makes (below) and a dozen sample prompts; they are not trained.

When the classifier is absent, raises, or is slower than the deadline, the fallback rule decides:
a message shorter than `fallback_small_max_tokens` tokens and without code goes small, the rest
large (`fallback_is_small`).

Scoring is synchronous CPU work: `DifficultyJudge` runs it on a thread of its own with the
deadline, and passes a classifier that is still busy with earlier messages over (a hung
deployment classifier never holds more than a few threads)."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tandem.errors import StartupError
from tandem.plugins import load_plugin

log = logging.getLogger(__name__)

NONE = "none"
FEATURES = "features"


@runtime_checkable
class DifficultyClassifier(Protocol):
    def score(self, text: str) -> float:
        """0 (easy) to 1 (hard)."""
        ...


_WORDS = re.compile(r"\w+|[^\w\s]", re.UNICODE)
_FENCE = re.compile(r"```|~~~")
_CODE_LINE = re.compile(
    r"^\s*(def |class |function\b|fn |func |import |from \S+ import |#include|public |private |static |return\b|"
    r"const |let |var |for \(|while \(|if \(|SELECT |select |<\w+[^>]*>)|[;{}]\s*$"
)
_STACK_TRACE = re.compile(
    r"Traceback \(most recent call last\)|^\s+at [\w$.<>]+\(.*\)\s*$|^\s*File \".+\", line \d+|"
    r"\b\w+(Error|Exception): |panicked at|Segmentation fault|core dumped",
    re.MULTILINE,
)
_MATHS = re.compile(
    r"\\(frac|sum|int|sqrt|begin|mathbb|partial|lim)|[∫∑√∂∞≤≥≠±∀∃∈π]|\b\w\^\d|\d\s*[*/^]\s*\w|"
    r"\b\d+\s*[a-z]\s*[+\-]\s*\d|\b(integral|derivative|eigen\w*|theorem|lemma|matrix|probability|equation)\b",
    re.IGNORECASE,
)
_REASONING = re.compile(
    r"\b(explain\w*|why|prove|proof|compare|comparison|contrast|step[- ]by[- ]step|derive|derivation|"
    r"analy[sz]e|analysis|evaluate|solve|calculate|justify|trade[- ]?offs?|pros and cons|difference between|design|"
    r"optimi[sz]e|debug|implement|refactor|how does|how do|what happens)\b",
    re.IGNORECASE,
)
_TECHNICAL = re.compile(
    r"\b(python|java(script)?|typescript|rust|golang|c\+\+|sql|database|query|api|http|json|regex|algorithm|"
    r"complexity|recursion|hash ?(table|map)|linked list|array|tuple|dictionary|pointer|thread|mutex|async|"
    r"compiler|kernel|latency|cache|git|docker|kubernetes|join|index(es)?|schema|bug|exception|variable|"
    r"function|method|class(es)?|object|library|framework|sorted lists?|binary|bitwise)\b",
    re.IGNORECASE,
)
_PART = re.compile(r"^\s*(\d+[.)]|[a-h][.)]|\([a-h1-9]\)|[-*•] )\s*\S", re.MULTILINE)
_SENTENCE_END = re.compile(r"[.!?]+(\s|$)")


@dataclass(frozen=True)
class Features:
    num_tokens: int
    has_code_fence: bool
    code_line_share: float
    has_stack_trace: bool
    has_maths: bool
    num_technical_terms: int
    num_reasoning_words: int
    num_parts: int
    num_questions: int
    num_sentences: int

    @property
    def has_code(self) -> bool:
        """What the fallback rule calls code: a fence, a stack trace, or a few lines of code."""
        return self.has_code_fence or self.has_stack_trace or self.code_line_share >= 0.3


def count_tokens(text: str) -> int:
    """Words and symbols: close to a subword tokenizer's count for English prose and code."""
    return len(_WORDS.findall(text))


def features_of(text: str) -> Features:
    lines = [line for line in text.splitlines() if line.strip()]
    code_lines = sum(1 for line in lines if _CODE_LINE.search(line))
    reasoning = {m.group(0).lower().replace("-", " ") for m in _REASONING.finditer(text)}
    return Features(
        num_tokens=count_tokens(text),
        has_code_fence=bool(_FENCE.search(text)),
        code_line_share=code_lines / len(lines) if lines else 0.0,
        has_stack_trace=bool(_STACK_TRACE.search(text)),
        has_maths=bool(_MATHS.search(text)),
        num_technical_terms=len({m.group(0).lower() for m in _TECHNICAL.finditer(text)}),
        num_reasoning_words=len(reasoning),
        num_parts=len(_PART.findall(text)),
        num_questions=text.count("?"),
        num_sentences=len(_SENTENCE_END.findall(text)) or (1 if text.strip() else 0),
    )


@dataclass(frozen=True)
class Weights:
    """The logistic model's hand-set weights (see the module's docstring)."""

    bias: float = -3.0
    length: float = 0.8
    code_fence: float = 2.0
    code_lines: float = 2.5
    stack_trace: float = 2.0
    maths: float = 1.5
    technical_term: float = 0.6
    reasoning_word: float = 0.8
    part: float = 0.5
    extra_question: float = 0.4
    extra_sentence: float = 0.05


class FeatureClassifier:
    """The built-in classifier: a logistic model over `Features` (arithmetic on a few counts: cheap enough for the event loop)."""

    def __init__(self, weights: Weights | None = None) -> None:
        self.weights = weights or Weights()

    def logit(self, f: Features) -> float:
        w = self.weights
        return (
            w.bias
            + w.length * math.log2(1 + f.num_tokens / 16)
            + w.code_fence * f.has_code_fence
            + w.code_lines * min(f.code_line_share, 1.0)
            + w.stack_trace * f.has_stack_trace
            + w.maths * f.has_maths
            + w.technical_term * min(f.num_technical_terms, 3)
            + w.reasoning_word * min(f.num_reasoning_words, 3)
            + w.part * min(f.num_parts, 4)
            + w.extra_question * min(max(f.num_questions - 1, 0), 4)
            + w.extra_sentence * min(max(f.num_sentences - 3, 0), 10)
        )

    def score(self, text: str) -> float:
        return 1 / (1 + math.exp(-self.logit(features_of(text))))


def load_classifier(spec: str) -> DifficultyClassifier | None:
    """The classifier a setting names (see the module's docstring); None for `none`. Raises
    ValueError for a spec that names nothing it can load."""
    spec = spec.strip()
    if spec in ("", NONE):
        return None
    if spec == FEATURES:
        return FeatureClassifier()
    return load_plugin(spec, DifficultyClassifier, "difficulty classifier", "features, none")  # type: ignore[type-abstract]


def open_judge(spec: str, timeout_s: float) -> DifficultyJudge:
    """The judge of the classifier the difficulty_classifier setting names; one that names nothing
    loadable is a StartupError naming the setting."""
    try:
        return DifficultyJudge(load_classifier(spec), timeout_s)
    except ValueError as exc:
        raise StartupError(f"TANDEM_DIFFICULTY_CLASSIFIER: {exc}") from None


def fallback_is_small(text: str, num_tokens: int, max_small_tokens: int) -> bool:
    """The fallback rule: shorter than `max_small_tokens` tokens and without code."""
    return num_tokens < max_small_tokens and not features_of(text).has_code


@dataclass(frozen=True)
class Scored:
    """A classifier's answer: its score, or None and why there is none (none, error, timeout, busy)."""

    score: float | None
    why_not: str = ""


class DifficultyJudge:
    """Runs a classifier on threads of its own, each call with a deadline. A classifier with
    `max_in_flight` calls unfinished (slow or hung) is passed over until one ends."""

    def __init__(self, classifier: DifficultyClassifier | None, timeout_s: float, max_in_flight: int = 2) -> None:
        self.classifier = classifier
        self.timeout_s = timeout_s
        self._max_in_flight = max_in_flight
        self._in_flight = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_in_flight, thread_name_prefix="difficulty") if classifier is not None else None

    async def score(self, text: str) -> Scored:
        if self.classifier is None or self._pool is None:
            return Scored(None, NONE)
        with self._lock:
            if self._in_flight >= self._max_in_flight:
                return Scored(None, "busy")
            self._in_flight += 1
        running = self._pool.submit(self.classifier.score, text)
        running.add_done_callback(self._ended)  # also when it is cancelled before it starts
        try:
            score = await asyncio.wait_for(asyncio.wrap_future(running), self.timeout_s)
        except TimeoutError:
            return Scored(None, "timeout")
        except Exception as exc:  # a deployment's classifier may raise anything: the fallback rule decides
            log.warning("the difficulty classifier raised %s: %s", type(exc).__name__, exc)
            return Scored(None, "error")
        if not (isinstance(score, int | float) and 0.0 <= score <= 1.0):
            log.warning("the difficulty classifier answered %r, not a number from 0 to 1", score)
            return Scored(None, "error")
        return Scored(float(score))

    def _ended(self, _: Future[float]) -> None:
        with self._lock:
            self._in_flight -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
