"""Versioned models on the chat side: a bare name stands for its versions, a conversation stays on
the version that answered it, a retired version gives way to its name, the rollout's shadow
request mirrors the shown one, and the routers' rollout status as /v1/status shows it."""

from types import SimpleNamespace

from services.chat.difficulty import DifficultyJudge
from services.chat.model_routing import DecidedBy, ModelRouter, RoutingConfig, conversation_model, turn_model
from services.chat.models_view import ModelsView
from services.chat.rollout_view import RolloutView, rollout_body
from services.chat.shadow import shadow_request
from tandem.bus.events import ReplyStatus
from tandem.config import ApiKey, Tier
from tandem.store import Message, Role
from tandem.v1.common_pb2 import LANE_BACKGROUND, LANE_FREE
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.worker_pb2 import ModelRollout, RolloutStatus, ServiceHeartbeat, VersionWindow, WorkerHeartbeat

FREE, PRO = ApiKey("bob", Tier.FREE), ApiKey("carol", Tier.PRO)


def heartbeat(worker: str, model: str, window: int = 8192) -> SimpleNamespace:
    hb = WorkerHeartbeat(service=ServiceHeartbeat(instance_id=worker), model=model, max_model_len=window, is_engine_ready=True)
    return SimpleNamespace(data=hb.SerializeToString(), subject=f"tandem.v1.heartbeat.decode.{worker}")


async def served(*models: tuple[str, int]) -> ModelsView:
    view = ModelsView()
    for i, (model, window) in enumerate(models):
        await view.on_heartbeat(heartbeat(f"d{i}", model, window))
    return view


def message(seq: int, parent_seq: int, role: Role, model: str) -> Message:
    return Message(f"m{seq}", "c", seq, parent_seq, role, "text", 1, model, ReplyStatus.COMPLETE, 0)


async def test_a_versioned_model_is_served_under_its_name_too_with_the_smallest_window():
    view = await served(("smol@1", 8192), ("smol@1", 8192), ("smol@2", 4096), ("plain", 2048))
    models = view.models()
    assert sorted(models) == ["plain", "smol", "smol@1", "smol@2"]
    alias = models["smol"]
    assert (alias.window_tokens, alias.num_workers, alias.versions) == (4096, 3, ("smol@1", "smol@2"))
    assert models["plain"].versions == ()
    assert view.most_served().name == "smol"  # a name, never one of its versions


async def test_a_conversation_stays_on_the_version_that_answered_its_newest_user_turn():
    # The user turn is stored before the router chose the version: it names the model only.
    messages = [message(1, 0, Role.USER, "smol"), message(2, 1, Role.ASSISTANT, "smol@2")]
    assert conversation_model(messages) == "smol@2"
    assert turn_model(messages[0], messages) == "smol@2"
    # Another pool's answer (the router moved it) does not pin the conversation to that pool.
    moved = [message(1, 0, Role.USER, "big"), message(2, 1, Role.ASSISTANT, "smol@2")]
    assert conversation_model(moved) == "big"
    assert conversation_model([message(1, 0, Role.USER, "smol@1")]) == "smol@1"


async def test_the_router_is_asked_for_the_pinned_version_and_a_retired_one_gives_way_to_its_name():
    models = await served(("smol@1", 8192), ("smol@2", 8192))
    router = ModelRouter(RoutingConfig(large_model="smol"), models, DifficultyJudge(None, timeout_s=1))
    new = await router.route(FREE, "auto", "hi", len)
    pinned = await router.route(FREE, "auto", "hi", len, on_model="smol@1")
    retired = await router.route(FREE, "auto", "hi", len, on_model="smol@0")
    picked = await router.route(PRO, "smol@2", "hi", len, on_model="smol@1")
    assert new.model.name == "smol"  # the routers' rollout picks its version
    assert (pinned.model.name, pinned.decided_by) == ("smol@1", DecidedBy.CONVERSATION)
    assert retired.model.name == "smol"
    assert (picked.model.name, picked.decided_by) == ("smol@2", DecidedBy.USER)
    named = await router.route(PRO, "smol", "hi", len, on_model="smol@1")  # the model, not another version
    assert (named.model.name, named.decided_by) == ("smol@1", DecidedBy.USER)
    # The version the router answered with is the decided model, not another pool's.
    assert new.answered_by("smol@2").instead_of == ""
    assert new.answered_by("other@1").instead_of == "smol"


def test_a_shadow_request_mirrors_the_shown_one_on_the_background_lane():
    primary = GenerateRequest(request_id="r1", reply_id="r1", model="smol", user_id="u", lane=LANE_FREE, prompt_token_ids=[1, 2, 3])
    shadow = shadow_request(primary, "smol@2")
    assert (shadow.model, shadow.shadow_of, shadow.lane, list(shadow.prompt_token_ids)) == ("smol@2", "r1", LANE_BACKGROUND, [1, 2, 3])
    assert shadow.reply_id not in ("", "r1") and shadow.request_id == shadow.reply_id
    assert primary.shadow_of == "" and primary.model == "smol"


def rollout(rolled_back: bool = False) -> ModelRollout:
    return ModelRollout(
        model="smol",
        stable="1",
        candidate="2",
        configured_percent=10,
        candidate_percent=0 if rolled_back else 10,
        rolled_back=rolled_back,
        rollback_reason="error_rate" if rolled_back else "",
        rolled_back_unix_ms=1_800_000_000_000 if rolled_back else 0,
        candidate_window=VersionWindow(replies=30, errors=12, ttft_p95_s=0.25),
    )


def test_the_status_shows_a_rollback_any_fresh_router_made_and_forgets_silent_routers():
    now = [100.0]
    view = RolloutView(clock=lambda: now[0])
    assert view.current() is None and rollout_body(None) is None
    view.observe(RolloutStatus(router_id="a", sent_unix_ms=2, interval_s=2, models=[rollout()]))
    view.observe(RolloutStatus(router_id="b", sent_unix_ms=1, interval_s=2, models=[rollout(rolled_back=True)]))
    (shown,) = rollout_body(view.current())
    assert shown["rolled_back"] is True and shown["candidate_percent"] == 0 and shown["rollback_reason"] == "error_rate"
    assert shown["window"]["candidate"] == {"replies": 30, "errors": 12, "ttft_p95_s": 0.25}
    now[0] += 7  # past three intervals: neither router is current
    assert view.current() is None
