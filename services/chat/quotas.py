"""Token quotas in the chat service (the buckets themselves: tandem.quota). A reply reserves its
worst case before anything of it is stored or sent, and gets it back whole if it never starts;
the relay settles it when it ends. A request the bucket cannot afford yet is refused with 429
`quota_exceeded` and a Retry-After saying when it could (unless its tier falls back to the small
model: services.chat.replies.ReplyStarter draws on the small model's bucket then); every authenticated answer says how
much is left (`x-ratelimit-*-tokens`, OpenAI's names). Calls that handle tokens without a reply
(`/tokenize`, `/detokenize`) draw on the same bucket: `charge_tokens`."""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from redis.exceptions import RedisError
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.chat import metrics
from services.chat.errors import InvalidRequest, RateLimited
from tandem.config import ApiKey
from tandem.quota import Admission, Bucket, ExceedsCapacity, TokenBuckets, worst_case_units
from tandem.v1.common_pb2 import Usage

log = logging.getLogger(__name__)


def install(app: FastAPI) -> None:
    """Adds the rate-limit headers to every authenticated answer (the chat's state holds the buckets)."""
    app.add_middleware(QuotaHeaders)


class QuotaExhausted(RateLimited):
    """The bucket cannot afford the reply yet (429 quota_exceeded, Retry-After: when it could)."""

    default_code = "quota_exceeded"


async def reserve(
    buckets: TokenBuckets, user: ApiKey, reply_id: str, num_prompt_tokens: int, max_tokens: int, bucket: Bucket = Bucket.MAIN
) -> None:
    """Reserves the reply's worst case in the user's `bucket` (one Redis round trip). Raises
    QuotaExhausted when the bucket cannot afford it yet, InvalidRequest (400 exceeds_quota) when no
    such bucket ever could."""
    worst_case = worst_case_units(num_prompt_tokens, max_tokens)
    try:
        admission = await buckets.reserve(user.user_id, user.tier, worst_case, reply_id, num_prompt_tokens, bucket)
    except ExceedsCapacity as exc:
        message = (
            f"this request could cost up to {worst_case:.0f} units ({num_prompt_tokens} prompt tokens + max_tokens {max_tokens} x4), "
            f"more than the {user.tier.value} tier's whole quota of {exc.capacity_units}; lower max_tokens or shorten the prompt"
        )
        metrics.REPLIES_REFUSED.labels(code="exceeds_quota").inc()
        raise InvalidRequest(message, code="exceeds_quota", param="max_tokens") from None
    if not admission.is_admitted:
        raise exhausted(user, admission, f"up to {worst_case:.0f}", bucket)


def exhausted(user: ApiKey, admission: Admission, needs: str, bucket: Bucket = Bucket.MAIN) -> QuotaExhausted:
    """The refusal of a request the user's `bucket` cannot afford yet (`needs`: the units it asked)."""
    wait_s = math.ceil(admission.retry_after_s)
    which = "" if bucket is Bucket.MAIN else " and its small-model quota"
    message = (
        f"you have used your {user.tier.value} tier's token quota{which} for now ({admission.remaining_units:.0f} units left, "
        f"this request needs {needs}); try again in {wait_phrase(wait_s)}"
    )
    return QuotaExhausted(message, retry_after_s=wait_s)


async def charge_tokens(buckets: TokenBuckets | None, user: ApiKey, num_tokens: int, param: str) -> None:
    """Charges a call that handles `num_tokens` tokens and starts no reply (`/tokenize`,
    `/detokenize`) to the user's main bucket, as that many uncached prompt tokens and at least one
    unit, so every call counts. Refused as a reply is (QuotaExhausted, 429 with Retry-After) when
    the bucket cannot afford it yet; InvalidRequest (400 exceeds_quota, naming `param`) when the
    tier's whole bucket could not. Reserved and settled at once: nothing is left to expire."""
    if buckets is None:
        return
    units = max(1, num_tokens)
    call_id = f"call-{uuid.uuid4().hex}"
    try:
        admission = await buckets.reserve(user.user_id, user.tier, units, call_id, num_tokens)
    except ExceedsCapacity as exc:
        message = f"this request handles {num_tokens} tokens, more than the {user.tier.value} tier's whole quota of {exc.capacity_units}"
        raise InvalidRequest(message, code="exceeds_quota", param=param) from None
    if not admission.is_admitted:
        raise exhausted(user, admission, str(units))
    await buckets.settle(call_id, Usage(input_tokens=units))


@contextlib.asynccontextmanager
async def refunded_on_error(buckets: TokenBuckets, reply_id: str) -> AsyncIterator[None]:
    """Gives the reply's whole reservation back if the block raises (the reply never started)."""
    try:
        yield
    except BaseException:
        await refund(buckets, reply_id)
        raise


async def refund(buckets: TokenBuckets, reply_id: str) -> None:
    """A failed refund leaves the reservation to expire (its units spent); the caller's own
    error is the one to report."""
    try:
        await buckets.refund(reply_id)
    except (RedisError, OSError) as exc:
        log.warning("reply %s: its quota reservation could not be refunded (%s); it expires", reply_id, exc)


def wait_phrase(seconds: float) -> str:
    """ "45 seconds", "1 minute", "12 minutes": how a person says a wait."""
    if seconds < 90:
        count, unit = max(1, math.ceil(seconds)), "second"
    else:
        count, unit = math.ceil(seconds / 60), "minute"
    return f"{count} {unit}{'' if count == 1 else 's'}"


def reset_duration(seconds: float) -> str:
    """OpenAI's form of a reset time: "0s", "45s", "6m0s", "2h5m0s"."""
    total = math.ceil(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


class QuotaHeaders:
    """ASGI middleware: an answer to a caller with a valid key carries the level of its bucket
    after the request (`x-ratelimit-limit-tokens`, `-remaining-tokens`, `-reset-tokens`: until
    full). When Redis does not answer, the answer goes without them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        buckets: TokenBuckets | None = request.app.state.chat.quotas  # None: no quotas apply
        if buckets is None:
            await self.app(scope, receive, send)
            return

        async def send_with_level(message: Message) -> None:
            # Looked up as the answer starts: the route has checked the key by then (a key is
            # hashed, and a wrong one counted, by the route's dependency alone).
            user = request.app.state.chat.auth.known_caller(request) if message["type"] == "http.response.start" else None
            if buckets is not None and user is not None:
                await _add_level(MutableHeaders(scope=message), buckets, user)
            await send(message)

        await self.app(scope, receive, send_with_level)


async def _add_level(headers: MutableHeaders, buckets: TokenBuckets, user: ApiKey) -> None:
    try:
        level = await buckets.peek(user.user_id, user.tier)
    except (RedisError, OSError) as exc:
        log.debug("no rate-limit headers: %s", exc)
        return
    headers["x-ratelimit-limit-tokens"] = str(buckets.config.capacity_of(user.tier))
    headers["x-ratelimit-remaining-tokens"] = str(math.floor(level.remaining_units))
    headers["x-ratelimit-reset-tokens"] = reset_duration(level.full_in_s)
