"""Model versions and their rollout on the real stack: three decode workers serve the model `smol`
as versions 1 and 2 (the embedded SmolLM2 weights, each under its own version) and 3 (a broken
build: random weights with a tokenizer of its own, so it cannot run the chat's prompts), with a
router reading a rollout file the tests rewrite, a relay and a chat.

Proves that a 10 % canary gets about 10 % of new conversations, that a conversation stays on the
version that began it while the split moves, that shadow answers are computed and stored and never
streamed, and that a failing candidate is rolled back automatically (and /v1/status says so)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from helpers import wait_until
from product_stack import ALICE, ProductStack, own_product_stack, read_stream, text_of, wait_listed
from prometheus_client.parser import text_string_to_metric_families

from tandem.store.sqlite import SqliteStore

pytestmark = pytest.mark.real_model
NAME = "smol"
ANSWER = {"temperature": 0, "max_tokens": 2}
NUM_CANARY_CONVERSATIONS = 200
# 10 % of 200 is 20, with a binomial spread of 4.2: between 6 and 36 (3 % to 18 %) holds with a
# probability above 99.9 % for a fair 10 % split, and fails for a split of 0 % or 25 % and more.
CANARY_RANGE = (6, 36)
MIN_REPLIES = 5  # the rollback's minimum of candidate replies in its window


def write_rollout(path: Path, candidate: str, candidate_percent: float, shadow_percent: float = 0) -> None:
    path.write_text(
        f'[models.{NAME}]\nstable = "1"\ncandidate = "{candidate}"\n'
        f"candidate_percent = {candidate_percent}\nshadow_percent = {shadow_percent}\n"
    )


@pytest_asyncio.fixture(scope="module")
async def rollout_stack(tmp_path_factory):
    from hf_models import write_hf_checkpoint  # torch and transformers: only for this module's broken build
    from reference_model import write_tokenizer
    from tokenizers import Tokenizer

    workdir = tmp_path_factory.mktemp("rollout")
    broken = workdir / "broken-build"
    broken.mkdir()
    write_tokenizer(broken)
    vocab_size = Tokenizer.from_file(str(broken / "tokenizer.json")).get_vocab_size()
    write_hf_checkpoint("llama", broken, seed=4, vocab_size=vocab_size, max_position_embeddings=8192)
    rollout_file = workdir / "rollout.toml"
    write_rollout(rollout_file, "2", 0)  # before the router starts: never version 3 by default
    env = {
        "TANDEM_SERVED_MODEL_NAME": NAME,
        "TANDEM_ROLLOUT_FILE": str(rollout_file),
        "TANDEM_ROLLOUT_RELOAD_S": "0.5",
        "TANDEM_ROLLOUT_WINDOW_S": "600",
        "TANDEM_ROLLOUT_MIN_REPLIES": str(MIN_REPLIES),
        "TANDEM_ROLLOUT_ERROR_MARGIN": "0.2",
        # TTFTs on two shared cores differ by more than any margin between two copies of one model:
        # the TTFT rule is unit-tested (tests/unit/router/test_router_rollback.py), the error rule here.
        "TANDEM_ROLLOUT_TTFT_MARGIN": "1000",
        "TANDEM_KV_CACHE_MIB": "64",
        "TANDEM_INPUT_MODERATION": "none",
        "TANDEM_OUTPUT_MODERATION": "none",
    }
    roles = [
        "router",
        ("decode", {"TANDEM_MODEL_VERSION": "1"}),
        ("decode", {"TANDEM_MODEL_VERSION": "2"}),
        ("decode", {"TANDEM_MODEL_VERSION": "3", "TANDEM_MODEL_PATH": str(broken), "TANDEM_DTYPE": "fp32"}),
        "relay",
        "chat",
    ]
    async with own_product_stack(workdir, roles=roles, **env) as stack:
        await wait_listed(stack, {NAME, f"{NAME}@1", f"{NAME}@2", f"{NAME}@3"}, ALICE)
        stack.rollout_file = rollout_file  # type: ignore[attr-defined]
        yield stack


async def applied(client: httpx.AsyncClient, candidate: str, candidate_percent: float, shadow_percent: float = 0) -> dict:
    """The rollout as /v1/status shows it, once the router applies the file's new entry."""

    async def shown() -> dict | None:
        rollout = (await client.get("/v1/status")).json()["rollout"] or []
        entry = next((r for r in rollout if r["model"] == NAME), None)
        wanted = (candidate, candidate_percent, shadow_percent)
        if entry is None or (entry["candidate"], entry["configured_percent"], entry["shadow_percent"]) != wanted:
            return None
        return entry

    return await wait_until(shown, timeout_s=15)


async def set_rollout(stack: ProductStack, client: httpx.AsyncClient, candidate: str, percent: float, shadow: float = 0) -> dict:
    write_rollout(stack.rollout_file, candidate, percent, shadow)  # type: ignore[attr-defined]
    return await applied(client, candidate, percent, shadow)


async def send(client: httpx.AsyncClient, conversation_id: str, content: str = "Say hi.") -> tuple[int, dict, str]:
    """The status, the meta event and the text of one message (no events for a refused one)."""
    async with client.stream(
        "POST",
        f"/v1/conversations/{conversation_id}/messages",
        headers={**ALICE, "Accept": "text/event-stream"},
        json={"content": content, "model": NAME, **ANSWER},
    ) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, response.json(), ""
        events = await read_stream(response)
    by_name = {e.event: e.data for e in events}
    assert "done" in by_name, events
    return 200, by_name["meta"], text_of(events)


async def new_conversation(client: httpx.AsyncClient) -> str:
    response = await client.post("/v1/conversations", headers=ALICE, json={})
    assert response.status_code == 201, response.text
    return response.json()["id"]


async def first_message(client: httpx.AsyncClient) -> tuple[str, int, dict]:
    conversation_id = await new_conversation(client)
    status, meta, _ = await send(client, conversation_id)
    return conversation_id, status, meta


async def test_versions_are_served_under_their_name_too(rollout_stack):
    async with httpx.AsyncClient(base_url=rollout_stack.url, timeout=30) as client:
        response = await client.get("/v1/models", headers=ALICE)
    assert sorted(m["id"] for m in response.json()["data"]) == [NAME, f"{NAME}@1", f"{NAME}@2", f"{NAME}@3"]


async def test_a_ten_percent_canary_gets_about_ten_percent_of_new_conversations(rollout_stack):
    async with httpx.AsyncClient(base_url=rollout_stack.url, timeout=120) as client:
        await set_rollout(rollout_stack, client, "2", 10)
        gate = asyncio.Semaphore(6)

        async def one() -> str:
            """A new conversation's first answer; one a busy worker refused (503) is asked again, a
            few times: the split decides a version per accepted reply, so a refusal counts nothing."""
            for _ in range(5):
                async with gate:
                    conversation_id = await new_conversation(client)
                    status, meta, _ = await send(client, conversation_id)
                if status == 200:
                    return meta["model"]
                assert status == 503, meta
                await asyncio.sleep(0.2)  # a backoff, as a client honouring Retry-After does
            raise AssertionError(f"refused five times: {meta}")

        models = await asyncio.gather(*(one() for _ in range(NUM_CANARY_CONVERSATIONS)))
    on_candidate = models.count(f"{NAME}@2")
    print(f"canary: {on_candidate} of {NUM_CANARY_CONVERSATIONS} new conversations on the candidate")
    assert set(models) <= {f"{NAME}@1", f"{NAME}@2"}, models
    low, high = CANARY_RANGE
    assert low <= on_candidate <= high, f"{on_candidate} of {NUM_CANARY_CONVERSATIONS} new conversations on the 10 % canary"


async def test_a_conversation_stays_on_the_version_that_began_it_while_the_split_moves(rollout_stack):
    async with httpx.AsyncClient(base_url=rollout_stack.url, timeout=120) as client:
        await set_rollout(rollout_stack, client, "2", 0)
        on_stable, status, meta = await first_message(client)
        assert (status, meta["model"]) == (200, f"{NAME}@1")
        await set_rollout(rollout_stack, client, "2", 100)
        on_candidate, status, meta = await first_message(client)
        assert (status, meta["model"]) == (200, f"{NAME}@2")
        for _ in range(2):  # every new conversation goes to 2 now; the one begun on 1 stays there
            assert (await send(client, on_stable, "And again?"))[1]["model"] == f"{NAME}@1"
            assert (await send(client, on_candidate, "And again?"))[1]["model"] == f"{NAME}@2"
        await set_rollout(rollout_stack, client, "2", 0)
        assert (await send(client, on_candidate, "Once more."))[1]["model"] == f"{NAME}@2"

        async def stored(conversation_id: str) -> list[tuple[str, str]] | None:
            messages = (await client.get(f"/v1/conversations/{conversation_id}", headers=ALICE)).json()["messages"]
            if any(m["status"] == "running" for m in messages):
                return None
            return [(m["role"], m["model"]) for m in messages]

        turns = await wait_until(lambda: stored(on_candidate), timeout_s=30)
    # The first user turn is stored before the router picks the version: it names the model, its
    # answer the version; every later turn is routed to that version.
    assert turns == [("user", NAME), ("assistant", f"{NAME}@2")] + [("user", f"{NAME}@2"), ("assistant", f"{NAME}@2")] * 3


async def test_shadow_answers_are_stored_and_never_streamed(rollout_stack):
    store = SqliteStore(rollout_stack.store_path)
    await store.start()
    try:
        async with httpx.AsyncClient(base_url=rollout_stack.url, timeout=120) as client:
            await set_rollout(rollout_stack, client, "2", 0, shadow=100)
            conversation_id = await new_conversation(client)
            status, meta, text = await send(client, conversation_id, "Name a colour.")
            assert (status, meta["model"]) == (200, f"{NAME}@1")
            reply_id = meta["message_id"]

            async def recorded():
                answers = await store.shadow_answers(reply_id)
                return answers or None

            (shadow,) = await wait_until(recorded, timeout_s=60)
            assert (shadow.model, shadow.shadow_of, shadow.user_id) == (f"{NAME}@2", reply_id, "alice")
            assert shadow.num_output_tokens >= 1 and shadow.finish in ("stop", "length"), shadow

            # Never shown: the conversation holds only the stable's answer, and the shadow's id
            # streams nothing to anyone (it belongs to no conversation).
            async def stored() -> list[dict] | None:  # the relay stores the shown answer and the shadow independently
                messages = (await client.get(f"/v1/conversations/{conversation_id}", headers=ALICE)).json()["messages"]
                return None if any(m["status"] == "running" for m in messages) else messages

            messages = await wait_until(stored, timeout_s=30)
            assert [(m["role"], m["model"]) for m in messages] == [("user", NAME), ("assistant", f"{NAME}@1")]
            assert shadow.reply_id not in {m["id"] for m in messages}
            assert messages[1]["content"] == text
            response = await client.get(f"/v1/messages/{shadow.reply_id}/stream", headers=ALICE)
            assert response.status_code == 404, response.text
            await set_rollout(rollout_stack, client, "2", 0)
    finally:
        await store.close()


async def test_a_failing_candidate_is_rolled_back_automatically(rollout_stack):
    async with httpx.AsyncClient(base_url=rollout_stack.url, timeout=120) as client:
        await set_rollout(rollout_stack, client, "3", 50)
        refused, answered = 0, []
        entry = None
        for _ in range(80):  # about 2 x MIN_REPLIES messages roll it back; a bound, not a pause
            _, status, meta = await first_message(client)
            if status == 200:
                answered.append(meta["model"])
            else:  # the broken build's workers refuse its prompts: the candidate's errors
                assert (status, meta["error"]["code"]) == (400, "bad_request"), meta
                refused += 1
            rollout = (await client.get("/v1/status")).json()["rollout"]  # null while no router's status is fresh
            entry = rollout[0] if rollout else entry
            if entry is not None and entry["rolled_back"]:
                break
        assert entry is not None and entry["rolled_back"], entry
        print(f"rolled back after {refused} refused and {len(answered)} answered messages: {entry['rollback_reason']}")
        assert refused >= MIN_REPLIES and set(answered) <= {f"{NAME}@1"}, (refused, answered)
        assert entry["candidate_percent"] == 0 and entry["configured_percent"] == 50
        assert entry["rollback_reason"].startswith("error rate"), entry
        # Rolled back: every new conversation is the stable's, though the candidate is still served.
        after = [await first_message(client) for _ in range(6)]
        assert [(status, meta["model"]) for _, status, meta in after] == [(200, f"{NAME}@1")] * 6
        router_url = rollout_stack.ops_urls[rollout_stack.ids["router"][0]]
        metrics = (await client.get(f"{router_url}/metrics")).text
    rollbacks = {
        frozenset(sample.labels.items()): sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "tandem_router_rollbacks_total"
    }
    assert rollbacks == {frozenset({("model", NAME), ("version", "3"), ("reason", "error_rate")}): 1.0}
