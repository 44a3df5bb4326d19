"""The checkpoint's chat template, rendered the way Hugging Face transformers renders it.

Templates come from model files (untrusted), so they run in jinja2's immutable sandbox. The
environment matches transformers' (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text) so published templates render the same.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or is itself broken."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from None


@lru_cache(maxsize=8)
def _variables(source: str) -> frozenset[str]:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateError:
        return frozenset()


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str
    eos_token: str

    @property
    def supports_tools(self) -> bool:
        """The template reads a `tools` variable: it can show the model function definitions."""
        return "tools" in _variables(self.source)

    @property
    def tool_call_style(self) -> str:
        """How the model writes a call, as its template teaches it: "hermes" (a JSON object
        between `<tool_call>` and `</tool_call>`, Qwen2.5's and Hermes' way) when the template
        mentions `<tool_call>`, else "json" (the whole reply one JSON object with `name` and
        `parameters` or `arguments`, Llama 3's way)."""
        return "hermes" if "<tool_call>" in self.source else "json"

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text for `messages` ([{"role", "content"}, ...]); with
        `add_generation_prompt` it ends where the assistant's reply begins."""
        try:
            return _compile(self.source).render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **variables,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from None
