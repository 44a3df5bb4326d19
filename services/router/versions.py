"""Which version of a model answers a request, before admission.

A request naming a full id (`smol@1`: a pinned conversation, a shadow reply) gets exactly it. A
request naming the bare name (`smol`: a new conversation, the OpenAI API; `auto` is resolved to
the large model's name first) gets, under the model's rollout (services.router.rollout_state):
the candidate with probability candidate_percent / 100 when a worker serves it, else the stable
when served, else the version most workers serve (ties: the highest version). Workers that serve
an unversioned model keep being answered by the bare name, exactly as before versions.

When the stable version answers, a share of requests (shadow_percent) is also mirrored to the
candidate: the router names it in GenerateReply.shadow_model and the caller starts that reply."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.router import metrics
from services.router.admission import AUTO_MODELS
from services.router.dispatch import QUEUE_FULL
from services.router.placement import can_serve, serves_name
from services.router.rollout import ModelRollout
from services.router.workers import LiveWorker
from tandem import model_ids
from tandem.bus.events import now_ms
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.worker_pb2 import ReplyOutcome

# A uniform draw in [0, 1): random.random in production, a seeded Random's in tests.
Draw = Callable[[], float]
_CHUNKS = re.compile(r"(\d+)")


class AppliedRollouts(Protocol):
    def applied(self, name: str) -> ModelRollout | None:
        """The model's rollout as applied now (a rolled-back candidate's percents are 0)."""
        ...

    def observe(self, outcome: ReplyOutcome) -> object:
        """A finished reply's outcome, for the automatic rollback."""
        ...


@dataclass(frozen=True)
class VersionChoice:
    model: str  # the served id that answers
    shadow_model: str = ""  # the candidate to mirror the request to; empty: none

    def shadow_for(self, answering: str) -> str:
        """The shadow to start when `answering` answers: none for a request moved to another model."""
        return self.shadow_model if answering == self.model else ""


def version_order(version: str) -> tuple[tuple[int, int, str], ...]:
    """Versions in natural order: "2" < "10", "2026-11-30" < "2026-12-01"; "" (unversioned) first."""
    return tuple((0, int(chunk), "") if chunk.isdigit() else (1, 0, chunk) for chunk in _CHUNKS.split(version) if chunk)


def most_served(name: str, workers: Sequence[LiveWorker]) -> str:
    """The served id of `name` that most workers take work for (of those live when none does);
    ties: the highest version. The bare name when no worker announces it."""
    ids = [w.model for w in workers if serves_name(w, name)]
    ids = ids or [w.model for w in workers if w.model and model_ids.name_of(w.model) == name]
    if not ids:
        return name
    counts: dict[str, int] = {}
    for served in ids:
        counts[served] = counts.get(served, 0) + 1
    return max(counts, key=lambda served: (counts[served], version_order(model_ids.version_of(served))))


def count_version(served: str, request: GenerateRequest) -> None:
    """An admitted request, by model name, version and whether it is a shadow."""
    name, version = model_ids.split(served)
    metrics.VERSION_REQUESTS.labels(model=name, version=version, shadow=str(bool(request.shadow_of)).lower()).inc()


def is_new(request: GenerateRequest) -> bool:
    """A reply the rollout may split and mirror: not a continuation, not a shadow."""
    return not request.resume_reply_id and not request.shadow_of


class VersionPicker:
    def __init__(self, rollouts: AppliedRollouts, draw: Draw = random.random) -> None:
        self._rollouts = rollouts
        self._draw = draw

    def pick(self, asked: str, workers: Sequence[LiveWorker], *, is_new: bool = True) -> VersionChoice:
        """The version that answers `asked` (a bare name or a full id). `is_new`: a reply that may
        be split and mirrored; a continuation is not (it keeps to the stable or the most served)."""
        if model_ids.is_versioned(asked):
            return VersionChoice(asked)
        rollout = self._rollouts.applied(asked)
        if rollout is None:
            return VersionChoice(most_served(asked, workers))
        has_candidate = bool(rollout.candidate) and any(can_serve(w, rollout.candidate_id) for w in workers)
        if is_new and has_candidate and self._draw() < rollout.candidate_percent / 100:
            return VersionChoice(rollout.candidate_id)
        if any(can_serve(w, rollout.stable_id) for w in workers):
            is_shadowed = is_new and has_candidate and rollout.shadow_percent > 0 and self._draw() < rollout.shadow_percent / 100
            return VersionChoice(rollout.stable_id, rollout.candidate_id if is_shadowed else "")
        return VersionChoice(most_served(asked, workers))

    def refused_at_placement(self, model: str, reply_id: str, code: str) -> None:
        """A reply every worker of `model` refused, answered to its caller as a refusal: no reply ran,
        so no relay reports it. It counts as the version's error (a candidate whose workers cannot
        run its requests fails), unless they were only full: a rollback judges faults, not load.
        Only this router hears it; a rollback it causes reaches the others with its status."""
        if code != QUEUE_FULL and model_ids.is_versioned(model):
            self._rollouts.observe(ReplyOutcome(reply_id=reply_id, model=model, is_error=True, finished_unix_ms=now_ms()))

    def version_of(self, model: str, request: GenerateRequest, workers: Sequence[LiveWorker]) -> str:
        """The served id of a model a request moves to (a pool move names it as the settings do)."""
        return self.pick(model, workers, is_new=is_new(request)).model

    def pick_for(self, request: GenerateRequest, large_model: str, workers: Sequence[LiveWorker]) -> VersionChoice:
        """The version that answers a generate request: `auto` is `large_model` (the large model's
        name); a new reply's bare name is split, a continuation's or a shadow's is not."""
        asked = large_model if request.model in AUTO_MODELS else request.model
        if not asked:  # no worker announced a model yet: admission says so
            return VersionChoice(request.model)
        return self.pick(asked, workers, is_new=is_new(request))
