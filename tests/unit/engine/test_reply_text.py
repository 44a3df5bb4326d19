"""Streaming text with stop strings: a stop string split across tokens is caught, never shown,
and nothing that could still start one is streamed early."""

from test_engine import byte_level_tokenizer

from tandem.engine.reply_text import ReplyText

TOKENIZER = byte_level_tokenizer(512)


def stream(text: str, stop: tuple[str, ...], min_tokens: int = 0) -> tuple[list[str], ReplyText]:
    """Feeds `text` one byte-token at a time; returns the deltas (the finish flush last)."""
    reply = ReplyText(TOKENIZER, prompt_ids=(), stop=stop, min_tokens=min_tokens)
    deltas = []
    for token_id in TOKENIZER.encode(text):
        deltas.append(reply.add(token_id))
        if reply.has_hit_stop:
            break
    deltas.append(reply.finish())
    return deltas, reply


def test_without_stop_strings_text_streams_as_it_comes():
    deltas, _reply = stream("hello world", ())
    assert deltas[:-1] == list("hello world") and deltas[-1] == ""


def test_a_stop_string_split_across_tokens_ends_the_text_before_it():
    deltas, reply = stream("answer: 42\nUser: more", ("\nUser:",))
    assert reply.has_hit_stop
    assert "".join(deltas) == "answer: 42"


def test_text_that_could_start_a_stop_string_is_held_back_until_it_cannot():
    reply = ReplyText(TOKENIZER, prompt_ids=(), stop=("END",))
    released = [reply.add(t) for t in TOKENIZER.encode("xEN")]
    assert "".join(released) == "x"  # "EN" might become "END"
    assert reply.add(TOKENIZER.encode("D")[0]) == ""
    assert reply.has_hit_stop and reply.finish() == ""  # "x" was all it ever released


def test_the_held_back_tail_is_released_at_the_end():
    deltas, reply = stream("almost EN", ("END",))
    assert not reply.has_hit_stop
    assert deltas[-1] == "EN"
    assert "".join(deltas) == "almost EN"


def test_the_earliest_of_several_stop_strings_wins():
    deltas, _reply = stream("a STOP b HALT", ("HALT", "STOP"))
    assert "".join(deltas) == "a "


def test_multibyte_characters_are_never_split():
    deltas, _reply = stream("naïve café 東京", ())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "naïve café 東京"


def test_no_stop_string_ends_the_reply_before_min_tokens():
    # One token per byte: "ab|" is 3 tokens, so with min_tokens 4 the first "|" is text.
    deltas, reply = stream("ab|cd|ef", ("|",), min_tokens=4)
    assert reply.has_hit_stop and "".join(deltas) == "ab|cd"
    # A stop string completed by the min_tokens-th token ends it: "ab|" with min_tokens 3.
    deltas, reply = stream("ab|cd|ef", ("|",), min_tokens=3)
    assert reply.has_hit_stop and "".join(deltas) == "ab"
    # One begun before that token and completed after it ends it too.
    deltas, reply = stream("abEND", ("END",), min_tokens=4)
    assert reply.has_hit_stop and "".join(deltas) == "ab"
