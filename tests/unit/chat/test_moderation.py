"""The input check: it runs while the prompt is built (not before it), a refused message is a 400
with a stable code and a clear message, stored as `moderated` on the product API with nothing
started, counted, and never sent to a model again; a check that fails refuses with a 503 rather
than letting a message through unchecked; a bad setting fails the start."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from collections.abc import AsyncIterator, Sequence
from concurrent.futures.process import BrokenProcessPool
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
from helpers import is_running, wait_until
from prometheus_client import REGISTRY

from services.chat.config import ChatConfig
from services.chat.context import active_history
from services.chat.door import Door
from services.chat.errors import Moderated, Unavailable, answer
from services.chat.model_routing import ModelRouter, RoutingConfig
from services.chat.models_view import ModelsView
from services.chat.moderation import (
    MODERATED_MESSAGE,
    InputCheck,
    load_input_check,
    refuse_openai_input,
    start_input_check,
)
from services.chat.prompt import LoadedTokenizer
from services.chat.replies import ReplyStarter
from services.chat.turns import SamplingChoice, Turns
from tandem.bus.events import ReplyStatus
from tandem.config import ApiKey, Tier
from tandem.errors import StartupError
from tandem.models.loader import load_tokenizer
from tandem.models.tokenizer import Tokenizer
from tandem.safety import Blocklist
from tandem.store import Conversation, Message, Role
from tandem.store.sqlite import SqliteStore
from tandem.v1.worker_pb2 import ServiceHeartbeat, WorkerHeartbeat

RENDEZVOUS_S = 10.0  # only a way out: an overlapping check and prompt build meet at once
USER = ApiKey(user_id="u1", tier=Tier.FREE)
CONFIG = ChatConfig(
    system_prompt="Be kind.",
    max_answer_tokens=16,
    prompt_budget_free=512,
    prompt_budget_plus=512,
    max_message_chars=1000,
    idempotency_ttl_s=60,
)


class Rendezvous:
    """The check and the prompt build each wait for the other to have begun: both see the other
    begun only if they overlap. Run one after the other, the first waits out RENDEZVOUS_S alone."""

    def __init__(self) -> None:
        self.check_began = threading.Event()
        self.build_began = threading.Event()
        self.check_saw_build = False
        self.build_saw_check = False


class MeetingCheck:
    """A deployment's check that refuses everything, after meeting the prompt build."""

    name = "meeting"

    def __init__(self, rendezvous: Rendezvous) -> None:
        self._rendezvous = rendezvous

    def score(self, texts: Sequence[str]) -> list[float]:
        self._rendezvous.check_began.set()
        self._rendezvous.check_saw_build = self._rendezvous.build_began.wait(RENDEZVOUS_S)
        return [1.0 for _ in texts]


class MeetingTokenizer:
    """The real tokenizer; its first use by the prompt build meets the check."""

    def __init__(self, tokenizer: Tokenizer, rendezvous: Rendezvous) -> None:
        self._tokenizer = tokenizer
        self._rendezvous = rendezvous

    def encode_chat(self, *args: Any, **kwargs: Any) -> list[int]:
        if not self._rendezvous.build_began.is_set():
            self._rendezvous.build_began.set()
            self._rendezvous.build_saw_check = self._rendezvous.check_began.wait(RENDEZVOUS_S)
        return self._tokenizer.encode_chat(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


class FailingCheck:
    name = "failing"

    def score(self, texts: Sequence[str]) -> list[float]:
        raise ConnectionError("the moderation model's server is down")


def heartbeat(model: str, window: int) -> SimpleNamespace:
    beat = WorkerHeartbeat(service=ServiceHeartbeat(instance_id="d1"), model=model, max_model_len=window, is_engine_ready=True)
    return SimpleNamespace(data=beat.SerializeToString(), subject="tandem.v1.heartbeat.decode.d1")


def moderated_count(tier: str, model: str) -> float:
    value = REGISTRY.get_sample_value("tandem_chat_moderated_total", {"direction": "input", "tier": tier, "model": model})
    return value or 0.0


def message(seq: int, role: Role, status: ReplyStatus = ReplyStatus.COMPLETE) -> Message:
    return Message(
        id=f"m{seq}",
        conversation_id="c",
        seq=seq,
        parent_seq=0,
        role=role,
        content=f"text {seq}",
        tokens=5,
        model="m",
        status=status,
        created_at_ms=seq,
    )


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


@pytest_asyncio.fixture
async def store(tmp_path) -> AsyncIterator[SqliteStore]:
    store = SqliteStore(tmp_path / "conversations.db")
    await store.start()
    yield store
    await store.close()


async def chat_turns(store: SqliteStore, tokenizer: Any, input_check: InputCheck) -> Turns:
    """No Redis, no bus: a refused message must not reach either (starting a reply on None fails the test)."""
    models = ModelsView()
    await models.on_heartbeat(heartbeat("m1", 2048))
    door = Door()
    return Turns(
        config=CONFIG,
        store=store,
        redis=None,  # type: ignore[arg-type]
        bus=None,  # type: ignore[arg-type]
        models=models,
        door=door,
        tokenizer=LoadedTokenizer(tokenizer),
        router=ModelRouter(RoutingConfig.of(CONFIG), models),
        starter=ReplyStarter(None, None, door, None, CONFIG.generate_timeout_s),  # type: ignore[arg-type]
        input_check=input_check,
    )


@pytest.mark.real_model
async def test_the_check_runs_while_the_prompt_is_built_and_a_refused_turn_is_stored_moderated_with_nothing_started(store, tokenizer):
    rendezvous = Rendezvous()
    turns = await chat_turns(store, MeetingTokenizer(tokenizer, rendezvous), InputCheck.in_thread(MeetingCheck(rendezvous), 0.5))
    conversation = Conversation(id="c1", user_id=USER.user_id, title="", model="", created_at_ms=1, updated_at_ms=1)
    await store.create_conversation(conversation)
    before = moderated_count("free", "m1")

    with pytest.raises(Moderated) as refused:
        await turns.send_message(USER, conversation, "some words", "m1", "r1", SamplingChoice())

    assert rendezvous.check_saw_build and rendezvous.build_saw_check  # they overlapped
    assert (refused.value.code, refused.value.message) == ("moderated", MODERATED_MESSAGE)
    [stored] = await store.list_messages("c1")  # the user turn only: no assistant turn
    assert (stored.role, stored.status, stored.content, stored.model) == (Role.USER, ReplyStatus.MODERATED, "some words", "m1")
    assert moderated_count("free", "m1") == before + 1
    # A refused first message does not name the conversation.
    assert (await store.get_conversation(USER.user_id, "c1")).title == ""


def test_the_model_never_sees_a_moderated_user_turn_again():
    messages = [
        message(1, Role.USER),
        message(2, Role.ASSISTANT),
        message(3, Role.USER, ReplyStatus.MODERATED),
        message(4, Role.USER),
        message(5, Role.ASSISTANT),
    ]
    assert [m.seq for m in active_history(messages)] == [1, 2, 4, 5]


async def test_a_refusal_is_a_400_with_code_moderated_and_a_clear_message():
    response = await answer(None, Moderated(MODERATED_MESSAGE))
    error = json.loads(response.body)["error"]
    assert response.status_code == 400
    assert (error["code"], error["type"], error["message"]) == ("moderated", "invalid_request_error", MODERATED_MESSAGE)


async def test_the_openai_endpoints_refuse_in_openais_shape_with_code_content_filter():
    check = InputCheck.in_thread(Blocklist(["idiot"]), 0.5)
    before = moderated_count("plus", "m1")
    await refuse_openai_input(start_input_check(check, "hello there"), "plus", "m1")  # let through
    with pytest.raises(Moderated) as refused:
        await refuse_openai_input(start_input_check(check, "you are an idiot"), "plus", "m1")
    response = await answer(None, refused.value)
    assert response.status_code == 400
    assert json.loads(response.body)["error"]["code"] == "content_filter"
    assert moderated_count("plus", "m1") == before + 1


async def test_texts_checked_together_are_refused_when_any_one_is_flagged():
    """An OpenAI request's user messages: one flagged among them, first or last, refuses the request."""
    check = InputCheck.in_thread(Blocklist(["idiot"]), 0.5)
    before = moderated_count("plus", "m2")
    assert not await start_input_check(check, "hello there", "", "what is the capital of France?").is_refused("plus", "m2")
    assert await start_input_check(check, "you are an idiot", "what is the capital of France?").is_refused("plus", "m2")
    assert moderated_count("plus", "m2") == before + 1, "one request refused, counted once"


async def test_a_check_that_fails_refuses_with_a_503_not_a_message_let_through():
    with pytest.raises(Unavailable) as failed:
        await start_input_check(InputCheck.in_thread(FailingCheck(), 0.5), "hello").is_refused("free", "m1")
    assert failed.value.code == "moderation_unavailable"
    assert "server" not in failed.value.message  # the check's own text goes to the log only


async def test_no_check_configured_refuses_nothing():
    assert load_input_check("none", 0.5) is None
    assert not await start_input_check(None, "you are a fucking idiot").is_refused("free", "m1")


async def test_the_default_check_is_profanity_checks_trained_model_and_its_time_is_measured():
    check = load_input_check("profanity-check", 0.5)
    assert check is not None and check.name == "profanity-check"
    try:
        count_before = REGISTRY.get_sample_value("tandem_chat_input_check_seconds_count") or 0.0
        assert await start_input_check(check, "you are a fucking idiot").is_refused("free", "m1")
        assert not await start_input_check(check, "What is the capital of France?").is_refused("free", "m1")
        assert REGISTRY.get_sample_value("tandem_chat_input_check_seconds_count") == count_before + 2
    finally:
        check.close()


@pytest_asyncio.fixture
async def blocklist_check() -> AsyncIterator[InputCheck]:
    """A blocklist check loaded as the chat loads its check, in a process of its own."""
    check = load_input_check("blocklist:idiot", 0.5, call_timeout_s=3.0)  # a stopped child fails its call after 3 s
    assert check is not None and check.process is not None
    yield check
    check.close()


async def test_a_loaded_check_runs_in_its_process_and_messages_checked_at_once_each_get_their_verdict(blocklist_check):
    texts = ["hello", "you idiot", "fine words", "IDIOT!", "an idiotic plan"]  # the last: not the whole word
    refused = await asyncio.gather(*(start_input_check(blocklist_check, text).is_refused("free", "m1") for text in texts))
    assert refused == [False, True, False, True, False]


@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
async def test_a_check_process_killed_or_stopped_is_a_503_for_its_message_and_the_next_is_checked_in_a_new_one(
    blocklist_check, signal_number
):
    process = blocklist_check.process
    first_pid = await process.child_pid()
    assert first_pid != os.getpid()
    os.kill(first_pid, signal_number)
    with pytest.raises(Unavailable) as failed:  # never let through unchecked, never waited for forever
        await start_input_check(blocklist_check, "you idiot").is_refused("free", "m1")
    assert failed.value.code == "moderation_unavailable"
    assert await start_input_check(blocklist_check, "you idiot").is_refused("free", "m1")
    assert not await start_input_check(blocklist_check, "hello").is_refused("free", "m1")
    assert await process.child_pid() not in (first_pid, os.getpid())

    async def gone() -> bool:
        return not is_running(first_pid)

    await wait_until(gone, timeout_s=10)  # a stopped child is killed, not left behind


async def test_a_check_process_that_died_between_calls_is_a_503_once_and_the_next_call_is_checked_in_a_new_one(blocklist_check):
    """The pool may see its child die before the next call is made: then the call's submit itself
    raises, and that too replaces the process (before, every later call failed)."""
    process = blocklist_check.process
    first_pid = await process.child_pid()
    os.kill(first_pid, signal.SIGKILL)

    async def pool_saw_it() -> bool:
        try:
            process._executor.submit(os.getpid)
        except BrokenProcessPool:
            return True
        return False

    await wait_until(pool_saw_it, timeout_s=10)
    with pytest.raises(Unavailable):
        await start_input_check(blocklist_check, "you idiot").is_refused("free", "m1")
    assert await start_input_check(blocklist_check, "you idiot").is_refused("free", "m1")
    assert await process.child_pid() not in (first_pid, os.getpid())


def test_a_setting_that_names_no_check_fails_the_start_naming_the_setting():
    with pytest.raises(StartupError, match="TANDEM_INPUT_MODERATION"):
        load_input_check("no_such_module_anywhere:make_check", 0.5)
