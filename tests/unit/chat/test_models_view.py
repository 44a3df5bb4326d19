"""The chat service's view of served models, from decode heartbeats."""

import asyncio
from types import SimpleNamespace

from services.chat.models_view import ModelsView
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat


def heartbeat(worker: str, model: str = "m1", window: int = 8192, is_ready: bool = True, started_unix_ms: int = 0) -> SimpleNamespace:
    service = ServiceHeartbeat(instance_id=worker, started_unix_ms=started_unix_ms)
    hb = WorkerHeartbeat(service=service, model=model, max_model_len=window, is_engine_ready=is_ready)
    return SimpleNamespace(data=hb.SerializeToString(), subject=f"tandem.v1.heartbeat.decode.{worker}")


async def test_auto_and_names_resolve_to_served_models_with_the_smallest_window():
    view = ModelsView()
    await view.on_heartbeat(heartbeat("d1", window=8192))
    await view.on_heartbeat(heartbeat("d2", window=4096))
    await view.on_heartbeat(heartbeat("d3", model="loading", is_ready=False))
    assert view.resolve("auto").window_tokens == 4096
    assert view.resolve("m1").name == "m1"
    assert view.resolve("loading") is None and view.resolve("gpt-9") is None


async def test_a_request_right_after_start_waits_for_the_first_heartbeat():
    view = ModelsView()
    waiting = asyncio.create_task(view.resolve_soon("auto", wait_s=5))
    await asyncio.sleep(0)  # the request is waiting now
    assert not waiting.done()
    await view.on_heartbeat(heartbeat("d1"))
    assert (await asyncio.wait_for(waiting, 1)).name == "m1"


async def test_with_no_worker_at_all_the_wait_is_bounded():
    assert await ModelsView().resolve_soon("auto", wait_s=0.05) is None


async def test_a_model_was_created_when_its_earliest_worker_started():
    view = ModelsView()
    await view.on_heartbeat(heartbeat("d1", window=8192, started_unix_ms=1_700_000_500_999))
    await view.on_heartbeat(heartbeat("d2", window=4096, started_unix_ms=1_700_000_900_000))
    assert view.resolve("m1").created_unix_s == 1_700_000_500


async def test_auto_is_the_model_most_workers_serve_and_every_served_model_is_listed():
    view = ModelsView()
    for worker, model in (("d1", "large"), ("d2", "large"), ("d3", "small"), ("d4", "a-small")):
        await view.on_heartbeat(heartbeat(worker, model=model))
    assert sorted(view.models()) == ["a-small", "large", "small"]
    assert view.models()["large"].num_workers == 2
    assert view.resolve("auto").name == "large"  # not the first by name
    assert view.most_served(excluding="large").name == "a-small"  # a tie goes by name, as the routers break it
