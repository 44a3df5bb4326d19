"""The drills: the fault each causes mid-stream on the stack, how many streams it runs, and its
target (printed beside the numbers as PASS/MISS, never an exit code)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from drill_report import DrillReport
from drill_stack import DrillStack
from drill_storm import reconnect_storm, storm_met, storm_target

Fault = Callable[[DrillStack], Awaitable[str]]
PARTITION_S = 10.0  # how long a partition lasts
HOST_DRILLS = ("partition_decode", "partition_relay_redis")  # they need every member on a host of its own
HA_DRILLS = ("kill_redis_primary", "kill_nats_node", "kill_nats_leader")  # they need the stack's servers with failover (--ha)
# A drill that drives its own load and fault (the reconnect storm) instead of drills.run_load's.
OwnRun = Callable[[DrillStack, argparse.Namespace], Awaitable[DrillReport]]


async def kill_decode(stack: DrillStack) -> str:
    name = stack.busiest("decode")
    pid = stack.signal(name, signal.SIGKILL)
    return f"kill -9 {name} (pid {pid})"


async def kill_decode_rank(stack: DrillStack) -> str:
    """kill -9 the last rank of the busiest decode worker's tensor-parallel engine (the stack runs
    with TANDEM_TENSOR_PARALLEL_SIZE > 1): the group ends, and its replies continue elsewhere."""
    name = stack.busiest("decode")
    worker_pid = stack.stack.member(name).pid
    ranks = rank_pids(worker_pid) if worker_pid is not None else []
    if not ranks:
        raise RuntimeError(f"{name} runs no tensor-parallel ranks: run the drills with --tensor-parallel-size N (N > 1)")
    os.kill(ranks[-1], signal.SIGKILL)
    return f"kill -9 rank {len(ranks)} (pid {ranks[-1]}) of {name}'s engine"


def rank_pids(worker_pid: int) -> list[int]:
    """The processes of ranks 1..N-1 a worker started (`python -m tandem.worker.engine_rank RANK`), by rank."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if ppid == worker_pid and b"tandem.worker.engine_rank" in argv:
            found[int(argv[argv.index(b"tandem.worker.engine_rank") + 1])] = int(entry.name)
    return [found[rank] for rank in sorted(found)]


async def kill_prefill(stack: DrillStack) -> str:
    name = stack.members("prefill")[0]
    pid = stack.signal(name, signal.SIGKILL)
    return f"kill -9 {name} (pid {pid})"


async def kill_relay(stack: DrillStack) -> str:
    name = stack.members("relay")[0]
    pid = stack.signal(name, signal.SIGKILL)
    return f"kill -9 {name} (pid {pid})"


async def restart_redis(stack: DrillStack) -> str:
    old_pid = stack.stack.member("redis").pid
    await stack.stack.restart("redis", signal.SIGTERM, timeout_s=60.0)
    return f"SIGTERM redis-server (pid {old_pid}), started again on the same port (pid {stack.stack.member('redis').pid})"


async def pause_nats(stack: DrillStack) -> str:
    pid = stack.signal("nats", signal.SIGSTOP)
    await asyncio.sleep(10.0)  # the fault itself lasts 10 s
    stack.signal("nats", signal.SIGCONT)
    return f"SIGSTOP nats-server (pid {pid}) for 10 s"


def connected_peers(pid: int) -> set[tuple[str, int]]:
    """The (address, port) at the other end of each established TCP connection of process `pid`,
    read from /proc (its own network namespace's table)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    peers = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "01" and fields[9] in inodes:  # ESTABLISHED
            address, port = fields[2].split(":")
            peers.add((socket.inet_ntoa(bytes.fromhex(address)[::-1]), int(port, 16)))
    return peers


async def kill_nats_node(stack: DrillStack) -> str:
    """kill -9 the NATS node the relay is connected to (--ha: a cluster of three); the relay and
    every service on it reconnect to another node."""
    relay = stack.members("relay")[0]
    relay_pid = stack.stack.member(relay).pid
    if relay_pid is None:
        raise RuntimeError("the relay is not running")
    peers = connected_peers(relay_pid)
    nodes = stack.stack.members_of("nats")
    if len(nodes) < 2:
        raise RuntimeError("the stack runs one NATS node: this drill needs --ha")
    node = next((m for m in nodes if (urlsplit(m.url).hostname, urlsplit(m.url).port) in peers), None)
    if node is None:
        raise RuntimeError(f"the relay (pid {relay_pid}) is connected to no NATS node; its peers: {sorted(peers)}")
    stream_leader, consumer_leader = await stack.stream_leaders()
    led = [
        what
        for what, leader in (("the token stream", stream_leader), ("the relay's consumer", consumer_leader))
        if leader == f"tandem-{node.name}"
    ]
    pid = stack.signal(node.name, signal.SIGKILL)
    # A leader's loss waits for nats-server's raft election (4-9 s, fixed in its code).
    held = " and ".join(led) or "neither the token stream nor the relay's consumer"
    return f"kill -9 {node.name} (pid {pid}), the NATS node the relay was connected to; it led {held}"


async def kill_nats_leader(stack: DrillStack) -> str:
    """kill -9 the NATS node leading the token stream (--ha), the worst node to lose: publishes
    wait until the other two elect a new leader (nats-server's raft: 4-9 s, fixed in its code)."""
    stream_leader, consumer_leader = await stack.stream_leaders()
    node = next((m for m in stack.stack.members_of("nats") if f"tandem-{m.name}" == stream_leader), None)
    if node is None:
        raise RuntimeError(f"no NATS member of the stack leads the token stream (its leader: {stream_leader!r}); this drill needs --ha")
    also = " and the relay's consumer" if consumer_leader == stream_leader else ""
    pid = stack.signal(node.name, signal.SIGKILL)
    return f"kill -9 {node.name} (pid {pid}), the leader of the token stream{also}"


async def kill_redis_primary(stack: DrillStack) -> str:
    """kill -9 the Redis node the sentinels name the primary: they promote a replica, and the
    relay and chat find it through them."""
    redis_ha = stack.stack.redis_ha
    if redis_ha is None:
        raise RuntimeError("the stack runs one Redis: this drill needs --ha")
    primary = await asyncio.to_thread(redis_ha.primary)
    if primary is None:
        raise RuntimeError("no sentinel names a Redis primary")
    pid = stack.signal(primary.name, signal.SIGKILL)
    return f"kill -9 the Redis primary {primary.name} (pid {pid})"


async def partition_decode(stack: DrillStack) -> str:
    """The busiest decode worker's host loses its network (link down) for PARTITION_S, then gets
    it back: its replies continue on the other decode worker meanwhile."""
    name = stack.busiest("decode")
    host, network = stack.stack.host(name), stack.network
    network.cut(host)
    try:
        await asyncio.sleep(PARTITION_S)  # the fault itself lasts this long
    finally:
        network.heal(host)
        stack.healed_unix_s = time.time()
    return f"cut {name}'s host ({host.address}) off the network for {PARTITION_S:.0f} s, then healed it"


async def partition_relay_redis(stack: DrillStack) -> str:
    """The relay's host and Redis's host (--ha: the primary's) cannot reach each other for
    PARTITION_S (each still reaches every other host), then can again."""
    redis_ha = stack.stack.redis_ha
    primary = await asyncio.to_thread(redis_ha.primary) if redis_ha is not None else None
    redis_name = "redis" if redis_ha is None else primary.name if primary is not None else ""
    if not redis_name:
        raise RuntimeError("no sentinel names a Redis primary")
    relay, redis = stack.stack.host(stack.members("relay")[0]), stack.stack.host(redis_name)
    network = stack.network
    network.separate(relay, redis)
    try:
        await asyncio.sleep(PARTITION_S)  # the fault itself lasts this long
    finally:
        network.join(relay, redis)
        stack.healed_unix_s = time.time()
    return f"cut the relay's host ({relay.address}) off Redis's ({redis.address}) for {PARTITION_S:.0f} s, then joined them"


async def rolling(stack: DrillStack) -> str:
    done = []
    for name in stack.service_members():
        pid = stack.signal(name, signal.SIGTERM)
        await stack.wait_restarted(name, pid, timeout_s=180.0)
        done.append(name)
    return "SIGTERM in turn: " + ", ".join(done)


@dataclass(frozen=True)
class DrillPlan:
    name: str
    fault: Fault | None
    num_streams: int
    target: str
    long_prompts: bool = False
    disconnects: int = 0
    check_texts: bool = True
    steady: bool = False  # the load lasts as long as the fault: each reply is sent again once it ends
    own_run: OwnRun | None = None


def plans(args: argparse.Namespace) -> dict[str, DrillPlan]:
    n = args.streams
    return {
        "kill_decode": DrillPlan("kill_decode", kill_decode, n, f"{n}/{n} complete, texts identical, longest pause <= 3 s"),
        "kill_decode_rank": DrillPlan("kill_decode_rank", kill_decode_rank, n, f"{n}/{n} complete, texts identical, longest pause <= 3 s"),
        "kill_prefill": DrillPlan(
            "kill_prefill", kill_prefill, max(1, n // 2), f"{max(1, n // 2)}/{max(1, n // 2)} complete", long_prompts=True
        ),
        "kill_relay": DrillPlan("kill_relay", kill_relay, n, f"{n}/{n} complete, every stored turn complete"),
        "restart_redis": DrillPlan("restart_redis", restart_redis, n, f"{n}/{n} complete, every stored turn complete"),
        "pause_nats": DrillPlan("pause_nats", pause_nats, n, "every reply completes or errors clearly; 0 hung", check_texts=False),
        "kill_nats_node": DrillPlan(
            "kill_nats_node", kill_nats_node, n, f"{n}/{n} complete, texts identical, every stored turn complete, pause <= 5 s"
        ),
        "kill_nats_leader": DrillPlan(
            "kill_nats_leader", kill_nats_leader, n, f"{n}/{n} complete, texts identical, every stored turn complete, pause <= 5 s"
        ),
        "kill_redis_primary": DrillPlan(
            "kill_redis_primary", kill_redis_primary, n, f"{n}/{n} complete, texts identical, every stored turn complete, pause <= 5 s"
        ),
        "partition_decode": DrillPlan(
            "partition_decode",
            partition_decode,
            n,
            f"{n}/{n} complete (continued elsewhere), texts identical, <= 5 s after the heal",
        ),
        "partition_relay_redis": DrillPlan(
            "partition_relay_redis",
            partition_relay_redis,
            n,
            f"{n}/{n} complete, every stored turn complete, <= 5 s after the heal",
        ),
        "rolling": DrillPlan("rolling", rolling, max(1, n // 2), "0 replies lost (0 hung, 0 errors)", steady=True),
        "resume": DrillPlan(
            "resume", None, args.resume_streams, "every text identical, event ids contiguous", disconnects=args.resume_drops
        ),
        "reconnect_storm": DrillPlan(
            "reconnect_storm", None, args.storm_streams, storm_target(args), check_texts=False, own_run=reconnect_storm
        ),
    }


def met(report: DrillReport, plan: DrillPlan) -> bool:
    n = report.num_replies
    identical = report.texts_identical == n if report.texts_identical is not None else True
    if plan.name in ("kill_decode", "kill_decode_rank"):
        return report.completed == n and identical and report.longest_pause_s <= 3.0
    if plan.name in ("kill_relay", "restart_redis"):
        return report.completed == n and report.stored.get("complete", 0) == n
    after_heal = report.pause_after_heal_s if report.pause_after_heal_s is not None else float("inf")
    if plan.name in ("kill_redis_primary", "kill_nats_node", "kill_nats_leader"):
        stored = report.stored.get("complete", 0) == n
        return report.completed == n and identical and stored and report.hung == 0 and report.longest_pause_s <= 5.0
    if plan.name == "partition_decode":
        return report.completed == n and identical and report.hung == 0 and after_heal <= 5.0
    if plan.name == "partition_relay_redis":
        return report.completed == n and report.stored.get("complete", 0) == n and after_heal <= 5.0
    if plan.name == "pause_nats":
        return report.hung == 0
    if plan.name == "reconnect_storm":
        return storm_met(report)
    if plan.name == "resume":
        return report.completed == n and identical and report.ids_contiguous
    return report.completed == n
