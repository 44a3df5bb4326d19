"""OpenAI's `n`: each choice's reply id and seed, and the usage of the choices together."""

from services.chat.openai_replies import choice_reply_id, choice_sampling, choices_final
from services.chat.openai_shape import CHAT, TEXT
from tandem.v1.common_pb2 import SamplingParams, Usage
from tandem.v1.tokens_pb2 import TokenEvent


def test_the_first_choice_is_the_request_itself_and_the_others_are_numbered():
    assert [choice_reply_id("chatcmpl-ab", i) for i in range(3)] == ["chatcmpl-ab", "chatcmpl-ab-1", "chatcmpl-ab-2"]


def test_a_seeded_choice_samples_with_seed_plus_its_index_modulo_2_to_the_64():
    sampling = SamplingParams(temperature=0.7, max_tokens=9, seed=2**64 - 2)
    seeds = [choice_sampling(sampling, i).seed for i in range(3)]
    assert seeds == [2**64 - 2, 2**64 - 1, 0]
    assert choice_sampling(sampling, 2).max_tokens == 9 and sampling.seed == 2**64 - 2  # a copy, the request's left alone


def test_an_unseeded_choice_stays_unseeded():
    assert not choice_sampling(SamplingParams(temperature=1.0), 3).HasField("seed")


def test_choices_together_count_the_prompt_once_every_output_and_the_most_cached():
    lasts = [TokenEvent(usage=Usage(input_tokens=40, output_tokens=n, cached_tokens=c)) for n, c in ((5, 0), (7, 32), (2, 32))]
    usage = choices_final(lasts).usage
    assert (usage.input_tokens, usage.output_tokens, usage.cached_tokens) == (40, 14, 32)


def test_a_finished_choice_names_its_stop_reason_as_vllm_does_null_when_there_is_none():
    assert CHAT.choice(0, "la la", "length", stop_reason="repetition")["stop_reason"] == "repetition"
    assert TEXT.choice(1, "la la", "stop")["stop_reason"] is None
    last = CHAT.chunk_choice(0, "", "length", stop_reason="repetition")
    assert (last["finish_reason"], last["stop_reason"]) == ("length", "repetition")
    assert "stop_reason" not in TEXT.chunk_choice(0, "la", None), "only the last chunk of a choice ends it"
