"""The meaning of final events, shared by every service: each finish reason's name, the status a
reply ends in, and back from a stored status to the finish a client is told."""

import pytest

from tandem.bus.events import (
    FINISH_NAMES,
    ReplyStatus,
    final_event,
    finish_name,
    finish_of_status,
    is_final,
    status_of_finish,
)
from tandem.v1.common_pb2 import (
    FINISH_REASON_CANCELLED,
    FINISH_REASON_CONTENT_FILTER,
    FINISH_REASON_ERROR,
    FINISH_REASON_LENGTH,
    FINISH_REASON_STOP,
    FINISH_REASON_UNSPECIFIED,
)


@pytest.mark.parametrize(
    ("finish", "name", "status"),
    [
        (FINISH_REASON_STOP, "stop", ReplyStatus.COMPLETE),
        (FINISH_REASON_LENGTH, "length", ReplyStatus.COMPLETE),
        (FINISH_REASON_CANCELLED, "cancelled", ReplyStatus.STOPPED),
        (FINISH_REASON_ERROR, "error", ReplyStatus.FAILED),
        (FINISH_REASON_CONTENT_FILTER, "content_filter", ReplyStatus.MODERATED),
    ],
)
def test_each_finish_has_a_name_and_a_status(finish, name, status):
    assert finish_name(finish) == name
    assert status_of_finish(finish) == status


def test_every_named_finish_ends_a_reply_and_unspecified_does_not():
    assert FINISH_REASON_UNSPECIFIED not in FINISH_NAMES
    with pytest.raises(ValueError):
        finish_name(FINISH_REASON_UNSPECIFIED)
    with pytest.raises(ValueError):
        status_of_finish(FINISH_REASON_UNSPECIFIED)


def test_a_stored_status_reports_the_finish_it_came_from():
    assert finish_of_status(ReplyStatus.COMPLETE) == FINISH_REASON_STOP
    assert finish_of_status(ReplyStatus.STOPPED) == FINISH_REASON_CANCELLED
    assert finish_of_status(ReplyStatus.MODERATED) == FINISH_REASON_CONTENT_FILTER
    assert finish_of_status(ReplyStatus.FAILED) is None
    assert finish_of_status(ReplyStatus.RUNNING) is None


def test_a_content_filter_event_is_final_and_an_error_needs_its_own_constructor():
    event = final_event("r1", 7, FINISH_REASON_CONTENT_FILTER)
    assert is_final(event) and status_of_finish(event.finish) == ReplyStatus.MODERATED
    with pytest.raises(ValueError):
        final_event("r1", 7, FINISH_REASON_ERROR)
