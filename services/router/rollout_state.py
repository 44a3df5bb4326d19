"""The rollout as this router applies it: the plan from the file (services.router.rollout), the
candidates rolled back (by this router's rule, services.router.rollback, or adopted from another
router's RolloutStatus), and the windows of reply outcomes the rule reads.

A rollback sets the candidate's applied candidate_percent and shadow_percent to 0 and holds while
the file's entry for the model stays as it was; an entry that changes (another candidate, another
percent) ends it, and the candidate's window starts again empty."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from services.router import metrics
from services.router.rollback import RollbackRule, Verdict, VersionWindow, verdict
from services.router.rollout import ModelRollout, RolloutPlan
from tandem import model_ids
from tandem.bus.events import now_ms
from tandem.v1.worker_pb2 import ModelRollout as ModelRolloutMessage
from tandem.v1.worker_pb2 import ReplyOutcome, RolloutStatus
from tandem.v1.worker_pb2 import VersionWindow as VersionWindowMessage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolledBack:
    entry: ModelRollout  # the file's entry it was rolled back under
    reason: str
    at_unix_ms: int


class Rollouts:
    def __init__(
        self, rule: RollbackRule = RollbackRule(), clock: Callable[[], float] = time.monotonic, wall_ms: Callable[[], int] = now_ms
    ) -> None:
        self._rule = rule
        self._clock = clock
        self._wall_ms = wall_ms
        self._plan = RolloutPlan()
        self._rolled_back: dict[str, RolledBack] = {}  # by model name
        self._windows: dict[str, VersionWindow] = {}  # by served id
        self._gauge_labels: set[tuple[str, str]] = set()

    def applied(self, name: str) -> ModelRollout | None:
        entry = self._plan.models.get(name)
        if entry is None or name not in self._rolled_back:
            return entry
        return replace(entry, candidate_percent=0.0, shadow_percent=0.0)

    def set_plan(self, plan: RolloutPlan) -> None:
        """A new plan from the file: rollbacks of entries that changed end."""
        for name, rolled_back in list(self._rolled_back.items()):
            entry = plan.models.get(name)
            if entry != rolled_back.entry:
                del self._rolled_back[name]
                if entry is not None and entry.candidate:
                    self._windows.pop(entry.candidate_id, None)  # its replies are judged afresh
                log.info("the rollback of %s ended: the rollout file changed its entry", rolled_back.entry.candidate_id)
        self._plan = plan
        self._set_gauges()

    def observe(self, outcome: ReplyOutcome) -> Verdict | None:
        """A finished reply of a rollout's stable or candidate (shadows and other versions are
        ignored); the verdict when it made this router roll the candidate back."""
        name, version = model_ids.split(outcome.model)
        entry = self._plan.models.get(name)
        if outcome.is_shadow or entry is None or not version or version not in (entry.stable, entry.candidate):
            return None
        self._window(outcome.model).add(self._clock(), outcome.ttft_s, outcome.is_error)
        if version != entry.candidate or name in self._rolled_back:
            return None
        now_s = self._clock()
        found = verdict(self._window(entry.stable_id).summary(now_s), self._window(entry.candidate_id).summary(now_s), self._rule)
        if found is not None:
            self._roll_back(entry, found.message, self._wall_ms())
            metrics.ROLLBACKS.labels(model=name, version=entry.candidate, reason=found.reason).inc()
            log.warning("rolled back %s (its share of %s is 0 now): %s", entry.candidate_id, name, found.message)
        return found

    def adopt(self, status: RolloutStatus) -> list[str]:
        """Rollbacks another router announced for the entries this router has too (same stable,
        candidate and configured percents); the names of the models rolled back here by them."""
        adopted = []
        for announced in status.models:
            entry = self._plan.models.get(announced.model)
            if not announced.rolled_back or entry is None or announced.model in self._rolled_back:
                continue
            announced_entry = ModelRollout(
                announced.model, announced.stable, announced.candidate, announced.configured_percent, announced.shadow_percent
            )
            if replace(entry, shadow_percent=0.0) != replace(announced_entry, shadow_percent=0.0):
                continue  # another entry (or the same before an edit): not this router's rollout
            self._roll_back(entry, announced.rollback_reason, announced.rolled_back_unix_ms)
            log.warning("rolled back %s as router %s did: %s", entry.candidate_id, status.router_id, announced.rollback_reason)
            adopted.append(announced.model)
        return adopted

    def status(self, router_id: str, interval_s: float) -> RolloutStatus:
        now_s = self._clock()
        message = RolloutStatus(router_id=router_id, sent_unix_ms=self._wall_ms(), interval_s=interval_s)
        for name, entry in sorted(self._plan.models.items()):
            applied = self.applied(name)
            assert applied is not None
            rolled_back = self._rolled_back.get(name)
            model = ModelRolloutMessage(
                model=name,
                stable=entry.stable,
                candidate=entry.candidate,
                configured_percent=entry.candidate_percent,
                candidate_percent=applied.candidate_percent,
                shadow_percent=applied.shadow_percent,
                rolled_back=rolled_back is not None,
                rollback_reason=rolled_back.reason if rolled_back else "",
                rolled_back_unix_ms=rolled_back.at_unix_ms if rolled_back else 0,
                stable_window=self._window_message(entry.stable_id, now_s),
            )
            if entry.candidate:
                model.candidate_window.CopyFrom(self._window_message(entry.candidate_id, now_s))
            message.models.append(model)
        return message

    def _roll_back(self, entry: ModelRollout, reason: str, at_unix_ms: int) -> None:
        self._rolled_back[entry.name] = RolledBack(entry, reason, at_unix_ms)
        self._set_gauges()

    def _window(self, served: str) -> VersionWindow:
        window = self._windows.get(served)
        if window is None:
            window = self._windows[served] = VersionWindow(self._rule.window_s)
        return window

    def _window_message(self, served: str, now_s: float) -> VersionWindowMessage:
        summary = self._window(served).summary(now_s)
        return VersionWindowMessage(replies=summary.num_replies, errors=summary.num_errors, ttft_p95_s=summary.ttft_p95_s)

    def _set_gauges(self) -> None:
        """tandem_router_rollout_percent: each version's applied share of new conversations."""
        labels: set[tuple[str, str]] = set()
        for name in self._plan.models:
            applied = self.applied(name)
            assert applied is not None
            candidate_percent = applied.candidate_percent if applied.candidate else 0.0
            labels.add((name, applied.stable))
            metrics.ROLLOUT_PERCENT.labels(model=name, version=applied.stable).set(100.0 - candidate_percent)
            if applied.candidate:
                labels.add((name, applied.candidate))
                metrics.ROLLOUT_PERCENT.labels(model=name, version=applied.candidate).set(candidate_percent)
        for name, version in self._gauge_labels - labels:
            metrics.ROLLOUT_PERCENT.remove(name, version)
        self._gauge_labels = labels
