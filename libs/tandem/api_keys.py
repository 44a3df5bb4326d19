"""API keys as the settings give them ("key1=user1:plus,key2=user2:free"): each names its user
and tier. tandem.config re-exports these names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class Tier(str, Enum):
    FREE = "free"
    PLUS = "plus"
    PRO = "pro"


@dataclass(frozen=True)
class ApiKey:
    user_id: str
    tier: Tier


_KEY_ENTRY = re.compile(r"^(?P<key>[^\s=,:]+)=(?P<user>[^\s=,:]+):(?P<tier>[^\s=,:]+)$")


def parse_api_keys(spec: str) -> dict[str, ApiKey]:
    """Parses "key1=user1:plus,key2=user2:free"; raises ValueError naming the bad entry."""
    keys: dict[str, ApiKey] = {}
    tiers = ", ".join(t.value for t in Tier)
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        match = _KEY_ENTRY.match(entry)
        if match is None:
            raise ValueError(f"entry {entry!r} must look like key=user:tier (tier one of {tiers})")
        if match["tier"] not in {t.value for t in Tier}:
            raise ValueError(f"entry {entry!r} has unknown tier {match['tier']!r} (one of {tiers})")
        if match["key"] in keys:
            raise ValueError(f"key {match['key']!r} is listed twice")
        keys[match["key"]] = ApiKey(user_id=match["user"], tier=Tier(match["tier"]))
    return keys
