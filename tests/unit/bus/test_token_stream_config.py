"""The token stream as the admin step makes it, and which refusals mean it is full."""

from nats.js.api import DiscardPolicy, RetentionPolicy
from nats.js.errors import APIError, ServiceUnavailableError

from tandem.bus.token_stream import TokenStreamConfig, is_stream_full, publish_failure, token_stream_config


def test_the_stream_refuses_when_full_instead_of_dropping_events_no_relay_took():
    stream = token_stream_config(TokenStreamConfig(num_replicas=3, max_bytes=1 << 30, max_age_s=86400))
    assert stream.discard == DiscardPolicy.NEW and stream.retention == RetentionPolicy.WORK_QUEUE
    assert (stream.num_replicas, stream.max_bytes, stream.max_age) == (3, 1 << 30, 86400.0)


def test_a_full_stream_is_told_apart_by_its_error_code_and_counted_as_refused():
    full = ServiceUnavailableError(code=503, err_code=10077, description="maximum bytes exceeded")
    other = APIError(code=500, err_code=10049, description="another refusal")
    assert is_stream_full(full) and publish_failure(full) == "refused"
    assert not is_stream_full(other) and publish_failure(other) == "refused"
