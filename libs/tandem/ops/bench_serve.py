"""`tandem bench serve`: being built (issue 14)."""

from __future__ import annotations

import argparse

from tandem.errors import StartupError


def add_cli(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("bench", help="(being built)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    raise StartupError("not built yet")
