"""One connection to a Cassandra cluster (cassandra-driver, protocol v5), for the store's requests.

Every driver request is bounded by timeout_s; driver errors become StoreUnavailable. The driver
reconnects by itself (ExponentialReconnectionPolicy, 0.5-5 s). Reactor: libev (the driver's C
loop, in its wheel), else the driver's asyncio reactor.

With a CA file (TANDEM_CASSANDRA_CA_FILE) every connection is TLS, and the node must show a
certificate of that CA for cassandra.tandem.internal (tandem.tls.server_name), whatever address
was dialed; without one the link is in clear.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from cassandra import AuthenticationFailed, ConsistencyLevel, OperationTimedOut, RequestExecutionException
from cassandra.auth import PlainTextAuthProvider
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile, NoHostAvailable, ResponseFuture, ResultSet, Session
from cassandra.connection import ConnectionException, DefaultEndPoint
from cassandra.policies import DCAwareRoundRobinPolicy, ExponentialReconnectionPolicy, TokenAwarePolicy
from cassandra.protocol import IsBootstrappingErrorMessage, OverloadedErrorMessage
from cassandra.query import PreparedStatement, dict_factory

from tandem.errors import StartupError
from tandem.store.base import StoreUnavailable
from tandem.tls import server_name, verifying_context

try:  # libev: the driver's C event loop (bundled in the wheel); asyncore is gone from Python 3.12
    from cassandra.io.libevreactor import LibevConnection as _Connection
except ImportError:  # pragma: no cover - a driver built without libev
    from cassandra.io.asyncioreactor import AsyncioConnection as _Connection

DDL_TIMEOUT_S = 30.0  # connecting and schema changes wait for the cluster's agreement
DRIVER_ERRORS = (
    NoHostAvailable,
    OperationTimedOut,
    RequestExecutionException,
    ConnectionException,
    OverloadedErrorMessage,
    IsBootstrappingErrorMessage,
)


class LoginRefused(StoreUnavailable):
    """Every host refused the username and password."""


def parse_hosts(hosts: str) -> list[DefaultEndPoint]:
    """ "host[:port],..." (port 9042 when left out)."""
    endpoints = []
    for entry in filter(None, (part.strip() for part in hosts.split(","))):
        host, _, port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
        endpoints.append(DefaultEndPoint(host, int(port) if port else 9042))
    if not endpoints:
        raise ValueError(f"no Cassandra host in {hosts!r}")
    return endpoints


class CassandraSession:
    def __init__(
        self, hosts: str, *, consistency: str, timeout_s: float, username: str = "", password: str = "", ca_file: str = ""
    ) -> None:
        """`username`: log in with it and `password` (the node's PasswordAuthenticator); empty: no login.
        `ca_file`: TLS, verified against that CA; empty: in clear."""
        self._hosts = hosts
        self._endpoints = parse_hosts(hosts)
        self._consistency = ConsistencyLevel.name_to_value[consistency]
        self._serial = ConsistencyLevel.LOCAL_SERIAL if consistency.startswith("LOCAL") else ConsistencyLevel.SERIAL
        self._timeout_s = timeout_s
        self._auth = PlainTextAuthProvider(username, password) if username else None
        if ca_file and not Path(ca_file).is_file():
            raise StartupError(f"TANDEM_CASSANDRA_CA_FILE: no file at {ca_file}")
        self._tls = (
            {"ssl_context": verifying_context(ca_file), "ssl_options": {"server_hostname": server_name("cassandra")}} if ca_file else {}
        )
        self._cluster: Cluster | None = None
        self._session: Session | None = None
        self._prepared: dict[str, PreparedStatement] = {}

    @property
    def is_connected(self) -> bool:
        return self._session is not None

    async def connect(self) -> None:
        profile = ExecutionProfile(
            load_balancing_policy=TokenAwarePolicy(DCAwareRoundRobinPolicy()),
            consistency_level=self._consistency,
            serial_consistency_level=self._serial,
            request_timeout=self._timeout_s,
            row_factory=dict_factory,
        )
        cluster = Cluster(
            contact_points=self._endpoints,
            protocol_version=5,
            connection_class=_Connection,
            execution_profiles={EXEC_PROFILE_DEFAULT: profile},
            reconnection_policy=ExponentialReconnectionPolicy(0.5, 5.0),
            connect_timeout=self._timeout_s,
            control_connection_timeout=self._timeout_s,
            idle_heartbeat_interval=10,
            auth_provider=self._auth,
            **self._tls,
        )
        try:
            session = await asyncio.wait_for(asyncio.to_thread(cluster.connect), DDL_TIMEOUT_S)
        except (*DRIVER_ERRORS, TimeoutError) as exc:
            await asyncio.to_thread(cluster.shutdown)
            raise self.unavailable(exc) from None
        self._cluster, self._session = cluster, session

    async def close(self) -> None:
        cluster, self._cluster, self._session = self._cluster, None, None
        if cluster is not None:
            await asyncio.to_thread(cluster.shutdown)

    async def prepare(self, statements: dict[str, str]) -> None:
        """Prepares each statement, to be run by its name."""
        session = self._connected()
        try:
            for name, statement in statements.items():
                self._prepared[name] = await asyncio.wait_for(asyncio.to_thread(session.prepare, statement), DDL_TIMEOUT_S)
        except (*DRIVER_ERRORS, TimeoutError) as exc:
            raise self.unavailable(exc) from None

    def prepared(self, name: str) -> PreparedStatement:
        return self._prepared[name]

    def unavailable(self, exc: BaseException) -> StoreUnavailable:
        if isinstance(exc, NoHostAvailable):
            why = "; ".join(f"{host}: {error}" for host, error in list(exc.errors.items())[:2]) or "no host is up"
            is_refused = bool(exc.errors) and all(isinstance(error, AuthenticationFailed) for error in exc.errors.values())
            return (LoginRefused if is_refused else StoreUnavailable)(f"cassandra {self._hosts}: no host available ({why})")
        if isinstance(exc, TimeoutError):
            return StoreUnavailable(f"cassandra {self._hosts}: no answer within {self._timeout_s} s")
        detail = " ".join(str(exc).split()) or "no detail"
        return StoreUnavailable(f"cassandra {self._hosts}: {type(exc).__name__}: {detail[:300]}")

    async def execute(self, statement: Any, params: Any, *, paging_state: bytes | None = None, timeout_s: float | None = None) -> ResultSet:
        """One request; the driver's future is bridged to asyncio (its callbacks run on the driver's thread)."""
        session = self._connected()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[ResponseFuture] = loop.create_future()

        def settle(outcome: Any, is_error: bool) -> None:
            if not done.done():
                done.set_exception(outcome) if is_error else done.set_result(outcome)

        try:
            future = session.execute_async(statement, params, timeout=timeout_s or self._timeout_s, paging_state=paging_state)
        except DRIVER_ERRORS as exc:
            raise self.unavailable(exc) from None
        future.add_callbacks(
            lambda _: loop.call_soon_threadsafe(settle, future, False), lambda exc: loop.call_soon_threadsafe(settle, exc, True)
        )
        try:
            await done
        except DRIVER_ERRORS as exc:
            raise self.unavailable(exc) from None
        return future.result()  # already complete: no wait

    async def run(self, name: str, *params: Any) -> ResultSet:
        """Runs the prepared statement `name`."""
        return await self.execute(self._prepared[name], params)

    async def pages(self, name: str, params: tuple, page_size: int) -> AsyncIterator[dict[str, Any]]:
        """The rows of a prepared query, fetched page by page as they are consumed."""
        bound = self._prepared[name].bind(params)
        bound.fetch_size = page_size
        paging_state = None
        while True:
            result = await self.execute(bound, None, paging_state=paging_state)
            for row in result.current_rows:
                yield row
            paging_state = result.paging_state
            if paging_state is None:
                return

    def _connected(self) -> Session:
        if self._session is None:
            raise StoreUnavailable(f"cassandra {self._hosts}: the store is not started")
        return self._session
