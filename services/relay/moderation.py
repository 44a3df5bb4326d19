"""The output safety check while a reply streams: every `every_tokens`-th token, the newest
`window_chars` characters of the reply's text are scored by the deployment's check
(tandem.safety); a window that trips it ends the reply as moderated.

- Off the hot path: a token is appended and acknowledged first; its check runs afterwards, in
  the check's own process (tandem.safety_process), so delivery never waits for a verdict. The final event is the one
  exception: its window is checked before it is appended, so a reply whose last words trip the
  check ends moderated, never complete.
- The window is read from the token log, not from what this relay happened to see: the relays
  share one consumer, so a reply's events are spread over them. Each relay keeps the window it
  read last per reply (the text of seq 1..c never changes once logged) and reads only the entries
  after it, so a check usually costs one short range read.
- Tripping: the reply is fenced (a new owner epoch, so whatever its worker still sends is
  dropped), its worker is told to cancel it (reason "moderated"), and a CONTENT_FILTER final event
  at the next seq goes out on its finals subject, as the relay's other ends of a reply do. The
  stored turn is `moderated` with no text (persist.py)."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.relay import metrics
from services.relay.consumer import Redeliver
from tandem.bus import encode, subjects
from tandem.bus.events import final_event
from tandem.config import Settings
from tandem.safety_process import BatchScorer, CheckProcess
from tandem.tokenlog import Appended, fence_reply, load_reply, load_reply_states, logged_events
from tandem.tokenlog.reader import entry_id
from tandem.v1.common_pb2 import (
    FINISH_REASON_CANCELLED,
    FINISH_REASON_CONTENT_FILTER,
    FINISH_REASON_LENGTH,
    FINISH_REASON_STOP,
    Lane,
    Usage,
)
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.tokens_pb2 import Cancel, TokenEvent

log = logging.getLogger(__name__)

Publish = Callable[[str, bytes], Awaitable[None]]
PublishFinal = Callable[[TokenEvent], Awaitable[None]]

CANCEL_REASON = "moderated"
# Final events whose text a user keeps (a reply that stopped or was cancelled); an error or a
# moderated end is not checked again.
CHECKED_FINISHES = frozenset({FINISH_REASON_STOP, FINISH_REASON_LENGTH, FINISH_REASON_CANCELLED})
READ_PAGE = 64  # log entries per read when a window is read from scratch
REDELIVER_AFTER_S = 0.1  # a final event that arrived before the events preceding it


@dataclass(frozen=True)
class OutputCheckConfig:
    threshold: float
    every_tokens: int
    window_chars: int
    running_ttl_s: int  # the fenced reply's keys keep this expiry (settings.running_reply_ttl_s)
    max_batch: int = 64  # windows scored in one call
    max_cached_replies: int = 4096  # replies whose last window this relay remembers

    @classmethod
    def from_settings(cls, settings: Settings) -> OutputCheckConfig:
        return cls(
            threshold=settings.moderation_threshold,
            every_tokens=settings.output_check_every_tokens,
            window_chars=settings.output_check_window_chars,
            running_ttl_s=settings.running_reply_ttl_s,
        )


def crosses_check(last_seq: int, num_appended: int, every_tokens: int) -> bool:
    """Whether the seqs an append just logged (last_seq - num_appended + 1 .. last_seq; more than
    one when it filled a gap) include a check's turn (a multiple of `every_tokens`)."""
    return num_appended > 0 and last_seq // every_tokens > (last_seq - num_appended) // every_tokens


def newest_chars(text: str, window_chars: int) -> str:
    return text[-window_chars:] if len(text) > window_chars else text


def tier_of(request: bytes) -> str:
    """The lane the reply was asked in (paid, free, background), from its GenerateRequest."""
    if not request:
        return "unknown"
    lane = GenerateRequest.FromString(request).lane
    return Lane.Name(lane).removeprefix("LANE_").lower() if lane else "unknown"


class LogWindows:
    """The newest characters of a reply's logged text up to a seq: read from the log, remembering
    each reply's last window so the next read takes only the entries after it."""

    def __init__(self, redis: Redis, window_chars: int, max_replies: int) -> None:
        self._redis = redis
        self._window_chars = window_chars
        self._max_replies = max_replies
        self._tails: OrderedDict[str, tuple[int, str]] = OrderedDict()  # reply id -> (seq, window up to it)

    async def text_up_to(self, reply_id: str, seq: int) -> str:
        cached = self._tails.get(reply_id)
        if cached is not None and cached[0] <= seq:
            text = cached[1] + await self._text_between(reply_id, cached[0] + 1, seq)
        else:
            text = await self._read_back(reply_id, seq)
        text = newest_chars(text, self._window_chars)
        self._tails[reply_id] = (seq, text)
        self._tails.move_to_end(reply_id)
        while len(self._tails) > self._max_replies:
            self._tails.popitem(last=False)
        return text

    def forget(self, reply_id: str) -> None:
        self._tails.pop(reply_id, None)

    async def _text_between(self, reply_id: str, first_seq: int, last_seq: int) -> str:
        if first_seq > last_seq:
            return ""
        events = await logged_events(self._redis, reply_id, since=entry_id(first_seq), until=entry_id(last_seq))
        return "".join(event.text for event in events)

    async def _read_back(self, reply_id: str, seq: int) -> str:
        """Pages backwards from `seq` until the window is full or the log's start (seqs are contiguous from 1)."""
        pages: list[str] = []
        num_chars, high = 0, seq
        while high >= 1 and num_chars < self._window_chars:
            low = max(1, high - READ_PAGE + 1)
            page = await self._text_between(reply_id, low, high)
            pages.append(page)
            num_chars += len(page)
            high = low - 1
        return "".join(reversed(pages))


class OutputModerator:
    """The relay's output check: `admit_final` before a final event is appended, `after_append`
    after every append."""

    def __init__(self, redis: Redis, check: CheckProcess, publish: Publish, publish_final: PublishFinal, config: OutputCheckConfig) -> None:
        self._redis = redis
        self._check = check
        self._publish = publish
        self._publish_final = publish_final
        self._config = config
        self._windows = LogWindows(redis, config.window_chars, config.max_cached_replies)
        self._scorer = BatchScorer(check.score, config.max_batch, metrics.OUTPUT_CHECK_SECONDS.observe)
        self._due: dict[str, int] = {}  # reply id -> the newest seq whose window waits for a check
        self._checking: dict[str, asyncio.Task[None]] = {}  # reply id -> its checks in flight

    def after_append(self, event: TokenEvent, appended: Appended) -> None:
        """Schedules a check of the window up to the log's last seq when the append logged a check's turn."""
        if appended.final_status is not None:
            self._windows.forget(event.reply_id)
            return
        if not crosses_check(appended.last_seq, appended.num_appended, self._config.every_tokens):
            return
        reply_id = event.reply_id
        self._due[reply_id] = max(self._due.get(reply_id, 0), appended.last_seq)
        if reply_id not in self._checking:
            self._spawn(reply_id, self._check_while_due(reply_id))

    async def admit_final(self, event: TokenEvent) -> bool:
        """False when the reply's last window tripped the check: the reply was ended as moderated
        instead, and `event` must not be appended. Raises Redeliver for a final event whose
        predecessors are not all logged yet (its window is not readable)."""
        if event.finish not in CHECKED_FINISHES:
            return True
        meta = (await load_reply_states(self._redis, [event.reply_id]))[event.reply_id]
        if meta is None or not meta.is_running or event.epoch < meta.epoch or meta.last_seq >= event.seq:
            return True  # the log drops it (stale, duplicate, after the end) or records it as it would
        if meta.last_seq < event.seq - 1:
            raise Redeliver(REDELIVER_AFTER_S)
        window = newest_chars(await self._windows.text_up_to(event.reply_id, meta.last_seq) + event.text, self._config.window_chars)
        self._windows.forget(event.reply_id)
        try:
            flagged = await self._is_flagged(event.reply_id, window)
        except Exception:  # a failing check must not hold the reply's end back: it ends unchecked, loudly
            log.exception("reply %s: the output check of its last window failed; it ends unchecked", event.reply_id)
            return True
        if not flagged:
            return True
        return not await self._moderate(event.reply_id, usage=event.usage if event.HasField("usage") else None, cancel=False)

    async def stop(self) -> None:
        tasks = list(self._checking.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._check.close()

    def _spawn(self, reply_id: str, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work, name=f"output-check:{reply_id}")
        self._checking[reply_id] = task
        task.add_done_callback(lambda _: self._checking.pop(reply_id, None))

    async def _check_while_due(self, reply_id: str) -> None:
        """One reply's checks, one at a time, each at the newest seq due (a check that falls behind skips to it)."""
        while seq := self._due.pop(reply_id, 0):
            try:
                window = await self._windows.text_up_to(reply_id, seq)
                if await self._is_flagged(reply_id, window):
                    await self._moderate(reply_id, usage=None, cancel=True)
                    self._due.pop(reply_id, None)
                    return
            except (RedisError, OSError) as exc:
                log.warning(
                    "reply %s: the output check at seq %d could not read or end it (%s); the next one tries again", reply_id, seq, exc
                )
            except Exception:  # a deployment's check failing: the reply goes on unchecked, loudly
                log.exception("reply %s: the output check at seq %d failed", reply_id, seq)

    async def _is_flagged(self, reply_id: str, window: str) -> bool:
        if not window.strip():
            return False
        score = await self._scorer.score(window)
        if score < self._config.threshold:
            return False
        log.info("reply %s: its output tripped the %s check (score %.2f)", reply_id, self._check.name, score)
        return True

    async def _moderate(self, reply_id: str, usage: Usage | None, cancel: bool) -> bool:
        """Ends the reply as moderated; False when it had ended meanwhile (nothing done)."""
        taken = await fence_reply(self._redis, reply_id, ttl_s=self._config.running_ttl_s)
        if taken is None:
            return False
        meta = await load_reply(self._redis, reply_id)
        if cancel:
            await self._publish(subjects.cancel(reply_id), encode(Cancel(reply_id=reply_id, reason=CANCEL_REASON)))
        if usage is None and meta is not None and meta.request:
            prompt_ids = GenerateRequest.FromString(meta.request).prompt_token_ids
            usage = Usage(input_tokens=len(prompt_ids), output_tokens=taken.last_seq)
        event = final_event(reply_id, taken.last_seq + 1, FINISH_REASON_CONTENT_FILTER, worker_id="relay", usage=usage)
        event.epoch = taken.epoch
        await self._publish_final(event)
        tier = tier_of(meta.request) if meta is not None else "unknown"
        model = (meta.model if meta is not None else "") or "unknown"
        metrics.MODERATED.labels(direction="output", tier=tier, model=model).inc()
        return True
