"""`Authorization: Bearer <key>` -> the caller (user id and tier), or Unauthenticated (401); an
address that sent too many wrong keys lately is refused first, RateLimited (429), before its key
is looked at."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from services.chat import metrics
from services.chat.auth_throttle import FailedKeyThrottle
from services.chat.errors import RateLimited, Unauthenticated
from services.chat.key_ring import KeyRing
from tandem.api_keys import ApiKey


@dataclass
class Authenticator:
    keys: KeyRing
    throttle: FailedKeyThrottle = field(default_factory=FailedKeyThrottle)

    async def caller(self, request: Request) -> ApiKey:
        address = request.client.host if request.client is not None else ""
        wait_s = self.throttle.retry_after_s(address)
        if wait_s > 0:
            metrics.API_KEYS_REFUSED.labels("throttled").inc()
            raise RateLimited(
                "too many wrong API keys from this address: wait before trying again", code="too_many_failed_keys", retry_after_s=wait_s
            )
        token = bearer_token(request)
        api_key = await self.keys.caller_of(token) if token else None
        if api_key is None:
            if token:  # a request without a key guesses nothing
                self.throttle.record_failure(address)
                metrics.API_KEYS_REFUSED.labels("wrong").inc()
            raise Unauthenticated("a valid API key is required: send Authorization: Bearer <key>")
        return api_key

    def known_caller(self, request: Request) -> ApiKey | None:
        """The caller whose key was already checked (by the route's `caller`); no hash, no count."""
        token = bearer_token(request)
        return self.keys.known_caller(token) if token else None


def bearer_token(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


async def caller(request: Request) -> ApiKey:
    auth: Authenticator = request.app.state.chat.auth
    return await auth.caller(request)
