"""Structured output: what a reply must match, as one spec string, and its grammar (llguidance).

A spec is a small JSON object with one key, the form the chat writes into SamplingParams.grammar
and every worker reads: `{"json_schema": {...}}` (the reply is JSON valid against the schema),
`{"json_object": {}}` (any JSON object), `{"regex": "..."}`, `{"choice": ["a", "b"]}` (exactly
one of the strings) or `{"lark": "..."}` (llguidance's Lark grammar, `%json {...}` embeds included:
what a forced tool call is written in). The chat checks a spec here before a request leaves it, so a schema the
library cannot compile is a 400 naming the problem, never a failure on a worker; a worker
compiles it against its tokenizer (GrammarCompiler, once per spec) into a matcher that each
sequence copies and advances token by token.

llguidance computes a step's token masks on the host's cores, in parallel over the rows that
have a grammar (bench/structured_output.py measures it); it needs no torch, so the chat can
check specs with it too.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import llguidance

SPEC_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
# JSON without free whitespace between tokens: a model cannot pad a reply out to max_tokens with
# blanks, and the output is what json.dumps(..., separators=(",", ":")) writes.
_JSON_OPTIONS = {"whitespace_flexible": False}
_MAX_CACHED_GRAMMARS = 64


class InvalidGrammar(ValueError):
    """A spec that is malformed or that the grammar library cannot compile; the message says why."""


def json_schema_spec(schema: dict[str, object]) -> str:
    return json.dumps({"json_schema": schema}, sort_keys=True)


def json_object_spec() -> str:
    return json.dumps({"json_object": {}})


def regex_spec(pattern: str) -> str:
    return json.dumps({"regex": pattern})


def choice_spec(choices: Sequence[str]) -> str:
    return json.dumps({"choice": list(choices)})


def lark_spec(grammar: str) -> str:
    return json.dumps({"lark": grammar})


def grammar_of(spec: str) -> str:
    """The llguidance grammar of a spec; raises InvalidGrammar for a malformed spec."""
    try:
        parsed = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise InvalidGrammar(f"a grammar spec must be JSON: {exc}") from None
    if not isinstance(parsed, dict) or len(parsed) != 1 or next(iter(parsed)) not in SPEC_KINDS:
        raise InvalidGrammar(f"a grammar spec is an object with one of {', '.join(SPEC_KINDS)}")
    kind, value = next(iter(parsed.items()))
    if kind == "json_object":
        return _from_json_schema({"type": "object"})
    if kind == "json_schema":
        if not isinstance(value, dict):
            raise InvalidGrammar("a JSON schema must be an object")
        return _from_json_schema(value)
    if kind == "regex":
        if not isinstance(value, str):
            raise InvalidGrammar("a regex must be a string")
        return str(llguidance.LLMatcher.grammar_from_regex(value))
    if kind == "lark":
        if not isinstance(value, str):
            raise InvalidGrammar("a Lark grammar must be a string")
        try:
            return str(llguidance.LLMatcher.grammar_from_lark(value))
        except ValueError as exc:
            raise InvalidGrammar(f"the Lark grammar cannot be used: {exc}") from None
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise InvalidGrammar("a choice must be a non-empty list of strings")
    return str(llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in value)))


def _from_json_schema(schema: dict[str, object]) -> str:
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS))  # type: ignore[arg-type]
    except ValueError as exc:
        raise InvalidGrammar(f"the JSON schema cannot be used: {exc}") from None


def check_spec(spec: str) -> None:
    """Raises InvalidGrammar when a worker could not compile the spec (without a tokenizer: what
    the grammar itself asks is checked, the same for every model)."""
    message = llguidance.LLMatcher.validate_grammar(grammar_of(spec))
    if message:
        raise InvalidGrammar(message)


class GrammarCompiler:
    """Specs compiled against one tokenizer, the last few kept: each sequence gets its own copy."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """`tokenizer_json`: gives the Hugging Face tokenizers serialization, called at the first
        grammar (a worker that never sees one never serializes its tokenizer); `vocab_size`: the
        model's logits width (a mask covers every column); `eos_token_ids`: what ends a finished reply."""
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use: about a second for a large vocabulary
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # an engine checks requests beside its step, on another thread

    def matcher(self, spec: str) -> llguidance.LLMatcher:
        """A fresh matcher for the spec, at the reply's start; raises InvalidGrammar."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is None:
                compiled = llguidance.LLMatcher(self._llg_tokenizer(), grammar_of(spec), log_level=0)
                if compiled.is_error():
                    raise InvalidGrammar(compiled.get_error())
                self._compiled[spec] = compiled
                if len(self._compiled) > _MAX_CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(spec)
            return compiled.deep_copy()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            eos = self._eos_token_ids or None
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self._vocab_size, eos_token=eos)
        return self._tokenizer
