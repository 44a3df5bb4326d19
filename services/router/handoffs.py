"""The return path of a KV handoff: a prefill worker that accepted a reply publishes how its
handoff ended (HandoffOutcome on tandem.v1.handoff.<reply_id>); the router that dispatched the
reply waits for it here, and a failed one comes back to that router's dispatch, which places the
reply again. Every router hears every outcome; only the one waiting for a reply acts on it."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg

from tandem.bus import validate
from tandem.v1.dispatch_pb2 import Assignment, HandoffOutcome

log = logging.getLogger(__name__)


class HandoffOutcomes:
    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[HandoffOutcome]] = {}

    def expect(self, reply_id: str) -> None:
        """Before the assignment goes out: a fast failure may arrive before its acceptance does."""
        self._waiting[reply_id] = asyncio.get_running_loop().create_future()

    def forget(self, reply_id: str) -> None:
        future = self._waiting.pop(reply_id, None)
        if future is not None:
            future.cancel()

    async def wait(self, reply_id: str, timeout_s: float) -> HandoffOutcome | None:
        """The outcome, or None when none came within `timeout_s` (the prefill worker died with
        the reply: the relay's stall detection resubmits it as a continuation)."""
        future = self._waiting[reply_id]
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            return None
        finally:
            self.forget(reply_id)

    async def on_message(self, msg: Msg) -> None:
        try:
            outcome = validate.handoff_outcome(msg.data, msg.subject)
        except validate.Invalid as exc:
            validate.drop("handoff_outcome", msg.subject, exc)
            return
        future = self._waiting.get(outcome.reply_id)
        if future is not None and not future.done():
            future.set_result(outcome)


def continuation(assignment: Assignment, published_token_ids: list[int]) -> Assignment:
    """The same reply, continuing after tokens already published: they join the generated tokens
    and the numbering goes on after them (neither duplicated nor lost)."""
    continued = Assignment()
    continued.CopyFrom(assignment)
    continued.request.generated_token_ids.extend(published_token_ids)
    continued.first_seq = (assignment.first_seq or 1) + len(published_token_ids)
    continued.ClearField("decode_worker_id")
    continued.ClearField("decode_grpc_address")
    return continued
