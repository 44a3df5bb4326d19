import pytest

from tandem.bus import subjects


def test_subjects_live_under_tandem_v1():
    assert subjects.GENERATE == "tandem.v1.generate"
    assert subjects.tokens("r-1") == "tandem.v1.tokens.r-1"
    assert subjects.cancel("r_1") == "tandem.v1.cancel.r_1"
    assert subjects.heartbeat("decode", "decode-0") == "tandem.v1.heartbeat.decode.decode-0"
    assert subjects.kv_events("w1") == "tandem.v1.kv.events.w1"
    assert subjects.handoff("r-1") == "tandem.v1.handoff.r-1"
    assert subjects.reply_id_of(subjects.tokens("abc")) == "abc"


@pytest.mark.parametrize("bad", ["a.b", "*", ">", "", "a b", "r1.>"])
def test_an_id_can_never_widen_a_subject(bad):
    with pytest.raises(ValueError, match="may hold only"):
        subjects.tokens(bad)


def test_a_workers_batch_subject_is_under_the_token_subjects_and_no_reply_id_names_it():
    assert subjects.token_batch("decode-1") == "tandem.v1.tokens.batch.decode-1"
    assert subjects.is_token_batch(subjects.token_batch("decode-1"))
    assert not subjects.is_token_batch(subjects.tokens("batch"))  # a reply called "batch" is a reply
    assert not subjects.is_token_batch(subjects.tokens("r1"))
    assert not subjects.is_token_batch(subjects.final("r1"))
