"""Each request's logit rules, on a batch at once: what each rule does to its own row, that rows
which ask for nothing are left alone, and that a batch that asks for nothing costs nothing."""

import pytest
import torch

from tandem.engine.logits_processors import process_logits
from tandem.engine.sequence import SamplingOptions, Sequence

VOCAB = 16


def seq(prompt: list[int], output: list[int], **options) -> Sequence:
    s = Sequence("s", prompt, SamplingOptions(**options))
    for token_id in output:
        s.append_token(token_id)
    return s


def logits_row() -> torch.Tensor:
    """Alternating signs, so the repetition penalty's two cases both show: token t has (t - 7.5)."""
    return (torch.arange(VOCAB, dtype=torch.float32) - 7.5).unsqueeze(0)


def test_a_batch_that_asks_for_nothing_gets_its_logits_back_untouched():
    logits = logits_row().repeat(2, 1)
    assert process_logits(logits, [seq([1, 2], [3, 3]), seq([4], [])]) is logits


def test_frequency_and_presence_count_only_the_output_so_far():
    out = process_logits(logits_row(), [seq([9, 9], [5, 5, 7], frequency_penalty=0.5, presence_penalty=1.5)])[0]
    expected = logits_row()[0].clone()
    expected[5] -= 2 * 0.5 + 1.5
    expected[7] -= 1 * 0.5 + 1.5
    assert torch.equal(out, expected), "token 9 is only in the prompt: OpenAI's penalties leave it alone"


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output_tokens():
    out = process_logits(logits_row(), [seq([12, 2], [14, 3, 14], repetition_penalty=2.0)])[0]
    expected = logits_row()[0].clone()
    expected[12], expected[14] = 4.5 / 2, 6.5 / 2
    expected[2], expected[3] = -5.5 * 2, -4.5 * 2
    assert torch.equal(out, expected), "once per token however often it came, and a penalty always lowers"


def test_logit_bias_adds_to_its_tokens_and_a_token_outside_the_vocabulary_is_skipped():
    out = process_logits(logits_row(), [seq([1], [], logit_bias=((3, 100.0), (4, -100.0), (VOCAB + 5, 50.0)))])[0]
    expected = logits_row()[0].clone()
    expected[3] += 100
    expected[4] -= 100
    assert torch.equal(out, expected)


def test_each_row_gets_only_its_own_rules_and_the_input_is_not_changed():
    logits = logits_row().repeat(4, 1).to(torch.bfloat16)
    before = logits.clone()
    seqs = [
        seq([1], [2, 2], frequency_penalty=1.0),
        seq([1], [2, 2]),
        seq([12], [13], repetition_penalty=4.0, logit_bias=((0, 10.0),)),
        Sequence("e", [1], SamplingOptions(min_tokens=1), eos_token_ids=(15,)),
    ]
    out = process_logits(logits, seqs)
    assert torch.equal(logits, before)
    alone = [process_logits(logits[i : i + 1], [s])[0].float() for i, s in enumerate(seqs)]
    assert torch.equal(out, torch.stack(alone))
    assert torch.equal(out[1], before[1].float()) and out[3, 15] == float("-inf")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be > 0"),
        ({"logit_bias": ((1, 101.0),)}, r"logit_bias must be in \[-100, 100\]"),
    ],
)
def test_out_of_range_penalties_are_refused_with_their_rule(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingOptions(**fields)
