"""A readiness check that raises counts as failing; it never stops the process's heartbeat."""

from tandem.runtime import Runtime, RuntimeConfig


async def test_a_raising_check_is_reported_as_not_ready():
    runtime = Runtime(RuntimeConfig("relay", "relay-1", "http://127.0.0.1:1", "nats://127.0.0.1:1", None, 1.0))

    async def store_not_started() -> bool:
        raise RuntimeError("the store has not started")

    async def fine() -> bool:
        return True

    runtime.add_check("store", store_not_started)
    runtime.add_check("other", fine)
    report = await runtime.readiness()
    assert report["store"] is False and report["other"] is True
    assert not all(report.values())
