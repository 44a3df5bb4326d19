"""Token quotas: a user's buckets in Redis, so every chat instance sees the same level.

A bucket holds cost units (uncached input tokens x1, cached input tokens x0.1, output tokens x4:
roughly GPU time) up to its tier's capacity and refills linearly, from empty to full in
`refill_s`. Before a reply starts, its worst case (the prompt as uncached plus max_tokens x4) is
reserved under its reply id; whoever ends the reply settles it with the actual usage and the rest
goes back; a reply that never started is refunded whole. A reservation nobody settles expires
(its units stay spent; the bucket refills anyway).

Every change is one Lua script, so concurrent reservations never overdraw a bucket. The scripts
take the time as an argument (callers pass the wall clock in ms; tests inject a clock). A missing
bucket is a full one: a bucket's key expires when it would be full, a reservation's after
`reservation_ttl_s`. A script touches the user's bucket and the reply's reservation, which sit
in different hash slots: like the token log's append, this needs one Redis (or a cluster whose
scripts may touch several slots), as Tandem runs today.

A user has two buckets: the main one, which every reply draws on first, and the small model's
(`Bucket.SMALL`, capacities of its own), which a reply draws on instead when the main one cannot
afford it and its tier falls back to the small model (`fallback_tiers`; services.chat.quotas).
A reservation records the bucket it came from, and settling gives the rest back to that one."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from redis.asyncio import Redis

from tandem.bus.events import now_ms
from tandem.config import Settings, Tier
from tandem.v1.common_pb2 import Usage

PREFIX = "tandem:quota"
UNCACHED_INPUT_WEIGHT = 1.0
CACHED_INPUT_WEIGHT = 0.1
OUTPUT_WEIGHT = 4.0


class Bucket(str, Enum):
    """Which of a user's buckets a reservation draws on."""

    MAIN = "main"  # every reply's first choice
    SMALL = "small"  # the small model's, for replies the main one cannot afford (the quota fallback)


def bucket_key(user_id: str, bucket: Bucket = Bucket.MAIN) -> str:
    suffix = "" if bucket is Bucket.MAIN else f":{bucket.value}"
    return f"{PREFIX}:{{{user_id}}}:bucket{suffix}"


def reservation_key(reply_id: str) -> str:
    return f"{PREFIX}:reservation:{{{reply_id}}}"


def cost_units(usage: Usage) -> float:
    """What a reply that used `usage` costs."""
    num_cached = min(usage.cached_tokens, usage.input_tokens)
    return (
        (usage.input_tokens - num_cached) * UNCACHED_INPUT_WEIGHT + num_cached * CACHED_INPUT_WEIGHT + usage.output_tokens * OUTPUT_WEIGHT
    )


def worst_case_units(num_prompt_tokens: int, max_tokens: int) -> float:
    """The most a reply can cost: its whole prompt uncached and every answer token it may write."""
    return cost_units(Usage(input_tokens=num_prompt_tokens, output_tokens=max_tokens))


@dataclass(frozen=True)
class QuotaConfig:
    capacity_free: int
    capacity_plus: int
    capacity_pro: int
    refill_s: float
    reservation_ttl_s: int
    # The small model's buckets (Bucket.SMALL), and the tiers whose replies draw on them when the
    # main bucket cannot afford a reply.
    small_capacity_free: int = 0
    small_capacity_plus: int = 0
    small_capacity_pro: int = 0
    fallback_tiers: frozenset[Tier] = field(default_factory=frozenset)

    @classmethod
    def from_settings(cls, settings: Settings) -> QuotaConfig:
        fallback = {Tier.FREE: settings.quota_fallback_free, Tier.PLUS: settings.quota_fallback_plus, Tier.PRO: settings.quota_fallback_pro}
        return cls(
            capacity_free=settings.quota_free,
            capacity_plus=settings.quota_plus,
            capacity_pro=settings.quota_pro,
            refill_s=settings.quota_refill_s,
            reservation_ttl_s=settings.quota_reservation_ttl_s,
            small_capacity_free=settings.quota_small_free,
            small_capacity_plus=settings.quota_small_plus,
            small_capacity_pro=settings.quota_small_pro,
            fallback_tiers=frozenset(tier for tier, is_on in fallback.items() if is_on),
        )

    def capacity_of(self, tier: Tier, bucket: Bucket = Bucket.MAIN) -> int:
        if bucket is Bucket.SMALL:
            return {Tier.FREE: self.small_capacity_free, Tier.PLUS: self.small_capacity_plus, Tier.PRO: self.small_capacity_pro}[tier]
        return {Tier.FREE: self.capacity_free, Tier.PLUS: self.capacity_plus, Tier.PRO: self.capacity_pro}[tier]

    def falls_back(self, tier: Tier) -> bool:
        """Whether a reply of `tier` that its main bucket cannot afford may draw on the small model's."""
        return tier in self.fallback_tiers and self.capacity_of(tier, Bucket.SMALL) > 0


class ExceedsCapacity(ValueError):
    """A worst case larger than the tier's whole bucket: it could never be admitted, so waiting
    does not help (a smaller max_tokens or a shorter prompt does)."""

    def __init__(self, worst_case_units: float, capacity_units: int, tier: Tier) -> None:
        super().__init__(f"a worst case of {worst_case_units:.0f} units exceeds the {tier.value} tier's bucket of {capacity_units}")
        self.worst_case_units = worst_case_units
        self.capacity_units = capacity_units
        self.tier = tier


@dataclass(frozen=True)
class Admission:
    """`is_admitted`: the worst case was reserved; otherwise `retry_after_s` says when the bucket
    would hold it. `remaining_units`: the level after the reservation (or as it stands)."""

    is_admitted: bool
    remaining_units: float
    retry_after_s: float


@dataclass(frozen=True)
class Level:
    remaining_units: float
    full_in_s: float  # seconds until the bucket is full again (0: it is)


# Shared by every script: the bucket's level now (KEYS[1]: the bucket; capacity and refill in ms,
# now in ms), and how to store it (a full bucket is no key at all; otherwise it expires when full).
_LEVEL = """
local function level_now(key, capacity, refill_ms, now)
  local saved = redis.call('HMGET', key, 'level', 'at_ms')
  if not saved[1] then return capacity, now end
  local level, at = tonumber(saved[1]), tonumber(saved[2])
  if now > at then
    level = level + (now - at) * capacity / refill_ms
    at = now
  end
  return math.min(capacity, level), at
end
local function store_level(key, level, at, capacity, refill_ms)
  if level >= capacity then
    redis.call('DEL', key)
    return 0
  end
  local full_in_ms = (capacity - level) * refill_ms / capacity
  redis.call('HSET', key, 'level', tostring(level), 'at_ms', tostring(at))
  redis.call('PEXPIRE', key, math.ceil(full_in_ms) + 1)
  return full_in_ms
end
"""

# KEYS: bucket, reservation. ARGV: capacity, refill_ms, now_ms, worst case, reservation ttl_s,
# user id, tier, prompt tokens, bucket. Returns {1 admitted | 0 not, level, ms until it fits (0 when admitted)}.
# A reply id already reserved is admitted again without taking more (a retried request).
_RESERVE = (
    _LEVEL
    + """
local capacity, refill_ms, now, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local level, at = level_now(KEYS[1], capacity, refill_ms, now)
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {1, tostring(level), '0'}
end
if level < cost then
  return {0, tostring(level), tostring((cost - level) * refill_ms / capacity)}
end
level = level - cost
store_level(KEYS[1], level, at, capacity, refill_ms)
redis.call('HSET', KEYS[2], 'user', ARGV[6], 'tier', ARGV[7], 'units', tostring(cost), 'prompt_tokens', ARGV[8],
  'capacity', ARGV[1], 'refill_ms', ARGV[2], 'bucket', ARGV[9])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return {1, tostring(level), '0'}
"""
)

# KEYS: bucket, reservation. ARGV: now_ms, actual cost, user id the caller read from the reservation.
# Gives back reserved - actual (the bucket never above its capacity) and deletes the reservation.
# Returns the units given back, or -1 when there is no such reservation (settled, refunded, expired).
_SETTLE = (
    _LEVEL
    + """
local saved = redis.call('HMGET', KEYS[2], 'units', 'capacity', 'refill_ms', 'user')
if not saved[1] or saved[4] ~= ARGV[3] then return '-1' end
redis.call('DEL', KEYS[2])
local capacity, refill_ms = tonumber(saved[2]), tonumber(saved[3])
local back = math.max(0, tonumber(saved[1]) - tonumber(ARGV[2]))
local level, at = level_now(KEYS[1], capacity, refill_ms, tonumber(ARGV[1]))
store_level(KEYS[1], math.min(capacity, level + back), at, capacity, refill_ms)
return tostring(back)
"""
)

# KEYS: bucket. ARGV: capacity, refill_ms, now_ms. Returns {level, ms until full}; changes nothing.
_PEEK = (
    _LEVEL
    + """
local capacity, refill_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local level = level_now(KEYS[1], capacity, refill_ms, tonumber(ARGV[3]))
return {tostring(level), tostring((capacity - level) * refill_ms / capacity)}
"""
)


@dataclass(frozen=True)
class Reservation:
    user_id: str
    tier: Tier
    units: float
    num_prompt_tokens: int
    bucket: Bucket = Bucket.MAIN


class TokenBuckets:
    def __init__(self, redis: Redis, config: QuotaConfig, clock: Callable[[], int] = now_ms) -> None:
        """`clock`: the wall clock in unix ms (every process's, so they must agree roughly; a clock
        behind the bucket's last update refills nothing until it catches up)."""
        if config.refill_s <= 0 or config.reservation_ttl_s < 1:
            raise ValueError(
                f"a quota needs a positive refill time and reservation expiry; got {config.refill_s} and {config.reservation_ttl_s}"
            )
        self._redis = redis
        self.config = config
        self._clock = clock
        self._reserve = redis.register_script(_RESERVE)
        self._settle = redis.register_script(_SETTLE)
        self._peek = redis.register_script(_PEEK)

    @property
    def _refill_ms(self) -> int:
        return max(1, round(self.config.refill_s * 1000))

    async def reserve(
        self, user_id: str, tier: Tier, worst_case: float, reply_id: str, num_prompt_tokens: int = 0, bucket: Bucket = Bucket.MAIN
    ) -> Admission:
        """Takes `worst_case` units from the user's `bucket` if it holds them, recorded under
        `reply_id`; raises ExceedsCapacity for a worst case no such bucket of the tier can ever hold.
        `num_prompt_tokens`: charged, with the output its log shows, when the reply's end reports
        no usage (a failure)."""
        capacity = self.config.capacity_of(tier, bucket)
        if worst_case > capacity:
            raise ExceedsCapacity(worst_case, capacity, tier)
        args: list[str | int] = [capacity, self._refill_ms, self._clock(), repr(float(worst_case)), self.config.reservation_ttl_s]
        args += [user_id, tier.value, num_prompt_tokens, bucket.value]
        keys = [bucket_key(user_id, bucket), reservation_key(reply_id)]
        is_admitted, level, wait_ms = await self._reserve(keys=keys, args=args)
        return Admission(bool(int(is_admitted)), float(level), math.ceil(float(wait_ms)) / 1000)

    async def reservation(self, reply_id: str) -> Reservation | None:
        saved = await self._redis.hmget(reservation_key(reply_id), ["user", "tier", "units", "prompt_tokens", "bucket"])
        if saved[0] is None:
            return None
        if saved[4] is None:  # reserved before there were two buckets
            saved[4] = Bucket.MAIN.value
        user, tier, units, prompt_tokens, bucket = (value.decode() if isinstance(value, bytes) else str(value) for value in saved)
        return Reservation(user, Tier(tier), float(units), int(prompt_tokens), Bucket(bucket))

    async def settle(self, reply_id: str, usage: Usage) -> float | None:
        """Charges the reply what `usage` costs (at most what was reserved) and gives back the
        rest: the units given back, or None when nothing was reserved under `reply_id` (settled or
        refunded already, expired, or never reserved)."""
        return await self._give_back(reply_id, lambda _: cost_units(usage))

    async def settle_final(self, reply_id: str, usage: Usage, num_output_tokens: int) -> float | None:
        """Settles with `usage` when the reply's end reported any; otherwise (an error, or an end
        the relay wrote) with its prompt and the `num_output_tokens` it delivered."""
        if usage.input_tokens or usage.output_tokens:
            return await self.settle(reply_id, usage)

        def delivered(reservation: Reservation) -> float:
            return cost_units(Usage(input_tokens=reservation.num_prompt_tokens, output_tokens=num_output_tokens))

        return await self._give_back(reply_id, delivered)

    async def refund(self, reply_id: str) -> float | None:
        """Gives the whole reservation back (the reply never started); None as for settle."""
        return await self._give_back(reply_id, lambda _: 0.0)

    async def peek(self, user_id: str, tier: Tier, bucket: Bucket = Bucket.MAIN) -> Level:
        capacity = self.config.capacity_of(tier, bucket)
        if capacity == 0:
            return Level(0.0, 0.0)
        level, full_in_ms = await self._peek(keys=[bucket_key(user_id, bucket)], args=[capacity, self._refill_ms, self._clock()])
        return Level(float(level), max(0.0, float(full_in_ms)) / 1000)

    async def _give_back(self, reply_id: str, cost_of: Callable[[Reservation], float]) -> float | None:
        reservation = await self.reservation(reply_id)
        if reservation is None:
            return None
        keys = [bucket_key(reservation.user_id, reservation.bucket), reservation_key(reply_id)]
        back = float(await self._settle(keys=keys, args=[self._clock(), repr(float(cost_of(reservation))), reservation.user_id]))
        return None if back < 0 else back
