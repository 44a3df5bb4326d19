"""The `tandem` command: `tandem up` (the whole local stack), `tandem serve <role>`, and
`tandem generate` (one answer from the in-process engine)."""

from __future__ import annotations

import argparse
import asyncio
import runpy
import sys

from tandem.config import ROLES, load_settings
from tandem.errors import StartupError
from tandem.models.files import open_model
from tandem.service import bind_port


def _up(args: argparse.Namespace) -> int:
    from tandem.stack import Stack, stack_config_from

    settings = load_settings(**({"host": args.host} if args.host else {}))
    config = stack_config_from(settings, chat_port=args.port)
    # Fail before anything starts when the stack could not come up anyway.
    open_model(settings.model_path)
    bind_port(config.host, config.chat_port, "TANDEM_HTTP_PORT or --port").close()
    return asyncio.run(Stack(config).run())


def _generate(args: argparse.Namespace) -> int:
    """Streams one chat answer from the in-process engine."""
    import time
    from pathlib import Path

    import torch

    from tandem.engine.engine import Engine, EngineConfig, Request
    from tandem.engine.sequence import SamplingOptions
    from tandem.kernels import select_attention
    from tandem.models.loader import default_dtype, load_model

    try:
        sampling = SamplingOptions(temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    dtype = {"auto": default_dtype("cpu"), "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    loaded = load_model(Path(args.model) if args.model else None, dtype, "cpu", select_attention("cpu"))
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": args.prompt}]
    prompt_ids = loaded.tokenizer.encode_chat(messages) if not args.raw else loaded.tokenizer.encode(args.prompt, add_bos=True)
    engine = Engine(loaded, EngineConfig(kv_cache_mib=256))
    try:
        engine.add(Request("cli", tuple(prompt_ids), sampling))
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


def _serve(args: argparse.Namespace) -> int:
    runpy.run_module(f"services.{args.role}", run_name="__main__", alter_sys=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start nats, redis and all five services locally (Ctrl-C stops all)")
    up.add_argument("--host", help="address to serve on (default TANDEM_HOST or 127.0.0.1)")
    up.add_argument("--port", type=int, help="chat service port (default TANDEM_HTTP_PORT or 8080)")
    up.set_defaults(run=_up)
    generate = commands.add_parser("generate", help="stream one chat answer from the in-process engine")
    generate.add_argument("prompt")
    generate.add_argument("--system", help="a system message before the prompt")
    generate.add_argument("--raw", action="store_true", help="no chat template: continue the text as is")
    generate.add_argument("--max-tokens", type=int, default=256)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--model", help="a .gguf file or safetensors folder (default: the embedded SmolLM2)")
    generate.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    generate.add_argument("-v", "--verbose", action="store_true", help="print token counts and speed to stderr")
    generate.set_defaults(run=_generate)
    serve = commands.add_parser("serve", help="run one service in this process")
    serve.add_argument("role", choices=ROLES)
    serve.set_defaults(run=_serve)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except StartupError as exc:
        print(f"tandem {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
