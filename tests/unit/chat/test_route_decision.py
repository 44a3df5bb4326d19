"""The decision behind `model: "auto"`: a paid pick, a conversation's own model, the classifier's
score or the fallback rule, a model no worker serves, and the quota fallback's route."""

from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from services.chat.difficulty import DifficultyJudge, FeatureClassifier
from services.chat.errors import Unavailable
from services.chat.model_routing import DecidedBy, Decision, ModelRouter, RoutingConfig, UnknownModel, conversation_model
from services.chat.models_view import ModelsView
from tandem.bus.events import ReplyStatus
from tandem.config import ApiKey, Tier
from tandem.store import Message, Role
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat

LARGE, SMALL = "smollm-large", "smollm-small"
FREE = ApiKey("bob", Tier.FREE)
PLUS = ApiKey("alice", Tier.PLUS)
PRO = ApiKey("carol", Tier.PRO)
EASY, HARD = "hi there", "```python\ndef f(x):\n    return x[0]\n```\nExplain why this raises a TypeError, step by step."


def heartbeat(worker: str, model: str) -> SimpleNamespace:
    hb = WorkerHeartbeat(service=ServiceHeartbeat(instance_id=worker), model=model, max_model_len=8192, is_engine_ready=True)
    return SimpleNamespace(data=hb.SerializeToString(), subject=f"tandem.v1.heartbeat.decode.{worker}")


class Constant:
    def __init__(self, value: float) -> None:
        self.value = value

    def score(self, text: str) -> float:
        return self.value


class Raising:
    def score(self, text: str) -> float:
        raise RuntimeError("down")


def words(text: str) -> int:
    return len(text.split())


async def stack(served=(LARGE, SMALL), classifier=None, small=SMALL, large=LARGE, threshold=0.5, judge=None) -> ModelRouter:
    """A router over the served models, the settings and the classifier (`judge`: a judge of its own)."""
    models = ModelsView()
    for i, name in enumerate(served):
        await models.on_heartbeat(heartbeat(f"d{i}", model=name))
    config = RoutingConfig(large_model=large, small_model=small, difficulty_threshold=threshold)
    return ModelRouter(config, models, judge or DifficultyJudge(classifier or FeatureClassifier(), timeout_s=1))


async def test_auto_sends_an_easy_message_small_and_a_hard_one_large_by_the_classifier():
    router = await stack()
    easy = await router.route(FREE, "auto", EASY, words)
    hard = await router.route(PLUS, "auto", HARD, words)
    assert (easy.model.name, easy.decision, easy.decided_by) == (SMALL, Decision.SMALL, DecidedBy.CLASSIFIER)
    assert (hard.model.name, hard.decision, hard.decided_by) == (LARGE, Decision.LARGE, DecidedBy.CLASSIFIER)
    assert easy.score < 0.5 <= hard.score
    assert easy.as_dict() == {"decision": "small", "decided_by": "classifier", "score": easy.score}


async def test_the_threshold_is_the_setting():
    router = await stack(classifier=Constant(0.6))
    assert (await router.route(FREE, "auto", EASY, words)).model.name == LARGE
    router = await stack(classifier=Constant(0.6), threshold=0.7)
    assert (await router.route(FREE, "auto", EASY, words)).model.name == SMALL


@pytest.mark.parametrize("classifier", [None, Raising()], ids=["none", "raising"])
async def test_without_a_classifier_score_the_fallback_rule_decides(classifier):
    router = await stack(judge=DifficultyJudge(classifier, timeout_s=1))
    short = await router.route(FREE, "auto", EASY, words)
    fenced = await router.route(FREE, "auto", "fix:\n```\nx = 1\n```", words)
    long = await router.route(FREE, "auto", "word " * 200, words)
    assert (short.model.name, short.decided_by, short.score) == (SMALL, DecidedBy.FALLBACK, None)
    assert (fenced.model.name, fenced.decided_by) == (LARGE, DecidedBy.FALLBACK)
    assert (long.model.name, long.decided_by) == (LARGE, DecidedBy.FALLBACK)


async def test_a_paid_user_who_picks_a_model_gets_it_and_a_free_user_is_routed():
    router = await stack(classifier=Constant(0.9))
    for paid in (PLUS, PRO):
        picked = await router.route(paid, SMALL, HARD, words)
        assert (picked.model.name, picked.decision, picked.decided_by, picked.score) == (SMALL, Decision.PICKED, DecidedBy.USER, None)
    free = await router.route(FREE, SMALL, HARD, words)  # a free user's pick is auto
    assert (free.model.name, free.decided_by) == (LARGE, DecidedBy.CLASSIFIER)
    with pytest.raises(UnknownModel):
        await router.route(PLUS, "gpt-9", EASY, words)
    with pytest.raises(UnknownModel):  # a free user's name is checked too
        await router.route(FREE, "gpt-9", EASY, words)


async def test_a_conversation_stays_on_its_model_unless_a_paid_user_picks_another():
    router = await stack(classifier=Constant(0.9))
    stays = await router.route(FREE, "auto", HARD, words, on_model=SMALL)
    assert (stays.model.name, stays.decision, stays.decided_by) == (SMALL, Decision.CONVERSATION, DecidedBy.CONVERSATION)
    assert (await router.route(FREE, LARGE, HARD, words, on_model=SMALL)).model.name == SMALL
    moved = await router.route(PLUS, LARGE, EASY, words, on_model=SMALL)
    assert (moved.model.name, moved.decided_by) == (LARGE, DecidedBy.USER)
    gone = await router.route(FREE, "auto", HARD, words, on_model="a-retired-model")  # neither served nor configured
    assert (gone.model.name, gone.decided_by) == (LARGE, DecidedBy.CLASSIFIER)


def message(seq: int, role: Role, model: str) -> Message:
    return Message(f"m{seq}", "c", seq, seq - 1, role, "text", 1, model, ReplyStatus.COMPLETE, 0)


def test_a_conversation_is_on_the_model_its_newest_user_turn_was_routed_to():
    assert conversation_model([]) == ""
    turns = [message(1, Role.USER, SMALL), message(2, Role.ASSISTANT, LARGE), message(3, Role.USER, LARGE), message(4, Role.ASSISTANT, "x")]
    assert conversation_model(turns) == LARGE
    assert conversation_model(turns[:2]) == SMALL  # the answer's model (served by another pool) does not move it


async def test_a_model_no_worker_serves_gives_way_to_the_other(monkeypatch):
    monkeypatch.setattr("services.chat.model_routing.MODEL_WAIT_S", 0.05)  # the wait for a first heartbeat
    router = await stack(served=(LARGE,), classifier=Constant(0.1))
    route = await router.route(FREE, "auto", EASY, words)
    assert (route.model.name, route.decision, route.instead_of) == (LARGE, Decision.SMALL, SMALL)
    assert route.as_dict()["instead_of"] == SMALL
    router = await stack(served=(SMALL,), classifier=Constant(0.9))
    assert (await router.route(PLUS, LARGE, HARD, words)).model.name == SMALL  # a pick of a pool that is down
    assert (await router.route(FREE, "auto", HARD, words, on_model=LARGE)).model.name == SMALL
    with pytest.raises(Unavailable):
        await (await stack(served=())).route(FREE, "auto", EASY, words)


async def test_with_no_small_model_auto_is_the_large_one_as_before():
    router = await stack(served=("only",), small="", large="", classifier=Raising())
    route = await router.route(FREE, "auto", HARD, words)
    assert (route.model.name, route.decided_by) == ("only", DecidedBy.SINGLE_MODEL)
    assert (await router.route(FREE, "only", EASY, words)).model.name == "only"


async def test_an_empty_large_model_is_the_one_most_workers_serve_other_than_the_small():
    router = await stack(served=("b-model", "a-model", "b-model", SMALL, SMALL, SMALL), large="", classifier=Constant(0.9))
    assert (await router.route(FREE, "auto", HARD, words)).model.name == "b-model"


async def test_each_route_is_counted_by_model_and_who_decided():
    def count() -> float:
        return REGISTRY.get_sample_value("tandem_chat_model_routes_total", {"model": SMALL, "decided_by": "user"}) or 0.0

    before = count()
    await (await stack()).route(PRO, SMALL, HARD, words)
    assert count() == before + 1


async def test_a_reply_the_router_gave_to_the_other_pool_says_which_was_decided():
    route = await (await stack(classifier=Constant(0.1))).route(FREE, "auto", EASY, words)
    assert route.answered_by(SMALL) is route
    moved = route.answered_by(LARGE)  # the small pool was full: the router sent it large
    assert moved.as_dict() == {"decision": "small", "decided_by": "classifier", "score": 0.1, "instead_of": SMALL}


async def test_the_quota_fallback_goes_to_the_served_small_model_and_says_instead_of_what():
    router = await stack()
    hard = await router.route(PLUS, "auto", HARD, words)
    fallback = router.quota_fallback(hard)
    assert fallback is not None
    assert (fallback.model.name, fallback.decision, fallback.decided_by) == (SMALL, Decision.SMALL, DecidedBy.QUOTA_FALLBACK)
    assert fallback.as_dict()["decided_by"] == "quota_fallback" and fallback.as_dict()["instead_of"] == LARGE
    easy = await router.route(FREE, "auto", EASY, words)  # on the small model already: its bucket, nothing instead
    assert "instead_of" not in router.quota_fallback(easy).as_dict()


async def test_no_quota_fallback_without_a_served_small_model():
    assert (await stack(small="")).quota_fallback(await (await stack(small="")).route(FREE, "auto", EASY, words)) is None
    unserved = await stack(served=(LARGE,))
    assert unserved.quota_fallback(await unserved.route(FREE, "auto", HARD, words)) is None
