"""Every NATS subject Tandem uses, in one place. All live under `tandem.v1.`."""

from __future__ import annotations

import re

PREFIX = "tandem.v1"
GENERATE = f"{PREFIX}.generate"
TOKENS_ALL = f"{PREFIX}.tokens.>"
TOKEN_BATCHES_ALL = f"{PREFIX}.tokens.batch.*"  # inside TOKENS_ALL: one more token than a reply's subject
FINALS_ALL = f"{PREFIX}.finals.>"  # a reply's failure ended by the router or a relay, never by a worker
CANCEL_ALL = f"{PREFIX}.cancel.*"
KV_EVENTS_ALL = f"{PREFIX}.kv.events.>"
HANDOFFS_ALL = f"{PREFIX}.handoff.*"
LADDER = f"{PREFIX}.ladder"  # LadderStatus, from every router at each busyness observation
ROLLOUT = f"{PREFIX}.rollout"  # RolloutStatus, from every router at each reload and observation
OUTCOMES = f"{PREFIX}.outcomes"  # ReplyOutcome, from the relay once it stores a finished reply

# A token of a subject: no dots, spaces or wildcards, so an id can never widen a subscription.
_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")


def is_token(value: str) -> bool:
    """Whether `value` can be one token of a subject (an id, a role, a code)."""
    return _TOKEN.fullmatch(value) is not None  # fullmatch: `$` alone lets a trailing newline through


def _token(value: str, what: str) -> str:
    if not is_token(value):
        raise ValueError(f"{what} {value!r} may hold only letters, digits, '-' and '_'")
    return value


def tokens(reply_id: str) -> str:
    """TokenEvents of one reply."""
    return f"{PREFIX}.tokens.{_token(reply_id, 'reply id')}"


def token_batch(worker_id: str) -> str:
    """TokenBatches of one worker: a step's events for all its replies. Five tokens against a
    reply's four (`tokens.<reply_id>`), so no reply id can name it."""
    return f"{PREFIX}.tokens.batch.{_token(worker_id, 'worker id')}"


def is_token_batch(subject: str) -> bool:
    return subject.startswith(TOKEN_BATCHES_ALL.removesuffix("*")) and subject.count(".") == 4


def final(reply_id: str) -> str:
    """The final event of a reply that the router or a relay ends (no worker can): on its own
    subject, so that only workers may publish on token subjects."""
    return f"{PREFIX}.finals.{_token(reply_id, 'reply id')}"


def cancel(reply_id: str) -> str:
    return f"{PREFIX}.cancel.{_token(reply_id, 'reply id')}"


def handoff(reply_id: str) -> str:
    """HandoffOutcome of one reply's KV handoff, from its prefill worker to the router."""
    return f"{PREFIX}.handoff.{_token(reply_id, 'reply id')}"


def heartbeat(role: str, instance_id: str) -> str:
    return f"{PREFIX}.heartbeat.{_token(role, 'role')}.{_token(instance_id, 'instance id')}"


def heartbeats_of(role: str) -> str:
    return f"{PREFIX}.heartbeat.{_token(role, 'role')}.*"


def ping(instance_id: str) -> str:
    """Request/reply, empty both ways: every service answers while it runs. A request that gets
    "no responders" means the process is gone (NATS drops a dead connection's subscriptions)."""
    return f"{PREFIX}.ping.{_token(instance_id, 'instance id')}"


def assign(worker_id: str) -> str:
    """Request/reply: Assignment -> AssignmentReply, the router handing a reply to a worker."""
    return f"{PREFIX}.worker.{_token(worker_id, 'worker id')}.assign"


def kv_events(worker_id: str) -> str:
    return f"{PREFIX}.kv.events.{_token(worker_id, 'worker id')}"


def kv_state(worker_id: str) -> str:
    """Request/reply: KvStateRequest -> KvState, for a router that saw a gap in KV events."""
    return f"{PREFIX}.kv.state.{_token(worker_id, 'worker id')}"


def reply_id_of(subject: str) -> str:
    """The reply id at the end of a tokens, finals or cancel subject."""
    return subject.rsplit(".", 1)[-1]
