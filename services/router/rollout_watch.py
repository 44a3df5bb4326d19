"""The rollout's bus side: every `rollout_reload_s` the file is checked for changes and a
RolloutStatus published on `tandem.v1.rollout` (the chat's GET /v1/status shows it); reply
outcomes from `tandem.v1.outcomes` feed the rollback rule, and a rollback is published at once;
another router's status is heard so that a rollback it decided holds here too (a router that
restarts learns it from the next status)."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg

from services.router.ladder_watch import Publish
from services.router.rollout import RolloutFile
from services.router.rollout_state import Rollouts
from tandem.bus import encode, subjects, validate

log = logging.getLogger(__name__)


class RolloutWatch:
    def __init__(self, router_id: str, file: RolloutFile, rollouts: Rollouts, publish: Publish, interval_s: float) -> None:
        self._router_id = router_id
        self._file = file
        self._rollouts = rollouts
        self._publish = publish
        self._interval_s = interval_s

    def reload(self) -> None:
        plan = self._file.reload()
        if plan is not None:
            self._rollouts.set_plan(plan)

    async def tick(self) -> None:
        self.reload()
        await self.publish_status()

    async def publish_status(self) -> None:
        await self._publish(subjects.ROLLOUT, encode(self._rollouts.status(self._router_id, self._interval_s)))

    async def run(self) -> None:
        """Ticks until cancelled (the router's stop); a failed tick is logged, never fatal."""
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.tick()
            except Exception:  # the rollout must keep being reloaded whatever one tick met
                log.exception("the rollout's reload or status failed")

    async def on_outcome(self, msg: Msg) -> None:
        try:
            outcome = validate.reply_outcome(msg.data)
        except validate.Invalid as exc:
            validate.drop("reply_outcome", msg.subject, exc)
            return
        if self._rollouts.observe(outcome) is not None:
            await self._publish_quietly()

    async def on_status(self, msg: Msg) -> None:
        try:
            status = validate.rollout_status(msg.data)
        except validate.Invalid as exc:
            validate.drop("rollout_status", msg.subject, exc)
            return
        if status.router_id != self._router_id:
            self._rollouts.adopt(status)

    async def _publish_quietly(self) -> None:
        try:
            await self.publish_status()
        except Exception:  # the next tick publishes it again
            log.exception("could not publish the rollout's status after a rollback")
