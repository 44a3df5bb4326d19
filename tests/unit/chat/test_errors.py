"""Library errors become the service's own: an outage of the store or of Redis is a 503 with a
time to retry, never a 500."""

import json

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
