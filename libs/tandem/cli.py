"""The `tandem` command: `tandem up` (the whole local stack; --ha with a NATS cluster), `tandem serve <role>` (one service,
every setting also a flag), `tandem generate` (one answer from the in-process engine), and the
operators' tools (`tandem plan`, `tandem top`, `tandem usage export`, `tandem bus init`, ...)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from importlib import metadata

from tandem.config import ROLES, load_settings, settings_flags
from tandem.devstack import cassandra_node, secrets
from tandem.errors import StartupError
from tandem.models.files import open_model
from tandem.ops import bench_serve, bus_init, keys_cli, plan, store_migrate, top, usage_export
from tandem.runtime import run_service

VIA_BUS_IDLE_S = 300.0  # tandem generate --via-bus gives up when its reply sends nothing for this long


def _up(args: argparse.Namespace) -> int:
    """The whole local stack; any setting is also a flag (`--decode-workers 2`), for the stack
    (how many workers and chat instances) and, as its TANDEM_ variable, for every service it starts."""
    from tandem.devstack.members import check_chat_ports_free
    from tandem.devstack.stack import Stack, stack_config_from
    from tandem.models.tensor_parallel import check_split

    settings = load_settings(args.settings, prog="tandem up", **({"host": args.host} if args.host else {}))
    flags = settings_flags(args.settings, prog="tandem up")() if args.settings else {}
    config = stack_config_from(settings, chat_port=args.port, flags={name: str(value) for name, value in flags.items()}, is_ha=args.ha)
    # Fail before anything starts when the stack could not come up anyway.
    check_split(open_model(settings.model_path), settings.tensor_parallel_size)
    check_chat_ports_free(config)  # every chat instance's: chat_port, chat_port + 1, ...
    return asyncio.run(Stack(config).run())


def _up_settings_flags(model: str | None, flags: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """The settings flags `tandem up` passes on (read by load_settings as `tandem serve` reads
    them), with vLLM's `--model` spelled as the setting's own `--model-path`."""
    if model is None:
        return flags
    if any(flag == "--model-path" or flag.startswith("--model-path=") for flag in flags):
        parser.error("--model and --model-path name the same setting: give one")
    return ["--model-path", model, *flags]


def _messages(args: argparse.Namespace) -> list[dict[str, str]]:
    return ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": args.prompt}]


def _sampling(args: argparse.Namespace):  # -> SamplingOptions; validated before anything loads
    from tandem.engine.sequence import SamplingOptions

    try:
        return SamplingOptions(
            temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos
        )
    except ValueError as exc:
        raise StartupError(str(exc)) from None


def _generate(args: argparse.Namespace) -> int:
    """Streams one chat answer from the in-process engine, or through the running stack."""
    sampling = _sampling(args)
    if args.via_bus:
        return asyncio.run(_generate_via_bus(args, sampling))
    import dataclasses
    from pathlib import Path

    from tandem.engine.engine import EngineConfig, Request
    from tandem.models.loader import resolve_device, resolve_dtype
    from tandem.worker.engine_ranks import PeerRanks
    from tandem.worker.engine_spec import EngineSpec, build_engine

    device = resolve_device(args.device, setting="--device")
    config = EngineConfig(kv_cache_mib=256, gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len)
    if args.gpu_memory_utilization is not None:  # a share of memory sizes the cache instead
        config = dataclasses.replace(config, kv_cache_mib=None)
    spec = EngineSpec(
        open_model(Path(args.model) if args.model else None, quantization=args.quantization),
        device,
        resolve_dtype(args.dtype, device),
        config,
        torch_threads=max(1, len(os.sched_getaffinity(0)) // args.tensor_parallel_size) if args.tensor_parallel_size > 1 else 0,
        tensor_parallel_size=args.tensor_parallel_size,
        log_level="WARNING",
    )
    peers = PeerRanks.start(spec) if spec.tensor_parallel_size > 1 else None
    if peers is not None:  # a rank that ends early would leave this one waiting for it in a collective
        peers.watch(_rank_ended)
    try:
        engine = build_engine(peers.spec if peers is not None else spec)
        try:
            return _generate_with(engine, args, sampling, Request)
        finally:
            if peers is not None:
                peers.ending()
            engine.close()
    finally:
        if peers is not None:
            peers.stop()


def _rank_ended(rank: int, code: int) -> None:
    """From a rank's watcher thread: the answer cannot be computed without it."""
    print(f"tandem generate: error: rank {rank} of the engine ended (exit code {code})", file=sys.stderr, flush=True)
    os._exit(1)


def _generate_with(engine, args: argparse.Namespace, sampling, request_type) -> int:  # -> the exit code
    import time

    tokenizer = engine.loaded.tokenizer
    prompt_ids = tokenizer.encode(args.prompt, add_bos=True) if args.raw else tokenizer.encode_chat(_messages(args))
    try:
        engine.add(request_type("cli", tuple(prompt_ids), sampling))
    except ValueError as exc:  # a prompt that can never fit, or an empty one
        raise StartupError(str(exc)) from None
    started_s = time.perf_counter()
    first_token_s = None
    num_tokens = 0
    while engine.has_work():
        for output in engine.step():
            first_token_s = first_token_s or time.perf_counter()
            num_tokens += len(output.new_token_ids)
            print(output.text, end="", flush=True)
    print(flush=True)
    if first_token_s is not None and args.verbose:
        decode_s = time.perf_counter() - first_token_s
        print(
            f"[{len(prompt_ids)} prompt tokens, {num_tokens} generated; TTFT {1000 * (first_token_s - started_s):.0f} ms, "
            f"{(num_tokens - 1) / decode_s if decode_s > 0 else 0:.1f} tokens/s after]",
            file=sys.stderr,
        )
    return 0


async def _quiet(*_: object) -> None:
    """nats-py logs every connection error with a traceback; the CLI says it in one line instead."""


async def _generate_via_bus(args: argparse.Namespace, sampling) -> int:
    """The internal-client path: a GenerateRequest on tandem.v1.generate, then the TokenEvents."""
    from pathlib import Path

    import nats

    from tandem.bus import decode, encode, subjects
    from tandem.bus.connection import server_urls, without_credentials
    from tandem.bus.token_batches import watch_events
    from tandem.models.loader import load_tokenizer
    from tandem.tls import TlsSettings, nats_tls_options
    from tandem.v1.common_pb2 import FINISH_REASON_ERROR, FINISH_REASON_UNSPECIFIED, SamplingParams
    from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest
    from tandem.v1.tokens_pb2 import TokenEvent

    settings = load_settings()
    tokenizer = load_tokenizer(Path(args.model) if args.model else settings.model_path)
    prompt_ids = tokenizer.encode(args.prompt, add_bos=True) if args.raw else tokenizer.encode_chat(_messages(args))
    params = SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_tokens, ignore_eos=sampling.ignore_eos
    )
    if sampling.seed is not None:
        params.seed = sampling.seed
    # The login: TANDEM_NATS_USER/PASSWORD, else the URL's own (tandem up prints one with its operator's).
    login = {"user": settings.nats_user, "password": settings.nats_password.get_secret_value()} if settings.nats_user else {}
    url = without_credentials(settings.nats_url)
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                server_urls(settings.nats_url),
                **login,
                **nats_tls_options(TlsSettings()),
                connect_timeout=2,
                allow_reconnect=False,
                error_cb=_quiet,
            ),
            timeout=5,
        )
    except Exception as exc:  # a refused login says so: allow_reconnect=False raises the server's answer
        raise StartupError(
            f"cannot reach NATS at {url} ({str(exc) or type(exc).__name__}): start the stack, set TANDEM_NATS_URL "
            "(tandem up prints it with a login), or TANDEM_NATS_USER and TANDEM_NATS_PASSWORD"
        ) from None
    events: asyncio.Queue[TokenEvent] = asyncio.Queue()

    async def on_event(event: TokenEvent) -> None:
        events.put_nowait(event)

    # Subscribed before asking, so no token can arrive before we listen: every reply's events
    # (workers' batches, and a failure the router ends the reply with), this one's kept below.
    await watch_events(nc, on_event)
    try:
        answer = await nc.request(
            subjects.GENERATE, encode(GenerateRequest(model="auto", prompt_token_ids=prompt_ids, sampling=params)), timeout=10
        )
    except Exception as exc:
        await nc.close()
        raise StartupError(f"no router answered on {subjects.GENERATE} ({exc or type(exc).__name__}): is the stack up?") from None
    reply = decode(answer.data, GenerateReply)
    if reply.WhichOneof("outcome") == "refused":
        await nc.close()
        raise StartupError(f"refused ({reply.refused.reason}): {reply.refused.message}")
    loop = asyncio.get_running_loop()
    deadline_s = loop.time() + VIA_BUS_IDLE_S
    while True:
        try:  # a bus that drops (no reconnect here) or a lost event must not leave the command waiting for ever
            event = await asyncio.wait_for(events.get(), max(0.0, deadline_s - loop.time()))
        except TimeoutError:
            await nc.close()
            raise StartupError(f"reply {reply.reply_id}: nothing came for {VIA_BUS_IDLE_S:.0f} s (lost the bus?)") from None
        if event.reply_id != reply.reply_id:
            continue
        deadline_s = loop.time() + VIA_BUS_IDLE_S
        print(event.text, end="", flush=True)
        if event.finish == FINISH_REASON_ERROR:
            await nc.close()
            raise StartupError(f"{event.error.code}: {event.error.message}")
        if event.finish != FINISH_REASON_UNSPECIFIED:
            break
    print(flush=True)
    await nc.close()
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Runs one service with its settings from flags, then the environment, then the toml file."""
    settings = load_settings(args.settings, prog=f"tandem serve {args.role}")  # first: --help needs no service
    service = importlib.import_module(f"services.{args.role}.app")
    run_service(args.role, service.build_app, settings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=f"tandem {metadata.version('tandem-serve')}")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser(
        "up",
        help="start nats, redis and all five services locally (Ctrl-C stops all)",
        description="Starts the local stack. Every setting is also a flag here, as for tandem serve: "
        "--decode-workers N and --prefill-workers M (or TANDEM_DECODE_WORKERS, TANDEM_PREFILL_WORKERS) set how many "
        "worker processes run, --chat-instances K (TANDEM_CHAT_INSTANCES) how many chat instances, on consecutive ports "
        "from the chat port; any other (--stall-timeout-s 1, ...) reaches every service. "
        "--tensor-parallel-size N makes each of the large model's prefill and decode workers N ranks (the small model's "
        "stay at 1); with --gpu-memory-utilization F and --max-model-len L they size its KV cache. On a host with GPUs each "
        "rank gets one of its own (CUDA_VISIBLE_DEVICES: prefill 0..N-1, decode N..2N-1, ...; too few is an error before "
        "anything starts); on a CPU the ranks share the cores (TANDEM_TORCH_THREADS each). "
        "tandem serve <role> --help lists them.",
    )
    up.add_argument("--host", help="address to serve on (default TANDEM_HOST or 127.0.0.1)")
    up.add_argument("--port", type=int, help="the first chat instance's port (default TANDEM_HTTP_PORT or 8080)")
    up.add_argument(
        "--model",
        help="the large model: a .gguf file, a safetensors folder or a Hugging Face id in the local cache "
        "(the same as --model-path, TANDEM_MODEL_PATH; default: the embedded SmolLM2)",
    )
    up.add_argument(
        "--ha",
        action="store_true",
        help="three clustered NATS nodes with the token stream on all three (TANDEM_TOKEN_STREAM_REPLICAS, default 3 here); "
        "services are given every node's URL and ride one node's loss",
    )
    up.set_defaults(run=_up, settings=[])
    generate = commands.add_parser("generate", help="stream one chat answer from the in-process engine")
    generate.add_argument("prompt")
    generate.add_argument("--system", help="a system message before the prompt")
    generate.add_argument("--raw", action="store_true", help="no chat template: continue the text as is")
    generate.add_argument("--max-tokens", type=int, default=256)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--ignore-eos", action="store_true", help="write --max-tokens tokens, past any end token")
    generate.add_argument(
        "--model", help="a .gguf file, a safetensors folder or a Hugging Face id in the local cache (default: the embedded SmolLM2)"
    )
    generate.add_argument(
        "--dtype", choices=("auto", "bf16", "fp32"), default="auto", help="auto: bf16 where the device computes it natively"
    )
    generate.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto (the default): the GPU when torch sees one"
    )
    generate.add_argument(
        "--quantization", choices=("none", "int8", "fp8"), default="none", help="the projections kept as the dtype, int8 or fp8 (e4m3)"
    )
    generate.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks the engine spans, one process each (gloo on a CPU, NCCL on GPUs)"
    )
    generate.add_argument(
        "--gpu-memory-utilization", type=float, help="the share of the device's memory (a CPU's: of RAM) for weights, activations and KV"
    )
    generate.add_argument("--max-model-len", type=int, help="the longest sequence served (default: the model's context window)")
    generate.add_argument("--via-bus", action="store_true", help="ask the running stack over NATS (TANDEM_NATS_URL)")
    generate.add_argument("-v", "--verbose", action="store_true", help="print token counts and speed to stderr")
    generate.set_defaults(run=_generate)
    serve = commands.add_parser(
        "serve",
        help="run one service in this process",
        description="Runs one service. Every setting is also a flag, over its TANDEM_ variable and tandem.toml: "
        "tandem serve decode --kv-cache-mib 2048 --host 0.0.0.0. tandem serve <role> --help lists them with their defaults.",
    )
    serve.add_argument("role", choices=ROLES)
    serve.add_argument("settings", nargs=argparse.REMAINDER, help="settings flags (tandem serve <role> --help lists them)")
    serve.set_defaults(run=_serve)
    cassandra_node.add_cli(commands)
    secrets.add_cli(commands)
    plan.add_cli(commands)
    bench_serve.add_cli(commands)
    top.add_cli(commands)
    usage_export.add_cli(commands)
    bus_init.add_cli(commands)
    store_migrate.add_cli(commands)
    keys_cli.add_cli(commands)
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command != "up":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "up":
        args.settings = _up_settings_flags(args.model, unknown, parser)
    try:
        return args.run(args)
    except StartupError as exc:
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
