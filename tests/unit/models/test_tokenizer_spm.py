"""A SentencePiece vocabulary in a GGUF (`tokenizer.ggml.model` "llama") encodes to the same ids as
transformers' own GGUF tokenizer conversion, the independent reference, and decodes back."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import transformers

from tandem.errors import StartupError
from tandem.models.detokenizer import IncrementalDetokenizer
from tandem.models.gguf_weights import read_gguf
from tandem.models.tokenizer import Tokenizer
from tandem.models.tokenizer_spm import BYTE_PIECES, merges_by_rank

SPECIALS = ["<unk>", "<s>", "</s>"]
# Joined pieces, best first by score, and single characters after them. Two scores break the
# vocabulary order (Gemma ranks by place, the others by score), and "  " is how a Gemma GGUF spells the piece "▁▁".
PIECES = [("▁hello", -1.0), ("▁world", -2.0), ("▁wor", -3.0), ("▁hel", -4.0), ("▁he", -5.0), ("▁w", -6.0)]
PIECES += [("▁h", -7.0), ("ll", -30.0), ("llo", -8.0), ("or", -9.0), ("ld", -10.0), ("  ", -11.0)]
CHARS = ["▁", "h", "e", "l", "o", "w", "r", "d", "i", "\n", "é", "ö"]
TEXTS = [
    "hello world",
    " hello world",
    "hello  world",
    "  hi",
    "héllo ✓ wörld\n",  # ✓ is outside the vocabulary: three byte pieces
    "😀 ok",
    "<s>hello</s> world",
    "\n\nhi ",
    "a lld",  # "ll" or "ld" first: Gemma and the others rank these two merges differently
]


def write_spm_gguf(path: Path, arch: str = "llama", add_space_prefix: bool | None = None, scores: bool = True) -> None:
    tokens = [*SPECIALS, *BYTE_PIECES, *(p for p, _ in PIECES), *CHARS]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * len(BYTE_PIECES) + [1] * (len(PIECES) + len(CHARS)))
    if scores:
        writer.add_token_scores(
            [0.0] * (len(SPECIALS) + len(BYTE_PIECES)) + [s for _, s in PIECES] + [-100.0 - i for i in range(len(CHARS))]
        )
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
def test_spm_gguf_encodes_as_transformers_gguf_tokenizer_does_and_decodes_back(tmp_path: Path, arch: str):
    write_spm_gguf(tmp_path / "spm.gguf", arch)
    ours = Tokenizer.from_gguf(read_gguf(tmp_path / "spm.gguf").metadata)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False), text
    assert (ours.bos_token_id, ours.eos_token_ids) == (1, (2,))
    byte_ids = ours.encode("✓")
    assert [ours.backend.id_to_token(i) for i in byte_ids][-3:] == ["<0xE2>", "<0x9C>", "<0x93>"]
    assert ours.decode(ours.encode("héllo ✓ wörld\n")) == "héllo ✓ wörld\n"
    # the same tokenizer as a Hugging Face folder (tokenizer.json written by transformers) agrees
    reference.save_pretrained(tmp_path / "hf")
    folder = Tokenizer.from_hf_folder(tmp_path / "hf")
    assert [folder.encode(text) for text in TEXTS] == [ours.encode(text) for text in TEXTS]
    assert (folder.bos_token_id, folder.eos_token_ids) == (1, (2,))


def test_spm_dummy_prefix_follows_add_space_prefix(tmp_path: Path):
    write_spm_gguf(tmp_path / "prefixed.gguf")
    write_spm_gguf(tmp_path / "bare.gguf", add_space_prefix=False)
    prefixed = Tokenizer.from_gguf(read_gguf(tmp_path / "prefixed.gguf").metadata)
    bare = Tokenizer.from_gguf(read_gguf(tmp_path / "bare.gguf").metadata)
    hello, h = prefixed.token_to_id("▁hel"), prefixed.token_to_id("h")
    assert prefixed.encode("hello")[0] == hello and bare.encode("hello")[0] == h
    for text in TEXTS:  # without the prefix nothing is stripped: every text comes back exactly
        assert bare.decode(bare.encode(text), skip_special_tokens=False) == text


def test_gemma_ranks_merges_by_vocabulary_place_not_score():
    tokens = ["a", "b", "c", "ab", "bc"]
    assert merges_by_rank(tokens, [0, 0, 0, -2.0, -1.0]) == [("b", "c"), ("a", "b")]
    assert merges_by_rank(tokens, [0, 0, 0, -3.0, -4.0]) == [("a", "b"), ("b", "c")]


def test_spm_gguf_without_scores_or_byte_pieces_is_refused_by_name(tmp_path: Path):
    write_spm_gguf(tmp_path / "noscores.gguf", scores=False)
    with pytest.raises(StartupError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf(read_gguf(tmp_path / "noscores.gguf").metadata)
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<s>", "a"],
        "tokenizer.ggml.scores": [0.0, 0.0],
    }
    with pytest.raises(StartupError, match="<0x00>"):
        Tokenizer.from_gguf(metadata)


def test_streamed_spm_text_is_the_whole_decode(tmp_path: Path):
    """Token by token, as a reply streams: spaces between pieces survive the decoder's strip of the
    dummy prefix, and a character spelt in byte pieces comes out once it is whole."""
    write_spm_gguf(tmp_path / "spm.gguf")
    tokenizer = Tokenizer.from_gguf(read_gguf(tmp_path / "spm.gguf").metadata)
    prompt, reply = tokenizer.encode("hello"), tokenizer.encode(" world ✓ héllo\n")
    stream = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [stream.add(token) for token in reply] + [stream.flush()]
    assert "".join(pieces) == tokenizer.decode(prompt + reply)[len(tokenizer.decode(prompt)) :] == " world ✓ héllo\n"
