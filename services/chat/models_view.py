"""The models being served, from the decode workers' heartbeats: name -> context window, since
when (the start of the longest-running worker that serves it: OpenAI's `created`), and by how
many workers. Several models may be served at once (a large and a small one, for `auto`), each by
its own workers; `GET /v1/models` lists every one a live heartbeat names.

Workers that version their model (the model_version setting) serve `name@version`; the bare
`name` is then served too, as the versions' alias: a request for it gets the version the routers'
rollout gives it (services/router/rollout.py), and its window is the smallest of theirs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

from nats.aio.msg import Msg

from tandem import model_ids
from tandem.bus import validate


@dataclass(frozen=True)
class ServedModel:
    name: str
    window_tokens: int
    created_unix_s: int
    num_workers: int = 1
    versions: tuple[str, ...] = ()  # a bare name's served versions (name@version ids); empty: not an alias


def most_served(models: Iterable[ServedModel], excluding: str = "") -> ServedModel | None:
    """The model most workers serve (then by name, as the routers choose for "auto"), other than
    `excluding`; a versioned model counts under its name (the alias), never as a version."""
    candidates = (m for m in models if m.name != excluding and not model_ids.is_versioned(m.name))
    return min(candidates, key=lambda m: (-m.num_workers, m.name), default=None)


class ModelsView:
    def __init__(self, expiry_s: float = 3.0) -> None:
        self._expiry_s = expiry_s
        self._seen: dict[str, tuple[float, ServedModel]] = {}  # worker id -> (when, model)
        self._heard = asyncio.Event()  # set by each serving heartbeat

    async def on_heartbeat(self, msg: Msg) -> None:
        try:
            heartbeat = validate.worker_heartbeat(msg.data, msg.subject)
        except validate.Invalid as exc:
            validate.drop("heartbeat", msg.subject, exc)
            return
        if heartbeat.is_engine_ready and heartbeat.model and heartbeat.max_model_len:
            started_unix_s = heartbeat.service.started_unix_ms // 1000
            model = ServedModel(heartbeat.model, heartbeat.max_model_len, started_unix_s)
            self._seen[heartbeat.service.instance_id] = (time.monotonic(), model)
            self._heard.set()

    def models(self) -> dict[str, ServedModel]:
        now = time.monotonic()
        live = [model for when, model in self._seen.values() if now - when <= self._expiry_s]
        # Several workers may serve one model with different windows: the smallest holds on any of
        # them; it has been served since the earliest of their starts.
        out: dict[str, ServedModel] = {}
        for model in sorted(live, key=lambda m: -m.window_tokens):
            earlier = out.get(model.name)
            created_unix_s = model.created_unix_s if earlier is None else min(earlier.created_unix_s, model.created_unix_s)
            num_workers = 1 if earlier is None else earlier.num_workers + 1
            out[model.name] = replace(model, created_unix_s=created_unix_s, num_workers=num_workers)
        return _aliases(out.values()) | out  # a name some worker serves unversioned is that model

    def most_served(self, excluding: str = "") -> ServedModel | None:
        return most_served(self.models().values(), excluding)

    def resolve(self, requested: str) -> ServedModel | None:
        """ "auto" (or empty) is the model most workers serve; otherwise the one named."""
        if requested in ("", "auto"):
            return self.most_served()
        return self.models().get(requested)

    async def resolve_soon(self, requested: str, wait_s: float) -> ServedModel | None:
        """`resolve`, but when no model is known at all (this process just started, or every worker
        just restarted) it waits up to `wait_s` for a serving heartbeat before answering."""
        if not self.models():
            self._heard.clear()
            try:
                await asyncio.wait_for(self._heard.wait(), wait_s)
            except TimeoutError:
                pass
        return self.resolve(requested)


def _aliases(models: Iterable[ServedModel]) -> dict[str, ServedModel]:
    """A bare name for each versioned model: its versions' workers together, its smallest window."""
    out: dict[str, ServedModel] = {}
    for model in sorted(models, key=lambda m: m.name):
        name = model_ids.name_of(model.name)
        if name == model.name:
            continue
        earlier = out.get(name)
        if earlier is None:
            out[name] = replace(model, name=name, versions=(model.name,))
            continue
        out[name] = replace(
            earlier,
            window_tokens=min(earlier.window_tokens, model.window_tokens),
            created_unix_s=min(earlier.created_unix_s, model.created_unix_s),
            num_workers=earlier.num_workers + model.num_workers,
            versions=(*earlier.versions, model.name),
        )
    return out
