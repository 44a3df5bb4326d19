"""The limits of the HTTP server every service runs (tandem.runtime.run), on a real chat process,
the one that faces clients, with the timeouts and the connection limit set short by its
environment: a slowloris client and a stalled body are cut off, a request past the connection
limit gets 503 with Retry-After while the ops port (a limit of its own) still answers, and a plain
request is answered throughout."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from helpers import ops_url, service_env, service_process

from tandem.devstack.servers import EmbeddedServer

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
MARGIN_S = 3.0  # a service process, its servers and the test on two busy cores
DRIP_S = 0.2


@pytest.fixture(scope="module")
def chat(nats_server: EmbeddedServer, redis_server: EmbeddedServer) -> Iterator[dict[str, str]]:
    env = service_env(
        "chat",
        nats_server.url,
        redis_server.url,
        TANDEM_HTTP_HEADER_TIMEOUT_S=str(HEADER_TIMEOUT_S),
        TANDEM_HTTP_BODY_TIMEOUT_S=str(BODY_TIMEOUT_S),
        TANDEM_HTTP_MAX_CONNECTIONS="1",
    )
    child = service_process("chat", env)
    child.start()
    yield env
    child.stop(timeout_s=10)


@pytest.fixture
def port(chat: dict[str, str]) -> int:
    port = int(chat["TANDEM_HTTP_PORT"])
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{ops_url(chat)}/healthz", timeout=10).status_code == 200:
                return port
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "chat did not answer /healthz on its ops port within 60 s"
        time.sleep(0.2)


def seconds_until_closed(client: socket.socket, drip: bytes, give_up_s: float) -> float:
    """Sends `drip` a byte every DRIP_S; the seconds until the server closed the connection
    (fails if it answered anything, or was still open at `give_up_s`)."""
    started = time.monotonic()
    sent = 0
    while time.monotonic() - started < give_up_s:
        client.settimeout(DRIP_S)
        try:
            data = client.recv(65536)
            assert not data, f"the server answered instead of closing: {data!r}"
            return time.monotonic() - started
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - started
        try:
            client.send(drip[sent % len(drip) : sent % len(drip) + 1])
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - started
        sent += 1
    raise AssertionError(f"still open after {give_up_s} s")


def test_a_slowloris_client_is_cut_off_within_the_header_timeout_and_plain_requests_are_answered(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        closed_after_s = seconds_until_closed(client, b"X-Slow: yes\r\n", give_up_s=HEADER_TIMEOUT_S + MARGIN_S)
    assert closed_after_s >= HEADER_TIMEOUT_S - DRIP_S, "closed by the timer, not at once"
    assert httpx.get(f"http://127.0.0.1:{port}/", timeout=10).status_code == 200


def test_a_stalled_body_is_cut_off_within_the_body_timeout(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(
            b"POST /v1/conversations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key\r\n"
            b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"
        )
        closed_after_s = seconds_until_closed(client, b" ", give_up_s=BODY_TIMEOUT_S + MARGIN_S)
    assert closed_after_s >= BODY_TIMEOUT_S - DRIP_S


def test_a_request_past_the_connection_limit_gets_503_with_retry_after_and_the_ops_port_still_answers(port, chat):
    url = f"http://127.0.0.1:{port}/"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as holder:
        holder.sendall(b"GET / HTTP/1.1\r\n")  # accepted before the next: the one connection allowed
        refused = httpx.get(url, timeout=10)
        assert httpx.get(f"{ops_url(chat)}/healthz", timeout=10).status_code == 200, "a probe is not starved by the public port"
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "server_busy"
    deadline = time.monotonic() + 10
    while (status := httpx.get(url, timeout=10).status_code) != 200:
        assert time.monotonic() < deadline, f"still {status} 10 s after the holder left"
