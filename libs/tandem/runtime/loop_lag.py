"""How late a service's event loop runs: a timer asked for every LAG_INTERVAL_S, and how much
later than asked it fired (tandem_event_loop_lag_seconds). Everything the process does waits
that long on a busy loop: a chat's streams, a router's choices, a worker's step events."""

from __future__ import annotations

import asyncio

from tandem import metrics

LAG_INTERVAL_S = 0.1


async def watch_loop_lag(interval_s: float = LAG_INTERVAL_S) -> None:
    """Runs until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due_s = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        metrics.EVENT_LOOP_LAG.observe(max(0.0, loop.time() - due_s))
