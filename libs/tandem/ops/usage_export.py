"""`tandem usage export`: the usage ledger for billing, every user's tokens per model and UTC day
since a day, as CSV on stdout. It reads the conversation store the services are configured with
(TANDEM_STORE and its settings, from the environment or tandem.toml), as they do."""

from __future__ import annotations

import argparse
import asyncio
import csv
import sys
from collections.abc import Sequence
from datetime import date
from typing import TextIO

from tandem.config import Settings, load_settings
from tandem.errors import StartupError
from tandem.store import StoreUnavailable, UsageRow, open_store
from tandem.store.usage import MAX_USAGE_DAYS, earliest_day, today_utc

COLUMNS = ("user_id", "model", "day", "messages", "prompt_tokens", "cached_tokens", "completion_tokens")


def write_csv(rows: Sequence[UsageRow], out: TextIO) -> None:
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow(
            (row.user_id, row.model, row.day.isoformat(), row.messages, row.prompt_tokens, row.cached_tokens, row.completion_tokens)
        )


def _since(text: str) -> date:
    try:
        day = date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date as YYYY-MM-DD: {text!r}") from None
    if day < earliest_day(today_utc()):
        raise argparse.ArgumentTypeError(f"reaches back more than {MAX_USAGE_DAYS} days (to {earliest_day(today_utc())} at most)")
    return day


async def _read(settings: Settings, since: date) -> list[UsageRow]:
    if settings.store == "sqlite" and not settings.sqlite_path.exists():  # opening it would make an empty one
        raise StartupError(f"no SQLite store at {settings.sqlite_path} (TANDEM_SQLITE_PATH)")
    store = open_store(settings)
    try:
        await store.start()
        return await store.usage_since(since)
    except StoreUnavailable as exc:
        raise StartupError(str(exc)) from None
    finally:
        await store.close()


def _export(args: argparse.Namespace) -> int:
    rows = asyncio.run(_read(load_settings(), args.since))
    write_csv(rows, sys.stdout)
    return 0


def add_cli(commands: argparse._SubParsersAction) -> None:
    usage = commands.add_parser("usage", help="the usage ledger: every user's tokens per model and day")
    actions = usage.add_subparsers(dest="action", required=True)
    export = actions.add_parser(
        "export",
        help="every user's usage since a day, one row per user, model and UTC day",
        description="Prints the usage ledger from --since (a UTC day) to today: one row per user, model and day with "
        f"the messages answered and their prompt, cached and completion tokens. Columns: {', '.join(COLUMNS)}. "
        "Reads the store the services use (TANDEM_STORE, TANDEM_SQLITE_PATH or TANDEM_CASSANDRA_*; tandem.toml).",
    )
    export.add_argument(
        "--since", type=_since, required=True, metavar="YYYY-MM-DD", help=f"the first day, at most {MAX_USAGE_DAYS} days ago"
    )
    export.add_argument("--format", choices=("csv",), default="csv", help="csv (the default) to stdout")
    export.set_defaults(run=_export)
