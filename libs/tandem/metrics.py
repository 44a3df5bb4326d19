"""Prometheus metrics every Tandem process exports on GET /metrics."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Info, generate_latest

SERVICE_INFO = Info("tandem_service", "Role, instance and version of this process")
IS_READY = Gauge("tandem_ready", "1 when /readyz answers 200")
IS_NATS_CONNECTED = Gauge("tandem_nats_connected", "1 while the NATS connection is up")
HEARTBEATS_SENT = Counter("tandem_heartbeats_sent", "Heartbeats published on NATS")
HEARTBEATS_SEEN = Counter("tandem_heartbeats_seen", "Heartbeats received from other services", ["role"])


def exposition() -> tuple[bytes, str]:
    """The text format body and its content type."""
    return generate_latest(), CONTENT_TYPE_LATEST
