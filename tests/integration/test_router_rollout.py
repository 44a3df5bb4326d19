"""The model rollout in the real router process against a real nats-server, with stand-in decode
workers serving two versions: a bare name is split between them by the rollout file, a full id is
pinned, failing ReplyOutcomes of the candidate roll it back (published in a RolloutStatus at once),
and a router started later adopts that rollback from the statuses it hears."""

from __future__ import annotations

import asyncio
import time

import httpx
from nats.aio.msg import Msg
from test_router import MODEL, ask_accepted, generate_request, stand_in, start_router, wait_until_router_lists

from tandem.bus import decode, encode, subjects
from tandem.v1.worker_pb2 import ReplyOutcome, RolloutStatus

__all__ = ["stand_in"]  # the stand-in workers' fixture, shared with the router's other tests

STABLE = f"{MODEL}@1"
CANDIDATE = f"{MODEL}@2"
MIN_REPLIES = 5
WAIT_S = 10.0
ROLLOUT = f"""
[models."{MODEL}"]
stable = "1"
candidate = "2"
candidate_percent = 50
"""


async def next_status(statuses: asyncio.Queue[RolloutStatus], router_id: str, accept) -> RolloutStatus:
    """The first status from `router_id` that `accept` takes, within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while True:
        status = await asyncio.wait_for(statuses.get(), max(0.01, deadline - time.monotonic()))
        if status.router_id == router_id and accept(status):
            return status


async def test_a_bare_name_is_split_a_full_id_pinned_and_a_failing_candidate_rolled_back(nats_server, redis_server, stand_in, nc, tmp_path):
    rollout_file = tmp_path / "rollout.toml"
    rollout_file.write_text(ROLLOUT)
    settings = {
        "TANDEM_ROLLOUT_FILE": str(rollout_file),
        "TANDEM_ROLLOUT_RELOAD_S": "0.2",
        "TANDEM_ROLLOUT_MIN_REPLIES": str(MIN_REPLIES),
        "TANDEM_ROLLOUT_WINDOW_S": "60",
    }
    statuses: asyncio.Queue[RolloutStatus] = asyncio.Queue()

    async def on_status(msg: Msg) -> None:
        await statuses.put(decode(msg.data, RolloutStatus))

    subscription = await nc.subscribe(subjects.ROLLOUT, cb=on_status)
    await nc.flush()
    router = await start_router(nats_server, redis_server, nc, **settings)
    later = None
    try:
        stable, candidate = await stand_in(model=STABLE), await stand_in(model=CANDIDATE)
        await wait_until_router_lists(router, stable, candidate)
        status = await next_status(statuses, router.instance_id, lambda s: len(s.models) == 1)
        model = status.models[0]
        assert (model.model, model.stable, model.candidate, model.candidate_percent, model.rolled_back) == (MODEL, "1", "2", 50.0, False)

        split = [(await ask_accepted(nc, generate_request(model=MODEL))).model for _ in range(40)]
        assert set(split) == {STABLE, CANDIDATE}
        assert 8 <= split.count(CANDIDATE) <= 32, split  # 50 % of 40; outside this about once in 10^5 runs
        for worker, served in ((stable, STABLE), (candidate, CANDIDATE)):
            for _ in range(split.count(served)):
                assert (await worker.next_assignment()).request.model == served
        pinned = [(await ask_accepted(nc, generate_request(model=STABLE))).model for _ in range(10)]
        assert pinned == [STABLE] * 10

        for index in range(MIN_REPLIES):
            outcome = ReplyOutcome(reply_id=f"failed{index}", model=CANDIDATE, ttft_s=0.1, is_error=True)
            await nc.publish(subjects.OUTCOMES, encode(outcome))
        status = await next_status(statuses, router.instance_id, lambda s: s.models[0].rolled_back)
        model = status.models[0]
        assert (model.configured_percent, model.candidate_percent, model.candidate_window.errors) == (50.0, 0.0, MIN_REPLIES)
        assert model.rollback_reason.startswith("error rate 1.00 > stable 0.00")
        after = [(await ask_accepted(nc, generate_request(model=MODEL))).model for _ in range(20)]
        assert after == [STABLE] * 20, "rolled back: every new conversation is the stable's"
        async with httpx.AsyncClient(base_url=router.url) as http:
            text = (await http.get(f"{router.ops_url}/metrics")).text
        labels = f'model="{MODEL}",reason="error_rate",version="2"'
        assert f"tandem_router_rollbacks_total{{{labels}}} 1.0" in text, [line for line in text.splitlines() if "rollback" in line]
        assert f'tandem_router_rollout_percent{{model="{MODEL}",version="2"}} 0.0' in text

        later = await start_router(nats_server, redis_server, nc, **settings)
        adopted = await next_status(statuses, later.instance_id, lambda s: s.models[0].rolled_back)
        assert adopted.models[0].rollback_reason == model.rollback_reason, "it learned the rollback from the first router"
    finally:
        await subscription.unsubscribe()
        router.child.stop(timeout_s=10)
        if later is not None:
            later.child.stop(timeout_s=10)
