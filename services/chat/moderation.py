"""The input check: what a user sends is scored by the deployment's safety check (tandem.safety)
before any reply is started. The check runs in a process of its own (tandem.safety_process: its
Python would otherwise hold the GIL that the prompt build needs), started the moment the message
has passed its size checks, while the caller builds the prompt: it adds to the time to first
token only what it takes beyond the prompt build, not its whole latency. The product API waits
for the verdict before it reserves quota or stores the turn (a refused turn is stored as
moderated); the OpenAI endpoints, which store nothing and are sent the whole conversation each
time, check every user message of it, each on its own, and wait for the verdict once the reply's
quota is reserved and its log created, just before the router is asked (both undone when it
refuses), so that those round trips overlap the check. Messages checked at once are scored in
one call.

A refused message is answered with one clear, non-judgemental message (an HTTP 400, code
`moderated` on the product API, which stores the user turn as `moderated` so the conversation
shows it (it is never sent to a model), `content_filter` on the OpenAI endpoints, which store
nothing) and counted in `tandem_chat_moderated_total{direction="input"}`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from services.chat import metrics
from services.chat.errors import Moderated, Unavailable
from tandem.safety import TextCheck, Verdict
from tandem.safety_process import CALL_TIMEOUT_S, BatchScorer, CheckProcess

log = logging.getLogger(__name__)
MODERATED_MESSAGE = "This message can't be answered as written. Please rephrase it and try again."
OPENAI_CODE = "content_filter"  # what OpenAI's endpoints call a refused prompt


MAX_BATCH = 32  # messages scored in one call of the check
_RUNNING: set[asyncio.Future[Verdict]] = set()  # checks started and not yet ended


@dataclass(frozen=True)
class InputCheck:
    """The deployment's check on what users send (`score`: one text's score, 0 to 1), and the
    score from which it refuses."""

    name: str  # the check's, in logs
    score: Callable[[str], Awaitable[float]]
    threshold: float
    process: CheckProcess | None = None  # the check's own process, when it runs in one

    @classmethod
    def in_thread(cls, check: TextCheck, threshold: float) -> InputCheck:
        """A check scored in a thread of this process, one text a call (a check object of its own,
        as the tests give)."""

        async def score(text: str) -> float:
            [value] = await asyncio.to_thread(check.score, [text])
            return float(value)

        return cls(check.name, score, threshold)

    async def judge_timed(self, text: str) -> Verdict:
        started = time.perf_counter()
        try:
            score = await self.score(text)
        finally:
            metrics.INPUT_CHECK_SECONDS.observe(time.perf_counter() - started)
        return Verdict(flagged=score >= self.threshold, score=score, check=self.name)

    def close(self) -> None:
        if self.process is not None:
            self.process.close()


def load_input_check(spec: str, threshold: float, call_timeout_s: float = CALL_TIMEOUT_S) -> InputCheck | None:
    """The check `TANDEM_INPUT_MODERATION` names (None for `none`), loaded in its own process now
    (loading profanity-check's model is slow): the caller runs this at startup. A spec that
    names nothing loadable is a StartupError naming the setting."""
    process = CheckProcess.start(spec, "TANDEM_INPUT_MODERATION", call_timeout_s)
    if process is None:
        return None
    return InputCheck(process.name, BatchScorer(process.score, MAX_BATCH).score, threshold, process)


class PendingCheck:
    """An input check already running; `is_refused` waits for its verdict."""

    def __init__(self, running: asyncio.Future[Verdict] | None) -> None:
        self._running = running

    async def is_refused(self, tier: str, model: str) -> bool:
        """True when the check refuses the message (counted); a check that fails is a 503,
        never a message let through unchecked."""
        if self._running is None:
            return False
        try:
            verdict = await self._running
        except Exception:  # a deployment's own check can fail in any way: it is logged in full
            log.exception("the input check failed")
            raise Unavailable("the message could not be checked; try again shortly", code="moderation_unavailable") from None
        if verdict.flagged:
            metrics.MODERATED.labels("input", tier, model).inc()
            log.info("input refused by %s (score %.3f, tier %s, model %s)", verdict.check, verdict.score, tier, model)
        return verdict.flagged


def start_input_check(input_check: InputCheck | None, *texts: str) -> PendingCheck:
    """Starts checking `texts` now (each on its own: a flagged message is not diluted by the
    others), so the caller can build the prompt meanwhile; the verdict is the highest score's,
    flagged when any is. A caller that fails before it asks for the verdict leaves the check to
    finish unread."""
    to_check = list(dict.fromkeys(text for text in texts if text.strip()))
    if input_check is None or not to_check:
        return PendingCheck(None)
    running = asyncio.ensure_future(_judge_all(input_check, to_check))
    _RUNNING.add(running)  # a task only the loop refers to may be collected before it ends
    running.add_done_callback(_RUNNING.discard)
    running.add_done_callback(_mark_retrieved)
    return PendingCheck(running)


async def _judge_all(input_check: InputCheck, texts: list[str]) -> Verdict:
    verdicts = await asyncio.gather(*(input_check.judge_timed(text) for text in texts))
    return max(verdicts, key=lambda verdict: verdict.score)


async def refuse_openai_input(checking: PendingCheck, tier: str, model: str) -> None:
    """The OpenAI endpoints' refusal: OpenAI's error shape with code `content_filter`; those
    endpoints store nothing."""
    if await checking.is_refused(tier, model):
        raise Moderated(MODERATED_MESSAGE, code=OPENAI_CODE)


def last_user_text(messages: Sequence[Mapping[str, str]]) -> str:
    """What an OpenAI chat request's user says now: its last user message ("" when none)."""
    return next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")


def user_texts(messages: Sequence[Mapping[str, str]]) -> list[str]:
    """Every user message of an OpenAI chat request: the client writes the whole conversation,
    earlier turns too, and none of it was checked before (the product API checks each message
    as it is sent, and stores it)."""
    return [m["content"] for m in messages if m["role"] == "user"]


def _mark_retrieved(future: asyncio.Future[Verdict]) -> None:
    # A failure nobody awaits (the prompt build failed first) is not an unhandled error.
    if not future.cancelled():
        future.exception()
