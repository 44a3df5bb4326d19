"""Prometheus metrics every Tandem process exports on GET /metrics."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, Info, generate_latest

SERVICE_INFO = Info("tandem_service", "Role, instance and version of this process")
IS_READY = Gauge("tandem_ready", "1 when /readyz answers 200")
IS_NATS_CONNECTED = Gauge("tandem_nats_connected", "1 while the NATS connection is up")
HEARTBEATS_SENT = Counter("tandem_heartbeats_sent", "Heartbeats published on NATS")
HEARTBEATS_SEEN = Counter("tandem_heartbeats_seen", "Heartbeats received from other services", ["role"])
EVENT_LOOP_LAG = Histogram(
    "tandem_event_loop_lag_seconds",
    "How much later than asked a timer of the event loop fired (one asked every 0.1 s): what everything on the loop waits",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
GC_PAUSE = Histogram(
    "tandem_gc_pause_seconds",
    "Passes of Python's cyclic collector by generation (2: full); the process's event loop stands still through each",
    ["generation"],
    buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
GC_LONGEST_PAUSE = Gauge(
    "tandem_gc_pause_longest_seconds", "The longest pass of the cyclic collector so far, by generation", ["generation"]
)


def exposition() -> tuple[bytes, str]:
    """The text format body and its content type."""
    return generate_latest(), CONTENT_TYPE_LATEST
