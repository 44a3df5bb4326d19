from services.router.workers import WorkerRegistry
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def heartbeat(instance_id: str, role: str = "decode", is_ready: bool = True) -> WorkerHeartbeat:
    return WorkerHeartbeat(service=ServiceHeartbeat(role=role, instance_id=instance_id, is_ready=is_ready))


def test_a_worker_silent_past_expiry_is_out():
    clock = FakeClock()
    registry = WorkerRegistry(expiry_s=3.0, clock=clock)
    registry.observe(heartbeat("d1"))
    clock.now_s += 2.9
    assert [w.service.instance_id for w in registry.live()] == ["d1"]
    clock.now_s += 0.2
    assert registry.live() == []


def test_a_fresh_heartbeat_keeps_it_in_and_replaces_the_old_one():
    clock = FakeClock()
    registry = WorkerRegistry(expiry_s=3.0, clock=clock)
    registry.observe(heartbeat("d1"))
    clock.now_s += 2.0
    registry.observe(heartbeat("d1"))
    clock.now_s += 2.0
    assert len(registry.live()) == 1


def test_filters_by_role_and_readiness():
    registry = WorkerRegistry(clock=FakeClock())
    registry.observe(heartbeat("d1", "decode"))
    registry.observe(heartbeat("p1", "prefill"))
    registry.observe(heartbeat("d2", "decode", is_ready=False))
    assert [w.service.instance_id for w in registry.live("decode")] == ["d1"]
    assert [w.service.instance_id for w in registry.live("prefill")] == ["p1"]
