"""The router's own Prometheus metrics (the shared ones live in tandem.metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS_ACCEPTED = Counter("tandem_router_requests_accepted", "Generate requests admitted", ["model"])
REQUESTS_REFUSED = Counter("tandem_router_requests_refused", "Generate requests refused", ["reason"])
DISPATCH_ATTEMPTS = Counter("tandem_router_dispatch_attempts", "Assignments offered to workers, by outcome", ["outcome"])
DISPATCH_FAILURES = Counter("tandem_router_dispatch_failures", "Admitted replies that no worker took")
DISPATCH_SECONDS = Histogram(
    "tandem_router_dispatch_seconds",
    "From admission to a worker's acceptance",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
KV_STATE_REQUESTS = Counter(
    "tandem_router_kv_state_requests", "Full KV state asked of a worker: after a gap in its events, or behind its heartbeat", ["reason"]
)
LADDER_RUNG = Gauge("tandem_router_ladder_rung", "The overload ladder's rung: 0 normal; 1, 2, 3 degrade free traffic")
LADDER_BUSYNESS = Gauge("tandem_router_ladder_busyness", "The large model's pool busyness at the last observation (0-1)")
LADDER_FREE_CAPPED = Counter("tandem_router_ladder_free_capped", "Free requests whose max_tokens the ladder capped (rung 2+)")
LADDER_SMALL_MODEL = Counter(
    "tandem_router_ladder_small_model", "Free requests the ladder sent to the small model (rung 1+), or found none served", ["outcome"]
)
LANE_REFUSALS = Counter("tandem_router_lane_refusals", "Workers' queue_full refusals the router heard, by lane", ["lane"])
PLACEMENTS = Counter(
    "tandem_router_placements_total",
    "Workers chosen for a reply, by pool (decode, prefill) and why it won: cache_hit (it holds part of the prompt), "
    "load (the least loaded), rendezvous (tied on load, the conversation's hash chose), lane (the cheaper ones are "
    "refusing the request's lane), only_worker",
    ["role", "reason"],
)
QUEUE_WAIT = Histogram(
    "tandem_router_queue_wait_seconds",
    "From a reply's admission to a worker's acceptance (retries and re-placements included), by lane",
    ["lane"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
MODEL_FALLBACKS = Counter(
    "tandem_router_model_fallbacks",
    "Requests moved to the other model's pool, by why: down (no worker of the asked model takes work) or full "
    "(every one is too busy to start it in time); small to large for any lane, large to small for free only",
    ["from_model", "to_model", "why"],
)
ROLLOUT_PERCENT = Gauge(
    "tandem_router_rollout_percent",
    "The rollout's applied share of a model's new conversations per version (percent; the candidate's is 0 once rolled back)",
    ["model", "version"],
)
VERSION_REQUESTS = Counter(
    "tandem_router_version_requests",
    "Generate requests admitted, by model name, version and whether they are shadow replies",
    ["model", "version", "shadow"],
)
ROLLBACKS = Counter(
    "tandem_router_rollbacks",
    "Candidate versions this router rolled back, by reason: error_rate or ttft (rollbacks adopted from other routers are not counted)",
    ["model", "version", "reason"],
)
ROLLOUT_FILE_ERRORS = Counter(
    "tandem_router_rollout_file_errors",
    "Rollout files not applied (the plan before stays), by reason: syntax, invalid, unreadable",
    ["reason"],
)
