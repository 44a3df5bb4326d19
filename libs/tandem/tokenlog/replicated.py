"""A write that counts as done only once replicas hold it (Redis WAIT), for the relay to
acknowledge a token event only after its append would survive the primary's death.

WAIT counts the replicas that have the writes of the connection it runs on, so the write and
its WAIT share one connection, held for both. Fewer replicas than asked within the timeout raises
NotReplicated, a RedisError: the caller treats it as a failed write (the relay naks the event;
the redelivered append is dropped as a duplicate if the first one did land, then waited for
again).

The WAIT is sent on the write's connection as it is, never retried on a new one: a fresh
connection has written nothing, so its WAIT would answer at once, vouching for nothing."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError

T = TypeVar("T")
_READ_MARGIN_S = 1.0  # the WAIT's answer is read for this longer than the WAIT may take


class NotReplicated(RedisError):
    """The write reached the primary but not enough replicas in time: it may be lost with the
    primary. `written`: what the write returned (None when its connection was lost before the
    WAIT), for a caller whose work after the write must not wait for a redelivery that the
    primary will answer as a duplicate."""

    def __init__(self, message: str, written: object = None) -> None:
        super().__init__(message)
        self.written = written


@dataclass(frozen=True)
class ReplicationConfig:
    num_replicas: int = 0  # settings.redis_wait_replicas; 0: the primary's word is enough
    timeout_ms: int = 500  # settings.redis_wait_timeout_ms


async def on_replicas(redis: Redis, config: ReplicationConfig, write: Callable[[Redis], Awaitable[T]]) -> T:
    """`write(client)` on one connection of `redis`'s pool, then WAIT there for
    `config.num_replicas` replicas; its result once they have it."""
    if config.num_replicas == 0:
        return await write(redis)
    async with redis.client() as pinned:  # one connection, held for the write and its WAIT
        result = await write(pinned)
        try:
            num_acked = await _wait(pinned, config)
        except NotReplicated as lost:
            lost.written = result
            raise
    if num_acked < config.num_replicas:
        raise NotReplicated(f"on {num_acked} of {config.num_replicas} replicas after {config.timeout_ms} ms", written=result)
    return result


async def _wait(pinned: Redis, config: ReplicationConfig) -> int:
    connection = pinned.connection
    if connection is None or not connection.is_connected:  # lost since the write: a WAIT now would vouch for nothing
        raise NotReplicated("the write's connection was lost before its WAIT")  # `written` set by on_replicas
    await connection.send_command("WAIT", config.num_replicas, config.timeout_ms)
    return int(await connection.read_response(timeout=config.timeout_ms / 1000 + _READ_MARGIN_S))
