"""`tandem keys add|revoke FILE`: the chat's keys file (tandem.key_file) kept by an operator. A
new key is printed once and only its salted hash is written; the file is replaced whole (a
temporary file renamed over it), so a chat re-reading it never sees half a write."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from tandem.api_keys import ApiKey, Tier
from tandem.errors import StartupError
from tandem.key_file import entry_for, generate_key, parse_key_file


def add_cli(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "keys",
        help="add or revoke an API key in the chat's keys file (TANDEM_API_KEYS_FILE)",
        description="Keeps the chat's keys file: salted hashes, one key a line. A running chat sees a change within about a second.",
    )
    actions = parser.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="make a new key (printed once) and write its hash")
    add.add_argument("file", type=Path, help="the keys file (created, readable by you alone, if missing)")
    add.add_argument("--user", required=True, help="the user the key acts for")
    add.add_argument("--tier", choices=[t.value for t in Tier], default=Tier.FREE.value)
    add.set_defaults(run=_add)
    revoke = actions.add_parser("revoke", help="remove a key by its id (the part before its first dot)")
    revoke.add_argument("file", type=Path)
    revoke.add_argument("key_id")
    revoke.set_defaults(run=_revoke)


def _add(args: argparse.Namespace) -> int:
    key = generate_key()
    entry = entry_for(key, ApiKey(user_id=args.user, tier=Tier(args.tier)))
    lines = _read_lines(args.file)
    _replace(args.file, [*lines, entry.line()])
    print(key)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    lines = _read_lines(args.file)
    kept = [line for line in lines if line.split(maxsplit=1)[:1] != [args.key_id]]
    if len(kept) == len(lines):
        raise StartupError(f"{args.file} has no key {args.key_id!r}")
    _replace(args.file, kept)
    return 0


def _read_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    text = path.read_text()
    _, problems = parse_key_file(text)
    if problems:
        raise StartupError(f"{path}: {problems[0]}: fix it first")
    return text.splitlines()


def _replace(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:  # mkstemp's file is readable by its owner alone
            out.write("".join(f"{line}\n" for line in lines))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
