"""GET /v1/status's view of the routers' overload ladder: the highest fresh rung, "unknown" without one."""

from types import SimpleNamespace

from services.chat.status_api import LadderView, status_body
from tandem.v1.worker_pb2 import LadderStatus


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def status(router_id: str, rung: int, busyness: float = 0.5, interval_s: float = 10.0) -> LadderStatus:
    return LadderStatus(router_id=router_id, rung=rung, busyness=busyness, sent_unix_ms=1_764_556_800_000, interval_s=interval_s)


def test_with_several_routers_the_highest_fresh_rung_counts_and_a_silent_router_drops_out():
    clock = Clock()
    view = LadderView(clock)
    view.observe(status("r1", rung=2, busyness=0.93))
    clock.now_s += 20
    view.observe(status("r2", rung=1, busyness=0.9))
    assert view.current().router_id == "r1"
    clock.now_s += 11  # r1 heard 31 s ago: more than three of its 10 s intervals
    assert view.current().router_id == "r2"
    view.observe(status("r2", rung=0, busyness=0.1))  # its newest replaces its last
    assert view.current().rung == 0
    clock.now_s += 31
    assert view.current() is None


async def test_a_garbled_status_is_ignored():
    view = LadderView(Clock())
    await view.on_status(SimpleNamespace(data=b"\x0a\xff\x01garbage", subject="tandem.v1.ladder"))
    assert view.current() is None
    await view.on_status(SimpleNamespace(data=status("r1", 3).SerializeToString(), subject="tandem.v1.ladder"))
    assert view.current().rung == 3


def test_the_body_says_the_rung_its_meaning_and_when_it_was_observed_or_unknown():
    body = status_body(status("r1", rung=3, busyness=0.981), ["m1"])
    assert body["status"] == "degraded" and body["rung"] == 3 and body["busyness"] == 0.981
    assert "refused" in body["meaning"]
    assert body["observed_at"] == "2025-12-01T02:40:00Z"
    assert body["models"] == ["m1"]
    assert "r1" not in str(body)  # no router ids: nothing internal
    assert status_body(None, [])["status"] == "unknown"
    assert status_body(status("r1", rung=0), ["m1"])["status"] == "normal"
