"""Renders an OpenAPI 3.1 schema (FastAPI's `app.openapi()`) as one Markdown page: per tag, each
path and method with its parameters, request body and responses, then the body schemas. Small on
purpose: the chat's schema uses $ref, anyOf, arrays, enums and numeric bounds, nothing more."""

from __future__ import annotations

import json
import re
from typing import Any

from markdown_text import escape, paragraphs

Schema = dict[str, Any]
TAG_TITLES = {"openai": "OpenAI"}
METHODS = ("get", "put", "post", "delete", "patch", "head", "options")
_BOUNDS = (
    ("minimum", "≥"),
    ("exclusiveMinimum", ">"),
    ("maximum", "≤"),
    ("exclusiveMaximum", "<"),
    ("minLength", "length ≥"),
    ("maxLength", "length ≤"),
    ("minItems", "items ≥"),
    ("maxItems", "items ≤"),
)


def operation_id(method: str, path: str) -> str:
    """The page's anchor for one operation: `post /v1/chat/completions` -> post-v1-chat-completions."""
    return "-".join([method, *re.findall(r"[\w]+", path)]).lower()


def schema_id(name: str) -> str:
    return f"schema-{name.lower()}"


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def describe(schema: Schema) -> str:
    """A schema in a few words, with a link where it names a component."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{schema_id(name)})"
    if options := schema.get("anyOf") or schema.get("oneOf"):
        return " or ".join(describe(option) for option in options)
    if "enum" in schema:
        return "one of " + ", ".join(f"`{value}`" for value in schema["enum"])
    if "const" in schema:
        return f"`{schema['const']}`"
    kind = schema.get("type", "any")
    if kind == "array":
        kind = f"array of {describe(schema.get('items', {}))}"
    elif isinstance(kind, list):
        kind = " or ".join(kind)
    bounds = [f"{symbol} {_number(schema[key])}" for key, symbol in _BOUNDS if key in schema]
    return f"{kind} ({', '.join(bounds)})" if bounds else kind


def _default(schema: Schema) -> str:
    return f"`{json.dumps(schema['default'])}`" if "default" in schema else ""


def _parameters(operation: Schema) -> list[str]:
    parameters = operation.get("parameters", [])
    if not parameters:
        return []
    lines = ["**Parameters**", "", "| Name | In | Type | Required | Default | Description |", "| --- | --- | --- | --- | --- | --- |"]
    for parameter in parameters:
        schema = parameter.get("schema", {})
        lines.append(
            f"| `{parameter['name']}` | {parameter['in']} | {describe(schema)} | {'yes' if parameter.get('required') else 'no'} "
            f"| {_default(schema)} | {escape(parameter.get('description', schema.get('description', '')))} |"
        )
    return [*lines, ""]


def _request_body(operation: Schema) -> list[str]:
    body = operation.get("requestBody")
    if not body:
        return []
    required = "required" if body.get("required") else "optional"
    kinds = [f"{describe(media.get('schema', {}))} as `{media_type}`" for media_type, media in body.get("content", {}).items()]
    return [f"**Request body** ({required}): {'; '.join(kinds)}", ""]


def _responses(operation: Schema) -> list[str]:
    lines = ["**Responses**", "", "| Status | Description | Body |", "| --- | --- | --- |"]
    for status, response in operation.get("responses", {}).items():
        bodies = [
            f"{describe(media['schema'])} as `{media_type}`" if media.get("schema") else f"`{media_type}`"
            for media_type, media in response.get("content", {}).items()
        ]
        lines.append(f"| {status} | {escape(response.get('description', ''))} | {'; '.join(bodies)} |")
    return [*lines, ""]


def _operation(method: str, path: str, operation: Schema) -> list[str]:
    lines = [f"### `{method.upper()} {path}` {{#{operation_id(method, path)}}}", ""]
    if summary := operation.get("summary"):
        lines += [escape(summary), ""]
    if description := operation.get("description"):
        lines += [line for paragraph in paragraphs(description) for line in (paragraph, "")]
    return lines + _parameters(operation) + _request_body(operation) + _responses(operation)


def _component(name: str, schema: Schema) -> list[str]:
    lines = [f"### {name} {{#{schema_id(name)}}}", ""]
    if description := schema.get("description"):
        lines += [line for paragraph in paragraphs(description) for line in (paragraph, "")]
    properties = schema.get("properties", {})
    if not properties:
        return [*lines, describe(schema), ""]
    required = set(schema.get("required", []))
    lines += ["| Field | Type | Required | Default | Description |", "| --- | --- | --- | --- | --- |"]
    for field, field_schema in properties.items():
        lines.append(
            f"| `{field}` | {describe(field_schema)} | {'yes' if field in required else 'no'} | {_default(field_schema)} "
            f"| {escape(field_schema.get('description', ''))} |"
        )
    if schema.get("additionalProperties") is True:
        lines += ["", "Fields not listed are accepted and ignored."]
    return [*lines, ""]


def render_openapi(schema: Schema, title: str = "HTTP API reference", intro: str = "") -> str:
    by_tag: dict[str, list[str]] = {}
    for path, item in schema.get("paths", {}).items():
        for method in METHODS:
            if operation := item.get(method):
                tag = (operation.get("tags") or ["other"])[0]
                by_tag.setdefault(tag, []).extend(_operation(method, path, operation))
    info = schema.get("info", {})
    lines = [f"# {title}", ""]
    if intro:
        lines += [intro, ""]
    lines += [
        f"Schema: {escape(info.get('title', ''))} {escape(info.get('version', ''))}, OpenAPI {escape(schema.get('openapi', ''))}.",
        "",
    ]
    for tag, operations in by_tag.items():
        lines += [f"## {TAG_TITLES.get(tag, tag[:1].upper() + tag[1:])}", "", *operations]
    components = schema.get("components", {}).get("schemas", {})
    if components:
        lines += ["## Schemas", ""]
        for name, component in components.items():
            lines += _component(name, component)
    return "\n".join(lines)
