"""Admission: a request is checked against what the live decode workers serve before any worker
queue sees it, and a refusal says why in words and, where waiting helps, when to retry."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.router.placement import can_serve, num_context_tokens
from services.router.pools import ModelPools
from services.router.workers import LiveWorker
from tandem import model_ids
from tandem.bus import subjects, validate
from tandem.v1.generate_pb2 import GenerateRequest, Refusal

AUTO_MODELS = ("", "auto")
NO_WORKERS_RETRY_AFTER_S = 2.0


@dataclass(frozen=True)
class Admitted:
    model: str
    window: int  # tokens of context the model takes: prompt plus answer


def refusal(reason: str, message: str, retry_after_s: float = 0.0) -> Refusal:
    return Refusal(reason=reason, message=message, retry_after_s=retry_after_s)


def parse_request(data: bytes) -> GenerateRequest | Refusal:
    """The request, checked (tandem.bus.validate), or a bad_request refusal saying which field."""
    try:
        return validate.generate_request(data)
    except validate.Invalid as exc:
        validate.drop("generate_request", subjects.GENERATE, exc)
        return refusal("bad_request", str(exc))


def admit(request: GenerateRequest, workers: Sequence[LiveWorker], pools: ModelPools = ModelPools()) -> Admitted | Refusal:
    """Admitted with the model that will answer, or the first reason to refuse.
    `workers`: every live decode worker, ready or not. `pools`: the models the settings name,
    known (a refusal says no_workers, not unknown_model) while none of their workers is live;
    "auto" is the large one. `request.model` is a served id here (services.router.versions picked
    the version of a bare name)."""
    problem = _check_shape(request)
    if problem is not None:
        return problem
    if not workers:
        return refusal("no_workers", "no decode worker is live yet", NO_WORKERS_RETRY_AFTER_S)
    models_served = sorted({w.model for w in workers if w.model})
    if not models_served:
        return refusal("no_workers", "no decode worker has announced its model yet", NO_WORKERS_RETRY_AFTER_S)
    model = large_model(workers, pools) if request.model in AUTO_MODELS else request.model
    if model not in models_served and model_ids.name_of(model) not in pools.names:
        served = ", ".join(models_served)
        return refusal("unknown_model", f"model {request.model!r} is not served here; models served: {served} (or 'auto')")
    serving = [w for w in workers if can_serve(w, model)]
    if not serving:
        waiting = f"{len([w for w in workers if w.model == model])} starting, loading or draining"
        return refusal("no_workers", f"no decode worker for {model} takes work now ({waiting})", NO_WORKERS_RETRY_AFTER_S)
    # The smallest window, so whichever worker placement picks can hold the reply.
    window = min(w.heartbeat.max_model_len for w in serving)
    return _check_fits(request, model, window) or Admitted(model=model, window=window)


def _check_shape(request: GenerateRequest) -> Refusal | None:
    """What is wrong with the request whatever the workers."""
    num_prompt_tokens = len(request.prompt_token_ids)
    if num_prompt_tokens == 0:
        return refusal("empty_prompt", "the request has no prompt tokens (prompt_token_ids is empty)")
    if request.sampling.max_tokens == 0:
        return refusal("bad_max_tokens", "sampling.max_tokens must be at least 1")
    if request.public_prefix_tokens > num_prompt_tokens:
        return refusal(
            "bad_request",
            f"public_prefix_tokens is {request.public_prefix_tokens} but the prompt has {num_prompt_tokens} tokens",
        )
    for field in ("resume_reply_id", "reply_id"):
        value = getattr(request, field)
        if value and not _is_subject_token(value):
            return refusal("bad_request", f"{field} {value!r} may hold only letters, digits, '-' and '_'")
    if request.reply_id and request.resume_reply_id and request.reply_id != request.resume_reply_id:
        return refusal("bad_request", "reply_id and resume_reply_id differ: a continuation keeps its reply id")
    sampling = request.sampling
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
        return refusal("bad_sampling", f"sampling.temperature must be 0 (greedy) or more; got {sampling.temperature}")
    if not (0 <= sampling.top_p <= 1):
        return refusal("bad_sampling", f"sampling.top_p must be between 0 and 1; got {sampling.top_p}")
    return None


def _check_fits(request: GenerateRequest, model: str, window: int) -> Refusal | None:
    max_tokens = request.sampling.max_tokens
    if max_tokens > window:
        return refusal("bad_max_tokens", f"sampling.max_tokens is {max_tokens} but {model} has a window of {window} tokens")
    num_tokens = num_context_tokens(request)
    if num_tokens > window - 1:
        what = "the prompt and the tokens already generated have" if request.generated_token_ids else "the prompt has"
        return refusal(
            "prompt_too_long",
            f"{what} {num_tokens} tokens; {model} takes at most {window - 1} "
            f"(its window is {window} tokens, and the answer needs at least 1)",
        )
    return None


def large_model(workers: Sequence[LiveWorker], pools: ModelPools) -> str:
    """The large model as the settings name it (a name, or a full id that pins a version), else
    the name most workers serve; its version is services.router.versions' to pick."""
    return pools.large or choose_model(workers)


def choose_model(workers: Sequence[LiveWorker]) -> str:
    """For "auto": the model name most workers take work for now, whatever their versions (then
    by name, so every router agrees). It is also the large model, whose pool the overload ladder
    watches."""
    serving = [w for w in workers if w.is_serving and w.model] or [w for w in workers if w.model]
    if not serving:
        return ""
    counts: dict[str, int] = {}
    for worker in serving:
        name = model_ids.name_of(worker.model)
        counts[name] = counts.get(name, 0) + 1
    return min(counts, key=lambda name: (-counts[name], name))


def _is_subject_token(value: str) -> bool:
    try:
        subjects.tokens(value)
    except ValueError:
        return False
    return True
