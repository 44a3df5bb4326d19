"""Renders the settings reference from `tandem.config.Settings`, so the page lists every setting
once and cannot fall behind the code: its variable, flag, type, default and docstring, grouped by
the section comments in the class body."""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from pathlib import PurePath
from typing import Any

import annotated_types
from markdown_text import escape
from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode

FIRST_SECTION = "Processes, the model and the engine"
_FIELD_LINE = re.compile(r"^    (?P<name>\w+)\s*:")
_COMMENT_LINE = re.compile(r"^    # (?P<text>.+)$")
_ISSUE_REFERENCE = re.compile(r"\s*\(issue \d+\)")
_BOUNDS = (
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.Lt, "lt", "<"),
)


def sections(settings_cls: type[BaseSettings]) -> list[tuple[str, str, list[str]]]:
    """(title, note, field names) per section, in the class's order. A section starts at a
    comment line in the class body; its text up to a ';' is the title, the rest a note."""
    fields = settings_cls.model_fields
    grouped: list[tuple[str, str, list[str]]] = [(FIRST_SECTION, "", [])]
    for line in inspect.getsource(settings_cls).splitlines():
        if (comment := _COMMENT_LINE.match(line)) and grouped[-1][2]:  # comments before the first field are not sections
            title, _, note = _ISSUE_REFERENCE.sub("", comment["text"]).partition(";")
            grouped.append((_sentence_case(title.strip()), _sentence_case(note.strip()), []))
        elif (field := _FIELD_LINE.match(line)) and field["name"] in fields:
            grouped[-1][2].append(field["name"])
    listed = {name for _, _, names in grouped for name in names}
    grouped[-1][2].extend(name for name in fields if name not in listed)  # a field the source scan missed still appears
    return [section for section in grouped if section[2]]


def _sentence_case(text: str) -> str:
    return text[:1].upper() + text[1:]


def env_name(settings_cls: type[BaseSettings], field_name: str) -> str:
    return f"{settings_cls.model_config.get('env_prefix', '')}{field_name}".upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def describe_type(field: FieldInfo) -> str:
    """The value a setting takes, for a reader who writes it in a variable or a flag."""
    # a NoDecode setting is parsed from its text by a validator of its own (api_keys)
    kind = (
        "string"
        if any(item is NoDecode or isinstance(item, NoDecode) for item in field.metadata)
        else _describe_annotation(field.annotation)
    )
    bounds = [_bound(item) for item in field.metadata]
    limits = ", ".join(bound for bound in bounds if bound)
    return f"{kind} ({limits})" if limits else kind


def _describe_annotation(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _describe_annotation(args[0])
    if origin in (typing.Union, types.UnionType):
        present = [arg for arg in args if arg is not type(None)]
        described = " or ".join(_describe_annotation(arg) for arg in present)
        return f"{described}, optional" if len(present) < len(args) else described
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{value}`" for value in args)
    if origin is dict:
        return "map"
    names = {str: "string", int: "integer", float: "number", bool: "boolean", SecretStr: "secret string"}
    if annotation in names:
        return names[annotation]
    if isinstance(annotation, type) and issubclass(annotation, PurePath):
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def _bound(item: object) -> str:
    for kind, attribute, symbol in _BOUNDS:
        if isinstance(item, kind):
            return f"{symbol} {getattr(item, attribute)}"
    return ""


def describe_default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if value is None:
        return "unset"
    if value in ("", {}, [], ()):
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{value}`"


def render_settings(settings_cls: type[BaseSettings]) -> str:
    fields = settings_cls.model_fields
    example = "kv_cache_mib" if "kv_cache_mib" in fields else next(iter(fields))
    lines = [
        "# Settings reference",
        "",
        "Every setting of every Tandem process, generated from `tandem.config.Settings` when the site is built.",
        "Each one is read from, first to last:",
        "",
        f"1. a flag of `tandem serve <role>`: `{flag_name(example)} ...` (`tandem serve <role> --help` lists them);",
        f"2. an environment variable: `{env_name(settings_cls, example)}=...`;",
        f"3. `tandem.toml` in the working directory (another file with `TANDEM_CONFIG=path`): `{example} = ...`.",
        "",
        "A process reads only the settings its role uses; the description says which roles those are where it matters.",
        "",
    ]
    for title, note, names in sections(settings_cls):
        lines += [f"## {title}", ""]
        if note:
            lines += [note, ""]
        lines += ["| Setting | Type | Default | Description |", "| --- | --- | --- | --- |"]
        for name in names:
            field = fields[name]
            setting = f'<a id="{name}"></a>`{env_name(settings_cls, name)}`<br>`{flag_name(name)}`'
            description = escape(field.description or "")
            lines.append(f"| {setting} | {escape(describe_type(field))} | {describe_default(field)} | {description} |")
        lines.append("")
    return "\n".join(lines)
