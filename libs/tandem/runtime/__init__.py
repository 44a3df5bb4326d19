"""The service chassis: what every Tandem process has (a NATS connection, a heartbeat,
/healthz /readyz /metrics, drain, a clean exit on SIGTERM). A service's own package only adds
its logic."""

from tandem.runtime.app import create_app
from tandem.runtime.run import bind_port, check_port_free, run_service
from tandem.runtime.runtime import ReadinessCheck, Runtime, RuntimeConfig

__all__ = ["ReadinessCheck", "Runtime", "RuntimeConfig", "bind_port", "check_port_free", "create_app", "run_service"]
