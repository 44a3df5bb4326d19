"""The gRPC WorkerControl server of a prefill or decode worker (Health, Drain, Stats), on the
worker's configured host; with an internal secret, every call on its port must carry it."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from tandem.runtime import Runtime
from tandem.tls import TlsSettings
from tandem.v1 import control_pb2, control_pb2_grpc
from tandem.v1.worker_pb2 import WorkerHeartbeat
from tandem.worker.heartbeat import WorkerHeartbeats
from tandem.worker.internal_grpc import server_credentials, server_interceptors


class WorkerControl(control_pb2_grpc.WorkerControlServicer):
    def __init__(self, runtime: Runtime, heartbeats: WorkerHeartbeats) -> None:
        self._runtime = runtime
        self._heartbeats = heartbeats

    async def Health(self, request: control_pb2.HealthRequest, context: grpc.aio.ServicerContext) -> control_pb2.HealthReply:
        checks = await self._runtime.readiness()
        failing = sorted(name for name, ok in checks.items() if not ok)
        if failing:
            return control_pb2.HealthReply(status=control_pb2.HealthReply.STATUS_NOT_SERVING, detail="failing: " + ", ".join(failing))
        return control_pb2.HealthReply(status=control_pb2.HealthReply.STATUS_SERVING)

    async def Drain(self, request: control_pb2.DrainRequest, context: grpc.aio.ServicerContext) -> control_pb2.DrainReply:
        was_draining = self._runtime.is_draining
        self._runtime.is_draining = True
        return control_pb2.DrainReply(was_draining=was_draining)

    async def Stats(self, request: control_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> WorkerHeartbeat:
        return self._heartbeats.build(self._runtime.service_heartbeat(is_ready=not self._runtime.is_draining))


class ControlServer:
    def __init__(
        self, servicer: WorkerControl, address: str, secret: str = "", grace_s: float = 2.0, tls: TlsSettings | None = None
    ) -> None:
        """`address`: host:port to listen on; `secret`: the internal secret calls must carry (empty:
        none); `tls`: mutual TLS with this certificate (none or disabled: in clear)."""
        self._tls = tls
        self._servicer = servicer
        self._address = address
        self._secret = secret
        self._grace_s = grace_s
        self._server: grpc.aio.Server | None = None
        self._registrations: list[Callable[[grpc.aio.Server], None]] = []

    def add_service(self, register: Callable[[grpc.aio.Server], None]) -> None:
        """Another gRPC service on the same port (the decode worker's KvHandoff); before start()."""
        self._registrations.append(register)

    async def start(self) -> None:
        is_mutual_tls = self._tls is not None and self._tls.is_enabled
        self._server = grpc.aio.server(interceptors=server_interceptors(self._secret, is_mutual_tls))
        control_pb2_grpc.add_WorkerControlServicer_to_server(self._servicer, self._server)
        for register in self._registrations:
            register(self._server)
        if self._tls is not None and is_mutual_tls:
            self._server.add_secure_port(self._address, server_credentials(self._tls))
        else:
            self._server.add_insecure_port(self._address)
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(self._grace_s)
