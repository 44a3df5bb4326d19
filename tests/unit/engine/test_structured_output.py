"""Structured output in the engine with the tiny random-weight model: its unconstrained tokens are
noise, so only the grammar's masks can make a reply valid JSON against the schema, and they must
on every sample, greedy and seeded; a continuation re-advances the grammar over what it was given."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest
from test_engine import byte_level_tokenizer, seeded_prompts, tiny  # noqa: F401  (tiny: the module's fixture)

from services.chat.openai_tools import HERMES, JSON, forced_call_spec, parse_tool_calls
from tandem.engine.engine import Engine, EngineConfig, InvalidGrammar, Request
from tandem.engine.sequence import FinishReason, SamplingOptions
from tandem.models.loader import LoadedModel
from tandem.structured_output import choice_spec, json_object_spec, json_schema_spec, regex_spec

EOS = 511
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "green"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "n", "color", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def with_eos(tiny: LoadedModel) -> LoadedModel:  # noqa: F811
    return replace(tiny, tokenizer=byte_level_tokenizer(tiny.config.vocab_size, (EOS,)))


def reply(engine: Engine, request: Request) -> tuple[list[int], str, FinishReason | None]:
    stream = engine.generate([request])[request.request_id]
    tokens = [t for output in stream for t in output.new_token_ids]
    return tokens, "".join(o.text for o in stream), stream[-1].finish_reason


def text_before_eos(engine: Engine, tokens: list[int]) -> str:
    """The reply's text without its final eos (the byte-level test tokenizer spells it out)."""
    return engine.loaded.tokenizer.decode(tokens[:-1] if tokens and tokens[-1] == EOS else tokens)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 0), (1.0, 1), (1.5, 2)])
def test_every_json_schema_reply_is_valid_json_against_the_schema(with_eos, temperature, seed):
    engine = Engine(with_eos, EngineConfig(num_kv_blocks=128))
    for i, prompt in enumerate(seeded_prompts(12)[2:5]):
        sampling = SamplingOptions(temperature=temperature, seed=seed, max_tokens=200, grammar=json_schema_spec(SCHEMA))
        tokens, _, finish = reply(engine, Request(f"r{i}", tuple(prompt), sampling))
        assert finish is FinishReason.STOP, "a complete grammar ends the reply (at its last token or its eos)"
        jsonschema.validate(json.loads(text_before_eos(engine, tokens)), SCHEMA)


def test_a_free_row_in_the_same_batch_is_not_masked(with_eos):
    prompt = seeded_prompts(12)[5]
    engine = Engine(with_eos, EngineConfig(num_kv_blocks=128))
    free = SamplingOptions(max_tokens=12, ignore_eos=True)
    alone, _, _ = reply(engine, Request("alone", tuple(prompt), free))
    engine.add(Request("free", tuple(prompt), free))
    engine.add(Request("json", tuple(prompt), replace(free, grammar=json_object_spec(), max_tokens=100)))
    streams = {"free": [], "json": []}
    while engine.has_work():
        for output in engine.step():
            streams[output.request_id].extend(output.new_token_ids)
    assert streams["free"] == alone, "the grammar of another row changes nothing in this one"
    assert streams["json"] != alone and isinstance(json.loads(text_before_eos(engine, streams["json"])), dict)


def test_regex_and_choice_specs_constrain_the_reply(with_eos):
    engine = Engine(with_eos, EngineConfig(num_kv_blocks=128))
    prompt = tuple(seeded_prompts(12)[6])
    for seed in range(4):
        options = SamplingOptions(temperature=1.0, seed=seed, max_tokens=40)
        tokens, _, _ = reply(engine, Request("re", prompt, replace(options, grammar=regex_spec(r"[0-9]{2,4}-(yes|no)"))))
        assert __import__("re").fullmatch(r"[0-9]{2,4}-(yes|no)", text_before_eos(engine, tokens))
        tokens, _, _ = reply(engine, Request("ch", prompt, replace(options, grammar=choice_spec(["Paris", "Rome", "Berlin"]))))
        assert text_before_eos(engine, tokens) in ("Paris", "Rome", "Berlin")


@pytest.mark.parametrize("seed", [None, 7])
def test_a_continuation_re_advances_the_grammar_over_the_tokens_it_was_given(with_eos, seed):
    """Another worker continuing the reply rebuilds its sequence from prompt and output so far: its
    grammar must stand where the first worker's stood, so the rest is the uninterrupted reply's."""
    prompt = tuple(seeded_prompts(12)[7])
    sampling = SamplingOptions(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=200, grammar=json_schema_spec(SCHEMA))
    engine = Engine(with_eos, EngineConfig(num_kv_blocks=128))
    whole, _, _ = reply(engine, Request("whole", prompt, sampling))
    assert len(whole) > 8
    for cut in (1, 5, len(whole) // 2):
        rest, _, finish = reply(engine, Request(f"cut{cut}", prompt, sampling, generated_token_ids=tuple(whole[:cut])))
        assert whole[:cut] + rest == whole and finish is FinishReason.STOP
    jsonschema.validate(json.loads(text_before_eos(engine, whole)), SCHEMA)


def test_a_spec_that_does_not_compile_is_refused_at_the_door(with_eos):
    engine = Engine(with_eos, EngineConfig(num_kv_blocks=32))
    bad = SamplingOptions(grammar=json_schema_spec({"type": "string", "pattern": "(unclosed"}))
    with pytest.raises(InvalidGrammar):
        engine.check(Request("bad", (5, 6, 7), bad))
    with pytest.raises(InvalidGrammar):
        engine.add(Request("bad", (5, 6, 7), SamplingOptions(grammar='{"yaml": 1}')))
    assert not engine.has_work()


def test_a_reply_prefilled_on_one_engine_and_decoded_on_another_keeps_its_grammar(with_eos):
    """The decode side rebuilds the sequence with the first token the prefill side sampled under
    the grammar: its matcher must have taken that token too."""
    prompt = tuple(seeded_prompts(12)[8])
    sampling = SamplingOptions(max_tokens=200, grammar=json_schema_spec(SCHEMA))
    whole, _, _ = reply(Engine(with_eos, EngineConfig(num_kv_blocks=128)), Request("whole", prompt, sampling))
    prefill, decode = Engine(with_eos, EngineConfig(num_kv_blocks=128)), Engine(with_eos, EngineConfig(num_kv_blocks=128))
    prefill.add(Request("r", prompt, sampling), prefill_only=True)
    outputs = []
    while not outputs:
        outputs = prefill.step()
    (first,) = outputs
    assert first.handoff is not None
    reservation = decode.reserve_import(Request("r", prompt, sampling), len(first.handoff.block_ids))
    for source, target in zip(first.handoff.block_ids, reservation.block_ids, strict=True):
        decode.block_view(target).copy_(prefill.block_view(source))
    prefill.release("r")
    decode.import_sequence(Request("r", prompt, sampling), reservation, first.new_token_ids[0])
    rest = []
    while decode.has_work():
        rest.extend(t for output in decode.step() for t in output.new_token_ids)
    assert [first.new_token_ids[0], *rest] == whole
    jsonschema.validate(json.loads(text_before_eos(decode, whole)), SCHEMA)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 6}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.mark.parametrize("style", [HERMES, JSON])
@pytest.mark.parametrize("name", ["get_weather", None])
def test_a_forced_tool_call_parses_and_its_arguments_match_the_function_s_schema(with_eos, style, name):
    """The grammar of a forced call (services.chat.openai_tools) holds the noise model to one call,
    written as the template's style has it, that the chat's parser reads back whole."""
    engine = Engine(with_eos, EngineConfig(num_kv_blocks=128))
    prompt = tuple(seeded_prompts(12)[7])
    for seed in range(3):
        sampling = SamplingOptions(temperature=1.0, seed=seed, max_tokens=200, grammar=forced_call_spec(TOOLS, name, style))
        tokens, _, finish = reply(engine, Request(f"tool{seed}", prompt, sampling))
        assert finish is FinishReason.STOP
        content, calls = parse_tool_calls(text_before_eos(engine, tokens), style)
        assert content is None and len(calls) == 1, text_before_eos(engine, tokens)
        function = calls[0]["function"]
        assert name is None or function["name"] == name
        schema = next(tool["function"]["parameters"] for tool in TOOLS if tool["function"]["name"] == function["name"])
        jsonschema.validate(json.loads(function["arguments"]), schema)
