"""Served model ids: `name@version` where the workers version their model (the model_version
setting), else a bare `name`. A conversation is pinned to the full id that began it; a request
naming the bare name is split between the name's versions by the routers' rollout
(services/router/rollout.py)."""

from __future__ import annotations

import re

SEPARATOR = "@"
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,63}$")


def split(served: str) -> tuple[str, str]:
    """`name@version` -> (name, version); a bare name's version is ""."""
    name, _, version = served.partition(SEPARATOR)
    return name, version


def name_of(served: str) -> str:
    """The name without its version."""
    return split(served)[0]


def version_of(served: str) -> str:
    return split(served)[1]


def is_versioned(served: str) -> bool:
    return SEPARATOR in served


def versioned(name: str, version: str) -> str:
    """`name@version` ("" version: the bare name). Raises ValueError for a version that is not a
    short token of letters, digits, '.', '_' and '-', or a name that has a version already."""
    if not version:
        return name
    if SEPARATOR in name:
        raise ValueError(f"the served name {name!r} has a version already; set either it or model_version, not both")
    if not _VERSION.match(version):
        raise ValueError(f"model version {version!r}: up to 64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return f"{name}{SEPARATOR}{version}"
