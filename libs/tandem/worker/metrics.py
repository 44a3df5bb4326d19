"""A worker's own Prometheus metrics: how it answers assignments and what it expects a new
request to wait."""

from prometheus_client import Counter, Gauge

ASSIGNMENTS_REFUSED = Counter("tandem_worker_assignments_refused_total", "Assignments this worker refused, by reason", ["reason"])
ESTIMATED_WAIT = Gauge(
    "tandem_worker_estimated_wait_seconds", "Expected wait before a request offered now starts computing, by lane", ["lane"]
)
PREFILL_RATE = Gauge("tandem_worker_prefill_tokens_per_second", "Recent prefill tokens per second of engine step time (0 until measured)")
