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
- tools_stack: router, decode worker, relay and chat serving a random-weight llama checkpoint whose
  chat template (the tests' own, Hermes-style: tests/reference_model.py) offers tools, for the tool
  calls and the clients that send tools (test_openai_tool_calls, test_client_compat). Its context
  window holds a prompt of a front-end's twenty tool specs in the tests' tiny tokenizer.
"""

from __future__ import annotations

import json

import pytest_asyncio
from product_stack import BLOCKED, LEAN_MAX_ANSWER_TOKENS, LEAN_PROMPT_BUDGET_FREE, LEAN_ROLES, LEAN_SUMMARY_MAX_TOKENS, own_product_stack

# The tools stack's context window, in the tests' tokenizer (a few hundred tokens of vocabulary:
# JSON tool specs are about one token per character).
TOOLS_CONTEXT = 16384


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


@pytest_asyncio.fixture(scope="session")
async def tools_stack(tmp_path_factory):
    from hf_models import write_hf_checkpoint  # torch and transformers: only for the modules that take this stack
    from reference_model import TOOLS_TEMPLATE, write_tokenizer
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("tools-model")
    write_tokenizer(folder)
    vocab_size = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    write_hf_checkpoint("llama", folder, seed=3, vocab_size=vocab_size, max_position_embeddings=TOOLS_CONTEXT)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": TOOLS_TEMPLATE}))
    env = {
        "TANDEM_MODEL_PATH": str(folder),
        "TANDEM_DTYPE": "fp32",
        # The checks' classifier would score the noise model's text: neither is what these tests are about.
        "TANDEM_INPUT_MODERATION": "none",
        "TANDEM_OUTPUT_MODERATION": "none",
    }
    async with own_product_stack(tmp_path_factory.mktemp("tools-stack"), roles=LEAN_ROLES, **env) as stack:
        yield stack
