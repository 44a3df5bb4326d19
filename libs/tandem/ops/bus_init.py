"""`tandem bus init`: the admin step that creates the token stream, or brings an existing one to
the settings (token_stream_replicas, token_stream_max_bytes, token_stream_max_age_s). It logs
in as the operator, the one bus user allowed to change a stream (tandem.bus.permissions); the
services only wait for the stream. Run it once the bus is up and again after changing a setting:
`tandem up` runs it after NATS starts, compose as its one-shot `bus-init` service, Kubernetes as
the `tandem-bus-init` Job. Running it twice changes nothing the second time.

A clustered JetStream answers only once its nodes have met and elected a leader, so it retries
what the bus answers while it is not ready yet, for `within_s`. A stream the cluster cannot place
fails naming the setting: at once on a server not clustered, and on a cluster after
`placement_grace_s` of refusals, since a node that has just met the others counts as offline
until it has reported to their leader."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import nats
import nats.errors
from nats.js.api import DiscardPolicy, StreamConfig
from nats.js.errors import APIError, ServiceUnavailableError

from tandem.bus.connection import server_urls, without_credentials
from tandem.bus.token_stream import STREAM, TokenStreamConfig, ensure_token_stream
from tandem.errors import StartupError
from tandem.tls import TlsSettings, nats_tls_options

log = logging.getLogger(__name__)

INIT_WITHIN_S = 60.0
_RETRY_S = 0.25
# JetStream's answers while a cluster is still forming (no leader yet): try again.
_NOT_READY = frozenset({10008})  # JetStream system temporarily unavailable
# JetStream's answers to a stream it cannot place: more replicas than a cluster's nodes online,
# tried again for a grace while a node that has just joined reports; or replicas > 1 on a server
# not clustered, no use trying again.
_NO_SUITABLE_PEERS = 10005
_NOT_CLUSTERED = 10074
# A cluster's nodes send their first statistics to its leader a moment after they meet (measured
# here about a second after the last node starts); until then placement counts them as offline.
PLACEMENT_GRACE_S = 15.0


async def init_bus(
    url: str,
    config: TokenStreamConfig,
    user: str = "",
    password: str = "",
    within_s: float = INIT_WITHIN_S,
    tls: TlsSettings | None = None,
    placement_grace_s: float = PLACEMENT_GRACE_S,
) -> StreamConfig:
    """Creates or updates the token stream on the bus at `url` (one URL or every node's,
    comma-separated; the login in it, or `user` and `password`); returns the stream's
    configuration as JetStream holds it. Raises StartupError when the bus is not there in
    `within_s` or cannot hold the stream as configured. `tls`: the CA and certificate it connects
    with (tandem.tls; none: in clear). `placement_grace_s`: how long a cluster's refusals to place
    the stream are tried again (see the module's docstring)."""
    login = {"user": user, "password": password} if user else {}
    shown = without_credentials(url)
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                server_urls(url), **login, **nats_tls_options(tls), connect_timeout=2, max_reconnect_attempts=-1, reconnect_time_wait=0.5
            ),
            within_s,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        raise StartupError(f"tandem bus init: cannot reach NATS at {shown} ({type(exc).__name__} {exc})") from None
    try:
        return await _ensure_within(nc, config, within_s, placement_grace_s)
    finally:
        await nc.close()


async def _ensure_within(nc: nats.NATS, config: TokenStreamConfig, within_s: float, placement_grace_s: float) -> StreamConfig:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    placement_until: float | None = None  # the grace's end, counted from the cluster's first refusal
    while True:
        try:
            js = await ensure_token_stream(nc, config)
            return (await js.stream_info(STREAM)).config
        except APIError as exc:
            if exc.err_code == _NO_SUITABLE_PEERS:
                if placement_until is None:
                    placement_until = min(loop.time() + placement_grace_s, deadline)
                is_placement_final = loop.time() >= placement_until
            else:
                is_placement_final = exc.err_code == _NOT_CLUSTERED
            if is_placement_final:
                raise StartupError(
                    f"tandem bus init: the bus cannot keep {config.num_replicas} replicas of {STREAM} ({exc.description}): "
                    "set TANDEM_TOKEN_STREAM_REPLICAS to at most the cluster's nodes (1 for a single server)"
                ) from None
            if exc.err_code not in _NOT_READY | {_NO_SUITABLE_PEERS} and not isinstance(exc, ServiceUnavailableError):
                raise StartupError(f"tandem bus init: JetStream refused {STREAM}: {exc.description} (code {exc.err_code})") from None
            problem: BaseException = exc
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError) as exc:
            problem = exc
        if loop.time() >= deadline:
            raise StartupError(f"tandem bus init: JetStream not ready after {within_s:.0f} s ({type(problem).__name__} {problem})")
        log.info("JetStream not ready yet (%s %s); retrying", type(problem).__name__, problem)
        await asyncio.sleep(_RETRY_S)


def describe(stream: StreamConfig) -> str:
    return (
        f"{stream.name}: {stream.num_replicas} replica(s), at most {stream.max_bytes} bytes (discard {DiscardPolicy(stream.discard or DiscardPolicy.OLD).value}), "
        f"events kept {stream.max_age:.0f} s"
    )


def _run(args: argparse.Namespace) -> int:
    from tandem.config import load_settings

    settings = load_settings()
    config = TokenStreamConfig(
        num_replicas=settings.token_stream_replicas,
        max_bytes=settings.token_stream_max_bytes,
        max_age_s=settings.token_stream_max_age_s,
    )
    stream = asyncio.run(
        init_bus(
            settings.nats_url,
            config,
            settings.nats_user,
            settings.nats_password.get_secret_value(),
            args.within_s,
            TlsSettings(),
            args.placement_grace_s,
        )
    )
    print(f"token stream {describe(stream)}")
    return 0


def add_cli(commands: argparse._SubParsersAction) -> None:
    bus = commands.add_parser("bus", help="the bus's admin steps")
    actions = bus.add_subparsers(dest="action", required=True)
    init = actions.add_parser(
        "init",
        help="create or update the token stream (the operator's login)",
        description="Creates the JetStream token stream, or brings it to the settings: TANDEM_TOKEN_STREAM_REPLICAS, "
        "TANDEM_TOKEN_STREAM_MAX_BYTES, TANDEM_TOKEN_STREAM_MAX_AGE_S. Logs in as TANDEM_NATS_USER (the operator: no "
        "service may change a stream) at TANDEM_NATS_URL (one URL, or every node's comma-separated). Idempotent.",
    )
    init.add_argument("--within-s", type=float, default=INIT_WITHIN_S, help="how long to wait for the bus and JetStream")
    init.add_argument(
        "--placement-grace-s",
        type=float,
        default=PLACEMENT_GRACE_S,
        help="how long a cluster's refusals to place the stream are tried again (its nodes report to the leader after they meet)",
    )
    init.set_defaults(run=_run)


def main(argv: list[str] | None = None) -> int:
    """`python -m tandem.ops.bus_init`: the same step where only the package is installed (the
    compose service and the Kubernetes Job run it so)."""
    parser = argparse.ArgumentParser(prog="tandem")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bus", "init", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.run(args))
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    sys.exit(main())
