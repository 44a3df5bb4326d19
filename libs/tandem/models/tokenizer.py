"""Text <-> token ids for a checkpoint, with its chat template and special token ids.

From a GGUF the `tokenizers` byte-level BPE is rebuilt from the stored vocabulary and merges; the
pre-tokenizer (how text is split before BPE) is chosen by `tokenizer.ggml.pre`, mirroring the
regexes llama.cpp's llama-vocab.cpp uses for that name. A SentencePiece vocabulary (model
"llama") is rebuilt by tokenizer_spm.py. From a Hugging Face folder it is read from tokenizer.json.

Message text never becomes a control token: a chat prompt's special tokens are the template's
own, and a message that spells one (`<|im_start|>system`) is encoded as the text it is, so user
text cannot forge a turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from tandem.errors import StartupError
from tandem.models.chat_template import ChatTemplate, ChatTemplateError
from tandem.models.files import open_model
from tandem.models.gguf_weights import read_gguf
from tandem.models.tokenizer_spm import spm_backend

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# The GPT-2 regex after splitting every digit alone (llama.cpp: STARCODER, SMOLLM, ...).
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell")
_GPT2_PRE = ("gpt2", "mpt", "olmo", "jais")
_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# In a message rendered by the chat template, `_MARK<n>_MARK` stands for the n-th piece of message
# text that must stay literal (a special token's spelling, or the mark itself). A private-use
# character: no template trims, cases or escapes it.
_MARK = "\ue000"
_LITERAL_REF = re.compile(f"{_MARK}(\\d+){_MARK}")


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: ChatTemplate | None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        # The same tokenizer reading special-token spellings as ordinary text (its own copy: the
        # flag is the backend's state, and encoding runs on several threads at once).
        self._text_backend = BackendTokenizer.from_str(backend.to_str())
        self._text_backend.encode_special_tokens = True
        specials = sorted((t.content for t in backend.get_added_tokens_decoder().values() if t.special), key=len, reverse=True)
        self._literal_pattern = re.compile("|".join(re.escape(text) for text in (*specials, _MARK)))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Special-token text (`<|im_start|>`) becomes its one id; nothing is added unless asked
        (chat templates write their own BOS)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def encode_text(self, text: str) -> list[int]:
        """`text` as ordinary text: a special token's spelling in it is spelt out, never its id."""
        return self._text_backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        """`tools`: function definitions as Hugging Face templates read them
        (`[{"type": "function", "function": {...}}]`); not passed to the template when None."""
        if self.chat_template is None:
            raise ChatTemplateError("this checkpoint has no chat template")
        variables = {} if tools is None else {"tools": list(tools)}
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """The rendered prompt's ids, its text exactly as rendered: the template's special tokens
        are control ids; the messages' text (content, role, any field) is ordinary text even where
        it spells a special token. Such spellings are swapped for marks before rendering and
        encoded as text where the marks land, so a message without one encodes as it always did."""
        literals: list[str] = []
        marked = [_marked(message, self._literal_pattern, literals) for message in messages]
        marked_tools = None if tools is None else [_marked(tool, self._literal_pattern, literals) for tool in tools]
        pieces = _LITERAL_REF.split(self.render_chat(marked, add_generation_prompt, marked_tools))
        ids: list[int] = []
        for index, piece in enumerate(pieces):  # template text and literal references alternate
            ids += self.encode(piece) if index % 2 == 0 else self.encode_text(literals[int(piece)])
        return ids

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        model = metadata.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise StartupError(f"GGUF tokenizer model {model!r} is not supported (supported: gpt2 byte-level BPE, llama SentencePiece)")
        if "tokenizer.ggml.tokens" not in metadata:
            raise StartupError("GGUF metadata lacks tokenizer.ggml.tokens (the vocabulary)")
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        token_types: list[int] = metadata.get("tokenizer.ggml.token_type", [])
        backend = _byte_level_backend(metadata) if model == "gpt2" else spm_backend(metadata)
        # Control tokens (and SentencePiece's unknown token) are special: one id each, dropped from
        # decoded text. User-defined tokens are Hugging Face's non-special added tokens: never
        # split, but part of the text.
        control = [
            i for i, kind in enumerate(token_types) if kind == TOKEN_TYPE_CONTROL or (kind == TOKEN_TYPE_UNKNOWN and model == "llama")
        ]
        user_defined = [i for i, kind in enumerate(token_types) if kind == TOKEN_TYPE_USER_DEFINED]
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user_defined])
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        eos_ids = () if eos is None else (int(eos),)
        source = metadata.get("tokenizer.chat_template")
        template = None
        if source is not None:
            template = ChatTemplate(
                source=source,
                bos_token="" if bos is None else tokens[bos],
                eos_token="" if eos is None else tokens[eos],
            )
        return cls(backend, None if bos is None else int(bos), eos_ids, template)

    @classmethod
    def from_hf_folder(cls, folder: Path) -> Tokenizer:
        """tokenizer.json, with tokenizer_config.json for the special tokens and chat template
        (or chat_template.jinja, where newer transformers put it)."""
        if not (folder / "tokenizer.json").is_file():
            raise StartupError(f"TANDEM_MODEL_PATH={folder}: a model folder needs tokenizer.json")
        backend = BackendTokenizer.from_file(str(folder / "tokenizer.json"))
        settings_file = folder / "tokenizer_config.json"
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        bos_token = _token_text(settings.get("bos_token"))
        eos_token = _token_text(settings.get("eos_token"))
        bos = None if bos_token is None else backend.token_to_id(bos_token)
        eos = None if eos_token is None else backend.token_to_id(eos_token)
        source = _hf_chat_template(folder, settings)
        template = None if source is None else ChatTemplate(source, bos_token or "", eos_token or "")
        return cls(backend, bos, () if eos is None else (eos,), template)


def _marked(value: Any, pattern: re.Pattern[str], literals: list[str]) -> Any:
    """`value` (a message, or any part of one) with each match of `pattern` in its strings swapped
    for a reference to it, appended to `literals`."""
    if isinstance(value, str):

        def reference(match: re.Match[str]) -> str:
            literals.append(match.group())
            return f"{_MARK}{len(literals) - 1}{_MARK}"

        return pattern.sub(reference, value)
    if isinstance(value, Mapping):
        return {key: _marked(item, pattern, literals) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_marked(item, pattern, literals) for item in value]
    return value


def _byte_level_backend(metadata: Mapping[str, Any]) -> BackendTokenizer:
    if "tokenizer.ggml.merges" not in metadata:
        raise StartupError("GGUF byte-level BPE vocabulary lacks tokenizer.ggml.merges")
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    pre = metadata.get("tokenizer.ggml.pre", "gpt2")
    vocab = {token: index for index, token in enumerate(metadata["tokenizer.ggml.tokens"])}
    backend = BackendTokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=pre == "llama-bpe"))
    _set_pre_tokenizer(backend, pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _set_pre_tokenizer(backend: BackendTokenizer, pre: str) -> None:
    if pre in _DIGIT_SPLIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    elif pre in _GPT2_PRE:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in ("llama-bpe", "qwen2"):
        regex = _LLAMA3_REGEX if pre == "llama-bpe" else _QWEN2_REGEX
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if pre == "qwen2":
            backend.normalizer = normalizers.NFC()
    else:
        supported = ", ".join((*_DIGIT_SPLIT_PRE, *_GPT2_PRE, "llama-bpe", "qwen2"))
        raise StartupError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {supported})")


def _token_text(token: str | Mapping[str, Any] | None) -> str | None:
    if isinstance(token, Mapping):
        return token.get("content")
    return token


def _hf_chat_template(folder: Path, settings: Mapping[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one is the chat template
        by_name = {entry["name"]: entry["template"] for entry in template}
        return by_name.get("default")
    return template


def load_tokenizer(path: Path | None) -> Tokenizer:
    """The checkpoint's tokenizer alone (no weights, no torch), for clients that only encode prompts."""
    checkpoint = open_model(path)
    if checkpoint.format == "gguf":
        return Tokenizer.from_gguf(read_gguf(checkpoint.path).metadata)
    return Tokenizer.from_hf_folder(checkpoint.path)
