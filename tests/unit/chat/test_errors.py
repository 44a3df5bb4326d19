"""Library errors become the service's own: an outage of the store or of Redis is a 503 with a
time to retry, never a 500."""

import json
import logging

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.chat.errors import Unavailable, answer, as_chat_error
from tandem.store import StoreUnavailable


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (RedisConnectionError("Connection closed by server."), "token_log_unavailable"),
        (RedisTimeoutError("Timeout reading from socket"), "token_log_unavailable"),
        (StoreUnavailable("no host answered"), "store_unavailable"),
    ],
)
async def test_an_outage_is_a_503_with_retry_after(exc, code):
    error = as_chat_error(exc)
    assert isinstance(error, Unavailable) and error.code == code
    response = await answer(None, exc)
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert json.loads(response.body)["error"]["code"] == code


def test_an_error_no_chat_error_stands_for_is_not_swallowed():
    with pytest.raises(TypeError):
        as_chat_error(KeyError("x"))


async def test_an_outage_answer_names_no_host_and_repeats_no_driver_text(caplog):
    driver_text = "('Unable to connect to any servers', {'10.3.4.5:9042': ConnectionRefusedError(111)})"
    with caplog.at_level(logging.WARNING, logger="services.chat.errors"):
        response = await answer(None, StoreUnavailable(driver_text))
    error = json.loads(response.body)["error"]
    assert set(error) == {"message", "type", "code", "param", "request_id"}
    assert "10.3.4.5" not in error["message"] and "ConnectionRefused" not in error["message"]
    assert any("10.3.4.5" in r.getMessage() for r in caplog.records), "the details are the log's"
