"""Keeping one stack member running: started again with backoff when it exits, its readiness
announced while it runs, parked while a drill holds it down."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable

import httpx

from tandem.devstack.members import Member
from tandem.devstack.proc import describe_exit
from tandem.errors import StartupError

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


async def supervise(member: Member, *, stopping: asyncio.Event, say: Callable[[str], None], stable_after_s: float) -> None:
    """Keeps `member` running (a member already started, a server, is watched first), except
    while it is held, until `stopping` is set. A member that ran `stable_after_s` starts its
    backoff afresh."""
    while not stopping.is_set():
        if member.is_held:
            member.is_parked.set()
            await _sleep_unless_woken(member, stopping, None)
            continue
        member.is_parked.clear()
        started_s = time.monotonic()
        try:
            if member.child is None or member.child.poll() is not None:
                member.child = await asyncio.to_thread(member.launch)
                say(f"{member.name} started (pid {member.child.pid})")
        except StartupError as exc:
            outcome = f"failed to start: {exc}"
        else:
            if member.is_held or stopping.is_set():  # held, or the stack stopping, while it started
                signal_child(member.child.pid, signal.SIGTERM)
            outcome = await _watch(member, say)
        if stopping.is_set():
            return
        if member.is_held:
            say(f"{member.name} {outcome}; held down until released")
            continue
        if time.monotonic() - started_s >= stable_after_s:
            member.num_quick_restarts = 0
        delay_s = BACKOFF_S[min(member.num_quick_restarts, len(BACKOFF_S) - 1)]
        member.num_quick_restarts += 1
        say(f"{member.name} {outcome}; restarting in {delay_s:.0f} s")
        await _sleep_unless_woken(member, stopping, delay_s)


def signal_child(pid: int, signum: int) -> None:
    """A signal to a child that may have exited a moment ago (its pid is not reaped, so not reused)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


async def _sleep_unless_woken(member: Member, stopping: asyncio.Event, delay_s: float | None) -> None:
    """Waits `delay_s` (None: for ever), cut short by a stop or by hold/release."""
    woken = asyncio.ensure_future(member.wake.wait())
    stopped = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({woken, stopped}, timeout=delay_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        woken.cancel()
        stopped.cancel()
        member.wake.clear()


async def _watch(member: Member, say: Callable[[str], None]) -> str:
    """Waits for the member's exit, announcing readiness meanwhile; says how it ended."""
    assert member.child is not None
    readiness = None
    if member.readyz_url is None:
        member.is_ready.set()
    else:
        readiness = asyncio.create_task(_await_ready(member, say))
    try:
        returncode = await member.child.wait_async()
    finally:
        member.is_ready.clear()
        if readiness is not None:
            readiness.cancel()
    return f"exited ({describe_exit(returncode)})"


async def _await_ready(member: Member, say: Callable[[str], None]) -> None:
    assert member.readyz_url is not None
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            try:
                if (await client.get(member.readyz_url)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
    member.is_ready.set()
    say(f"{member.name} ready")
