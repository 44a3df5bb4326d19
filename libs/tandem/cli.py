"""The `tandem` command: `tandem up` (the whole local stack) and `tandem serve <role>`."""

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
