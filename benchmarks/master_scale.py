"""How many nodes one dlrover-master holds: N simulated agents against a real master process.

Run: PYTHONPATH=. python benchmarks/master_scale.py [--nodes 1000 2000 5000 10000]
         [--steady-s 40] [--protocol long-poll|poll|both] [--against REV]
         [--storm errors [--storm-gap-s 60] [--storm-kb 64] | --storm lose:0.1 [--engine fake]
          | --storm master-kill]

The master is a real `dlrover-master` (its default SQLite state, INFO logs to a file); the agents
are coroutines in this one process, each with the RPC sequence of a real agent
(`dlrover/agent/rendezvous_client.py`, `heartbeat.py`):

1. register (RegisterNode), and start heart-beating at the interval the master asks for;
2. rendezvous: JoinRendezvous, then GetCommWorld until the round closed;
3. steady state for --steady-s seconds: heartbeats, and the membership watch;
4. exit barrier: ReportNodeStatus(succeeded) until the job is done.

`long-poll` is today's protocol (the master holds GetCommWorld, the watch and the barrier until
the answer changes); `poll` is the protocol before it (GetCommWorld every 0.1 s, membership
every 0.5 s, heartbeats every 2 s, the barrier's report and status every 0.5 s), run against
the same master, so the table shows what the redesign buys. ``--against REV`` runs the
long-poll protocol at each size against the master of that commit too (a git worktree beside
this one), in the order REV, this, this, REV (the master run second in a row registers its
nodes slower, even the same code), and prints the mean of this master's figures over that
one's.

``--storm errors``: after the steady state, every node reports a failure with a 64 KB stack (the
same traceback, its rank, pid and host numbers its own) within one second, and again
``--storm-gap-s`` later; the storm table puts the quiet steady state of the same run beside it:
heartbeat p99 and RSS, then the storm's heartbeat p99 (heartbeats only, both waves), the master's
peak RSS, how long each wave's reports took to be answered, and what `dlrover diagnose` then
costs: its RPC (GetFailures, through the CLI's own client) and the records it shows.
``--storm lose:0.1``: after the steady state a tenth of the nodes go silent in the same moment
(heartbeats and watches stop, as when a rack goes); the master loses them on its heartbeat
timeout, the survivors' watches fire and they re-join; the benchmark, as the engine would,
registers one replacement per lost node and the round forms again. Its table: when the master
noticed, how spread the survivors' re-joins were and how many were refused, how long from the
last replacement's registration to the round, the heartbeat p99 meanwhile, and the losses
the master recorded (each node once: as many as lost, from as many nodes).

``--engine fake[:RATE:LO:HI]`` (with ``--storm lose``): the master runs its node controller over
a fake engine standing for Kubernetes (master_scale_engine.py: at most RATE pod creations a
second, default 100, a 429 past it; each pod up LO-HI s after its creation, default 1-5), whose
pods the job's nodes are. The engine reports half of the lost nodes (pods deleted); the other
half only go silent. The master relaunches every one through its launch queue (the silent ones
after their grace, DLROVER_SILENT_REPLACE_S: 10 s or the heartbeat timeout where longer); a replacement's agent starts
here when the engine says its pod runs. The table adds, per kind, the longest time from a
node's loss to the engine accepting its replacement, the launches the engine refused, and the
longest launch latency.

``--calls N``: only the CPU per call, the arrival pattern held equal: N heartbeats to a real
master with one registered node, and N calls of the same size to the bare echo, first 200 in
flight, then one at a time (as nodes spread over a heartbeat interval send them).

``--storm master-kill``: the master is SIGKILLed once half the nodes joined the first round,
and again in the steady state, each time started again on the same port, state and token (as
`dlrover submit` or a Kubernetes Deployment does); the nodes ask again while it is away. Its
table: how soon each new master listened, the rendezvous time with the kill in it, how soon
after the second restart every node's heartbeat was answered again, the nodes recorded lost
(none should be: the outage is the master's), the rounds re-formed (none should be) and the
calls the outage failed. Through the second kill up to 1,000 of the nodes lease the shards of a
dataset (6 each), train on each for 0.2-0.6 s and report it done; the table adds the shards
lost (never done), done twice, and handed out twice (told to two workers), the lease calls the
outage failed, and when the dataset finished (a grant whose answer the kill took goes out
again after its 10 s lease).

Heartbeat p99 (probe): a separate process sends the heartbeats of 20 of the nodes every 0.5 s
and times them, so the figure is what an agent in its own process sees, without the queueing of
the process that simulates all the others (the "p99 ms" column keeps that process's view).

The CPU account: the master's CPU-seconds per 1,000 calls of the steady state (heartbeats and
the watches' long polls, counted by the agents), beside a bare gRPC echo server's (grpc.aio, one
generic unary method, its own process) answering as many heartbeat-sized calls.

Columns: register / rendezvous / exit = seconds from the first call of the phase until every
node finished it; CPU = the master's CPU over the steady state, in % of one core; RSS = the
master's resident memory at the end of the steady state; p99 = client-side latency of the calls
the master answers at once (register, join, heartbeat, report, status), so it includes this
process's own queueing; exit ok = nodes that saw the job succeed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_account import cpu_seconds  # noqa: E402

from dlrover.client.master_client import (  # noqa: E402
    HEARTBEAT_LANE_RETRY_S,
    HEARTBEAT_LANE_TIMEOUT_S,
)
from dlrover.constants import TOKEN_METADATA_KEY  # noqa: E402
from dlrover.proto import master_pb2 as pb  # noqa: E402
from dlrover.proto import master_pb2_grpc as pb_grpc  # noqa: E402

PROBES = 20
ENGINE_JOB = "scale"
"""The job of master_scale_engine.py: its nodes are ``scale-worker-<i>-<attempt>``."""
"""Nodes whose heartbeats a separate process sends (`probe`), every PROBE_EVERY_S."""
PROBE_EVERY_S = 0.5

HOLD_S = 30.0
"""What a long poll asks the master to hold (it caps it at MAX_LONG_POLL_S)."""


class Master:
    """A real dlrover-master process for one run, with its state and log in a temp dir."""

    def __init__(self, nodes: int, tree: str = "", engine: str = "", lane: bool = True) -> None:
        """``tree``: run the master of another checkout (its directory), else this one's.
        ``engine``: ``fake:RATE:LO:HI``: a master with its node controller over a fake engine
        (master_scale_engine.py) that creates RATE pods a second, each up LO-HI s later.
        ``lane``: with its heartbeat server (``--heartbeat-port``; a tree's master before it has
        none either way)."""
        self.dir = tempfile.mkdtemp(prefix="dlrover_scale_")
        self.log_path = os.path.join(self.dir, "master.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 - open for the process's life
        self._nodes, self._tree, self.engine = nodes, tree, engine
        self._lane_args = [] if lane or tree else ["--heartbeat-port", "-1"]
        self.events_in = os.path.join(self.dir, "engine.in")
        """The benchmark's lines to the engine (``fail <node id>``)."""
        self.events_out = os.path.join(self.dir, "engine.out")
        """The engine's lines (accepted, running, deleted, refused)."""
        self.token = ""
        self.addr = ""
        self._start("0")

    def _start(self, port: str) -> None:
        env_file = os.path.join(self.dir, "master.env")
        with contextlib.suppress(FileNotFoundError):
            os.remove(env_file)
        token = ("--token", self.token) if self.token else ()
        if self.engine:
            _, rate, lo, hi = self.engine.split(":")
            command = [
                sys.executable,
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "master_scale_engine.py"),
                "--write-env",
                env_file,
                "--nodes",
                str(self._nodes),
                "--state-db",
                os.path.join(self.dir, "state.db"),
                "--rate",
                rate,
                "--latency",
                f"{lo}:{hi}",
                "--events-in",
                self.events_in,
                "--events-out",
                self.events_out,
                *self._lane_args,
            ]
        self.proc = subprocess.Popen(
            command
            if self.engine
            else [
                sys.executable,
                "-m",
                "dlrover.cli.master",
                "--port",
                port,
                "--host",
                "127.0.0.1",
                "--write-env",
                env_file,
                "--nnodes",
                f"{self._nodes}:{self._nodes}",
                "--state-db",
                os.path.join(self.dir, "state.db"),
                "--idle-timeout",
                "600",
                *token,
                *self._lane_args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self._tree or None,
            # PYTHONFAULTHANDLER: a master that does not exit is sent SIGABRT (`close`), and
            # its log then shows where each of its threads was.
            env={
                **os.environ,
                "PYTHONFAULTHANDLER": "1",
                **({"PYTHONPATH": self._tree} if self._tree else {}),
            },
        )
        deadline = time.monotonic() + 60
        while not os.path.exists(env_file):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"dlrover-master did not start; see {self.log_path}")
            time.sleep(0.05)
        time.sleep(0.1)  # the file is written in one go, but be sure it is complete
        with open(env_file) as f:
            env = dict(line.split("=", 1) for line in f.read().split())
        self.addr = env["DLROVER_MASTER_ADDR"].replace("0.0.0.0", "127.0.0.1")
        self.token = env["DLROVER_JOB_TOKEN"]
        self.ps = psutil.Process(self.proc.pid)

    def restart(self) -> float:
        """SIGKILL the master and start a new one on the same port, state and token; returns
        the seconds until the new one listened."""
        self.proc.kill()
        self.proc.wait()
        t = time.monotonic()
        self._start(self.addr.rsplit(":", 1)[1])
        return time.monotonic() - t

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def rss_mib(self) -> float:
        return self.ps.memory_info().rss / 2**20

    def close(self, keep: bool = False) -> int | None:
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)  # its threads' stacks into the log
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            code = None
            self._log.flush()
            with open(self.log_path, errors="replace") as f:
                tail = f.readlines()[-120:]
            print(
                "the master did not exit within 30 s of the job's end; its log ends:\n"
                + "".join(tail),
                file=sys.stderr,
            )
        self._log.close()
        if keep:
            print(f"master log kept: {self.log_path}", file=sys.stderr)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
        return code


class Refused(Exception):
    """The master refused a call: it answered with the response's `refused` field set."""


def answer(response):
    """The response, or Refused when the master refused the call (dlrover/api/rpc.py)."""
    if response.HasField("refused"):
        raise Refused(response.refused.message)
    return response


@dataclass
class Stats:
    latencies: list[float] = field(default_factory=list)
    heartbeats: list[float] = field(default_factory=list)
    """The heartbeats' latencies alone (a storm's figure)."""
    errors: int = 0
    outage_errors: int = 0
    """Calls that found no master while it restarted (a master-kill storm), asked again."""

    calls: int = 0
    """Every call answered or failed, long polls included (the CPU account's unit)."""
    outage: bool = False
    """The master is being restarted: a call it does not answer is an outage error."""

    def failed(self, e: Exception) -> None:
        """Count a failed call: an outage error while the master restarts, else an error."""
        unavailable = isinstance(e, grpc.aio.AioRpcError) and e.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        if self.outage and unavailable:
            self.outage_errors += 1
        else:
            self.errors += 1

    def p99_ms(self) -> float:
        if not self.latencies:
            return float("nan")
        return p99_ms(self.latencies)


def p99_ms(latencies: list[float]) -> float:
    if not latencies:
        return float("nan")
    xs = sorted(latencies)
    return 1000 * xs[min(len(xs) - 1, int(0.99 * len(xs)))]


LEASERS = 1000
"""In a master-kill storm, at most this many nodes lease shards of a dataset (one worker each)."""
SHARDS_PER_LEASER = 6
LEASE_S = 10.0
"""The storm's dataset's lease: a grant whose answer the kill took is handed out again after it."""
LEASE_DATASET = "storm"


@dataclass
class LeaseBook:
    """What the leasing nodes of a master-kill storm were told, to check the master lost no shard
    and handed none out twice: every grant a node received (shard, worker, when) and every done
    report the master accepted."""

    grants: dict[tuple[int, int], list[tuple[str, float]]] = field(default_factory=dict)
    done: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    asked_again: int = 0
    """Lease calls (fetch or done) the outage failed, asked again."""
    finished: float = 0.0
    """When the last leasing node heard that the dataset is finished (monotonic)."""

    def figures(self, shards: int) -> dict[str, int]:
        """Shards done, lost (never done), done twice (the master accepted two workers' reports),
        and handed out twice (two workers were told they held it: a grant whose answer the kill
        took reached no worker, so its hand-out again after the lease is not counted)."""
        return {
            "shards": shards,
            "shards_done": len(self.done),
            "shards_lost": shards - len(self.done),
            "done_twice": sum(len(by) > 1 for by in self.done.values()),
            "granted_twice": sum(len({w for w, _ in g}) > 1 for g in self.grants.values()),
            "lease_calls_asked_again": self.asked_again,
        }


def storm_stack(i: int, kb: int = 64) -> str:
    """A ~``kb`` KB traceback as a rank of a big job writes it when a collective breaks: the
    same frames on every node, its own rank, pid and host in the numbers."""
    frames = "".join(
        f'  File "/workspace/model/block_{k % 48}.py", line {40 + k % 300}, in forward\n'
        f"    hidden = self.layers[{k % 96}](hidden, attention_mask=mask, cache=cache)\n"
        for k in range(max(1, kb * 1024 // 115))
    )
    summary = (
        f"worker rank {i * 8} (pid {100000 + i}) exited with 1: DistBackendError: NCCL error "
        f"on rank {i * 8}"
    )
    return (
        f"{summary}\nTraceback (most recent call last):\n"
        f"{frames}"
        f"torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, rank "
        f"{i * 8}, pid {100000 + i}, host 10.0.{i // 256}.{i % 256}: unhandled system error "
        "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
    )


class Lanes:
    """The master's heartbeat server as the simulated agents reach it: a few channels per port
    it names (`HeartbeatReply.heartbeat_port`), on the master's host, shared as the main ones
    are; a port that failed is not tried again for HEARTBEAT_LANE_RETRY_S, as MasterClient."""

    def __init__(self, addr: str, options: list, n_channels: int) -> None:
        self.host = addr.rsplit(":", 1)[0]
        self.options = options
        self.n_channels = n_channels
        self.stubs: dict[int, list[pb_grpc.MasterStub]] = {}
        self.failed: tuple[int, float] = (0, 0.0)

    def stub(self, port: int, i: int) -> pb_grpc.MasterStub | None:
        """Node ``i``'s stub to the heartbeat server on ``port`` (None: beat at the address)."""
        failed, until = self.failed
        if not port or (port == failed and time.monotonic() < until):
            return None
        if port not in self.stubs:
            self.stubs[port] = [
                pb_grpc.MasterStub(grpc.aio.insecure_channel(f"{self.host}:{port}", self.options))
                for _ in range(self.n_channels)
            ]
        return self.stubs[port][i % self.n_channels]

    def fail(self, port: int) -> None:
        self.failed = (port, time.monotonic() + HEARTBEAT_LANE_RETRY_S)


class Agent:
    """One simulated node: a real agent's calls, with none of its processes."""

    def __init__(
        self,
        i: int,
        stub: pb_grpc.MasterStub,
        md: tuple,
        stats: Stats,
        poll: bool,
        lanes: Lanes | None = None,
    ):
        self.i, self.stub, self.md, self.stats, self.poll = i, stub, md, stats, poll
        self.lanes = lanes
        self.lane_port = 0
        """The heartbeat port the master's last heartbeat reply named (0: none)."""
        self.node_id, self.incarnation, self.round = "", 0, 0
        self.name = ""
        """The engine's node id it registers under ("" without an engine: the master names it)."""
        self.interval = 2.0
        self.phased_for = 0.0
        self.stop = asyncio.Event()
        self.probed = False
        self.last_ok = 0.0
        """When a heartbeat of this node was last answered (monotonic)."""
        self.joined = asyncio.Event()
        self.on_reform: Callable[[Agent], Awaitable[None]] | None = None
        """What the agent does when its watch says the job re-forms (None: not expected)."""
        self.rejoin_after = 0.0
        """As the agent: a re-form's join waits a random point within `Waiting.spread_s`."""
        self.watch_after = 0.0
        """As the agent: a closed round's watch starts a random point within its spread_s."""

    async def _call(self, method, request, timeout: float = 60.0):
        t = time.monotonic()
        try:
            return answer(await method(request, timeout=timeout, metadata=self.md))
        finally:
            self.stats.latencies.append(time.monotonic() - t)
            self.stats.calls += 1

    async def register(self, nodes: int) -> None:
        r = await self._call(
            self.stub.RegisterNode,
            pb.RegisterNodeRequest(
                node_id=self.name,
                host=f"10.0.{self.i // 256}.{self.i % 256}",
                local_world_size=8,
                pid=self.i + 1,
                config=pb.JobConfig(
                    min_nodes=nodes, max_nodes=nodes, node_unit=1, last_call_timeout_s=1.0
                ),
            ),
        )
        self.node_id, self.incarnation = r.node_id, r.incarnation
        if not self.poll:
            self.interval = max(2.0, r.heartbeat_interval_s)

    def next_wait(self) -> float:
        """As the agent's Heartbeat.next_wait_s: a new interval starts at a random phase, later
        waits vary by 10% (the poll protocol before it beat every 2 s, started together)."""
        if self.poll:
            return self.interval
        if self.interval != self.phased_for:
            self.phased_for = self.interval
            return random.uniform(0.0, self.interval)
        return self.interval * random.uniform(0.9, 1.1)

    async def heartbeats(self) -> None:
        if self.probed:
            return  # the probe process beats for this node
        await asyncio.sleep(random.uniform(0, self.interval) if self.poll else self.next_wait())
        while not self.stop.is_set():
            request = pb.HeartbeatRequest(node_id=self.node_id, incarnation=self.incarnation)
            try:
                lane = self.lanes.stub(self.lane_port, self.i) if self.lanes else None
                r = None
                if lane is not None:  # as MasterClient.heartbeat: the lane, else the address
                    try:
                        r = await self._call(
                            lane.Heartbeat, request, timeout=HEARTBEAT_LANE_TIMEOUT_S
                        )
                    except grpc.aio.AioRpcError:
                        assert self.lanes is not None
                        self.lanes.fail(self.lane_port)
                if r is None:
                    r = await self._call(self.stub.Heartbeat, request)
                self.lane_port = r.heartbeat_port
                self.stats.heartbeats.append(self.stats.latencies[-1])
                self.last_ok = time.monotonic()
                if not self.poll:
                    self.interval = max(2.0, r.heartbeat_interval_s)
            except (grpc.aio.AioRpcError, Refused) as e:
                self.stats.failed(e)
            try:
                await asyncio.wait_for(self.stop.wait(), self.next_wait())
            except asyncio.TimeoutError:
                pass

    async def report_failure(self, delay_s: float, kb: int) -> None:
        """After ``delay_s``, what an agent reports when its workers fail (ReportFailure)."""
        await asyncio.sleep(delay_s)
        record = pb.FailureRecord(
            at=time.time(),
            node_id=self.node_id,
            failure_class="exit_code",
            action="restart_processes",
            root_cause=storm_stack(self.i, kb),
        )
        try:
            await self._call(
                self.stub.ReportFailure,
                pb.ReportFailureRequest(
                    node_id=self.node_id, incarnation=self.incarnation, record=record
                ),
            )
        except (grpc.aio.AioRpcError, Refused):
            self.stats.errors += 1

    async def rendezvous(self, outage_s: float = 0.0) -> None:
        """Join the next round and wait until it forms; with ``outage_s``, a master that does
        not answer is asked again each second for that long (a restarting master)."""
        deadline = time.monotonic() + outage_s
        while True:
            try:
                return await self._rendezvous()
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                self.stats.outage_errors += 1
                await asyncio.sleep(1)
                self.joined.clear()

    async def _rendezvous(self) -> None:
        r = await self._call(
            self.stub.JoinRendezvous,
            pb.JoinRendezvousRequest(
                node_id=self.node_id,
                incarnation=self.incarnation,
                local_world_size=8,
                store_host="h",
                store_port=1,
            ),
        )
        self.round = r.round
        self.joined.set()
        while True:
            wait_s = 0.0 if self.poll else HOLD_S
            w = answer(
                await self.stub.GetCommWorld(
                    pb.GetCommWorldRequest(node_id=self.node_id, round=self.round, wait_s=wait_s),
                    timeout=wait_s + 60,
                    metadata=self.md,
                )
            )
            self.stats.calls += 1
            if w.complete:
                self.round = w.round
                self.watch_after = random.uniform(0.0, w.spread_s)
                return
            if self.poll:
                await asyncio.sleep(0.1)

    async def watch(self) -> None:
        """The membership watch (long poll), or the old check every 0.5 s."""
        while not self.stop.is_set():
            wait_s = 0.0 if self.poll else HOLD_S
            if self.watch_after > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), self.watch_after)
                self.watch_after = 0.0
                if self.stop.is_set():
                    return
            try:
                w = answer(
                    await self.stub.NumNodesWaiting(
                        pb.NumNodesWaitingRequest(
                            node_id=self.node_id, round=self.round, wait_s=wait_s
                        ),
                        timeout=wait_s + 60,
                        metadata=self.md,
                    )
                )
            except (grpc.aio.AioRpcError, Refused) as e:
                if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.CANCELLED:
                    return
                self.stats.failed(e)
                await asyncio.sleep(1)
                continue
            finally:
                self.stats.calls += 1
            if self.stop.is_set():
                return
            if w.waiting > 0 or w.latest_round > self.round:
                if self.on_reform is None:
                    raise AssertionError(f"node {self.node_id}: unexpected re-form {w}")
                self.rejoin_after = random.uniform(0.0, w.spread_s)
                await self.on_reform(self)  # a storm: re-join, as a real agent does
                continue
            if self.poll:
                try:
                    await asyncio.wait_for(self.stop.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass

    async def lease_shards(self, book: LeaseBook) -> None:
        """As a training worker of this node over a dataset the master shards: lease a shard,
        train on it (0.2-0.6 s), report it done; until the master says the dataset is finished.
        A call the master does not answer (it is being restarted) is asked again each 0.2 s."""
        worker = f"{self.node_id}/0"
        fetch = pb.FetchShardsRequest(dataset=LEASE_DATASET, worker_id=worker, max_count=1)
        while True:
            leased, _ = await self._lease_call(self.stub.FetchShards, fetch, book)
            if leased.HasField("error"):
                raise RuntimeError(f"{worker}: lease refused: {leased.error.message}")
            result = leased.result
            if not result.shards:
                if result.finished:
                    book.finished = max(book.finished, time.monotonic())
                    return
                await asyncio.sleep(0.2)  # the rest is leased to others: ask again
                continue
            ids = [shard.id for shard in result.shards]
            for shard_id in ids:
                book.grants.setdefault((shard_id.epoch, shard_id.index), []).append(
                    (worker, time.time())
                )
            await asyncio.sleep(random.uniform(0.2, 0.6))
            done = pb.ReportDoneRequest(dataset=LEASE_DATASET, worker_id=worker, shard_ids=ids)
            reported, again = await self._lease_call(self.stub.ReportDone, done, book)
            # Asked again, a report the killed master saved before it could answer is ignored
            # by the new one (the shard is done already; a lease it lost instead shows as a
            # shard handed out twice).
            taken = reported.result.accepted + (reported.result.ignored if again else 0)
            if reported.HasField("error") or taken != len(ids):
                raise RuntimeError(f"{worker}: done of {len(ids)} shards not accepted: {reported}")
            for shard_id in ids:
                book.done.setdefault((shard_id.epoch, shard_id.index), []).append(worker)

    async def _lease_call(self, method, request, book: LeaseBook) -> tuple[Any, bool]:
        """The answer, and whether the call had to be asked again."""
        deadline = time.monotonic() + 120
        again = False
        while True:
            try:
                return await self._call(method, request, timeout=10), again
            except grpc.aio.AioRpcError as e:
                if (
                    e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                    or time.monotonic() > deadline
                ):
                    raise
                book.asked_again += 1
                again = True
                await asyncio.sleep(0.2)

    async def exit_barrier(self) -> bool:
        request = pb.ReportNodeStatusRequest(
            node_id=self.node_id,
            incarnation=self.incarnation,
            status="succeeded",
            wait_s=0.0 if self.poll else HOLD_S,
        )
        for _ in range(100):
            try:
                if await self._exit_step(request):
                    return True
            except (grpc.aio.AioRpcError, Refused):
                self.stats.errors += 1
                return False  # e.g. the master took the node for lost: it misses the end
        return False

    async def _exit_step(self, request: pb.ReportNodeStatusRequest) -> bool:
        if not self.poll:
            r = answer(
                await self.stub.ReportNodeStatus(request, timeout=HOLD_S + 60, metadata=self.md)
            )
            return bool(r.job_done)
        if (await self._call(self.stub.ReportNodeStatus, request)).job_done:
            return True
        s = await self._call(self.stub.GetJobStatus, pb.GetJobStatusRequest())
        if s.state == "succeeded":
            return True
        await asyncio.sleep(0.5)
        return False


async def echo_cpu_per_1k(calls: int, in_flight: int = 200) -> float:
    """The peer of the master's CPU account: a bare gRPC echo server (grpc.aio, one generic
    unary method that returns its request) in a process of its own answers ``calls``
    heartbeat-sized calls, ``in_flight`` at a time; its CPU-seconds per 1,000 calls."""
    where = tempfile.mkdtemp(prefix="dlrover_echo_")
    port_file = os.path.join(where, "port")
    proc = subprocess.Popen([sys.executable, __file__, "--echo", port_file])
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):  # written whole (os.replace)
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the echo server did not start")
            await asyncio.sleep(0.05)
        with open(port_file) as f:
            port = int(f.read())
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.enable_http_proxy", 0)]
        ) as channel:
            echo = channel.unary_unary("/echo.Echo/Echo")
            payload = pb.HeartbeatRequest(node_id="0123456789ab", incarnation=1).SerializeToString()
            await echo(payload, timeout=30)  # warm
            before = cpu_seconds(proc.pid)
            left = calls
            while left > 0:
                batch = min(in_flight, left)
                await asyncio.gather(*(echo(payload, timeout=30) for _ in range(batch)))
                left -= batch
            return 1000 * (cpu_seconds(proc.pid) - before) / calls
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(where, ignore_errors=True)


async def echo_main(port_file: str) -> None:
    """The echo server process (`echo_cpu_per_1k`)."""

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "echo.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    with open(port_file + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(port_file + ".tmp", port_file)
    await server.wait_for_termination()


class Probe:
    """A separate process that sends the heartbeats of PROBES nodes every PROBE_EVERY_S (their
    simulated agents send none) and times each: what an agent in its own process sees of the
    master, without the queueing of the one process that simulates all the others."""

    def __init__(self, master: Master, agents: list[Agent]) -> None:
        self.out = os.path.join(master.dir, "probe.json")
        nodes = [[a.node_id, a.incarnation] for a in agents]
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--probe", master.addr, master.token, self.out],
            stdin=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(nodes) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> list[tuple[float, float]]:
        """(wall time, seconds) of every heartbeat the probe sent."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # the probe's signal to write its figures and exit
        self.proc.wait(timeout=60)
        with open(self.out) as f:
            return [(float(at), float(took)) for at, took in json.load(f)]

    @staticmethod
    def within(beats: list[tuple[float, float]], start: float, end: float) -> list[float]:
        return [took for at, took in beats if start <= at <= end]


async def probe_main(addr: str, token: str, out: str) -> None:
    """The probe process: beat for the nodes read from stdin's first line until stdin closes,
    then write [[wall time, seconds], ...] to ``out``."""
    loop = asyncio.get_running_loop()
    nodes = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
    closed = loop.run_in_executor(None, sys.stdin.read)  # returns at EOF
    md = ((TOKEN_METADATA_KEY, token),)
    options = [("grpc.enable_http_proxy", 0)]
    channel = grpc.aio.insecure_channel(addr, options=options)
    stub = pb_grpc.MasterStub(channel)
    lanes = Lanes(addr, options, 1)
    beats: list[tuple[float, float]] = []

    async def beat(node_id: str, incarnation: int) -> None:
        await asyncio.sleep(random.uniform(0, PROBE_EVERY_S))
        lane_port = 0
        while True:
            request = pb.HeartbeatRequest(node_id=node_id, incarnation=incarnation)
            t = time.monotonic()
            with contextlib.suppress(grpc.aio.AioRpcError):
                lane = lanes.stub(lane_port, 0)
                reply = None
                if lane is not None:  # as MasterClient.heartbeat: the lane, else the address
                    try:
                        reply = await lane.Heartbeat(
                            request, timeout=HEARTBEAT_LANE_TIMEOUT_S, metadata=md
                        )
                    except grpc.aio.AioRpcError:
                        lanes.fail(lane_port)
                if reply is None:
                    reply = await stub.Heartbeat(request, timeout=60, metadata=md)
                lane_port = reply.heartbeat_port
                beats.append((time.time(), time.monotonic() - t))
            await asyncio.sleep(PROBE_EVERY_S)

    tasks = [asyncio.create_task(beat(n, i)) for n, i in nodes]
    await closed
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await channel.close()
    with open(out, "w") as f:
        json.dump(beats, f)


async def error_storm(
    agents: list[Agent], master: Master, stats: Stats, gap_s: float, kb: int, row: dict
) -> None:
    """Two waves of failure reports, every node within one second, ``gap_s`` apart; then what
    `dlrover diagnose` costs (into ``row``)."""
    peak = [master.rss_mib()]
    sampling = asyncio.Event()

    async def sample() -> None:
        while not sampling.is_set():
            peak.append(master.rss_mib())
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    stats.heartbeats.clear()
    row["storm_from"] = time.time()
    waves = []
    for wave in range(2):
        if wave:
            await asyncio.sleep(gap_s)
        t = time.monotonic()
        await asyncio.wait_for(
            asyncio.gather(*(a.report_failure(random.uniform(0, 1), kb) for a in agents)), 600
        )
        waves.append(time.monotonic() - t)
    await asyncio.sleep(3)  # the heartbeats right after the second wave count too
    row["storm_to"] = time.time()
    sampling.set()
    await sampler
    row["storm_client_p99_ms"] = p99_ms(stats.heartbeats)
    row["peak_rss_mib"] = max(peak)
    row["wave_s"] = max(waves)

    folded: list[tuple[int, int]] = []

    def diagnose() -> tuple[float, int, int]:
        from dlrover.cli.status_view import failure_lines
        from dlrover.client.master_client import MasterClient

        client = MasterClient(master.addr, master.token, rpc_timeout_s=30)
        try:
            t = time.monotonic()
            failures = client.get_failures()
            lines = failure_lines(failures, False)
            folded.extend((f.count, f.node_count) for f in failures if f.count > 1)
            return time.monotonic() - t, len(failures), len(lines)
        finally:
            client.close()

    try:
        took, records, lines = await asyncio.to_thread(diagnose)
        row["diagnose_s"], row["records"], row["lines"] = took, records, lines
        row["folded_count"] = sum(count for count, _ in folded)
        row["folded_nodes"] = sum(nodes for _, nodes in folded)
    except Exception as e:  # the figure is that it failed, and why
        row["diagnose_s"] = f"failed: {type(e).__name__}: {str(e)[:80]}"


def node_losses(master: Master) -> tuple[int, int]:
    """The losses the master recorded (`dlrover diagnose`'s node_lost records, folds counted),
    and from how many nodes."""
    from dlrover.client.master_client import MasterClient

    client = MasterClient(master.addr, master.token, rpc_timeout_s=30)
    try:
        records = [f for f in client.get_failures() if f.failure_class.value == "node_lost"]
    finally:
        client.close()
    singles = {f.node_id for f in records if f.count <= 1}
    return sum(max(1, f.count) for f in records), len(singles) + sum(
        f.node_count for f in records if f.count > 1
    )


async def lose_storm(
    agents: list[Agent],
    master: Master,
    fraction: float,
    make_agent: Callable[[int], Agent],
    tasks: list[asyncio.Task],
    row: dict,
) -> list[Agent]:
    """``fraction`` of the nodes go silent in the same moment (their heartbeats and watches
    stop: a rack gone); the master loses them on its heartbeat timeout and the survivors'
    watches fire. As the engine would, the benchmark then registers one replacement per lost
    node, and the round re-forms with the survivors. Into ``row``: seconds until the master
    noticed, how spread the survivors' re-joins were (and refusals), seconds from the last
    replacement's registration until the round formed, and how the master recorded the
    losses. Returns the job's nodes after the storm."""
    nodes = len(agents)
    candidates = [a for a in agents if not a.probed]
    lost = random.sample(candidates, int(fraction * nodes))
    gone = {id(a) for a in lost}
    survivors = [a for a in agents if id(a) not in gone]
    noticed = asyncio.Event()
    joined: list[float] = []
    refused = [0]

    async def rejoin(agent: Agent) -> None:
        noticed.set()
        await asyncio.sleep(agent.rejoin_after)  # spread, as the master tells (spread_s)
        agent.rejoin_after = 0.0
        while True:
            try:
                await agent.rendezvous()
                joined.append(time.monotonic())
                return
            except (grpc.aio.AioRpcError, Refused):
                refused[0] += 1
                await asyncio.sleep(1)

    for a in survivors:
        a.on_reform = rejoin
    row["storm_from"] = time.time()
    t0 = time.monotonic()
    for a in lost:
        a.stop.set()
    if master.engine:  # the engine sees half of them go (pods deleted); the rest only go silent
        with open(master.events_in, "a") as f:
            f.writelines(f"fail {a.name}\n" for a in lost[::2])
    await asyncio.wait_for(noticed.wait(), 600)
    row["noticed_s"] = time.monotonic() - t0
    if master.engine:
        # The master's node controller relaunches them through its queue at the engine's
        # rate; each replacement's agent starts when the engine says its pod runs.
        replacements, t1 = await engine_replacements(master, lost, make_agent, nodes, tasks)
    else:  # the engine's part, played here: a replacement per lost node
        replacements = [make_agent(nodes + k) for k in range(len(lost))]
        t1 = time.monotonic()
        await asyncio.gather(*(a.register(nodes) for a in replacements))
        tasks += [asyncio.create_task(a.heartbeats()) for a in replacements]
    registered = time.monotonic()
    row["replacements_registered_s"] = registered - t1
    await asyncio.wait_for(asyncio.gather(*(rejoin(a) for a in replacements)), 600)
    while len(joined) < len(survivors) + len(replacements):
        await asyncio.sleep(0.05)  # the survivors' re-joins run in their watch tasks
    formed = max(joined)
    row["round_after_last_s"] = formed - registered
    survivor_joins = sorted(joined)[: len(survivors)]
    row["rejoin_spread_s"] = survivor_joins[-1] - survivor_joins[0]
    row["refused"] = refused[0]
    row["storm_to"] = time.time()
    everyone = survivors + replacements
    rounds = {a.round for a in everyone}
    assert len(rounds) == 1, f"nodes saw rounds {sorted(rounds)}"
    row["round"] = rounds.pop()
    tasks += [asyncio.create_task(a.watch()) for a in replacements]

    deadline = time.monotonic() + 300
    while True:  # the last of them are lost a heartbeat interval after the first
        row["lost_recorded"], row["lost_nodes"] = await asyncio.to_thread(node_losses, master)
        if int(row["lost_recorded"]) >= len(lost) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    row["all_noticed_s"] = time.monotonic() - t0
    await asyncio.sleep(2)  # and no node is recorded lost twice meanwhile
    row["lost_recorded"], row["lost_nodes"] = await asyncio.to_thread(node_losses, master)
    row["lost"] = len(lost)
    return everyone


async def engine_replacements(
    master: Master,
    lost: list[Agent],
    make_agent: Callable[[int], Agent],
    nodes: int,
    tasks: list[asyncio.Task],
) -> tuple[list[Agent], float]:
    """Start a simulated agent under each replacement's node id as the fake engine reports its
    pod running (``running`` lines of its events file), registered and beating; returns them
    once every lost node's replacement registered, and when the first came up."""
    want = {a.name.rsplit("-", 1)[0] + "-1": k for k, a in enumerate(lost)}
    replacements: list[Agent] = []
    started: list[asyncio.Task] = []
    first = 0.0
    deadline = time.monotonic() + 600
    with open(master.events_out) as f:
        while len(started) < len(want):
            line = f.readline()
            if not line:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{len(want) - len(started)} replacements never ran")
                await asyncio.sleep(0.02)
                continue
            words = line.split()
            if words[0] != "running" or words[1] not in want:
                continue
            if not first:
                first = time.monotonic()
            agent = make_agent(nodes + want[words[1]])
            agent.name = words[1]
            replacements.append(agent)

            async def up(agent: Agent = agent) -> None:
                await agent.register(nodes)
                tasks.append(asyncio.create_task(agent.heartbeats()))

            started.append(asyncio.create_task(up()))
    await asyncio.wait_for(asyncio.gather(*started), 600)
    return replacements, first


def engine_figures(master: Master, row: dict) -> None:
    """From the fake engine's events: for each lost node, seconds from its loss (the master's
    record of it) to the engine accepting its replacement's launch, for the nodes the engine
    reported and for the silent ones (which wait the grace first: 10 s, or the heartbeat timeout
    where longer: 60 s at 10,000 nodes); the
    launches the engine refused (429s); the replacements' launch latency."""
    lost_at: dict[str, tuple[float, bool]] = {}
    accepted: dict[str, float] = {}
    running: dict[str, float] = {}
    refused = 0
    with open(master.events_out) as f:
        for line in f:
            words = line.split()
            if words[0] == "lost":
                lost_at.setdefault(words[1], (float(words[2]), words[3] == "1"))
            elif words[0] == "accepted":
                accepted[words[1]] = float(words[2])
            elif words[0] == "running":
                running[words[1]] = float(words[2])
            elif words[0] == "refused_now":
                refused += 1
    handed: dict[bool, list[float]] = {False: [], True: []}
    for node_id, (at, silent) in lost_at.items():
        successor = node_id.rsplit("-", 1)[0] + "-1"
        if successor in accepted:
            handed[silent].append(accepted[successor] - at)
    row["handed_reported_s"] = max(handed[False], default=float("nan"))
    row["handed_silent_s"] = max(handed[True], default=float("nan"))
    row["engine_refused"] = refused
    ups = [running[n] - accepted[n] for n in running if n in accepted]
    row["launch_latency_s"] = max(ups, default=float("nan"))


async def master_kill_storm(agents: list[Agent], master: Master, stats: Stats, row: dict) -> None:
    """``--storm master-kill``'s steady-state half: up to LEASERS nodes lease the shards of a
    dataset, train on them and report them done; while they do, SIGKILL the master, start it
    again on its state, and time until every node's heartbeat is answered again. Then the nodes
    the outage cost (recorded lost), whether the round held, and, once the dataset is finished,
    whether any shard was lost or handed out twice (`LeaseBook`)."""
    reforms = [0]

    async def reformed(agent: Agent) -> None:
        reforms[0] += 1
        await agent.rendezvous(outage_s=60)

    for a in agents:
        a.on_reform = reformed
    leasers = [a for a in agents if not a.probed][:LEASERS]
    shards = len(leasers) * SHARDS_PER_LEASER
    spec = pb.DatasetSpec(name=LEASE_DATASET, size=shards, shard_size=1, lease_s=LEASE_S)
    registered = answer(
        await leasers[0].stub.RegisterDataset(
            pb.RegisterDatasetRequest(spec=spec), timeout=30, metadata=leasers[0].md
        )
    )
    if registered.HasField("error"):
        raise RuntimeError(f"the storm's dataset was refused: {registered.error.message}")
    book = LeaseBook()
    leasing = [asyncio.create_task(a.lease_shards(book)) for a in leasers]
    try:
        await asyncio.sleep(1.0)  # the kill comes while shards are leased, trained and reported
        row["storm_from"] = time.time()
        stats.outage = True
        row["steady_restart_s"] = await asyncio.to_thread(master.restart)
        started = time.monotonic()
        beating = [a for a in agents if not a.probed]
        deadline = started + 120
        while any(a.last_ok < started for a in beating) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        row["adopted_s"] = time.monotonic() - started
        row["not_adopted"] = sum(a.last_ok < started for a in beating)
        stats.outage = False
        row["storm_to"] = time.time()
        row["reforms"] = reforms[0]
        await asyncio.wait_for(asyncio.gather(*leasing), 300)
        row["dataset_done_s"] = book.finished - started
        row.update(book.figures(shards))
        # The master's own count: a done report asked again and ignored is one the killed master
        # saved, or one whose lease it lost (then the shard was never counted done).
        progress = answer(
            await leasers[0].stub.DatasetProgress(
                pb.DatasetProgressRequest(dataset=LEASE_DATASET), timeout=30, metadata=leasers[0].md
            )
        ).result
        row["master_done_shards"] = progress.done_shards
    finally:
        for task in leasing:  # a storm that failed half-way leaves none running
            task.cancel()

    row["lost_recorded"] = (await asyncio.to_thread(node_losses, master))[0]


async def run_one(
    nodes: int,
    steady_s: float,
    poll: bool,
    tree: str = "",
    storm: str = "",
    gap_s: float = 60.0,
    storm_kb: int = 64,
    engine: str = "",
    lane: bool = True,
) -> dict[str, float | int | str]:
    master = Master(nodes, tree, engine, lane)
    md = ((TOKEN_METADATA_KEY, master.token),)
    options = [("grpc.max_receive_message_length", 64 * 2**20), ("grpc.enable_http_proxy", 0)]
    n_channels = max(1, min(64, nodes // 100))
    channels = [grpc.aio.insecure_channel(master.addr, options=options) for _ in range(n_channels)]
    stubs = [pb_grpc.MasterStub(c) for c in channels]
    stats = Stats()
    lanes = Lanes(master.addr, options, n_channels)
    agents = [Agent(i, stubs[i % n_channels], md, stats, poll, lanes) for i in range(nodes)]
    if engine:  # the engine's nodes: its pods, each agent registering under its pod's name
        for a in agents:
            a.name = f"{ENGINE_JOB}-worker-{a.i}-0"
    row: dict[str, float | int | str] = {
        "nodes": nodes,
        "protocol": "poll" if poll else "long-poll",
    }
    tasks: list[asyncio.Task] = []
    probe: Probe | None = None
    try:
        t0 = time.monotonic()
        await asyncio.gather(*(a.register(nodes) for a in agents))
        row["register_s"] = time.monotonic() - t0
        probed = agents[:: max(1, nodes // PROBES)][:PROBES] if not poll else []
        for a in probed:
            a.probed = True
        probe = Probe(master, probed) if probed else None
        tasks += [asyncio.create_task(a.heartbeats()) for a in agents]
        t1 = time.monotonic()
        if storm == "master-kill":  # the first kill: once half the nodes joined the round
            stats.outage = True
            joining = [asyncio.create_task(a.rendezvous(outage_s=120)) for a in agents]
            deadline = time.monotonic() + 300
            while sum(a.joined.is_set() for a in agents) < nodes // 2:
                failed = [t for t in joining if t.done() and t.exception() is not None]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"half the nodes did not join: {failed[:1]}")
                await asyncio.sleep(0.01)
            row["rdzv_restart_s"] = await asyncio.to_thread(master.restart)
            await asyncio.wait_for(asyncio.gather(*joining), 300)
            stats.outage = False
        else:
            await asyncio.wait_for(asyncio.gather(*(a.rendezvous() for a in agents)), 300)
        row["rendezvous_s"] = time.monotonic() - t1
        rounds = {a.round for a in agents}
        assert rounds == {1}, f"nodes saw rounds {rounds}"

        tasks += [asyncio.create_task(a.watch()) for a in agents]
        await asyncio.sleep(3)  # let the watches settle before measuring
        stats.latencies.clear()
        stats.heartbeats.clear()
        c0, w0, steady_from, calls0 = master.cpu_s(), time.monotonic(), time.time(), stats.calls
        lags: list[float] = []
        while time.monotonic() - w0 < steady_s:  # how late this process's own loop runs
            t = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append(time.monotonic() - t - 0.01)
        lags.sort()
        row["lag_ms"] = 1000 * lags[int(0.99 * (len(lags) - 1))]
        row["cpu_pct"] = 100 * (master.cpu_s() - c0) / (time.monotonic() - w0)
        row["calls"] = stats.calls - calls0
        row["cpu_per_1k"] = 1000 * (master.cpu_s() - c0) / max(1, stats.calls - calls0)
        row["rss_mib"] = master.rss_mib()
        row["p99_ms"] = stats.p99_ms()
        steady_to = time.time()
        if storm == "errors":
            await error_storm(agents, master, stats, gap_s, storm_kb, row)
        elif storm == "master-kill":
            await master_kill_storm(agents, master, stats, row)
        elif storm.startswith("lose:"):
            agents = await lose_storm(
                agents,
                master,
                float(storm.split(":", 1)[1]),
                lambda i: Agent(i, stubs[i % n_channels], md, stats, poll, lanes),
                tasks,
                row,
            )
            if engine:
                engine_figures(master, row)
        if probe is not None:
            beats = probe.stop()
            probe = None
            row["hb_p99_ms"] = p99_ms(Probe.within(beats, steady_from, steady_to))
            if storm:
                storm_beats = Probe.within(beats, float(row["storm_from"]), float(row["storm_to"]))
                row["storm_p99_ms"] = p99_ms(storm_beats)

        t2 = time.monotonic()
        done = await asyncio.wait_for(asyncio.gather(*(a.exit_barrier() for a in agents)), 600)
        row["exit_s"] = time.monotonic() - t2
        row["exit_ok"] = sum(done)
        row["errors"] = stats.errors
        row["outage_errors"] = stats.outage_errors
    finally:
        if probe is not None:
            probe.proc.kill()
            probe.proc.wait()
        for a in agents:
            a.stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in channels:
            await c.close()
        code = master.close(keep=os.environ.get("KEEP_MASTER_LOG") == "1")
        row["master_exit"] = "?" if code is None else str(code)
    return row


CALL_KINDS = ("heartbeat", "report_step", "lease")
"""What `--calls` sends: a node's heartbeat, a worker's step report, and a shard lease with its
report (FetchShards then ReportDone: two calls)."""


async def master_cpu_per_1k(
    kind: str, calls: int, in_flight: int, lane: bool = False, tree: str = ""
) -> float:
    """A real dlrover-master (one registered node, one dataset) answers ``calls`` calls of
    ``kind`` (`CALL_KINDS`), ``in_flight`` at a time, from one channel (``lane``: heartbeats
    to its heartbeat server, as agents send them; else to its address); its CPU-seconds per
    1,000 calls (the same pattern as `echo_cpu_per_1k`, so the two differ only in what the
    server does per call). ``tree``: the master of that checkout (`Master`)."""
    master = Master(1, tree=tree)
    try:
        async with grpc.aio.insecure_channel(
            master.addr, options=[("grpc.enable_http_proxy", 0)]
        ) as channel:
            stub = pb_grpc.MasterStub(channel)
            md = ((TOKEN_METADATA_KEY, master.token),)
            # (A lease is no sign of a node's life: a node registered for leases alone would be
            # lost after the heartbeat timeout, and the master end the job. Its calls need none.)
            node = (
                answer(
                    await stub.RegisterNode(
                        pb.RegisterNodeRequest(
                            host="10.0.0.1",
                            local_world_size=8,
                            pid=1,
                            config=pb.JobConfig(min_nodes=1, max_nodes=1, node_unit=1),
                        ),
                        timeout=30,
                        metadata=md,
                    )
                )
                if kind != "lease"
                else pb.RegisterNodeResponse()
            )
            beat = pb.HeartbeatRequest(node_id=node.node_id, incarnation=node.incarnation)
            beats = stub
            if lane:
                reply = await stub.Heartbeat(beat, timeout=30, metadata=md)
                lanes = Lanes(master.addr, [("grpc.enable_http_proxy", 0)], 1)
                beats = lanes.stub(reply.heartbeat_port, 0) or stub
            spec = pb.DatasetSpec(name="d", size=10**9, shard_size=1)
            answer(await stub.RegisterDataset(pb.RegisterDatasetRequest(spec=spec), metadata=md))
            step = pb.ReportStepRequest(node_id=node.node_id, step=1)
            fetch = pb.FetchShardsRequest(dataset="d", worker_id="w", max_count=1)

            async def one() -> int:
                """One unit of ``kind``; returns the calls it made."""
                if kind == "heartbeat":
                    await beats.Heartbeat(beat, timeout=30, metadata=md)
                    return 1
                if kind == "report_step":
                    await stub.ReportStep(step, timeout=30, metadata=md)
                    return 1
                leased = await stub.FetchShards(fetch, timeout=30, metadata=md)
                ids = [shard.id for shard in leased.result.shards]
                done = pb.ReportDoneRequest(dataset="d", worker_id="w", shard_ids=ids)
                await stub.ReportDone(done, timeout=30, metadata=md)
                return 2

            async def run(count: int) -> None:
                while count > 0:
                    made = await asyncio.gather(*(one() for _ in range(min(in_flight, count))))
                    count -= sum(made)

            await run(500)  # warm
            before = master.cpu_s()
            await run(calls)
            return 1000 * (master.cpu_s() - before) / calls
    finally:
        master.proc.kill()
        master.close()


async def calls_table(calls: int, tree: str = "", against: str = "") -> None:
    """``--calls N``: the master's CPU per call beside the bare echo's, the arrival pattern
    held equal (200 in flight, and one at a time as spread-out nodes send them): heartbeats at
    its address and at its heartbeat server, step reports, and leases with their reports.
    ``tree``: also the master of that checkout (``--against`` ``against``), at its address,
    each run right before this one's."""
    header = [
        "call",
        "calls in flight",
        "bare gRPC echo CPU-s per 1,000",
        "master CPU-s per 1,000, at its address",
        "master / echo",
        "at its heartbeat server",
        "heartbeat server / echo",
    ]
    if tree:
        header += [f"master at {against}, at its address", f"at {against} / echo"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for in_flight in (200, 1):
        echo = await echo_cpu_per_1k(calls, in_flight)
        for kind in CALL_KINDS:
            before = await master_cpu_per_1k(kind, calls, in_flight, tree=tree) if tree else 0.0
            master = await master_cpu_per_1k(kind, calls, in_flight)
            cells = [kind, str(in_flight), f"{echo:.3f}", f"{master:.3f}"]
            cells.append(f"{master / max(echo, 1e-9):.2f}x")
            if kind == "heartbeat":
                lane = await master_cpu_per_1k(kind, calls, in_flight, lane=True)
                cells += [f"{lane:.3f}", f"{lane / max(echo, 1e-9):.2f}x"]
            else:
                cells += ["-", "-"]
            if tree:
                cells += [f"{before:.3f}", f"{before / max(echo, 1e-9):.2f}x"]
            print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--probe"]:  # the probe process (`Probe`)
        asyncio.run(probe_main(*sys.argv[2:5]))
        return
    if sys.argv[1:2] == ["--echo"]:  # the CPU account's peer (`echo_cpu_per_1k`)
        asyncio.run(echo_main(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 2000, 5000, 10000])
    parser.add_argument("--steady-s", type=float, default=40.0)
    parser.add_argument("--protocol", choices=["long-poll", "poll", "both"], default="both")
    parser.add_argument(
        "--poll-max-nodes",
        type=int,
        default=2000,
        help="with --protocol both, run the old protocol only up to this size",
    )
    parser.add_argument(
        "--against",
        default="",
        metavar="REV",
        help="also run each size (long-poll) against the master of this commit (with --calls: "
        "each call kind at its address)",
    )
    parser.add_argument(
        "--storm",
        default="",
        metavar="errors|lose:FRACTION|master-kill",
        help="after the steady state: errors = every node reports a failure with a 64 KB "
        "stack within one second, twice; lose:0.1 = a tenth of the nodes go silent at once "
        "and are replaced; master-kill = the master SIGKILLed mid-rendezvous and again in the "
        "steady state, restarted on its state (long-poll protocol only)",
    )
    parser.add_argument(
        "--storm-gap-s", type=float, default=60.0, help="seconds between the two waves"
    )
    parser.add_argument(
        "--storm-kb",
        type=int,
        default=64,
        help="KB of stack per report (an agent of dlrover-run sends at most 4)",
    )
    parser.add_argument(
        "--engine",
        default="",
        metavar="fake[:RATE:LO:HI]",
        help="with --storm lose: the master runs its node controller over a fake engine that "
        "stands for Kubernetes, creating at most RATE pods a second (default 100), each up "
        "LO-HI s later (default 1-5); the engine reports half the lost nodes, the rest only "
        "go silent; the master relaunches them all",
    )
    parser.add_argument(
        "--heartbeat-lane",
        choices=["on", "off", "both"],
        default="on",
        help="run the master with its heartbeat server (on, the default), without it "
        "(--heartbeat-port -1), or each size both ways, side by side (without it first)",
    )
    parser.add_argument(
        "--calls",
        type=int,
        default=0,
        metavar="N",
        help="only the CPU per call: N heartbeats (at the master's address and at its heartbeat "
        "server), step reports and leases with their reports to a real master, and N same-size "
        "calls to a bare gRPC echo, 200 in flight and one at a time, side by side",
    )
    args = parser.parse_args()
    if args.calls:
        with contextlib.ExitStack() as stack:
            tree = ""
            if args.against:
                from against import checkout  # beside this script (run as one, not imported)

                tree = str(stack.enter_context(checkout(args.against)))
            asyncio.run(calls_table(args.calls, tree, args.against))
        return
    if args.engine:
        parts = args.engine.split(":")
        if parts[0] != "fake" or len(parts) not in (1, 4):
            parser.error(f"--engine {args.engine}: say fake or fake:RATE:LO:HI")
        args.engine = args.engine if len(parts) == 4 else "fake:100:1:5"
        if not args.storm.startswith("lose:") or args.against:
            parser.error("--engine goes with --storm lose:FRACTION (and not with --against)")
    if args.storm not in ("", "errors", "master-kill") and not re.fullmatch(
        r"lose:0?\.\d+", args.storm
    ):
        parser.error(
            f"--storm {args.storm}: say errors, master-kill or lose:FRACTION (e.g. lose:0.1)"
        )
    if args.storm:
        args.protocol = "long-poll"
    random.seed(0)
    with contextlib.ExitStack() as stack:
        tree = ""
        if args.against:
            from against import checkout  # beside this script (run as one, not imported)

            tree = str(stack.enter_context(checkout(args.against)))
        rows = asyncio.run(run_all(args, tree))
    print_table(rows, args.nodes, args.against)
    print_cpu_table(rows)
    if args.storm:
        print_storm_table(rows, args.storm)


async def run_all(args: argparse.Namespace, tree: str) -> list[dict[str, float | int | str]]:
    """Every size and protocol, one after the other, on one event loop (with ``tree``, the
    long-poll protocol also against that checkout's master, right before this one's)."""
    rows: list[dict[str, float | int | str]] = []
    for n in args.nodes:
        modes = {"long-poll": [False], "poll": [True], "both": [True, False]}[args.protocol]
        runs = [(poll, "") for poll in modes]
        lanes = {"on": [True], "off": [False], "both": [False, True]}[args.heartbeat_lane]
        if tree:
            # A-B-B-A: the master run second in a row is slower to register (seen against the
            # same code), so each side runs once first and once second; the ratio is of means.
            if False in modes:
                runs = [(False, tree), *runs, (False, ""), (False, tree)]
            else:
                runs = [*runs, (False, tree), (False, ""), (False, ""), (False, tree)]
        for (poll, where), lane in [(r, lane) for r in runs for lane in lanes]:
            if poll and args.protocol == "both" and n > args.poll_max_nodes:
                continue
            if where and lane != lanes[-1]:
                continue  # a tree's master has no heartbeat server to turn off
            label = "poll" if poll else "long-poll"
            if where:
                label += f" at {args.against}"
            elif args.heartbeat_lane == "both":
                label += ", heartbeat server" if lane else ", no heartbeat server"
            print(f"... {n} nodes, {label}", flush=True)
            try:
                row = await run_one(
                    n,
                    args.steady_s,
                    poll,
                    where,
                    args.storm,
                    args.storm_gap_s,
                    args.storm_kb,
                    args.engine,
                    lane,
                )
                row["protocol"] = label
                rows.append(row)
            except Exception as e:  # a failed size is a row of the table, not the end of it
                traceback.print_exc()
                detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                rows.append(
                    {"nodes": n, "protocol": label, "failed": f"{type(e).__name__}: {detail}"[:120]}
                )
        measured = [r for r in rows if r["nodes"] == n and "calls" in r]
        if measured:  # the CPU account's peer, for as many calls as the master answered
            echo = await echo_cpu_per_1k(int(measured[0]["calls"]))
            for r in measured:
                r["echo_per_1k"] = echo
    return rows


def print_cpu_table(rows: list[dict[str, float | int | str]]) -> None:
    """The master's CPU per 1,000 calls of the steady state beside a bare gRPC echo's."""
    print()
    print(
        "| nodes | master | calls in the steady state | master CPU-s per 1,000 calls "
        "| bare gRPC echo CPU-s per 1,000 calls | master / echo |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "calls" not in r or "echo_per_1k" not in r:
            continue
        master, echo = float(r["cpu_per_1k"]), float(r["echo_per_1k"])
        print(
            f"| {r['nodes']} | {r['protocol']} | {r['calls']} | {master:.3f} | {echo:.3f} "
            f"| {master / max(echo, 1e-9):.1f}x |"
        )


def print_table(
    rows: list[dict[str, float | int | str]], sizes: list[int], against: str = ""
) -> None:
    """The markdown table, and the long-poll vs poll ratios where both ran (and this master
    over the one of ``against``)."""
    cols = [
        "nodes",
        "protocol",
        "register_s",
        "rendezvous_s",
        "cpu_pct",
        "rss_mib",
        "p99_ms",
        "hb_p99_ms",
        "lag_ms",
        "exit_s",
        "exit_ok",
        "errors",
        "master_exit",
    ]
    heads = [
        "nodes",
        "protocol",
        "register s",
        "rendezvous s",
        "CPU % (steady)",
        "RSS MiB",
        "p99 ms",
        "heartbeat p99 ms (probe)",
        "client lag p99 ms",
        "exit s",
        "exit ok",
        "errors",
        "master exit",
    ]
    print()
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        if "failed" in r:
            print(f"| {r['nodes']} | {r['protocol']} | failed: {r['failed']} |")
            continue
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.2f}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")
    runs: dict[tuple[object, object], list[dict[str, float | int | str]]] = {}
    for r in rows:
        if "failed" not in r:
            runs.setdefault((r["nodes"], r["protocol"]), []).append(r)
    by = {key: _mean(rs) for key, rs in runs.items()}
    for n in sizes:
        old, new = by.get((n, "poll")), by.get((n, "long-poll"))
        if old and new:
            print(
                f"{n} nodes: long-poll vs poll: rendezvous {old['rendezvous_s'] / new['rendezvous_s']:.1f}x "
                f"faster, steady CPU {old['cpu_pct'] / max(new['cpu_pct'], 0.01):.1f}x lower"
            )
        then = by.get((n, f"long-poll at {against}"))
        if then and new:
            ratios = ", ".join(
                f"{key} {float(new[key]) / max(float(then[key]), 1e-9):.2f}x"
                for key in ("register_s", "rendezvous_s", "cpu_pct", "rss_mib", "p99_ms", "exit_s")
            )
            print(
                f"{n} nodes: this master / the one at {against} (below 1: better; means of "
                f"the A-B-B-A runs): {ratios}"
            )


def print_storm_table(rows: list[dict[str, float | int | str]], storm: str) -> None:
    """Each run's storm beside its own quiet steady state."""
    if storm == "master-kill":
        heads = [
            "nodes",
            "master",
            "quiet heartbeat p99 ms (probe)",
            "killed mid-rendezvous: restarted in s",
            "rendezvous s (with the kill)",
            "killed in the steady state: restarted in s",
            "every node's heartbeat answered again after s",
            "nodes not back",
            "nodes recorded lost",
            "rounds re-formed",
            "calls the outage failed (asked again)",
            "shards leased through the kill",
            "done, as the master counts them",
            "shards lost",
            "done twice",
            "handed out twice",
            "lease calls asked again",
            "dataset finished after s",
            "exit ok",
            "errors",
        ]
        cols = [
            "nodes",
            "protocol",
            "hb_p99_ms",
            "rdzv_restart_s",
            "rendezvous_s",
            "steady_restart_s",
            "adopted_s",
            "not_adopted",
            "lost_recorded",
            "reforms",
            "outage_errors",
            "shards",
            "master_done_shards",
            "shards_lost",
            "done_twice",
            "granted_twice",
            "lease_calls_asked_again",
            "dataset_done_s",
            "exit_ok",
            "errors",
        ]
        _markdown(rows, heads, cols)
        return
    if storm.startswith("lose:"):
        heads = [
            "nodes",
            "master",
            "lost at once",
            "quiet heartbeat p99 ms (probe)",
            "storm heartbeat p99 ms (probe)",
            "first noticed after s",
            "all noticed after s",
            "survivors' re-joins spread over s",
            "re-joins refused",
            "replacements registered in s",
            "round formed after the last s",
            "losses recorded",
            "their nodes",
        ]
        cols = [
            "nodes",
            "protocol",
            "lost",
            "hb_p99_ms",
            "storm_p99_ms",
            "noticed_s",
            "all_noticed_s",
            "rejoin_spread_s",
            "refused",
            "replacements_registered_s",
            "round_after_last_s",
            "lost_recorded",
            "lost_nodes",
        ]
        if any("handed_reported_s" in r for r in rows):
            heads += [
                "replacements handed to the engine after the loss, reported s",
                "the same, silent s (grace: 10 s or the heartbeat timeout)",
                "launches the engine refused",
                "launch latency up to s",
            ]
            cols += ["handed_reported_s", "handed_silent_s", "engine_refused", "launch_latency_s"]
        _markdown(rows, heads, cols)
        return
    heads = [
        "nodes",
        "master",
        "quiet heartbeat p99 ms (probe)",
        f"{storm} storm heartbeat p99 ms (probe)",
        "the same, in the simulating process",
        "quiet RSS MiB",
        "storm peak RSS MiB",
        "slowest wave answered s",
        "diagnose s",
        "records shown",
        "diagnose lines",
        "failures folded",
        "their nodes",
    ]
    cols = [
        "nodes",
        "protocol",
        "hb_p99_ms",
        "storm_p99_ms",
        "storm_client_p99_ms",
        "rss_mib",
        "peak_rss_mib",
        "wave_s",
        "diagnose_s",
        "records",
        "lines",
        "folded_count",
        "folded_nodes",
    ]
    _markdown(rows, heads, cols)


def _markdown(rows: list[dict[str, float | int | str]], heads: list[str], cols: list[str]) -> None:
    print()
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        if "failed" in r:
            continue
        cells = [
            f"{v:.2f}" if isinstance(v, float) else str(v) for v in (r.get(c, "") for c in cols)
        ]
        print("| " + " | ".join(cells) + " |")


def _mean(rows: list[dict[str, float | int | str]]) -> dict[str, float | int | str]:
    """The row whose numbers are the means of ``rows``' (the others: the first row's)."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, float):
            out[key] = sum(float(r[key]) for r in rows) / len(rows)
    return out


if __name__ == "__main__":
    main()
