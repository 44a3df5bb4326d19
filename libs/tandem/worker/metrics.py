"""A worker's own Prometheus metrics: how it answers assignments, what it expects a new request to
wait, what its engine does (engine_metrics.py fills those from the engine's stats after every
step), its KV handoffs and its cost. Engine metrics carry the worker's `role` and `model`."""

from prometheus_client import Counter, Gauge, Histogram

ASSIGNMENTS_REFUSED = Counter("tandem_worker_assignments_refused_total", "Assignments this worker refused, by reason", ["reason"])
ESTIMATED_WAIT = Gauge(
    "tandem_worker_estimated_wait_seconds", "Expected wait before a request offered now starts computing, by lane", ["lane"]
)
PREFILL_RATE = Gauge("tandem_worker_prefill_tokens_per_second", "Recent prefill tokens per second of engine step time (0 until measured)")

_WORKER = ["role", "model"]
REQUESTS_RUNNING = Gauge("tandem_worker_requests_running", "Requests the engine runs now, by lane", [*_WORKER, "lane"])
REQUESTS_WAITING = Gauge("tandem_worker_requests_waiting", "Requests queued in the engine, not admitted yet, by lane", [*_WORKER, "lane"])
KV_CACHE_USAGE = Gauge(
    "tandem_worker_kv_cache_usage_ratio",
    "KV blocks held by requests (running, or reserved for a handoff) / all KV blocks; prefix-cache-only blocks are free",
    _WORKER,
)
KV_CACHE_PREFIX_CACHED = Gauge(
    "tandem_worker_kv_cache_prefix_cached_ratio",
    "KV blocks holding a cached prefix, held or free to reuse / all KV blocks (stays after replies end)",
    _WORKER,
)
QUEUED_PREFILL_TOKENS = Gauge(
    "tandem_worker_queued_prefill_tokens",
    "Prompt tokens still to prefill: waiting requests' and running prefills' (scale prefill on it)",
    _WORKER,
)
PREFIX_CACHE_QUERIES = Counter(
    "tandem_worker_prefix_cache_queries_tokens_total", "Tokens looked up in the prefix cache (admissions, handoff imports)", _WORKER
)
PREFIX_CACHE_HITS = Counter("tandem_worker_prefix_cache_hits_tokens_total", "Of the looked-up tokens, those found cached", _WORKER)
PROMPT_TOKENS = Counter(
    "tandem_worker_prompt_tokens_total", "Prompt tokens computed by prefill (cache hits excluded, recomputes included)", _WORKER
)
GENERATION_TOKENS = Counter("tandem_worker_generation_tokens_total", "Tokens sampled (output tokens)", _WORKER)
STEP_SECONDS = Histogram(
    "tandem_worker_step_seconds",
    "Engine step time, by kind: prefill (only prompt tokens), decode (only decodes) or mixed",
    [*_WORKER, "kind"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12),
)
STEPS_CUT = Counter(
    "tandem_worker_steps_cut_total",
    "Engine steps of free or background work cut short for a paid request that arrived during them",
    _WORKER,
)
PREEMPTIONS = Counter("tandem_worker_preemptions_total", "Running requests preempted (to be recomputed) for want of KV blocks", _WORKER)
QUEUE_WAIT = Histogram(
    "tandem_worker_queue_wait_seconds",
    "From a request's arrival at the worker (the step in flight included) to its first admission in the engine, by lane",
    [*_WORKER, "lane"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
TIME_TO_FIRST_TOKEN = Histogram(
    "tandem_worker_time_to_first_token_seconds",
    "From a request's arrival at the worker to its first token sampled, by lane (handoff imports, which arrive with it, excluded)",
    [*_WORKER, "lane"],
    buckets=(0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
KV_HANDOFFS = Counter(
    "tandem_worker_kv_handoffs_total", "KV transfers of a handoff, by side (send, receive) and outcome", [*_WORKER, "side", "outcome"]
)
KV_HANDOFF_BYTES = Counter("tandem_worker_kv_handoff_bytes_total", "KV bytes moved by completed transfers", [*_WORKER, "side"])
KV_HANDOFF_SECONDS = Histogram(
    "tandem_worker_kv_handoff_seconds",
    "Time of a completed KV transfer: send, from the first byte out to the receiver's ack; receive, from the go to all blocks landed",
    [*_WORKER, "side"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
COST_PER_HOUR = Gauge("tandem_worker_cost_per_hour", "What one hour of this worker costs (TANDEM_WORKER_HOUR_COST; 0: unknown)", _WORKER)
COST_PER_MTOK = Gauge(
    "tandem_worker_cost_per_million_output_tokens",
    "Cost per hour / output tokens per hour over the last 5 minutes, x 1e6; 0 when idle or the cost is unknown",
    _WORKER,
)
