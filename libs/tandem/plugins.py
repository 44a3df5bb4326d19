"""A deployment's own component, named by a setting as `module:function`: the function is
imported and called with no arguments, and what it returns must have the interface asked for."""

from __future__ import annotations

import importlib
from typing import TypeVar

T = TypeVar("T")


def load_plugin(spec: str, interface: type[T], what: str, choices: str) -> T:
    """`interface`: a runtime-checkable Protocol; `what`: its name in errors ("safety check");
    `choices`: the other values the setting takes, for the error of a spec with no colon.
    Raises ValueError saying what is wrong."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{spec!r} is not a {what}: use {choices} or module:function")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load the {what} {spec!r}: {exc}") from None
    if not callable(factory):
        raise ValueError(f"{spec!r} is not a function that returns a {what}")
    loaded = factory()
    if not isinstance(loaded, interface):
        raise ValueError(f"{spec!r} returned {type(loaded).__name__}, which is not a {what} ({interface.__name__})")
    return loaded
