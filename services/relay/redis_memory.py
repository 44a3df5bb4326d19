"""How full the Redis that holds the token logs and quotas is. Once in a while the relay reads
`INFO memory` and exports the memory used, the `maxmemory` limit and whether the eviction policy
may drop keys: with `noeviction` a full Redis refuses writes (the relay hands each event back to
the token stream until memory is freed: nothing is lost), with any other policy it drops keys,
a running reply's log or a user's quota among them. The alerts fire before the limit is reached
and whenever the policy may evict."""

from __future__ import annotations

import logging

from redis.asyncio import Redis

from services.relay import metrics

log = logging.getLogger(__name__)

SAFE_POLICY = "noeviction"


class MemoryWatch:
    """Reads Redis's memory and exports it; logs a policy that may evict when it first sees it."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._evicting_policy = ""  # the policy last logged, so a reading every few seconds logs it once

    async def read(self) -> None:
        """Exports one reading; raises RedisError when Redis does not answer."""
        info = await self._redis.info("memory")
        metrics.REDIS_USED_MEMORY.set(int(info["used_memory"]))
        metrics.REDIS_MAXMEMORY.set(int(info["maxmemory"]))
        policy = str(info["maxmemory_policy"])
        may_evict = policy != SAFE_POLICY
        if may_evict and policy != self._evicting_policy:
            log.error("Redis's maxmemory-policy is %s: a full Redis drops token logs and quotas; set it to %s", policy, SAFE_POLICY)
        self._evicting_policy = policy if may_evict else ""
        metrics.REDIS_MAY_EVICT.set(1 if may_evict else 0)
