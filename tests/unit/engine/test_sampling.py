import pytest
import torch

from tandem.engine.sampling import Sampler, token_generator
from tandem.engine.sequence import SamplingOptions, Sequence

VOCAB = 64


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rows(options: list[SamplingOptions], token_ids: tuple[int, ...] = (0,)) -> list[Sequence]:
    return [Sequence(f"s{i}", token_ids, option) for i, option in enumerate(options)]


def sample(logits: torch.Tensor, option: SamplingOptions, generators: list) -> torch.Tensor:
    return Sampler().sample(logits, rows([option] * logits.shape[0]), generators)


def test_greedy_takes_the_argmax_of_every_row():
    logits = random_logits(8)
    tokens = sample(logits, SamplingOptions(), [None] * 8)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_top_k_of_one_is_greedy_at_any_temperature():
    logits = random_logits(8)
    tokens = sample(logits, SamplingOptions(temperature=5.0, top_k=1), [seeded(i) for i in range(8)])
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_a_tiny_top_p_keeps_only_the_most_likely_token():
    logits = random_logits(8)
    tokens = sample(logits, SamplingOptions(temperature=5.0, top_p=1e-6), [seeded(i) for i in range(8)])
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_the_same_seed_gives_the_same_tokens_step_after_step():
    logits = torch.zeros(1, VOCAB)  # uniform: every draw is up to the generator
    option = SamplingOptions(temperature=1.0, seed=3)
    runs = []
    for _ in range(2):
        generator = seeded(3)
        runs.append([sample(logits, option, [generator]).item() for _ in range(20)])
    assert runs[0] == runs[1]


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(1, VOCAB)
    option = SamplingOptions(temperature=1.0)
    first, second = seeded(1), seeded(2)
    assert [sample(logits, option, [first]).item() for _ in range(20)] != [sample(logits, option, [second]).item() for _ in range(20)]


def test_a_row_draws_only_from_its_own_generator():
    logits = torch.zeros(2, VOCAB)
    option = SamplingOptions(temperature=1.0)
    alone = sample(logits[:1], option, [seeded(5)])
    beside_another = sample(logits, option, [seeded(9), seeded(5)])
    assert beside_another[1] == alone[0]


def test_top_k_draws_only_among_the_k_most_likely():
    logits = torch.zeros(2000, VOCAB)
    logits[:, 3], logits[:, 7] = 2.0, 1.5
    torch.manual_seed(0)
    tokens = sample(logits, SamplingOptions(temperature=1.0, top_k=2), [None] * 2000)
    assert set(tokens.tolist()) == {3, 7}


def test_top_p_keeps_the_smallest_set_reaching_the_mass_and_samples_in_proportion():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().expand(8000, 4)
    torch.manual_seed(0)
    tokens = Sampler().sample(logits, rows([SamplingOptions(temperature=1.0, top_p=0.5)] * 8000), [None] * 8000)
    counts = torch.bincount(tokens, minlength=4)
    assert counts[2:].sum() == 0  # 0.4 < 0.5 needs the second token; 0.7 >= 0.5 needs no third
    assert abs(counts[0].item() / 8000 - 4 / 7) < 0.03


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([0.5, 0.25, 0.25]).log().expand(8000, 3)
    torch.manual_seed(1)
    tokens = sample(logits, SamplingOptions(temperature=1.0), [None] * 8000)
    frequencies = torch.bincount(tokens, minlength=3) / 8000
    assert torch.allclose(frequencies, torch.tensor([0.5, 0.25, 0.25]), atol=0.03)


def test_greedy_rows_are_untouched_by_sampled_rows_beside_them():
    logits = random_logits(4)
    options = [SamplingOptions(), SamplingOptions(temperature=2.0), SamplingOptions(), SamplingOptions(temperature=2.0, top_k=5)]
    tokens = Sampler().sample(logits, rows(options), [None, seeded(1), None, seeded(2)])
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"min_tokens": -1}, r"min_tokens must be in \[0, max_tokens=256\]"),
        ({"min_tokens": 257}, r"min_tokens must be in \[0, max_tokens=256\]"),
    ],
)
def test_invalid_sampling_options_are_refused_with_the_rule_they_break(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingOptions(**fields)


def test_options_and_generators_must_match_the_rows():
    with pytest.raises(ValueError, match="one sequence and one generator per row"):
        Sampler().sample(random_logits(2), rows([SamplingOptions()]), [None])


def test_min_p_keeps_only_tokens_at_least_that_fraction_of_the_likeliest():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(8000, 4)
    torch.manual_seed(2)
    tokens = sample(logits, SamplingOptions(temperature=1.0, min_p=0.5), [None] * 8000)
    counts = torch.bincount(tokens, minlength=4)
    assert counts[2:].sum() == 0  # 0.15 < 0.5 x 0.5; 0.3 >= 0.25 stays
    assert abs(counts[0].item() / 8000 - 5 / 8) < 0.03


def test_min_p_of_one_is_greedy_and_zero_changes_nothing():
    logits = random_logits(8)
    assert torch.equal(sample(logits, SamplingOptions(temperature=5.0, min_p=1.0), [seeded(i) for i in range(8)]), logits.argmax(dim=-1))
    off = sample(logits, SamplingOptions(temperature=1.0, min_p=0.0), [seeded(i) for i in range(8)])
    plain = sample(logits, SamplingOptions(temperature=1.0), [seeded(i) for i in range(8)])
    assert torch.equal(off, plain)


def test_a_tokens_generator_depends_only_on_its_seed_and_position():
    logits = torch.zeros(1, VOCAB)  # uniform: every draw is up to the generator
    option = SamplingOptions(temperature=1.0, seed=3)

    def draws(seed: int, positions: range) -> list[int]:
        return [sample(logits, option, [token_generator(seed, p)]).item() for p in positions]

    assert draws(3, range(10, 40)) == draws(3, range(10, 40))
    assert draws(3, range(10, 40)) != draws(3, range(11, 41)), "each position draws afresh"
    assert draws(3, range(10, 40)) != draws(4, range(10, 40))
    assert draws(-1, range(5)) == draws(2**64 - 1, range(5)), "a seed is taken modulo 2**64"


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached_even_outside_the_vocabulary():
    logits = random_logits(3)
    best, second = logits.topk(2, dim=-1).indices.unbind(dim=1)
    held = SamplingOptions(stop_token_ids=(int(best[1]), 10**6), min_tokens=2)
    seqs = [
        Sequence("eos", (0,), SamplingOptions(min_tokens=2), eos_token_ids=(int(best[0]),)),
        Sequence("stop", (0,), held),
        Sequence("reached", (0,), SamplingOptions(min_tokens=2), eos_token_ids=(int(best[2]),)),
    ]
    seqs[2].append_token(1)
    seqs[2].append_token(2)
    tokens = Sampler().sample(logits, seqs, [None] * 3)
    assert tokens.tolist() == [second[0], second[1], best[2]]
