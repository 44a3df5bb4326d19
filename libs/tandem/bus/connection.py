"""The one way Tandem connects to NATS: retry until reachable, reconnect forever, drain on close.
With a user and password it logs in as its role's bus user (tandem.bus.permissions); a publish or
subscribe the server refuses is logged as an error naming the user, and the process goes on.
The URL may list a cluster's nodes, comma-separated: the client connects to one and, when it is
lost, reconnects to another (its subscriptions and the JetStream stream ride along)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import nats
from nats.aio.client import Client

from tandem.tls import TlsSettings, nats_tls_options

log = logging.getLogger(__name__)


def server_urls(url: str) -> list[str]:
    """The nodes of `url`: one URL, or a comma-separated list of them."""
    return [part.strip() for part in url.split(",") if part.strip()]


@dataclass(frozen=True)
class BusConfig:
    url: str  # one node's, or every node's comma-separated
    name: str  # shows in the server's connection list
    connect_timeout_s: float = 2.0
    reconnect_wait_s: float = 0.5
    first_retry_s: float = 0.2
    max_retry_s: float = 5.0
    drain_timeout_s: float = 3.0
    user: str = ""  # empty: the URL's credentials, if any
    password: str = field(default="", repr=False)
    inbox_prefix: str = ""  # empty: nats-py's _INBOX; a service's own (tandem.bus.permissions.inbox_prefix)
    tls: TlsSettings | None = None  # the CA and certificate to connect with (tandem.tls); none: in clear


def without_credentials(url: str) -> str:
    """The URL (or comma-separated URLs) as it may be logged: any user and password left out."""
    if "," in url:
        return ",".join(without_credentials(one) for one in server_urls(url))
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    if not host:  # a unix socket's (unix://:pw@/path): urlunsplit would drop the empty netloc's `//`
        return f"{parts.scheme}://{parts.path}" + (f"?{parts.query}" if parts.query else "")
    return urlunsplit(parts._replace(netloc=f"{host}:{parts.port}" if parts.port else host))


class Bus:
    """Owns a NATS connection. `on_connect` callbacks run once, after the first connect
    (subscriptions made there survive reconnects on their own)."""

    def __init__(self, config: BusConfig) -> None:
        self._config = config
        self._nc: Client | None = None
        self._connected = asyncio.Event()
        self._on_connect: list[Callable[[Client], Awaitable[None]]] = []
        self._on_reconnect: list[Callable[[], Awaitable[None]]] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def client(self) -> Client:
        if self._nc is None:
            raise RuntimeError("NATS is not connected yet")
        return self._nc

    @property
    def is_connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    def on_connect(self, callback: Callable[[Client], Awaitable[None]]) -> None:
        self._on_connect.append(callback)

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None:
        """`callback` runs each time the client is connected again (to the same node or, on a
        cluster, another one); nats-py has already restored its subscriptions."""
        self._on_reconnect.append(callback)

    def start(self) -> None:
        """Connects in the background; `wait_connected` or `is_connected` tell when it is up."""
        self._task = asyncio.create_task(self._connect_until_up(), name=f"nats-connect:{self._config.name}")

    async def wait_connected(self) -> Client:
        await self._connected.wait()
        return self.client

    async def _connect_until_up(self) -> None:
        delay_s = self._config.first_retry_s
        url = without_credentials(self._config.url)
        credentials = {"user": self._config.user, "password": self._config.password} if self._config.user else {}
        inbox = {"inbox_prefix": self._config.inbox_prefix} if self._config.inbox_prefix else {}
        while True:
            try:
                self._nc = await nats.connect(
                    server_urls(self._config.url),
                    **credentials,
                    **inbox,
                    **nats_tls_options(self._config.tls),
                    name=self._config.name,
                    connect_timeout=self._config.connect_timeout_s,
                    reconnect_time_wait=self._config.reconnect_wait_s,
                    max_reconnect_attempts=-1,
                    allow_reconnect=True,
                    drain_timeout=self._config.drain_timeout_s,
                    reconnected_cb=self._reconnected,
                    disconnected_cb=self._disconnected,
                    error_cb=self._error,
                )
                break
            except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
                log.warning("NATS at %s not reachable (%s); retrying in %.1f s", url, exc, delay_s)
            except nats.errors.Error as exc:  # the server answered and refused: wrong or missing credentials
                log.error("NATS at %s refused the connection as user %r (%s); retrying in %.1f s", url, self._config.user, exc, delay_s)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, self._config.max_retry_s)
        log.info("connected to NATS at %s%s", url, f" as {self._config.user}" if self._config.user else "")
        self._connected.set()
        await self._run_on_connect()

    async def _run_on_connect(self) -> None:
        for callback in self._on_connect:
            await callback(self.client)

    async def _reconnected(self) -> None:
        url = self._nc.connected_url if self._nc is not None else None
        log.info("reconnected to NATS%s", f" at {without_credentials(url.geturl())}" if url is not None else "")
        for callback in self._on_reconnect:
            await callback()

    async def _disconnected(self) -> None:
        log.warning("disconnected from NATS; reconnecting")

    async def _error(self, exc: Exception) -> None:
        # nats-py reports what the server refuses as the base error type itself: a login (wrong or
        # missing credentials; the client retries it) or a publish or subscribe outside this
        # user's rights (tandem.bus.permissions). Its subtypes are transport trouble it recovers from.
        if type(exc) is nats.errors.Error:
            log.error("NATS refused user %r: %s", self._config.user, exc)
        else:
            log.warning("NATS: %s", exc)

    async def close(self) -> None:
        """Stops connecting, then drains: pending messages are delivered before the socket closes."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._nc is not None and not self._nc.is_closed:
            try:
                await self._nc.drain()
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
                pass
            if not self._nc.is_closed:
                await self._nc.close()
