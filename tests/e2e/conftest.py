"""The e2e stacks, named by what they are for; a module that needs the same settings as another
takes the same fixture, so each stack starts once per session.

- product_stack: every service a process (router, decode worker, two relays, two chat instances),
  default settings, on a nats-server and redis-server of its own, so its router, workers and relays
  never take part in another test's traffic on the session's servers.
- lean_stack: router, decode worker, relay and chat on servers of their own, with settings the
  product stack must not have: the free tier's prompt budget small enough that a conversation
  outgrows it in a few turns (summaries), and the relay's output check a blocklist of one word no
  other prompt or answer holds (output moderation). Its free user (bob) writes the summaries' turns
  and its plus user (alice) the moderated ones, so neither module's answers meet the other's limit.
"""

from __future__ import annotations

import pytest_asyncio
from product_stack import BLOCKED, LEAN_MAX_ANSWER_TOKENS, LEAN_PROMPT_BUDGET_FREE, LEAN_ROLES, LEAN_SUMMARY_MAX_TOKENS, own_product_stack


@pytest_asyncio.fixture(scope="session")
async def product_stack(tmp_path_factory):
    async with own_product_stack(tmp_path_factory.mktemp("product")) as stack:
        yield stack


@pytest_asyncio.fixture(scope="session")
async def lean_stack(tmp_path_factory):
    env = {
        "TANDEM_OUTPUT_MODERATION": f"blocklist:{BLOCKED}",
        "TANDEM_PROMPT_BUDGET_FREE": str(LEAN_PROMPT_BUDGET_FREE),
        "TANDEM_MAX_ANSWER_TOKENS": str(LEAN_MAX_ANSWER_TOKENS),
        "TANDEM_SUMMARY_MAX_TOKENS": str(LEAN_SUMMARY_MAX_TOKENS),
    }
    async with own_product_stack(tmp_path_factory.mktemp("lean"), roles=LEAN_ROLES, **env) as stack:
        yield stack
