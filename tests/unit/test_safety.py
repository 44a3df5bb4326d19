import pytest

from tandem.safety import Blocklist, ProfanityCheck, TextCheck, judge, load_check


def test_the_trained_check_scores_abuse_high_and_a_plain_question_low():
    check = ProfanityCheck()
    abusive, plain = check.score(["you are a fucking idiot", "how do I bake bread at home?"])
    assert abusive >= 0.9 and plain < 0.2
    assert judge(check, "you are a fucking idiot", 0.5).flagged
    assert not judge(check, "how do I bake bread at home?", 0.5).flagged


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
