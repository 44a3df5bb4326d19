"""Token counts of chat turns and the prompt's token ids, through the model's chat template."""

from __future__ import annotations

from collections.abc import Sequence

from services.chat.context import Turn
from services.chat.errors import Unavailable
from tandem.models.tokenizer import Tokenizer

_PROBE_SYSTEM = "s"
_PROBE_TEXT = "a"


class LoadedTokenizer:
    """The model's tokenizer, loaded once the process has started (it takes a while, and the
    server answers meanwhile): made empty at build time and handed to every part that encodes."""

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self._tokenizer = tokenizer

    @property
    def is_loaded(self) -> bool:
        return self._tokenizer is not None

    def load(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def get(self) -> Tokenizer:
        """The tokenizer; a request that needs it before it has loaded is told to retry."""
        if self._tokenizer is None:
            raise Unavailable("the service is still starting (loading the tokenizer); try again shortly", code="starting")
        return self._tokenizer


class PromptCounter:
    """Counts a turn as what it adds to a prompt after a system turn: encoded the way the prompt
    is (message text as ordinary text, with the template's per-turn framing), so a message that
    spells a control token counts what it costs. The framing is measured once."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._system = [{"role": "system", "content": _PROBE_SYSTEM}]
        with_turn = [*self._system, {"role": "user", "content": _PROBE_TEXT}]
        self._num_system_tokens = len(tokenizer.encode_chat(self._system, add_generation_prompt=False))
        num_with_turn = len(tokenizer.encode_chat(with_turn, add_generation_prompt=False))
        self.generation_prompt_tokens = len(tokenizer.encode_chat(with_turn, add_generation_prompt=True)) - num_with_turn

    def count(self, content: str) -> int:
        with_turn = [*self._system, {"role": "user", "content": content}]
        return len(self._tokenizer.encode_chat(with_turn, add_generation_prompt=False)) - self._num_system_tokens


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
