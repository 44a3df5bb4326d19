"""A reply the output check withdrew ends with a `moderated` event instead of `done`: the text the
reader saw goes, the event says why, and its id follows the last delta's (resumes still line up)."""

from services.chat.sse import WITHDRAWN, log_seq_to_resume_after, meta_event, sse_events
from tandem.bus.events import final_event
from tandem.v1.common_pb2 import FINISH_REASON_CONTENT_FILTER
from tandem.v1.tokens_pb2 import TokenEvent


def withdrawn_reply(num_tokens: int) -> list[TokenEvent]:
    events = [TokenEvent(reply_id="r", seq=i, text=f"w{i} ") for i in range(1, num_tokens + 1)]
    return [*events, final_event("r", num_tokens + 1, FINISH_REASON_CONTENT_FILTER, worker_id="relay")]


def test_a_content_filter_final_is_a_moderated_event_not_done():
    out = [meta_event("r", "m"), *(sse for event in withdrawn_reply(3) for sse in sse_events(event))]
    assert [e.event for e in out] == ["meta", "delta", "delta", "delta", "moderated"]
    assert [e.id for e in out] == [1, 2, 3, 4, 5]
    assert out[-1].data == {"message": WITHDRAWN, "finish": "content_filter"}


def test_text_on_a_content_filter_final_is_never_sent():
    event = final_event("r", 4, FINISH_REASON_CONTENT_FILTER, text="the offending words")
    assert [(e.event, e.id) for e in sse_events(event)] == [("moderated", 5)]


def test_a_resume_after_the_last_delta_gets_only_the_moderated_event():
    events = withdrawn_reply(3)
    after = log_seq_to_resume_after(4)
    resumed = [sse for event in events if event.seq > after for sse in sse_events(event) if sse.id > 4]
    assert [(e.event, e.id) for e in resumed] == [("moderated", 5)]
