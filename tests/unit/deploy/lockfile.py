"""requirements/*.txt read as the tests need them: each pin and what it is pinned for."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from packaging.utils import canonicalize_name
from packaging.version import Version

PROJECT = "tandem-serve (pyproject.toml)"  # how uv names a requirement of pyproject.toml in `# via`
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>\S+)$")


@dataclass
class Pin:
    version: Version
    parents: set[str] = field(default_factory=set)  # `# via`: distribution names or PROJECT


def parse_lock(text: str) -> dict[str, Pin]:
    """uv's (and pip-compile's) annotated output: `name==version` lines, each followed by
    `# via parent` or `# via` and one `#   parent` line per parent."""
    pins: dict[str, Pin] = {}
    current: Pin | None = None
    for line in text.splitlines():
        if match := _PIN.match(line):
            current = pins[canonicalize_name(match["name"])] = Pin(Version(match["version"]))
        elif line.startswith("    #") and current is not None:
            comment = line.strip().removeprefix("#").strip()
            parent = comment.removeprefix("via ").strip()
            if comment != "via":
                current.parents.add(parent if parent == PROJECT else canonicalize_name(parent))
        elif line.strip() and not line.startswith("#"):
            raise ValueError(f"not a pin nor an annotation: {line!r}")
    return pins
