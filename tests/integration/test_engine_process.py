"""The engine in a process of its own (tandem.worker.engine_process), driven as a worker drives
it: the same greedy tokens as the engine in this process, calls that return and raise what the
engine does, a KV cache both processes see, and an end that never leaves either side waiting —
its death (kill -9) is the worker's `on_death`, and its worker's death (kill -9) ends it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from functools import partial
from operator import methodcaller

import pytest
import torch
import uvloop

from tandem.config import Settings
from tandem.engine.block_pool import NoFreeBlocks
from tandem.engine.engine import EngineStats, Request, RequestOutput, TokenIdOutOfRange
from tandem.engine.scheduler import EmptyPrompt, PromptTooLong
from tandem.engine.sequence import Lane, SamplingOptions
from tandem.models.files import open_model
from tandem.worker.engine_calls import add, reserve_import
from tandem.worker.engine_process import EngineProcess
from tandem.worker.engine_spec import EngineSpec, build_engine
from tandem.worker.thread import EngineDead

PROMPT = (1, 9690, 28, 940, 314, 253, 2118, 6128, 30, 2)
DEADLINE_S = 120.0


def spec(**overrides: object) -> EngineSpec:
    settings = Settings(dtype="fp32", kv_cache_mib=16, torch_threads=1, **overrides)  # type: ignore[arg-type]
    return EngineSpec.from_settings(settings, open_model(settings.model_path, settings.served_model_name, settings.quantization))


class Driven:
    """An EngineProcess with what it reported: outputs per request, changes, its death."""

    def __init__(self, engine_spec: EngineSpec | None = None) -> None:
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.finished: dict[str, asyncio.Event] = {}
        self.stats: list[EngineStats] = []
        self.deaths: list[BaseException] = []
        self.died = asyncio.Event()
        self.process = EngineProcess(engine_spec or spec(), self._on_outputs, asyncio.get_running_loop(), self._on_change, self._on_death)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self.outputs.setdefault(output.request_id, []).append(output)
            if output.is_finished:
                self.finished.setdefault(output.request_id, asyncio.Event()).set()

    def _on_change(self, stats: EngineStats, events: list, waits: list) -> None:
        self.stats.append(stats)

    def _on_death(self, exc: BaseException) -> None:
        self.deaths.append(exc)
        self.died.set()

    async def ready(self) -> EngineProcess:
        self.process.start()
        deadline = time.monotonic() + DEADLINE_S
        while not self.process.is_ready:
            assert not self.deaths, self.deaths
            assert time.monotonic() < deadline, "the engine process never said ready"
            await asyncio.sleep(0.05)
        return self.process

    async def run_with_cut(self, request: Request) -> None:
        """Adds a paid request as a worker does (the add, then cut_step) and waits for its reply."""
        self.finished.setdefault(request.request_id, asyncio.Event())
        self.process.post(partial(add, request))
        self.process.cut_step()
        await asyncio.wait_for(self.finished[request.request_id].wait(), DEADLINE_S)

    async def run(self, request: Request) -> list[int]:
        self.finished.setdefault(request.request_id, asyncio.Event())
        self.process.post(partial(add, request))
        await asyncio.wait_for(self.finished[request.request_id].wait(), DEADLINE_S)
        return [t for output in self.outputs[request.request_id] for t in output.new_token_ids]


def greedy(request_id: str, max_tokens: int = 12) -> Request:
    return Request(request_id, PROMPT, SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


@pytest.fixture
async def driven():
    driven = Driven()
    try:
        yield driven
    finally:
        driven.process.stop(timeout_s=10)


async def test_the_engine_process_streams_the_same_greedy_tokens_as_the_engine_here(driven):
    process = await driven.ready()
    tokens = await driven.run(greedy("r-1"))
    here = build_engine(spec())
    expected = [t for output in here.generate([greedy("r-here")])["r-here"] for t in output.new_token_ids]
    assert tokens == expected and len(tokens) == 12
    stats, num_applied = process.snapshot
    assert num_applied == 1 and stats.num_generated_tokens == 12  # the stats include the posted add


@pytest.mark.parametrize("step_tokens", [2048, 32])
async def test_an_added_prompt_shows_queued_before_each_step_that_computes_it(step_tokens):
    """The worker's heartbeat reads the last stats reported: a prompt one step computes whole
    (100 tokens, within a step's budget) must be reported queued before that step, or the router
    sees an idle worker for the whole of it; one of several steps counts down after each."""
    budget = {"max_num_batched_tokens": step_tokens, "max_num_prefill_only_batched_tokens": step_tokens}
    driven = Driven(spec(**budget))
    try:
        await driven.ready()
        prompt = (PROMPT * 10)[:100]
        await driven.run(Request("r-long", prompt, SamplingOptions(temperature=0.0, max_tokens=2, ignore_eos=True)))
    finally:
        driven.process.stop(timeout_s=10)
    queued = [stats.scheduler.num_queued_prefill_tokens for stats in driven.stats]
    left = list(range(len(prompt), 1, -step_tokens))  # 100; or 100, 68, 36, 4: the last chunk's 4 still queued
    assert list(dict.fromkeys(queued)) == [*left, 0], queued


async def test_calls_return_and_raise_what_the_engine_does_and_check_answers_at_once(driven):
    process = await driven.ready()
    reservation = await process.call(partial(reserve_import, greedy("r-import"), 2))
    assert reservation.block_ids
    with pytest.raises(NoFreeBlocks):
        await process.call(partial(reserve_import, greedy("r-huge"), 10**6))
    await process.check(greedy("r-ok"))
    with pytest.raises(TokenIdOutOfRange):
        await process.check(Request("r-bad", (1, 10**9), SamplingOptions()))
    with pytest.raises(EmptyPrompt):
        await process.check(Request("r-empty", (), SamplingOptions()))
    with pytest.raises(PromptTooLong):
        await process.check(Request("r-long", (1,) * 10**6, SamplingOptions()))
    # A result that cannot travel back is an error, not a call that never answers.
    with pytest.raises(RuntimeError, match="could not be sent back"):
        # Thread(None, None, engine): an unstarted thread named after the engine, which holds a lock
        await asyncio.wait_for(process.call(partial(threading.Thread, None, None)), 30)


async def test_a_paid_add_cuts_the_step_of_free_work_in_progress_and_every_reply_is_the_engines_here():
    """As a worker adds a paid request: the add, then cut_step. A step of the free prompt's 4-row
    chunks (the step's budget) in progress ends early, the paid reply runs next, and both replies
    are the greedy tokens of the engine in this process."""
    cut_spec = spec(max_num_batched_tokens=4, max_num_unpaid_batched_tokens=4)
    free = Request("free", PROMPT * 20, SamplingOptions(temperature=0.0, max_tokens=4, ignore_eos=True), lane=Lane.FREE)
    driven = Driven(cut_spec)
    try:
        process = await driven.ready()
        driven.finished["free"] = asyncio.Event()
        process.post(partial(add, free))
        paid_ids: list[str] = []
        deadline = time.monotonic() + DEADLINE_S
        while not (driven.stats and driven.stats[-1].num_cut_steps) and not driven.finished["free"].is_set():
            assert time.monotonic() < deadline, "no step was ever cut"
            paid = Request(f"paid-{len(paid_ids)}", PROMPT, SamplingOptions(temperature=0.0, max_tokens=4, ignore_eos=True), lane=Lane.PAID)
            paid_ids.append(paid.request_id)
            await driven.run_with_cut(paid)
        assert driven.stats[-1].num_cut_steps >= 1, "a paid add during the free prompt's 50 chunks cut one"
        await asyncio.wait_for(driven.finished["free"].wait(), DEADLINE_S)
        here = build_engine(cut_spec)
        expected = here.generate([free, *(replace(free, request_id=i, prompt_token_ids=PROMPT, lane=Lane.PAID) for i in paid_ids)])
        for request_id in ["free", *paid_ids]:
            got = [t for output in driven.outputs[request_id] for t in output.new_token_ids]
            assert got == [t for output in expected[request_id] for t in output.new_token_ids], request_id
    finally:
        driven.process.stop(timeout_s=10)


async def test_both_processes_see_one_kv_cache(driven):
    process = await driven.ready()
    await driven.run(greedy("r-kv", max_tokens=2))
    written = [b for b in range(process.facts.kv_shape.num_blocks) if process.block_views(b)[0].any()]
    assert written, "the prefill wrote K and V into blocks this process sees"
    for block_id in written:  # what the engine process reads is what this one maps
        assert torch.equal(await process.call(methodcaller("block_view", block_id)), process.block_views(block_id)[0])
    free_block = next(b for b in range(process.facts.kv_shape.num_blocks) if b not in written)
    process.block_views(free_block)[0].fill_(0.5)  # as a handoff's receive writes a reserved block
    assert bool((await process.call(methodcaller("block_view", free_block)) == 0.5).all())


async def test_an_engine_process_killed_is_a_death_and_every_call_then_raises_engine_dead(driven):
    process = await driven.ready()
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    await asyncio.wait_for(driven.died.wait(), DEADLINE_S)
    assert len(driven.deaths) == 1 and isinstance(driven.deaths[0], EngineDead) and not process.is_ready
    with pytest.raises(EngineDead):
        await process.call(methodcaller("has_work"))
    with pytest.raises(EngineDead):
        await process.check(greedy("r-after"))


def _only_importable_here(engine: object) -> int:
    """A call the engine process cannot unpickle: it cannot import this test module."""
    return 1


async def test_a_call_the_engine_process_cannot_read_ends_it_a_death_and_not_a_call_that_never_answers(driven):
    process = await driven.ready()
    with pytest.raises(EngineDead):
        await asyncio.wait_for(process.call(_only_importable_here), DEADLINE_S)
    assert len(driven.deaths) == 1 and not process.is_ready


async def test_stop_ends_the_engine_process():
    driven = Driven()
    process = await driven.ready()
    pid = process.pid
    process.stop(timeout_s=30)
    assert process.exit_code == 0 and not driven.deaths
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_the_engine_process_ends_when_its_worker_is_killed(tmp_path):
    # A worker that starts its engine process, says its pid, and waits to be killed.
    (tmp_path / "worker.py").write_text(
        textwrap.dedent(
            """
            import asyncio, sys, time
            sys.path.insert(0, sys.argv[1])
            from test_engine_process import Driven

            async def main():
                driven = Driven()
                process = await driven.ready()
                print("engine-pid", process.pid, flush=True)
                await asyncio.sleep(600)

            asyncio.run(main())
            """
        )
    )
    worker = subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), os.path.dirname(__file__)], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        lines: list[str] = []  # the engine process's log lines, then the pid (or nothing: the worker died)
        while len(lines) < 20 and (not lines or (lines[-1] and not lines[-1].startswith("engine-pid "))):
            lines.append(worker.stdout.readline())
        said = [line.split()[1] for line in lines if line.startswith("engine-pid ")]
        assert said, f"the worker did not start its engine process: {lines!r}"
        engine_pid = int(said[0])
        worker.kill()
        worker.wait(30)
        deadline = time.monotonic() + 60
        while _is_running(engine_pid):
            assert time.monotonic() < deadline, "the engine process outlived its worker by a minute"
            time.sleep(0.05)
    finally:
        worker.kill()
        worker.wait(30)


def _is_running(pid: int) -> bool:
    """Alive and not a zombie (the killed worker's child is reparented and reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_under_uvloop_messages_bigger_than_the_socket_s_buffer_arrive_whole_both_ways():
    """A worker's event loop is uvloop's (uvicorn's), whose add_reader makes the worker's end of
    the socket non-blocking: calls and results of a few hundred kB to megabytes still arrive
    whole and in order, and none is taken for the engine's death (Connection's reads and writes
    failed there mid-message with BlockingIOError)."""

    async def scenario() -> None:
        driven = Driven()
        try:
            process = await driven.ready()
            await driven.run(greedy("r-fill"))
            blocks = range(8)
            views = await asyncio.gather(*(process.call(methodcaller("block_view", b)) for b in blocks for _ in range(4)))
            assert views[0].numel() * views[0].element_size() > 200_000, "each result is more than a socket buffer"
            for index, view in enumerate(views):
                assert torch.equal(view, process.block_views(blocks[index // 4])[0])
            big = {"big": b"x" * 4_000_000}
            assert await asyncio.gather(*(process.call(partial(dict.get, big)) for _ in range(4))) == [None] * 4
            assert len(await driven.run(greedy("r-after"))) == 12
            assert not driven.deaths
        finally:
            driven.process.stop(timeout_s=10)

    uvloop.run(scenario())
