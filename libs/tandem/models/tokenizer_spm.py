"""A SentencePiece vocabulary stored in a GGUF (`tokenizer.ggml.model` "llama": Llama 2, Mistral,
Gemma, Phi-3) rebuilt as a `tokenizers` BPE with byte fallback.

llama.cpp encodes such a vocabulary by repeatedly joining the adjacent pair whose joined piece
scores highest. A BPE whose merge list is every (left, right) split of every piece, ranked by the
joined piece's score, does the same. Spaces are spelt "▁", text gets one "▁" in front (the
dummy prefix, `tokenizer.ggml.add_space_prefix`), characters outside the vocabulary are spelt by
their UTF-8 bytes as `<0xXX>` pieces, and the decoder undoes all three.

Per architecture, the shape follows transformers' GGUF tokenizer conversion, which the tests use
as the reference: Phi-3 prefixes "▁" with a normalizer (in front of every run of text, also after
a special token); Gemma adds no prefix, stores pieces of spaces as real spaces, and ranks its
merges by their place in the vocabulary, since its scores do not follow the merge order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from tandem.errors import StartupError

SPACE = "\u2581"  # SentencePiece's spelling of a space
BYTE_PIECES = tuple(f"<0x{byte:02X}>" for byte in range(256))
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def spm_backend(metadata: Mapping[str, Any]) -> BackendTokenizer:
    """The BPE model, normalizer, pre-tokenizer and decoder for a GGUF's SentencePiece vocabulary
    (its special tokens are added by the caller, as for every GGUF vocabulary)."""
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    arch = metadata.get("general.architecture")
    is_gemma = arch in _GEMMA_ARCHITECTURES
    if is_gemma:  # a piece of spaces is stored as real spaces
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    missing_bytes = [piece for piece in BYTE_PIECES if piece not in vocab]
    if missing_bytes and unk_id is None:
        raise StartupError(
            f"GGUF SentencePiece vocabulary lacks the byte piece {missing_bytes[0]} and names no unknown token "
            "(tokenizer.ggml.unknown_token_id): characters outside it could not be encoded"
        )
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    elif is_gemma:
        merges = merges_by_rank(tokens, [-float(index) for index in range(len(tokens))])
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None:
            raise StartupError("GGUF SentencePiece vocabulary lacks tokenizer.ggml.scores (its merge order)")
        merges = merges_by_rank(tokens, scores)
    backend = BackendTokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None if unk_id is None else tokens[int(unk_id)],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", not is_gemma))
    if is_gemma or arch == "phi3":
        prefix = [normalizers.Prepend(SPACE)] if arch == "phi3" and add_prefix else []
        backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", SPACE)])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first" if add_prefix else "never", split=False)
    undo = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix and not is_gemma:
        undo.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(undo)
    return backend


def merges_by_rank(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a piece whose halves are both pieces, best joined piece first
    (ties: the longer left half, the longer right half, the joined piece's vocabulary order, the
    halves' vocabulary order)."""
    index = {token: i for i, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, int, int, int, str, str]] = []
    for place, (token, score) in enumerate(zip(tokens, scores, strict=True)):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in index and right in index:
                ranked.append((-score, -len(left), -len(right), place, index[left], index[right], left, right))
    ranked.sort(key=lambda entry: entry[:6])
    return [(left, right) for *_, left, right in ranked]
