"""Where a service's ops port is: /healthz, /readyz, /metrics, /version and the API's /docs, /redoc
and /openapi.json answer there, on the internal address, never on the service's own HTTP port (the
chat's is public). Unset, it sits a fixed offset above the HTTP port, so that a chat instance on
8080 has its ops on 9080 and consecutive instances stay consecutive."""

from __future__ import annotations

from tandem.config import Settings
from tandem.errors import StartupError

OPS_PORT_OFFSET = 1000


def ops_port_for(settings: Settings, role: str) -> int:
    """The ops port to bind: the setting's; unset, the HTTP port + OPS_PORT_OFFSET (0, any free
    port, when the HTTP port is 0)."""
    if settings.ops_port is not None:
        return settings.ops_port
    http_port = settings.http_port_for(role)
    if http_port == 0:
        return 0
    if http_port + OPS_PORT_OFFSET > 65535:
        raise StartupError(
            f"the ops port would be {http_port + OPS_PORT_OFFSET} (HTTP port + {OPS_PORT_OFFSET}), past 65535: set TANDEM_OPS_PORT"
        )
    return http_port + OPS_PORT_OFFSET


def ops_url(settings: Settings, role: str) -> str:
    """The ops port's base URL as other processes reach it (heartbeats carry it)."""
    return f"http://{settings.reachable_host()}:{ops_port_for(settings, role)}"
