"""A reply's latencies as its client sees them: TTFT at the first content written, inter-token
latency between writes of content, e2e at the final event, exactly one outcome per reply, and
a streamed reply's longest pause once it ends."""

from __future__ import annotations

import uuid

import pytest
from prometheus_client import REGISTRY

from services.chat.latency import ReplyClock
from tandem.bus.events import cancelled_event
from tandem.v1.common_pb2 import FINISH_REASON_STOP, Usage
from tandem.v1.tokens_pb2 import TokenEvent


class Clock:
    def __init__(self) -> None:
        self.now_s = 50.0

    def __call__(self) -> float:
        return self.now_s


def value(name: str, **labels: str) -> float:
    found = REGISTRY.get_sample_value(name, labels)
    return 0.0 if found is None else found


def test_first_content_next_contents_and_the_final_event_give_ttft_itl_e2e_and_usage():
    model, clock = f"m-{uuid.uuid4().hex[:8]}", Clock()
    labels = {"tier": "plus", "model": model, "version": ""}
    reply = ReplyClock("plus", model, arrived_s=49.0, clock=clock)
    for step_s in (0.5, 0.1, 0.3):
        clock.now_s += step_s
        reply.content()
    clock.now_s += 0.2
    usage = Usage(input_tokens=30, cached_tokens=16, output_tokens=3)
    reply.final(TokenEvent(reply_id="r", seq=4, finish=FINISH_REASON_STOP, usage=usage))
    reply.close()  # the response ends after its final event: nothing more counts

    assert value("tandem_chat_time_to_first_token_seconds_sum", **labels) == pytest.approx(1.5)
    assert value("tandem_chat_inter_token_latency_seconds_count", **labels) == 2
    assert value("tandem_chat_inter_token_latency_seconds_sum", **labels) == pytest.approx(0.4)
    assert value("tandem_chat_e2e_latency_seconds_sum", **labels) == pytest.approx(2.1)
    assert value("tandem_chat_replies_total", outcome="done", **labels) == 1
    assert value("tandem_chat_replies_total", outcome="client_gone", **labels) == 0
    assert value("tandem_chat_prompt_tokens_total", **labels) == 30
    assert value("tandem_chat_cached_tokens_total", **labels) == 16
    assert value("tandem_chat_output_tokens_total", **labels) == 3


def test_a_stream_closed_before_its_final_event_counts_once_as_client_gone():
    model = f"m-{uuid.uuid4().hex[:8]}"
    reply = ReplyClock("free", model, arrived_s=0.0, clock=Clock())
    reply.content()
    reply.close()
    reply.close()
    reply.final(cancelled_event("r", 3))
    assert value("tandem_chat_replies_total", outcome="client_gone", tier="free", model=model, version="") == 1
    assert value("tandem_chat_replies_total", outcome="cancelled", tier="free", model=model) == 0
    assert value("tandem_chat_e2e_latency_seconds_count", tier="free", model=model) == 0


def test_a_streamed_reply_records_its_longest_pause_once_the_wait_for_its_final_event_included():
    model, clock = f"m-{uuid.uuid4().hex[:8]}", Clock()
    labels = {"tier": "pro", "model": model, "version": ""}
    reply = ReplyClock("pro", model, arrived_s=49.0, clock=clock)
    for step_s in (5.0, 0.1, 2.5, 0.2):  # the first gap is time to first token, not a pause
        clock.now_s += step_s
        reply.content()
    clock.now_s += 0.3
    reply.final(TokenEvent(reply_id="r", seq=5, finish=FINISH_REASON_STOP))
    reply.close()
    assert value("tandem_chat_stream_longest_pause_seconds_count", **labels) == 1
    assert value("tandem_chat_stream_longest_pause_seconds_sum", **labels) == pytest.approx(2.5)
    assert value("tandem_chat_stream_longest_pause_seconds_bucket", le="2.0", **labels) == 0, "over 2 s: a paused stream"

    quiet = ReplyClock("pro", model, arrived_s=clock.now_s, clock=clock)
    clock.now_s += 0.4
    quiet.content()
    clock.now_s += 3.0  # the client waits for the final event
    quiet.final(TokenEvent(reply_id="q", seq=2, finish=FINISH_REASON_STOP))
    assert value("tandem_chat_stream_longest_pause_seconds_sum", **labels) == pytest.approx(5.5)


def test_a_stream_closed_mid_pause_counts_the_pause_and_a_whole_reply_none():
    model, clock = f"m-{uuid.uuid4().hex[:8]}", Clock()
    labels = {"tier": "free", "model": model, "version": ""}
    gone = ReplyClock("free", model, arrived_s=49.0, clock=clock)
    clock.now_s += 1.0
    gone.content()
    clock.now_s += 0.5
    gone.content()
    clock.now_s += 4.0  # the client gives up waiting
    gone.close()
    assert value("tandem_chat_stream_longest_pause_seconds_sum", **labels) == pytest.approx(4.0)

    whole = ReplyClock("free", model, arrived_s=clock.now_s, clock=clock)
    clock.now_s += 6.0
    whole.final(TokenEvent(reply_id="w", seq=3, finish=FINISH_REASON_STOP))
    assert value("tandem_chat_stream_longest_pause_seconds_count", **labels) == 1, "a whole reply streams nothing to pause"
