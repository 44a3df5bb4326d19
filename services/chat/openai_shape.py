"""How one OpenAI endpoint writes its objects: chat completions a `message` or `delta` per
choice, text completions a `text`; the id prefix and the object names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReplyShape:
    """How one endpoint writes a reply: id prefix, object names, and a choice's form."""

    id_prefix: str
    object_name: str
    chunk_object: str
    is_chat: bool

    def choice(
        self,
        index: int,
        text: str | None,
        finish: str,
        logprobs: dict[str, object] | None = None,
        tool_calls: list[dict[str, object]] | None = None,
        stop_reason: str | None = None,
    ) -> dict[str, object]:
        """`logprobs` (openai_logprobs.py): a chat choice has the key only when the request asked;
        `tool_calls` (openai_tools.py): a chat message has the key only when it made calls;
        `stop_reason` (vLLM's): what ended it where `finish_reason` does not say, else null."""
        if self.is_chat:
            message: dict[str, object] = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            logprobs_part = {"logprobs": logprobs} if logprobs else {}
            return {"index": index, "message": message, **logprobs_part, "finish_reason": finish, "stop_reason": stop_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}

    def tool_call_chunks(self, index: int, calls: list[dict[str, Any]]) -> list[dict[str, object]]:
        """A chat choice's calls as stream deltas: each call's id and name, then its arguments whole."""
        deltas: list[dict[str, object]] = []
        for position, call in enumerate(calls):
            named = {
                "index": position,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            arguments = {"index": position, "function": {"arguments": call["function"]["arguments"]}}
            deltas += [{"index": index, "delta": {"tool_calls": [part]}, "finish_reason": None} for part in (named, arguments)]
        return deltas

    def chunk_choice(
        self, index: int, text: str, finish: str | None, logprobs: dict[str, object] | None = None, stop_reason: str | None = None
    ) -> dict[str, object]:
        """A chunk's choice; its last (with `finish`) names the `stop_reason` too, null when none."""
        ending = {"finish_reason": finish} if finish is None else {"finish_reason": finish, "stop_reason": stop_reason}
        if self.is_chat:
            delta = {"content": text} if text else {}
            return {"index": index, "delta": delta, **({"logprobs": logprobs} if logprobs else {}), **ending}
        return {"index": index, "text": text, "logprobs": logprobs, **ending}


CHAT = ReplyShape("chatcmpl-", "chat.completion", "chat.completion.chunk", is_chat=True)
TEXT = ReplyShape("cmpl-", "text_completion", "text_completion", is_chat=False)
