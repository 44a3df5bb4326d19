"""Token counts of chat turns and the prompt's token ids, through the model's chat template."""

from __future__ import annotations

from collections.abc import Sequence

from services.chat.context import Turn
from tandem.models.tokenizer import Tokenizer

_PROBE_SYSTEM = "s"
_PROBE_TEXT = "a"


class PromptCounter:
    """Counts a turn as its text's tokens plus the template's per-turn framing, measured once."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        system = [{"role": "system", "content": _PROBE_SYSTEM}]
        with_turn = [*system, {"role": "user", "content": _PROBE_TEXT}]
        num_system = len(tokenizer.encode_chat(system, add_generation_prompt=False))
        num_with_turn = len(tokenizer.encode_chat(with_turn, add_generation_prompt=False))
        self.turn_overhead_tokens = num_with_turn - num_system - len(tokenizer.encode(_PROBE_TEXT))
        self.generation_prompt_tokens = len(tokenizer.encode_chat(with_turn, add_generation_prompt=True)) - num_with_turn

    def count(self, content: str) -> int:
        return len(self._tokenizer.encode(content)) + self.turn_overhead_tokens


def encode_prompt(tokenizer: Tokenizer, turns: Sequence[Turn]) -> tuple[list[int], int]:
    """The prompt's ids and how many leading ids are the public system prefix (the first turn,
    when it is the system prompt and its rendering is a prefix of the whole)."""
    messages = [{"role": turn.role, "content": turn.content} for turn in turns]
    ids = tokenizer.encode_chat(messages)
    num_public = 0
    if messages and messages[0]["role"] == "system":
        system_ids = tokenizer.encode_chat(messages[:1], add_generation_prompt=False)
        if ids[: len(system_ids)] == system_ids:
            num_public = len(system_ids)
    return ids, num_public
