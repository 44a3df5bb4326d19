"""Tool calls on `/v1/chat/completions`: reading them out of a reply's text, whole or as it
streams, and the grammar that forces one.

A model writes a call the way its chat template taught it (ChatTemplate.tool_call_style):
"hermes", a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
`</tool_call>` (Qwen2.5's and Hermes' way; several calls, text around them), or "json", the whole
reply one JSON object `{"name": ..., "parameters": {...}}` (Llama 3's way; a list of them for
several calls). A call that does not parse (not JSON, no name, arguments not an object) is left
in the reply's content, never dropped. Calls come back as OpenAI writes them:
`{"id": "call_...", "type": "function", "function": {"name", "arguments": <a JSON string>}}`.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from tandem import structured_output

HERMES = "hermes"
JSON = "json"
STYLES = (HERMES, JSON)
_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_HERMES_CALL = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.DOTALL)
# Forced calls are written without free whitespace, as the structured-output grammars are.
_NO_FREE_WHITESPACE = {"whitespace_flexible": False}


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call(name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _as_call(value: object, arguments_key: str) -> dict[str, Any] | None:
    """The call a decoded JSON value stands for, None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments already as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return _call(value["name"], arguments)


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def parse_tool_calls(text: str, style: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a whole reply: content is the text outside the calls that parsed
    (stripped; None when nothing is left and there are calls), calls in the order written."""
    calls: list[dict[str, Any]] = []
    if style == HERMES:
        kept: list[str] = []
        at = 0
        for match in _HERMES_CALL.finditer(text):
            call = _as_call(_loads(match.group(1).strip()), "arguments")
            if call is None:
                continue  # malformed: stays in the content
            kept.append(text[at : match.start()])
            at = match.end()
            calls.append(call)
        kept.append(text[at:])
        content = "".join(kept)
        if not calls:
            return text, []
        content = content.strip()
        return content or None, calls
    decoded = _loads(text.strip())
    values = decoded if isinstance(decoded, list) and decoded else [decoded]
    for value in values:
        call = _as_call(value, "parameters")
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


class ToolCallStream:
    """A streamed reply's text split into content to send at once and calls read at its end:
    content streams until a call may be starting (for "hermes", `<tool_call>` or a prefix of it
    at the end of what came; for "json", a reply whose first non-blank character opens an
    object or a list), then the rest is held and parsed when the reply ends."""

    def __init__(self, style: str) -> None:
        self._style = style
        self._held = ""
        self._holding_call = False  # a call has started: everything from there waits for the end
        self._decided = False  # "json": whether the reply is a call is known once it is not blank

    def feed(self, text: str) -> str:
        """The content that can be sent now, of `text` and what was held before it."""
        self._held += text
        if self._holding_call:
            return ""
        if self._style == JSON:
            if not self._decided:
                stripped = self._held.lstrip()
                if not stripped:
                    return ""
                self._decided = True
                if stripped[0] in "{[":
                    self._holding_call = True
                    return ""
            out, self._held = self._held, ""
            return out
        start = self._held.find(_OPEN)
        if start >= 0:
            out, self._held = self._held[:start], self._held[start:]
            self._holding_call = True
            return out
        keep = _partial_suffix(self._held, _OPEN)
        out = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The reply has ended: the content still to send ("" for none) and the calls."""
        held, self._held = self._held, ""
        if not self._holding_call:
            return held, []
        content, calls = parse_tool_calls(held, self._style)
        if not calls:
            return held, []
        return content or "", calls  # what is held begins where the first call does: the text before it was sent


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _call_schema(tool: Mapping[str, Any], arguments_key: str) -> dict[str, Any]:
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def forced_call_spec(tools: Sequence[Mapping[str, Any]], name: str | None, style: str) -> str:
    """The grammar spec (tandem.structured_output) of one call: of the function `name`, or of any
    of `tools` when None; "hermes" wraps it in `<tool_call>\\n ... \\n</tool_call>` (a Lark
    grammar with the call's JSON schema embedded), "json" is the call's JSON schema alone."""
    chosen = [tool for tool in tools if name is None or tool["function"]["name"] == name]
    arguments_key = "arguments" if style == HERMES else "parameters"
    schemas = [_call_schema(tool, arguments_key) for tool in chosen]
    schema: dict[str, Any] = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if style == JSON:
        return structured_output.json_schema_spec(schema)
    embedded = {**schema, "x-guidance": _NO_FREE_WHITESPACE}
    lark = f"start: {json.dumps(_OPEN + chr(10))} call {json.dumps(chr(10) + _CLOSE)}\ncall: %json {json.dumps(embedded)}"
    return structured_output.lark_spec(lark)
