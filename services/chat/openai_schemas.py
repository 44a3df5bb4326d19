"""The request bodies of the OpenAI-compatible endpoints and what they ask of the engine.

Every parameter OpenAI (or vLLM's server) defines is either honoured, accepted and ignored where
ignoring it changes nothing the client can see (`parallel_tool_calls`),
accepted only at its neutral value (`best_of: 1`, `echo: false`, ...), or refused with a 400
that names it. A parameter sent as `null` counts as not sent. A field no one defines (a vendor's
extension, a newer client's) is ignored, as vLLM's server does, and named in the reply's
`X-Tandem-Ignored-Fields` header and a log line, so clients that send them keep working and
nothing is dropped unseen.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from services.chat import openai_tools
from services.chat.config import AnswerLength
from services.chat.errors import InvalidRequest
from services.chat.limits import (
    MAX_CONTENT_PARTS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS_LIMIT,
    MAX_TOOLS,
    LogitBias,
    MaxTokens,
    ModelName,
    NumChoices,
    Penalty,
    RepetitionPenalty,
    Seed,
    Temperature,
    TokenId,
    TopLogprobs,
    TopP,
    check_stop_strings,
)
from tandem import structured_output
from tandem.bus.events import finish_name
from tandem.v1.common_pb2 import SamplingParams

# Ignoring these changes nothing a client can observe: a reply may hold several tool calls
# (OpenAI's default), and one that is forced holds exactly one either way.
IGNORED = frozenset({"parallel_tool_calls"})
# Known parameters, accepted at the value that means "off"; any other value is refused. (`tools`
# and `tool_choice` are fields of a chat completion: only a text completion refuses them here.)
NEUTRAL: dict[str, object] = {
    "best_of": 1,
    "echo": False,
    "tools": [],
    "functions": [],
    "tool_choice": "none",
    "include_stop_str_in_output": False,
    "top_logprobs": 0,  # a chat completion's field; on a text completion, `logprobs` is the count
    "function_call": "none",
    "store": False,
    "suffix": "",
    "use_beam_search": False,
    "bad_words": [],
    "modalities": ["text"],
    # No neutral value but null: any value asks for something Tandem does not do.
    "allowed_token_ids": None,
    "prompt_logprobs": None,
    "guided_grammar": None,
    "structured_outputs": None,
    "prediction": None,
    "audio": None,
}
# The engine's finish reasons as OpenAI's `finish_reason`. A cancelled reply (its client went
# away, or it was stopped) is "abort", as vLLM's server says; OpenAI itself has no name for it.
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "content_filter": "content_filter"}


def openai_finish_reason(finish: int) -> str:
    """ "stop", "length", "abort" or "content_filter" for a final event's finish reason."""
    return FINISH_REASONS[finish_name(finish)]


def _is_neutral(value: object, neutral: object) -> bool:
    """`value` is the neutral value itself: a number is not a flag (`logprobs: 0` on a text
    completion asks for the chosen tokens' logprobs; only `false` is off)."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


# A grammar spec is compiled on every worker that runs the reply: a schema's size is bounded.
MAX_GRAMMAR_SPEC_BYTES = 64 * 1024


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the reply is JSON valid against `schema`. Tandem
    holds every reply to it, `strict` or not."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class GenerationBody(BaseModel):
    """What a chat completion and a text completion share: the model, sampling and streaming.
    Every value is bounded here (services.chat.limits), so none reaches SamplingParams out of
    its field's range."""

    model_config = ConfigDict(extra="allow")

    model: ModelName
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: NumChoices = 1  # choices, each a reply of its own (services.chat.openai_replies)
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = Field(default=None, ge=-1, lt=2**31)  # vLLM: -1 or 0 = off
    min_p: float | None = Field(default=None, ge=0, le=1)  # vLLM's: 0 = off
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    seed: Seed | None = None
    # OpenAI's end-user id: Tandem bills and limits the API key's user; this one is logged with the reply.
    user: str | None = None
    ignore_eos: bool | None = None  # vLLM's: the model's end-of-sequence tokens do not end the reply
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = (
        None  # vLLM's: no eos, stop token id or stop string before this many
    )
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None  # vLLM's; 1 = off
    # Token id -> bias; JSON's string keys are read as ids. An id the model lacks has no effect.
    logit_bias: Annotated[dict[TokenId, LogitBias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # Structured output: OpenAI's response_format, or one of vLLM's guided_* (the same, in its words).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None

    @field_validator("stop")
    @classmethod
    def bounded_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        check_stop_strings([stop] if isinstance(stop, str) else stop or [])
        return stop

    def refuse_unsupported(self) -> None:
        """Raises InvalidRequest naming the first known parameter Tandem cannot honour."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("`stream_options` is only allowed when `stream` is true", param="stream_options")
        for name, value in (self.model_extra or {}).items():
            if name not in NEUTRAL or value is None or _is_neutral(value, NEUTRAL[name]):
                continue
            neutral = NEUTRAL[name]
            message = f"`{name}` is not supported by Tandem" + ("" if neutral is None else f" (only {neutral!r}, its default, is accepted)")
            raise InvalidRequest(message, code="unsupported_parameter", param=name)

    def ignored_fields(self) -> list[str]:
        """The fields no OpenAI or vLLM parameter is named after, in the order sent: ignored."""
        return [name for name in self.model_extra or {} if name not in NEUTRAL and name not in IGNORED]

    @property
    def wants_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_top_logprobs(self) -> int | None:
        """None: no logprobs; k: each token's logprob and its k likeliest alternatives'."""
        return None

    def stop_strings(self) -> list[str]:
        stops = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]

    def grammar_spec(self) -> str:
        """The structured-output spec the reply must match (tandem.structured_output), "" for free
        text; InvalidRequest names a spec asked twice, too large, or one the grammar library refuses."""
        asked: list[tuple[str, str]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", structured_output.json_object_spec()))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise InvalidRequest("`response_format` of type json_schema needs `json_schema`", param="response_format")
            asked.append(("response_format", structured_output.json_schema_spec(fmt.json_schema.schema_ or {})))
        if self.guided_json is not None:
            schema = self.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise InvalidRequest(f"`guided_json` is not JSON: {exc}", param="guided_json") from None
            if not isinstance(schema, dict):
                raise InvalidRequest("`guided_json` must be a JSON schema object", param="guided_json")
            asked.append(("guided_json", structured_output.json_schema_spec(schema)))
        if self.guided_regex is not None:
            asked.append(("guided_regex", structured_output.regex_spec(self.guided_regex)))
        if self.guided_choice is not None:
            asked.append(("guided_choice", structured_output.choice_spec(self.guided_choice)))
        if not asked:
            return ""
        if len(asked) > 1:
            raise InvalidRequest(f"ask for one structured output, not {' and '.join(f'`{name}`' for name, _ in asked)}", param=asked[1][0])
        param, spec = asked[0]
        if len(spec.encode()) > MAX_GRAMMAR_SPEC_BYTES:
            raise InvalidRequest(f"`{param}` is over {MAX_GRAMMAR_SPEC_BYTES} bytes", param=param)
        try:
            structured_output.check_spec(spec)
        except structured_output.InvalidGrammar as exc:
            raise InvalidRequest(f"`{param}` cannot be used: {exc}", code="unsupported_grammar", param=param) from None
        return spec

    def sampling(self, answer_length: AnswerLength, room_tokens: int) -> SamplingParams:
        """The engine's sampling parameters, with max_tokens (and min_tokens) capped to the tier's
        answer length and the room left in the window; a min_tokens above the max_tokens asked for
        is refused."""
        requested = self.requested_max_tokens()
        min_tokens = self.min_tokens or 0
        if requested is not None and min_tokens > requested:
            raise InvalidRequest(f"`min_tokens` ({min_tokens}) is more than `max_tokens` ({requested})", param="min_tokens")
        max_tokens = max(1, min(answer_length.max_tokens(requested), room_tokens))
        params = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            min_p=self.min_p or 0.0,
            max_tokens=max_tokens,
            stop=self.stop_strings(),
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=bool(self.ignore_eos),
            min_tokens=min(min_tokens, max_tokens),  # the window's room caps both
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=self.logit_bias or {},
            grammar=self.grammar_spec(),
        )
        if self.seed is not None:
            params.seed = self.seed
        top_logprobs = self.requested_top_logprobs()
        if top_logprobs is not None:
            params.top_logprobs = top_logprobs
        return params


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # a JSON string, as OpenAI writes it


class MessageToolCall(BaseModel):
    """A call an earlier assistant message made (sent back with the conversation)."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def as_template_call(self) -> dict[str, Any]:
        """As Hugging Face templates read a call: its arguments an object where they are one."""
        arguments: object = self.function.arguments
        try:
            decoded = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            decoded = None
        if isinstance(decoded, dict):
            arguments = decoded
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")  # audio, refusal, ...: refused, never dropped
    # "developer" is OpenAI's newer name for the system role; the chat template sees "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only for an assistant message that made tool calls.
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None  # accepted; chat templates have no place for it
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @model_validator(mode="after")
    def tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has `tool_calls`")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the `tool_call_id` it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only a tool message has a `tool_call_id`")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("a message needs `content` (only an assistant message with `tool_calls` may have none)")
        return self

    def as_template_message(self) -> dict[str, Any]:
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(part.text for part in content)
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_call() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for a function's name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # a forced call always matches its schema; a free one is parsed as written


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None  # only with `logprobs: true`, as OpenAI has it
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    _tool_style: str = PrivateAttr(default="")  # how the model writes calls (openai_tools), set by use_tool_style

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("`top_logprobs` needs `logprobs` to be true", param="top_logprobs")
        names = [tool.function.name for tool in self.tools or []]
        twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
        if twice is not None:
            raise InvalidRequest(f"the function `{twice}` is defined twice in `tools`", param="tools")
        if self.tool_choice in (None, "none"):
            return
        if not names:  # as OpenAI answers
            raise InvalidRequest("`tool_choice` is only allowed when `tools` defines functions", param="tool_choice")
        named = self.forced_function()
        if named is not None and named not in names:
            raise InvalidRequest(f"`tool_choice` names the function `{named}`, which `tools` does not define", param="tool_choice")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model, as Hugging Face templates read them; None
        when there are none or `tool_choice` is "none" (then the model is not told of them, and its
        reply is plain text)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def use_tool_style(self, style: str) -> None:
        """The model writes calls in `style` (openai_tools.HERMES or JSON): a forced call's grammar
        is written in it."""
        self._tool_style = style

    def forced_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def grammar_spec(self) -> str:
        """A forced tool call (`tool_choice` "required" or a named function) is a grammar: the
        call, written as the model's template teaches; it cannot be combined with another."""
        spec = super().grammar_spec()
        if self.template_tools() is None or self.tool_choice in (None, "auto"):
            return spec
        if spec:
            raise InvalidRequest("a forced tool call cannot be combined with a structured output", param="tool_choice")
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools or []]
        forced = openai_tools.forced_call_spec(tools, self.forced_function(), self._tool_style or openai_tools.JSON)
        if len(forced.encode()) > MAX_GRAMMAR_SPEC_BYTES:
            raise InvalidRequest(f"the forced tool call's grammar is over {MAX_GRAMMAR_SPEC_BYTES} bytes", param="tools")
        try:
            structured_output.check_spec(forced)
        except structured_output.InvalidGrammar as exc:
            raise InvalidRequest(f"`tools` cannot be forced: {exc}", code="unsupported_grammar", param="tools") from None
        return forced

    def requested_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` is OpenAI's newer name for `max_tokens`; both may be given only
        when they agree."""
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequest(
                f"`max_tokens` ({self.max_tokens}) and `max_completion_tokens` ({self.max_completion_tokens}) disagree; send one",
                param="max_completion_tokens",
            )
        return self.max_completion_tokens or self.max_tokens
