"""One overload message: a user's message in a new conversation, read to its final event, and
what came of it (admitted or refused and why, TTFT, the conversation's creation time)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from chat_client import Event, Pool, ProtocolError, read_events


@dataclass
class Outcome:
    tier: str
    sent_s: float
    status: int = 0  # HTTP status of the message POST (0: no answer)
    retry_after: str | None = None
    result: str = "timed_out"  # complete | failed | refused | timed_out | http_error
    finish: str = ""
    ttft_s: float | None = None
    create_s: float | None = None  # the conversation's creation, part of ttft_s
    detail: str = ""


@dataclass(frozen=True)
class Sender:
    """A user's key and their subject: each user asks about a topic of their own, so a user's
    prompts share their first KV blocks (a tenant's own prefix cache), as a conversation's turns
    share its history, and do so alike in every phase. (A topic drawn from the message's index
    gave users 16 and 32 apart a fixed topic while only paid messages were sent, and a random one
    in the mixed overload: far more paid prompt tokens came from the cache in the first, so the
    bar and the overload measured different prompts.)"""

    key: str
    topic: str


def prompt(sender: Sender, index: int) -> str:
    return f"Explain {sender.topic} in a few short paragraphs. (message {index})"


async def send_message(pool: Pool, sender: Sender, tier: str, index: int, max_tokens: int, hang_s: float) -> Outcome:
    """One message in a new conversation, read to its final event (or to `hang_s` after sending)."""
    headers = {"Authorization": f"Bearer {sender.key}"}
    outcome = Outcome(tier=tier, sent_s=time.monotonic())
    try:
        async with asyncio.timeout(hang_s):
            connection, created = await pool.request("POST", "/v1/conversations", headers, {})
            body = await connection.body(created)
            pool.give(connection)
            if created.status != 201:
                return _refused(outcome, created.status, created.headers.get("retry-after"), body.decode(errors="replace"))
            outcome.create_s = time.monotonic() - outcome.sent_s
            conversation_id = json.loads(body)["id"]
            payload = {"content": prompt(sender, index), "temperature": 0, "max_tokens": max_tokens}
            connection, answer = await pool.request("POST", f"/v1/conversations/{conversation_id}/messages", headers, payload)
            outcome.status = answer.status
            if answer.status != 200:
                body = await connection.body(answer)
                pool.give(connection)
                return _refused(outcome, answer.status, answer.headers.get("retry-after"), body.decode(errors="replace"))

            def on_event(event: Event) -> None:
                if event.name == "delta" and outcome.ttft_s is None:
                    outcome.ttft_s = time.monotonic() - outcome.sent_s
                elif event.name == "done" and outcome.result == "timed_out":
                    data = json.loads(event.data)
                    outcome.result, outcome.finish = "complete", str(data.get("finish", ""))
                    outcome.detail = json.dumps(data.get("usage", {}))
                elif event.name == "error" and outcome.result == "timed_out":
                    outcome.result, outcome.detail = "failed", event.data.decode(errors="replace")[:200]

            await read_events(connection, answer, on_event)
            pool.give(connection)
            if outcome.result == "timed_out":
                outcome.result, outcome.detail = "http_error", "the stream ended without a final event"
    except TimeoutError:
        outcome.result = "timed_out"
    except (OSError, asyncio.IncompleteReadError, ProtocolError, ValueError) as exc:
        outcome.result = "http_error"
        outcome.detail = f"{type(exc).__name__}: {exc}"[:200]
    return outcome


def _refused(outcome: Outcome, status: int, retry_after: str | None, text: str) -> Outcome:
    outcome.status = status
    outcome.retry_after = retry_after
    outcome.result = "refused"
    outcome.detail = f"{status}: {text[:160]}"
    return outcome
