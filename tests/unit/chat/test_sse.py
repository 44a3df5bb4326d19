"""Token events as numbered SSE events: contiguous ids, and a resume that repeats nothing."""

from services.chat.sse import encode_frames, log_seq_to_resume_after, meta_event, sse_events
from tandem.v1.common_pb2 import FINISH_REASON_CANCELLED, FINISH_REASON_ERROR, FINISH_REASON_LENGTH, FINISH_REASON_STOP, Error, Usage
from tandem.v1.tokens_pb2 import TokenEvent


def log(num: int, finish: int = FINISH_REASON_STOP, last_text: str = "") -> list[TokenEvent]:
    events = [TokenEvent(reply_id="r", seq=i, text=f"w{i}") for i in range(1, num + 1)]
    events[-1].text = last_text
    events[-1].finish = finish
    events[-1].usage.CopyFrom(Usage(input_tokens=5, cached_tokens=2, output_tokens=num))
    return events


def stream(events: list[TokenEvent], last_event_id: int = 0, request_id: str = "req-1"):
    out = [meta_event("r", "m")] if last_event_id < 1 else []
    for event in events:
        if event.seq > log_seq_to_resume_after(last_event_id):
            out += [sse for sse in sse_events(event, request_id) if sse.id > last_event_id]
    return out


def test_ids_are_contiguous_from_the_meta_event_whether_or_not_the_last_event_has_text():
    for last_text in ("", "!"):
        events = stream(log(4, last_text=last_text))
        assert [e.id for e in events] == list(range(1, len(events) + 1))
        assert [e.event for e in events][0] == "meta" and events[-1].event == "done"


def test_done_carries_the_finish_and_usage():
    done = stream(log(3, FINISH_REASON_LENGTH))[-1]
    assert done.data == {"finish": "length", "usage": {"input": 5, "cached": 2, "output": 3}}
    assert stream(log(3, FINISH_REASON_CANCELLED))[-1].data["finish"] == "cancelled"


def test_done_names_the_model_the_final_event_names():
    events = log(3)
    events[-1].model = "SmolLM2-135M-Instruct-int8"
    assert stream(events)[-1].data["model"] == "SmolLM2-135M-Instruct-int8"


def test_done_names_the_stop_reason_only_when_the_final_event_has_one():
    events = log(3, FINISH_REASON_LENGTH)
    assert "stop_reason" not in stream(events)[-1].data
    events[-1].stop_reason = "repetition"
    assert stream(events)[-1].data == {"finish": "length", "usage": {"input": 5, "cached": 2, "output": 3}, "stop_reason": "repetition"}


def test_an_error_event_ends_the_stream_with_its_code_its_message_and_the_streaming_requests_id():
    events = log(2, FINISH_REASON_ERROR)
    events[-1].error.CopyFrom(Error(code="handoff_failed", message="no decode worker took it", retry_after_s=2))
    last = stream(events, request_id="req-7")[-1]
    expected = {"code": "handoff_failed", "message": "no decode worker took it", "request_id": "req-7", "retry_after": 2.0}
    assert (last.event, last.data) == ("error", expected)


def test_only_a_failed_replys_frames_are_encoded_per_request():
    failed = log(1, FINISH_REASON_ERROR)[-1]
    assert encode_frames(failed, "req-7").is_per_request and b'"request_id": "req-7"' in encode_frames(failed, "req-7").blob
    assert not any(encode_frames(event).is_per_request for event in [*log(3), *log(2, FINISH_REASON_CANCELLED)])


def test_resuming_after_any_event_gives_exactly_the_rest():
    for last_text in ("", "!"):
        whole = stream(log(6, last_text=last_text))
        for cut in range(1, len(whole) + 1):
            assert stream(log(6, last_text=last_text), last_event_id=cut) == whole[cut:]
