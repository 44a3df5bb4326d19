"""The version that answers, through GenerateService.handle: a bare name (or auto) is split by the
rollout between stable and candidate in the configured share, a full id is pinned, the stable's
answers are mirrored to the candidate in the shadow share, and unversioned workers keep working
as before; pool moves pick the other name's version the same way."""

import random

from prometheus_client import REGISTRY
from router_fakes import decode_worker, request

from services.router.dispatch import DispatchConfig
from services.router.generate import GenerateService
from services.router.ladder import Ladder
from services.router.overload import Overload
from services.router.placement import Placement
from services.router.pools import ModelPools
from services.router.rollout import ModelRollout, RolloutPlan
from services.router.rollout_state import Rollouts
from services.router.versions import VersionPicker, most_served, version_order
from services.router.workers import WorkerRegistry
from tandem.v1.common_pb2 import LANE_BACKGROUND, LANE_FREE

SMOL = ModelRollout("smol", stable="1", candidate="2", candidate_percent=10.0)


async def never_called(*args: object) -> None:
    raise AssertionError("the handler must not reach the network")


def service(*workers, plan: RolloutPlan = RolloutPlan(), seed: int = 7, pools: ModelPools = ModelPools()) -> GenerateService:
    registry = WorkerRegistry()
    for worker in workers:
        registry.observe(worker.heartbeat)
    rollouts = Rollouts()
    rollouts.set_plan(plan)
    picker = VersionPicker(rollouts, random.Random(seed).random)
    overload = Overload(Ladder(10.0))
    return GenerateService(registry, Placement(), never_called, never_called, DispatchConfig(), overload, pools=pools, versions=picker)


def fleet(*served: str):
    return [decode_worker(f"w{i}-{model}", model=model) for i, model in enumerate(served)]


def answer(generate: GenerateService, model: str, **fields):
    reply, job = generate.handle(request(model=model, **fields).SerializeToString())
    assert reply.WhichOneof("outcome") == "reply_id", reply
    assert job.assignment.request.model == reply.model, "the workers get the served id that answers"
    return reply


def version_requests(model: str, version: str, shadow: str) -> float:
    labels = {"model": model, "version": version, "shadow": shadow}
    return REGISTRY.get_sample_value("tandem_router_version_requests_total", labels) or 0.0


def test_a_ten_percent_candidate_gets_about_a_tenth_of_new_conversations():
    generate = service(*fleet("smol@1", "smol@2"), plan=RolloutPlan({"smol": SMOL}))
    num_requests = 2000
    models = [answer(generate, "smol").model for _ in range(num_requests)]
    share = models.count("smol@2") / num_requests
    assert 0.08 <= share <= 0.12, share  # binomial: 10 % +- 2 points is over 4 standard deviations
    assert set(models) == {"smol@1", "smol@2"}


def test_a_full_id_is_pinned_whatever_the_split():
    generate = service(*fleet("smol@1", "smol@2"), plan=RolloutPlan({"smol": ModelRollout("smol", "1", "2", 100.0)}))
    assert {answer(generate, "smol@1").model for _ in range(50)} == {"smol@1"}
    assert {answer(generate, "smol").model for _ in range(50)} == {"smol@2"}, "100 %: every new conversation"


def test_auto_is_the_large_models_name_split_the_same_way():
    generate = service(*fleet("smol@1", "smol@2"), plan=RolloutPlan({"smol": ModelRollout("smol", "1", "2", 100.0)}))
    assert answer(generate, "auto").model == "smol@2"
    named = service(*fleet("smol@1", "smol@2", "big@3"), plan=RolloutPlan({"smol": SMOL}), pools=ModelPools(large="big"))
    assert answer(named, "auto").model == "big@3"


def test_the_stable_answers_while_the_candidate_is_not_served_and_a_continuation_is_never_split():
    starting = decode_worker("w-2", model="smol@2", is_engine_ready=False)
    generate = service(decode_worker("w-1", model="smol@1"), starting, plan=RolloutPlan({"smol": ModelRollout("smol", "1", "2", 100.0)}))
    assert {answer(generate, "smol").model for _ in range(20)} == {"smol@1"}
    both = service(*fleet("smol@1", "smol@2"), plan=RolloutPlan({"smol": ModelRollout("smol", "1", "2", 100.0)}))
    assert answer(both, "smol", resume_reply_id="r1", reply_id="r1").model == "smol@1"


def test_without_a_rollout_entry_the_most_served_version_answers_ties_to_the_highest():
    assert answer(service(*fleet("smol@1", "smol@1", "smol@2")), "smol").model == "smol@1"
    assert answer(service(*fleet("smol@9", "smol@10")), "smol").model == "smol@10", "versions sort naturally"
    assert version_order("2026-11-30") < version_order("2026-12-01")
    # neither the stable nor the candidate served: the most served version
    assert answer(service(*fleet("smol@3"), plan=RolloutPlan({"smol": SMOL})), "smol").model == "smol@3"


def test_unversioned_workers_answer_their_bare_name_as_before():
    generate = service(*fleet("smol", "smol"), plan=RolloutPlan({"smol": SMOL}))
    reply = answer(generate, "smol")
    assert (reply.model, reply.shadow_model) == ("smol", "")
    assert answer(generate, "auto").model == "smol"
    assert most_served("other", []) == "other"


def test_the_stable_answers_are_mirrored_to_the_candidate_in_the_shadow_share():
    plan = RolloutPlan({"smol": ModelRollout("smol", "1", "2", candidate_percent=0.0, shadow_percent=25.0)})
    generate = service(*fleet("smol@1", "smol@2"), plan=plan)
    before = version_requests("smol", "1", "false")
    replies = [answer(generate, "smol") for _ in range(1000)]
    assert {r.model for r in replies} == {"smol@1"}
    shadows = [r.shadow_model for r in replies if r.shadow_model]
    assert set(shadows) == {"smol@2"}
    assert 0.20 <= len(shadows) / len(replies) <= 0.30, len(shadows)
    assert version_requests("smol", "1", "false") == before + 1000
    pinned = [answer(generate, "smol@1") for _ in range(50)]
    assert not any(r.shadow_model for r in pinned), "a pinned conversation is not a new one: no shadow"
    shadow_before = version_requests("smol", "2", "true")
    shadow = answer(generate, "smol@2", shadow_of="r1", lane=LANE_BACKGROUND)
    assert (shadow.model, shadow.shadow_model) == ("smol@2", "")
    assert version_requests("smol", "2", "true") == shadow_before + 1


def test_a_pool_move_picks_the_other_names_version():
    pools = ModelPools(large="big", small="smol")
    plan = RolloutPlan({"big": ModelRollout("big", "1", "2", 0.0)})
    # no smol worker at all: a free request for the small model goes to the large pool's stable version
    generate = service(*fleet("big@1", "big@2"), plan=plan, pools=pools)
    reply = answer(generate, "smol", lane=LANE_FREE)
    assert reply.model == "big@1"
    # a free request for the large model, its pool down, goes to the small one's most served version
    down = service(decode_worker("b", model="big@1", is_engine_ready=False), *fleet("smol@4", "smol@4", "smol@3"), pools=pools)
    assert answer(down, "big", lane=LANE_FREE).model == "smol@4"
