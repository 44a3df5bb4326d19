import re
from pathlib import Path

import pytest

from tandem.safety import Blocklist, ProfanityCheck, TextCheck, judge, load_check


def test_the_trained_check_scores_abuse_high_and_a_plain_question_low():
    check = ProfanityCheck()
    abusive, plain = check.score(["you are a fucking idiot", "how do I bake bread at home?"])
    assert abusive >= 0.9 and plain < 0.2
    assert judge(check, "you are a fucking idiot", 0.5).flagged
    assert not judge(check, "how do I bake bread at home?", 0.5).flagged


def test_the_trained_check_scores_as_scikit_learn_does():
    """The check applies the fitted classifier's arrays itself (tandem.safety.CalibratedLinear);
    scikit-learn's predict_proba is the reference, over a text the tests ship cut into sentences
    and into six-word pieces, and some abuse, one at a time and all at once."""
    from profanity_check import predict_prob

    check = ProfanityCheck()
    assert check._linear is not None  # the fast path is the one under test
    text = (Path(__file__).parents[2] / "bench" / "data" / "perplexity.txt").read_text()
    words = text.split()
    texts = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]
    texts += [" ".join(words[i : i + 6]) for i in range(0, min(len(words), 1200), 6)]
    texts += ["you are a fucking idiot", "shit", "what the hell", "", "   ", "ÄÖÜ ß 東京", "idiot " * 200]
    assert len(texts) > 100
    expected = [float(p) for p in predict_prob(texts)]
    assert check.score(texts) == pytest.approx(expected, abs=1e-12, rel=0)
    assert [check.score([t])[0] for t in texts[:40]] == pytest.approx(expected[:40], abs=1e-12, rel=0)
    assert max(expected) > 0.9 and min(expected) < 0.1  # both kinds of text are in the set


def test_a_blocklist_matches_whole_words_whatever_their_case():
    check = Blocklist(["paris", "new york"])
    assert check.score(["The capital is Paris.", "comparison", "I love New  York", "NEW YORK!"]) == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("spec", ["", "none", " none "])
def test_none_is_no_check(spec):
    assert load_check(spec) is None


def test_a_spec_names_each_check():
    assert isinstance(load_check("profanity-check"), ProfanityCheck)
    blocklist = load_check("blocklist:Paris|Rome")
    assert isinstance(blocklist, TextCheck) and blocklist.score(["rome"]) == [1.0]
    own = load_check("tandem.safety:ProfanityCheck")  # a deployment's own factory, by import path
    assert isinstance(own, ProfanityCheck)


@pytest.mark.parametrize("spec", ["nonsense", "no.such.module:check", "tandem.safety:nothing", "blocklist:", "tandem.safety:Verdict"])
def test_a_spec_that_loads_nothing_is_refused(spec):
    with pytest.raises((ValueError, TypeError)):
        load_check(spec)
