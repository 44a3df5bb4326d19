"""The API keys the chat accepts, as salted hashes (tandem.key_file): the keys file's lines,
re-read when the file changes so a key added or revoked counts within a second or two without a
restart, and TANDEM_API_KEYS's keys (the development form) hashed at start, so no key is kept
as it was given.

A key checked once is remembered by a SHA-256 digest until the next load: a request then costs
a dict lookup, not a scrypt hash. A load starts with nothing remembered, so a revoked key's
digest goes with it."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from tandem.api_keys import ApiKey
from tandem.errors import StartupError
from tandem.key_file import KeyEntry, KeyFileError, entry_for, key_id_of, parse_key_file

log = logging.getLogger(__name__)
FILE_SETTING = "TANDEM_API_KEYS_FILE"


class KeyRing:
    def __init__(
        self,
        env_entries: dict[str, KeyEntry],
        path: Path | None = None,
        check_every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._env_entries = env_entries
        self._path = path
        self._check_every_s = check_every_s
        self._clock = clock
        self._next_check_s = clock() + check_every_s
        self._file_version: tuple[int, int, int] | None = None
        self._entries = dict(env_entries)
        self._verified: dict[bytes, KeyEntry] = {}

    @classmethod
    def load(cls, env_keys: dict[str, ApiKey], path: Path | None) -> KeyRing:
        """The ring of TANDEM_API_KEYS's keys and the keys file's; a file that cannot be read, or
        with a line it cannot take (a short key among them), is a StartupError naming it."""
        ring = cls({entry.key_id: entry for entry in (entry_for(key, api_key) for key, api_key in env_keys.items())}, path)
        if path is not None:
            try:
                problems = ring._read_file()
            except OSError as exc:
                raise StartupError(f"{FILE_SETTING}: cannot read {path}: {exc.strerror}") from None
            if problems:
                raise StartupError(f"{FILE_SETTING}: {path}: {problems[0]}")
        return ring

    @property
    def num_keys(self) -> int:
        return len(self._entries)

    def known_caller(self, key: str) -> ApiKey | None:
        """The caller of a key already checked since the last load; None for any other (no hash)."""
        entry = self._verified.get(_digest(key))
        return entry.api_key if entry is not None else None

    async def caller_of(self, key: str) -> ApiKey | None:
        """The key's caller, or None for a key the ring does not hold."""
        self.refresh()
        known = self.known_caller(key)
        if known is not None:
            return known
        entries = self._entries
        entry = entries.get(key_id_of(key))
        if entry is None or not await asyncio.to_thread(entry.matches, key):
            return None
        if entries is self._entries:  # not a load's since the hash began: its key may be revoked
            self._verified[_digest(key)] = entry
        return entry.api_key

    def refresh(self) -> None:
        """Re-reads the keys file when it changed (at most once every check_every_s). A line it
        cannot take is left out and logged; the others count at once, so a revocation beside a
        bad line still takes effect. A file that is gone holds no keys."""
        if self._path is None or self._clock() < self._next_check_s:
            return
        self._next_check_s = self._clock() + self._check_every_s
        try:
            problems = self._read_file()
        except OSError as exc:
            if self._file_version is not None:
                log.error("%s: cannot read %s (%s): its keys are refused until it is back", FILE_SETTING, self._path, exc.strerror)
                self._file_version = None
                self._replace({})
            return
        for problem in problems:
            log.error("%s: %s: %s (that line is left out)", FILE_SETTING, self._path, problem)

    def _read_file(self) -> list[KeyFileError]:
        """Loads the file if its version (inode, size, mtime) is new; the lines left out."""
        assert self._path is not None
        stat = os.stat(self._path)
        version = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if version == self._file_version:
            return []
        entries, problems = parse_key_file(self._path.read_text())
        self._file_version = version
        self._replace(entries)
        log.info("%s: %d keys from %s", FILE_SETTING, len(entries), self._path)
        return problems

    def _replace(self, file_entries: dict[str, KeyEntry]) -> None:
        self._entries = {**file_entries, **self._env_entries}
        self._verified = {}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
