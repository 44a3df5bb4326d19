"""The model rollout as the operator writes it: a TOML file naming, per model, its stable and
candidate versions, the candidate's share of new conversations and the share of requests the
stable version answers that are mirrored to the candidate in shadow:

    [models.smol]
    stable = "1"
    candidate = "2"
    candidate_percent = 10
    shadow_percent = 5

The router rereads it when it changes (RolloutFile.reload, every `rollout_reload_s`); a file that
does not parse or check is logged naming the field, counted, and the plan before it stays. What
the router does with the plan (the split, shadows, rollbacks) is services.router.versions' and
services.router.rollout_state's."""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.router import metrics
from services.router.rollback import RollbackRule
from tandem import model_ids
from tandem.config import Settings

log = logging.getLogger(__name__)

_KEYS = ("stable", "candidate", "candidate_percent", "shadow_percent")


@dataclass(frozen=True)
class RolloutConfig:
    """The router's rollout settings."""

    file: Path | None = None
    reload_s: float = 2.0
    window_s: float = 300.0
    min_replies: int = 20
    error_margin: float = 0.05
    ttft_margin: float = 0.5

    @property
    def rule(self) -> RollbackRule:
        return RollbackRule(self.window_s, self.min_replies, self.error_margin, self.ttft_margin)

    @classmethod
    def from_settings(cls, settings: Settings) -> RolloutConfig:
        return cls(
            file=settings.rollout_file,
            reload_s=settings.rollout_reload_s,
            window_s=settings.rollout_window_s,
            min_replies=settings.rollout_min_replies,
            error_margin=settings.rollout_error_margin,
            ttft_margin=settings.rollout_ttft_margin,
        )


@dataclass(frozen=True)
class ModelRollout:
    """One model's entry: versions without the name ("1", not "smol@1")."""

    name: str
    stable: str
    candidate: str = ""
    candidate_percent: float = 0.0
    shadow_percent: float = 0.0

    @property
    def stable_id(self) -> str:
        return model_ids.versioned(self.name, self.stable)

    @property
    def candidate_id(self) -> str:
        return model_ids.versioned(self.name, self.candidate) if self.candidate else ""


@dataclass(frozen=True)
class RolloutPlan:
    """Every model's entry, by name; empty: no rollout (each name's most served version answers)."""

    models: Mapping[str, ModelRollout] = field(default_factory=dict)


class RolloutFileError(ValueError):
    """A rollout file that does not parse or check; the message names the field."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # the error counter's label: syntax, invalid


def parse_rollout(text: str) -> RolloutPlan:
    """The plan a rollout file's text describes. Raises RolloutFileError."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RolloutFileError("syntax", f"not TOML: {exc}") from None
    unknown = sorted(set(document) - {"models"})
    if unknown:
        raise RolloutFileError("invalid", f"unknown key {unknown[0]!r}: the file holds only [models.<name>] tables")
    models = document.get("models", {})
    if not isinstance(models, dict):
        raise RolloutFileError("invalid", "models: a table of [models.<name>] tables")
    return RolloutPlan({name: _model(name, entry) for name, entry in models.items()})


def _model(name: str, entry: Any) -> ModelRollout:
    where = f"models.{name}"
    if model_ids.is_versioned(name) or not name:
        raise RolloutFileError("invalid", f"{where}: the model's name without a version (smol, not smol@1)")
    if not isinstance(entry, dict):
        raise RolloutFileError("invalid", f"{where}: a table with stable, candidate, candidate_percent and shadow_percent")
    unknown = sorted(set(entry) - set(_KEYS))
    if unknown:
        raise RolloutFileError("invalid", f"{where}.{unknown[0]}: unknown key (known: {', '.join(_KEYS)})")
    if "stable" not in entry:
        raise RolloutFileError("invalid", f"{where}.stable: missing (the version that answers by default)")
    stable = _version(name, entry["stable"], f"{where}.stable")
    candidate = _version(name, entry.get("candidate", ""), f"{where}.candidate") if entry.get("candidate", "") != "" else ""
    candidate_percent = _percent(entry.get("candidate_percent", 0), f"{where}.candidate_percent")
    shadow_percent = _percent(entry.get("shadow_percent", 0), f"{where}.shadow_percent")
    if candidate and candidate == stable:
        raise RolloutFileError("invalid", f"{where}.candidate: {candidate!r} is the stable version too")
    if not candidate and (candidate_percent or shadow_percent):
        field_name = "candidate_percent" if candidate_percent else "shadow_percent"
        raise RolloutFileError("invalid", f"{where}.{field_name}: set, but there is no candidate")
    return ModelRollout(name, stable, candidate, candidate_percent, shadow_percent)


def _version(name: str, value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RolloutFileError("invalid", f'{where}: a version is a string (write "{value}")')
    try:
        model_ids.versioned(name, value)
    except ValueError as exc:
        raise RolloutFileError("invalid", f"{where}: {exc}") from None
    if not value:
        raise RolloutFileError("invalid", f"{where}: empty")
    return value


def _percent(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RolloutFileError("invalid", f"{where}: a number from 0 to 100, not {value!r}")
    if not 0 <= value <= 100:
        raise RolloutFileError("invalid", f"{where}: {value} is out of range (0 to 100)")
    return float(value)


class RolloutFile:
    """The file, read again on each `reload`; a new plan only when its text changed and checks."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._last_text: str | None = None  # the text last read, good or bad: a bad file is logged once
        self._is_missing = False

    def reload(self) -> RolloutPlan | None:
        """The new plan, or None: unchanged, missing (the plan before stays; at start: none) or bad."""
        if self._path is None:
            return None
        try:
            text = self._path.read_text(encoding="utf-8")
        except FileNotFoundError:
            if not self._is_missing:
                self._is_missing = True
                when = "at start: no rollout" if self._last_text is None else "the rollout before it stays"
                log.warning("the rollout file %s is missing (%s)", self._path, when)
            return None
        except (OSError, UnicodeDecodeError) as exc:
            self._count_error("unreadable", f"cannot read it: {exc}")
            return None
        self._is_missing = False
        if text == self._last_text:
            return None
        self._last_text = text
        try:
            plan = parse_rollout(text)
        except RolloutFileError as exc:
            self._count_error(exc.reason, str(exc))
            return None
        log.info("the rollout file %s: %s", self._path, describe(plan))
        return plan

    def _count_error(self, reason: str, message: str) -> None:
        metrics.ROLLOUT_FILE_ERRORS.labels(reason=reason).inc()
        log.error("the rollout file %s is not applied, the rollout before it stays: %s", self._path, message)


def describe(plan: RolloutPlan) -> str:
    if not plan.models:
        return "no model rollouts"
    return "; ".join(
        f"{m.name}: stable {m.stable}"
        + (f", candidate {m.candidate} at {m.candidate_percent:g} %, shadow {m.shadow_percent:g} %" if m.candidate else "")
        for m in plan.models.values()
    )
