"""The master of `master_scale.py --engine fake`: a real master with its node controller over an
in-memory engine that stands for Kubernetes (a pod-creation rate limit, a random launch
latency), talking to the benchmark's simulated agents through two files.

Run by master_scale.py, not by hand: ``python benchmarks/master_scale_engine.py --write-env F
--nodes N --state-db D --rate R --latency LO:HI --events-in IN --events-out OUT``.

- The job's N nodes are the engine's from the start (as pods a master restarted on its state
  adopts), so the quiet phase is the same as without an engine: the agents register
  themselves, under the engine's node ids (``scale-worker-<i>-0``).
- ``IN``: the benchmark appends ``fail <node id>`` lines: the engine reports those nodes lost
  (a pod deleted), as Kubernetes would; the others of a storm only go silent.
- ``OUT``: the engine appends ``accepted <node id> <time>`` when it accepts a launch,
  ``refused_now <node id> <time>`` when it answers one 429, ``running <node id> <time>`` when
  the node comes up after its latency (the benchmark then starts a simulated agent under that
  id) and ``deleted <node id> <time>`` for a delete; the master appends ``lost <node id> <time>
  <1 if silent>`` for each node the job loses.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path

from dlrover.engines.base import FailureReason, Node, NodeSpec, RateLimitedError
from dlrover.jobspec import job_spec_from_dict
from dlrover.master.assembly import MasterSettings, build_master
from dlrover.master.node_controller import NodeController
from dlrover.master.rendezvous import RendezvousConfig
from dlrover.master.server import new_token
from dlrover.testing.fake_engine import FakeEngine

JOB = "scale"


class _Out:
    """The engine's side of OUT, one line per fact, flushed at once."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
        self._lock = threading.Lock()

    def line(self, *words: object) -> None:
        with self._lock:
            self._file.write(" ".join(str(w) for w in words) + "\n")


class _Engine(FakeEngine):
    """The fake engine, telling the benchmark what it accepted and deleted."""

    def __init__(self, out: _Out, rate: float, latency: tuple[float, float]) -> None:
        super().__init__(
            launch_rate=rate,
            launch_latency=latency,
            on_running=lambda spec: out.line("running", spec.node_id, time.time()),
        )
        self._out = out

    def launch(self, spec: NodeSpec) -> Node:
        try:
            node = super().launch(spec)
        except RateLimitedError:
            self._out.line("refused_now", spec.node_id, time.time())
            raise
        self._out.line("accepted", spec.node_id, time.time())
        return node

    def delete(self, node_id: str) -> None:
        super().delete(node_id)
        self._out.line("deleted", node_id, time.time())


def _follow(path: str, engine: _Engine, stop: threading.Event) -> None:
    """Report the nodes the benchmark names in IN as lost, as the engine's watch would."""
    Path(path).touch()
    with open(path) as f:
        while not stop.is_set():
            line = f.readline()
            if not line:
                time.sleep(0.02)
                continue
            words = line.split()
            if words[:1] == ["fail"]:
                engine.fail(words[1], FailureReason.NODE_LOST, message="pod deleted")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--write-env", required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--state-db", required=True)
    p.add_argument("--rate", type=float, default=500.0, help="pods the engine creates a second")
    p.add_argument("--latency", default="1:5", help="LO:HI seconds from accepted to running")
    p.add_argument("--events-in", required=True)
    p.add_argument("--events-out", required=True)
    p.add_argument("--heartbeat-port", type=int, default=0, help="-1: no heartbeat server")
    a = p.parse_args()
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    lo, hi = (float(x) for x in a.latency.split(":"))
    token = new_token()
    master = build_master(
        MasterSettings(
            job_name=JOB,
            token=token,
            host="127.0.0.1",
            port=0,
            state=a.state_db,
            rendezvous=RendezvousConfig(a.nodes, a.nodes),
            metrics_port=None,
            owns_process=True,
            heartbeat_port=None if a.heartbeat_port < 0 else a.heartbeat_port,
        )
    )
    out = _Out(a.events_out)
    engine = _Engine(out, a.rate, (lo, hi))
    spec = job_spec_from_dict(
        {"name": JOB, "entrypoint": "train.py", "nodes": a.nodes, "max_relaunches": 3}
    )
    controller = NodeController(master.job, engine, spec, f"127.0.0.1:{master.port}", token)
    for rank in range(a.nodes):
        engine.adopt(controller.supervisor.current("worker", rank))
    master.job.members.on_lost.append(
        lambda node_id, cause, alive, silent: out.line("lost", node_id, time.time(), int(silent))
    )
    stop = threading.Event()
    threading.Thread(target=_follow, args=(a.events_in, engine, stop), daemon=True).start()
    tmp = a.write_env + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"DLROVER_MASTER_ADDR=127.0.0.1:{master.port}\nDLROVER_JOB_TOKEN={token}\n")
    os.replace(tmp, a.write_env)
    try:
        controller.run(stop, poll_s=0.2, delete_nodes=lambda: False)
    finally:
        stop.set()
        master.stop(grace_s=1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
