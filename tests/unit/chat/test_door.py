"""The door: after a router refuses a free reply as overloaded, that model's free messages are
refused at once until the router's retry time (at most max_closed_s), with the time left to it;
paid messages and other refusals never close it."""

from __future__ import annotations

import pytest

from services.chat.door import Door
from services.chat.errors import Unavailable
from tandem.config import Tier


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_a_free_overload_refusal_closes_the_door_of_its_model_for_free_messages_until_the_retry_time():
    clock = Clock()
    door = Door(max_closed_s=2.0, clock=clock)
    door.refused("m", Tier.FREE, "overloaded", 1.5, "every decode worker is too busy")
    clock.now_s += 0.5
    with pytest.raises(Unavailable) as refused:
        door.check("m", Tier.FREE)
    assert (refused.value.code, refused.value.retry_after_s) == ("overloaded", pytest.approx(1.0))
    assert "too busy" in refused.value.message
    door.check("m", Tier.PLUS)  # paid goes on to the router
    door.check("other", Tier.FREE)  # another model's door is open
    clock.now_s += 1.0
    door.check("m", Tier.FREE)  # the retry time has come: open again


def test_the_door_closes_for_at_most_max_closed_s_however_far_the_routers_retry_time():
    clock = Clock()
    door = Door(max_closed_s=2.0, clock=clock)
    door.refused("m", Tier.FREE, "overloaded", 30.0, "full")
    clock.now_s += 1.9
    with pytest.raises(Unavailable) as refused:
        door.check("m", Tier.FREE)
    assert refused.value.retry_after_s == pytest.approx(28.1)  # the router's word, not the door's
    clock.now_s += 0.2
    door.check("m", Tier.FREE)


def test_paid_refusals_and_other_codes_leave_the_door_open():
    door = Door(clock=Clock())
    door.refused("m", Tier.PLUS, "overloaded", 5.0, "full")
    door.refused("m", Tier.FREE, "prompt_too_long", 5.0, "long")
    door.refused("m", Tier.FREE, "overloaded", 0.0, "no time given")
    door.check("m", Tier.FREE)


def test_a_free_message_is_refused_on_arrival_only_while_every_model_it_could_go_to_is_closed():
    clock = Clock()
    door = Door(max_closed_s=2.0, clock=clock)
    asked: list[int] = []

    def served() -> list[str]:
        asked.append(1)
        return ["large", "small"]

    door.check_all(Tier.FREE, served)
    assert not asked, "nothing closed: the served models are not even listed"
    door.refused("large", Tier.FREE, "overloaded", 1.5, "the large pool is full")
    door.check_all(Tier.FREE, served)  # the small model may still take it
    door.refused("small", Tier.FREE, "overloaded", 0.5, "the small pool is full")
    with pytest.raises(Unavailable) as refused:
        door.check_all(Tier.FREE, served)
    assert refused.value.code == "overloaded" and refused.value.retry_after_s == pytest.approx(0.5)  # the sooner of the two
    assert "small pool" in refused.value.message
    door.check_all(Tier.PLUS, served)  # paid goes on
    door.check_all(Tier.FREE, lambda: [])  # no model known yet: routing decides
    clock.now_s += 0.6
    door.check_all(Tier.FREE, served)  # the small model's door has opened
