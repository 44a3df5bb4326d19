"""POST /v1/messages/{id}/feedback on a real SQLite store: the owner's rating is stored (a second
replaces the first) and counted once per vote; anyone else, and an unknown id, get the same 404;
a user's message cannot be rated; bad bodies are a 400 in the API's error shape naming the field."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import pytest_asyncio
from fastapi import FastAPI
from prometheus_client import REGISTRY

from services.chat import errors, feedback_api
from services.chat.auth import Authenticator
from services.chat.key_ring import KeyRing
from services.chat.metrics import model_labels
from services.chat.schemas import MAX_FEEDBACK_COMMENT_CHARS, MAX_FEEDBACK_REASON_CHARS
from tandem.bus.events import ReplyStatus
from tandem.config import ApiKey, Tier
from tandem.store import Conversation, NewMessage, Rating, Role
from tandem.store.sqlite import SqliteStore

KEYS = {"alice-key": ApiKey("alice", Tier.FREE), "mallory-key": ApiKey("mallory", Tier.PLUS)}
ALICE = {"Authorization": "Bearer alice-key"}
MALLORY = {"Authorization": "Bearer mallory-key"}
MODEL = "smollm2@2025-06"


@pytest_asyncio.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    store = SqliteStore(tmp_path / "conversations.db")
    await store.start()
    yield store
    await store.close()


@pytest_asyncio.fixture
async def client(store: SqliteStore) -> AsyncIterator[httpx.AsyncClient]:
    app = FastAPI()
    app.include_router(feedback_api.router)
    errors.install(app)
    app.state.chat = SimpleNamespace(store=store, auth=Authenticator(KeyRing.load(KEYS, None)))  # the route reads only these
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        yield client


async def a_turn(store: SqliteStore) -> tuple[str, str]:
    """Alice's question and its answer: (question id, answer id)."""
    conversation = await store.create_conversation(Conversation("c1", "alice", "a chat", "auto", 1_000, 1_000))
    question = await store.append_message("alice", NewMessage("q1", conversation.id, Role.USER, "2+2?", 3, model=MODEL))
    answer = NewMessage("a1", conversation.id, Role.ASSISTANT, "4", 1, model=MODEL, status=ReplyStatus.COMPLETE, parent_seq=question.seq)
    await store.append_message("alice", answer)
    return question.id, answer.id


def votes(vote: str) -> float:
    return REGISTRY.get_sample_value("tandem_feedback_total", {"model": "smollm2", "version": "2025-06", "vote": vote}) or 0.0


async def test_the_owners_rating_is_stored_a_second_replaces_it_and_each_vote_counts_once(
    client: httpx.AsyncClient, store: SqliteStore
) -> None:
    _, answer_id = await a_turn(store)
    up_before, down_before = votes("up"), votes("down")

    response = await client.post(f"/v1/messages/{answer_id}/feedback", json={"rating": "up"}, headers=ALICE)
    assert response.status_code == 204, response.text
    again = await client.post(f"/v1/messages/{answer_id}/feedback", json={"rating": "up", "comment": "a retry"}, headers=ALICE)
    assert again.status_code == 204, again.text
    assert (votes("up") - up_before, votes("down") - down_before) == (1, 0), "the same vote again was counted twice"

    body = {"rating": "down", "reason": "inaccurate", "comment": "it is 5"}
    assert (await client.post(f"/v1/messages/{answer_id}/feedback", json=body, headers=ALICE)).status_code == 204
    assert (votes("up") - up_before, votes("down") - down_before) == (1, 1)
    [stored] = await store.list_feedback("c1")
    assert (stored.message_id, stored.rating, stored.reason, stored.comment) == (answer_id, Rating.DOWN, "inaccurate", "it is 5")


async def test_another_user_and_an_unknown_id_get_the_same_404_and_nothing_is_stored(client: httpx.AsyncClient, store: SqliteStore) -> None:
    _, answer_id = await a_turn(store)
    up_before = votes("up")
    theirs = await client.post(f"/v1/messages/{answer_id}/feedback", json={"rating": "up"}, headers=MALLORY)
    unknown = await client.post("/v1/messages/no-such-message/feedback", json={"rating": "up"}, headers=ALICE)
    assert (theirs.status_code, unknown.status_code) == (404, 404)
    assert theirs.json()["error"]["code"] == unknown.json()["error"]["code"] == "message_not_found"
    hidden = theirs.json()["error"]["message"].replace(answer_id, "ID")
    assert hidden == unknown.json()["error"]["message"].replace("no-such-message", "ID"), "another's message 404s unlike a missing one"
    assert await store.list_feedback("c1") == []
    assert votes("up") == up_before


async def test_a_user_message_cannot_be_rated(client: httpx.AsyncClient, store: SqliteStore) -> None:
    question_id, _ = await a_turn(store)
    response = await client.post(f"/v1/messages/{question_id}/feedback", json={"rating": "down"}, headers=ALICE)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "not_an_answer"
    assert await store.list_feedback("c1") == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"rating": "sideways"}, "rating"),
        ({}, "rating"),
        ({"rating": "up", "reason": "r" * (MAX_FEEDBACK_REASON_CHARS + 1)}, "reason"),
        ({"rating": "up", "comment": "c" * (MAX_FEEDBACK_COMMENT_CHARS + 1)}, "comment"),
        ({"rating": "up", "comment": 5}, "comment"),
    ],
)
async def test_a_bad_body_is_a_400_naming_its_field_and_stores_nothing(
    client: httpx.AsyncClient, store: SqliteStore, body: dict[str, object], param: str
) -> None:
    _, answer_id = await a_turn(store)
    response = await client.post(f"/v1/messages/{answer_id}/feedback", json=body, headers=ALICE)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("bad_request", param, "invalid_request_error")
    assert await store.list_feedback("c1") == []


async def test_the_longest_reason_and_comment_are_accepted_and_kept_whole(client: httpx.AsyncClient, store: SqliteStore) -> None:
    _, answer_id = await a_turn(store)
    body = {"rating": "down", "reason": "r" * MAX_FEEDBACK_REASON_CHARS, "comment": "c" * MAX_FEEDBACK_COMMENT_CHARS}
    assert (await client.post(f"/v1/messages/{answer_id}/feedback", json=body, headers=ALICE)).status_code == 204
    [stored] = await store.list_feedback("c1")
    assert (stored.reason, stored.comment) == (body["reason"], body["comment"])


async def test_without_a_key_the_answer_is_401(client: httpx.AsyncClient, store: SqliteStore) -> None:
    _, answer_id = await a_turn(store)
    response = await client.post(f"/v1/messages/{answer_id}/feedback", json={"rating": "up"})
    assert response.status_code == 401


def test_model_labels_split_the_version_after_the_at_sign() -> None:
    assert model_labels("smollm2@2025-06") == {"model": "smollm2", "version": "2025-06"}
    assert model_labels("smollm2") == {"model": "smollm2", "version": ""}
