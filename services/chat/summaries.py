"""Summaries of long conversations. When a turn's prompt leaves history turns out (they no longer
fit the tier's budget), a job in the background writes a summary of them (the summary so far +
the turns left out, oldest first: services.chat.summary_prompt) with the conversation's served
model, greedy and bounded, on the background lane once the turn's own answer has ended
(services.chat.summary_reply), and stores it with the seq of the newest turn it covers. The
context builder then sends system prompt + summary + the newest turns.

A job never stands in a reply's way: it is scheduled, not awaited; one runs per conversation at
a time across chat instances (a Redis key set NX, with a TTL); this process runs at most
`max_jobs`; a job has a deadline for all of it; a refused, failed or late summary is logged and
counted, and the next turn that leaves history out tries again. A summary never moves backwards:
the conversation is read again before storing, and a summary is stored only when it covers more
than the stored one.

Its reply is no message of the conversation and costs the user no quota: summarising is the
service's own upkeep on idle capacity; the user pays for a summary only as its tokens in the
prompts that carry it."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import nats.errors
from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.chat import metrics
from services.chat.config import ChatConfig
from services.chat.context import Budget
from services.chat.models_view import ServedModel
from services.chat.prompt import LoadedTokenizer
from services.chat.summary_prompt import covers, fit_prompt, max_words_of, source_of
from services.chat.summary_reply import NoSummary, SummaryAsker, SummaryRequest
from tandem.config import ApiKey, Settings
from tandem.store import ConversationStore, Message, StoreUnavailable

log = logging.getLogger(__name__)

# Compare-and-delete: a job releases its conversation's key only while the key is still its own.
_RELEASE = """
if redis.call("get", KEYS[1]) == ARGV[1] then
  return redis.call("del", KEYS[1])
end
return 0
"""


class Outcome(str, Enum):
    WRITTEN = "written"  # stored: it covers more than the summary before it
    REFUSED = "refused"  # no idle capacity for it before its deadline (background work paused while the fleet is busy)
    FAILED = "failed"  # no router, an error, no text, past its deadline
    SKIPPED = "skipped"  # another job holds the conversation, this process is at its bound, or nothing new


class SummaryFailed(Exception):
    """The summary could not be written (its outcome says how)."""

    def __init__(self, outcome: Outcome, why: str) -> None:
        self.outcome = outcome
        super().__init__(why)


@dataclass(frozen=True)
class SummaryConfig:
    is_enabled: bool
    max_tokens: int  # a summary's bound (at most a quarter of the tier's prompt budget)
    timeout_s: float = 120.0  # the whole job: waiting for the turn's answer, refusals, writing
    max_jobs: int = 4  # running in this process
    key_margin_s: float = 30.0  # the conversation's key outlives a job's deadline by this

    @classmethod
    def from_settings(cls, settings: Settings) -> SummaryConfig:
        return cls(is_enabled=settings.summaries, max_tokens=settings.summary_max_tokens)


@dataclass(frozen=True)
class SummaryJob:
    user: ApiKey
    conversation_id: str
    model: ServedModel  # the model the turn was served by
    dropped: tuple[Message, ...]  # the history turns its prompt left out, oldest first
    after_reply_id: str = ""  # the turn's reply, which the job lets end first


def job_key(conversation_id: str) -> str:
    return f"tandem:conversation:{{{conversation_id}}}:summary_job"


class Summaries:
    """This process's summary jobs: scheduled without waiting, bounded, cancelled at shutdown;
    `write` does a job's work (SummaryWriter.write) and tells how it went."""

    def __init__(self, config: SummaryConfig, write: Callable[[SummaryJob], Awaitable[Outcome]]) -> None:
        self.config = config
        self._write = write
        self._tasks: set[asyncio.Task[Outcome]] = set()

    @property
    def num_running(self) -> int:
        return len(self._tasks)

    def schedule(self, job: SummaryJob) -> None:
        """Starts the job (none when its prompt left nothing out); never raises."""
        if not self.config.is_enabled or not job.dropped:
            return
        if len(self._tasks) >= self.config.max_jobs:
            log.info("conversation %s: no summary now, %d jobs are running already", job.conversation_id, len(self._tasks))
            metrics.SUMMARIES.labels(outcome=Outcome.SKIPPED.value).inc()
            return
        task = asyncio.create_task(self._run(job), name=f"summary:{job.conversation_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        """Until the jobs running now end."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.wait()

    async def _run(self, job: SummaryJob) -> Outcome:
        try:
            outcome = await self._write(job)
        except SummaryFailed as exc:
            log.warning("conversation %s: no summary (%s): %s", job.conversation_id, exc.outcome.value, exc)
            outcome = exc.outcome
        except (StoreUnavailable, RedisError, OSError, nats.errors.Error) as exc:
            log.warning("conversation %s: no summary: %s: %s", job.conversation_id, type(exc).__name__, exc)
            outcome = Outcome.FAILED
        except Exception:  # a bug: logged whole, and never the reply's concern
            log.exception("conversation %s: the summary job failed", job.conversation_id)
            outcome = Outcome.FAILED
        metrics.SUMMARIES.labels(outcome=outcome.value).inc()
        return outcome


class SummaryWriter:
    """Writes one job's summary: holds its conversation's key, asks the model (`asker`) and stores
    the summary in `store`. `chat` bounds a summary by the tier's prompt budget."""

    def __init__(
        self,
        config: SummaryConfig,
        chat: ChatConfig,
        redis: Redis,
        store: ConversationStore,
        tokenizer: LoadedTokenizer,
        asker: SummaryAsker,
    ) -> None:
        self.config = config
        self._chat = chat
        self._redis = redis
        self._store = store
        self._tokenizer = tokenizer
        self._asker = asker

    async def write(self, job: SummaryJob) -> Outcome:
        """Writes and stores the summary of `job`'s turns within the job's deadline, holding its
        conversation's key meanwhile; raises SummaryFailed when the model gave none."""
        config = self.config
        key, token = job_key(job.conversation_id), uuid.uuid4().hex
        if not await self._redis.set(key, token, nx=True, ex=int(config.timeout_s + config.key_margin_s)):
            return Outcome.SKIPPED  # another job is summarising this conversation
        deadline = asyncio.get_running_loop().time() + config.timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                return await self._summarise(job, deadline)
        except TimeoutError:
            raise SummaryFailed(Outcome.FAILED, f"no summary within {config.timeout_s:g} s") from None
        except NoSummary as exc:
            raise SummaryFailed(Outcome.REFUSED if exc.is_refused else Outcome.FAILED, str(exc)) from None
        finally:
            await self._redis.eval(_RELEASE, 1, key, token)

    async def _summarise(self, job: SummaryJob, deadline: float) -> Outcome:
        if job.after_reply_id:
            await self._asker.wait_for_turn(job.after_reply_id)
        conversation = await self._store.get_conversation(job.user.user_id, job.conversation_id)
        messages = await self._store.list_messages(job.conversation_id)
        source = source_of(conversation, job.dropped, messages) if conversation is not None else None
        if source is None:
            return Outcome.SKIPPED  # gone, or summarised up to these turns already
        max_tokens = self.summary_tokens_for(job)
        room_tokens = job.model.window_tokens - max_tokens
        prompt = await asyncio.to_thread(fit_prompt, self._tokenizer.get(), source, room_tokens, max_words_of(max_tokens))
        if prompt is None:
            raise SummaryFailed(Outcome.FAILED, f"the summary so far leaves no room in {job.model.name}'s window")
        request = SummaryRequest(job.user, job.conversation_id, job.model.name, prompt.ids, max_tokens)
        text = await self._asker.ask(request, deadline)
        is_stored = await store_if_newer(self._store, job.user.user_id, job.conversation_id, text, prompt.upto_seq)
        return Outcome.WRITTEN if is_stored else Outcome.SKIPPED

    def summary_tokens_for(self, job: SummaryJob) -> int:
        """The summary's bound: the setting, but at most a quarter of the prompt the user's tier may
        send, so a summary never crowds the new message out of it."""
        budget = Budget(
            window_tokens=job.model.window_tokens,
            tier_prompt_tokens=self._chat.prompt_budget_for(job.user.tier),
            answer_tokens=min(self._chat.max_answer_tokens, job.model.window_tokens // 2),
        )
        return max(1, min(self.config.max_tokens, budget.prompt_tokens // 4))


async def store_if_newer(store: ConversationStore, user_id: str, conversation_id: str, text: str, upto_seq: int) -> bool:
    """Stores the summary unless the stored one (read again now) covers as much of its branch
    already: a summary never moves backwards. One of another branch is replaced (the branch
    written on last is the one a summary serves). The conversation's job key keeps other jobs out
    meanwhile."""
    conversation = await store.get_conversation(user_id, conversation_id)
    if conversation is None or covers(await store.list_messages(conversation_id), conversation.summary_upto_seq, upto_seq):
        return False
    await store.update_conversation(user_id, conversation_id, summary=text, summary_upto_seq=upto_seq)
    log.info("conversation %s: summarised up to message %d (%d characters)", conversation_id, upto_seq, len(text))
    return True


def schedule_summary(
    summaries: Summaries | None, user: ApiKey, conversation_id: str, model: ServedModel, dropped: Sequence[Message], reply_id: str
) -> None:
    """For a turn (its reply `reply_id`) whose prompt left `dropped` out, oldest first: a summary
    job, unless none is needed or this chat writes none (`summaries` None). Returns at once; never raises."""
    if summaries is not None:
        summaries.schedule(SummaryJob(user, conversation_id, model, tuple(dropped), reply_id))
