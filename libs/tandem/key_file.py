"""API keys at rest: salted scrypt hashes, never the keys themselves. The chat reads them from
the keys file (TANDEM_API_KEYS_FILE) and finds a presented key's line by its id, the part of the
key before its first dot, so checking a key costs one hash however many keys there are.

A line of the file: `key_id salt hash tier user num_key_bytes` (salt and hash in hex; `#` starts
a comment). `num_key_bytes` is the random bytes the key's secret carries, as the writer measured
it: a line under MIN_KEY_BYTES is refused, so a short key never gets in. `tandem keys add`
writes lines; the keys are made by generate_key (secrets.token_urlsafe, MIN_KEY_BYTES bytes)."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from tandem.api_keys import ApiKey, Tier

MIN_KEY_BYTES = 32
# A key carries at least MIN_KEY_BYTES random bytes, so no work factor makes guessing it harder;
# scrypt's cost only has to slow a reader of the file down on a weak key, which the strength
# check keeps out. 2**12 is about 10 ms a hash (4 MiB), paid once per key after each load.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**12, 8, 1
SALT_BYTES = 16
HASH_BYTES = 32
_KEY_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class KeyFileError(ValueError):
    """A line of the keys file that cannot be taken; the message names its line."""


@dataclass(frozen=True)
class KeyEntry:
    key_id: str
    salt: bytes
    digest: bytes
    api_key: ApiKey
    num_key_bytes: int

    def matches(self, key: str) -> bool:
        """Whether `key` is this entry's: its hash compared in constant time."""
        return hmac.compare_digest(hash_key(key, self.salt), self.digest)

    def line(self) -> str:
        return f"{self.key_id} {self.salt.hex()} {self.digest.hex()} {self.api_key.tier.value} {self.api_key.user_id} {self.num_key_bytes}"


def hash_key(key: str, salt: bytes) -> bytes:
    return hashlib.scrypt(key.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=HASH_BYTES)


def key_id_of(key: str) -> str:
    """The id the key's entry is found by: the part before its first dot (generated keys,
    `tdm-<hex>.<secret>`); a key without one (a TANDEM_API_KEYS key of the operator's choosing)
    is found by a digest of the whole key."""
    prefix, dot, _ = key.partition(".")
    if dot and _KEY_ID.match(prefix):
        return prefix
    return "sha256-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def num_key_bytes_of(key: str) -> int:
    """The random bytes the key's secret (after the id) can carry, at six bits a character as
    base64url writes them."""
    prefix, dot, secret = key.partition(".")
    return len(secret if dot and _KEY_ID.match(prefix) else key) * 6 // 8


def generate_key(id_prefix: str = "tdm") -> str:
    """A new key, `<id_prefix>-<12 hex>.<secret of MIN_KEY_BYTES random bytes>`."""
    return f"{id_prefix}-{secrets.token_hex(6)}.{secrets.token_urlsafe(MIN_KEY_BYTES)}"


def entry_for(key: str, api_key: ApiKey) -> KeyEntry:
    salt = secrets.token_bytes(SALT_BYTES)
    return KeyEntry(key_id_of(key), salt, hash_key(key, salt), api_key, num_key_bytes_of(key))


def parse_key_file(text: str) -> tuple[dict[str, KeyEntry], list[KeyFileError]]:
    """The entries by key id, and a KeyFileError for each line left out (malformed, a key
    shorter than MIN_KEY_BYTES, an id listed twice)."""
    entries: dict[str, KeyEntry] = {}
    problems: list[KeyFileError] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.partition("#")[0].strip()
        if not line:
            continue
        try:
            entry = _parse_line(line)
        except KeyFileError as exc:
            problems.append(KeyFileError(f"line {number}: {exc}"))
            continue
        if entry.key_id in entries:
            problems.append(KeyFileError(f"line {number}: key id {entry.key_id!r} is listed twice"))
            continue
        entries[entry.key_id] = entry
    return entries, problems


def _parse_line(line: str) -> KeyEntry:
    fields = line.split()
    if len(fields) != 6:
        raise KeyFileError("must be `key_id salt hash tier user num_key_bytes` (tandem keys add writes it)")
    key_id, salt_hex, hash_hex, tier, user, num_bytes = fields
    tiers = {t.value for t in Tier}
    if not _KEY_ID.match(key_id):
        raise KeyFileError(f"key id {key_id!r} is not 1-64 of A-Z a-z 0-9 _ -")
    try:
        salt, digest, num_key_bytes = bytes.fromhex(salt_hex), bytes.fromhex(hash_hex), int(num_bytes)
    except ValueError:
        raise KeyFileError(f"key {key_id!r}: salt and hash must be hex, num_key_bytes a number") from None
    if len(salt) < SALT_BYTES or len(digest) != HASH_BYTES:
        raise KeyFileError(f"key {key_id!r}: the salt must be at least {SALT_BYTES} bytes and the hash {HASH_BYTES}")
    if tier not in tiers:
        raise KeyFileError(f"key {key_id!r} has unknown tier {tier!r} (one of {', '.join(sorted(tiers))})")
    if num_key_bytes < MIN_KEY_BYTES:
        raise KeyFileError(
            f"key {key_id!r} carries {num_key_bytes} random bytes, under the minimum {MIN_KEY_BYTES}: replace it with `tandem keys add`"
        )
    return KeyEntry(key_id, salt, digest, ApiKey(user_id=user, tier=Tier(tier)), num_key_bytes)
