"""The servers protocol_fuzz.py attacks, each hosted in a process of its own (``--serve``).

A host starts one real server on port 0 (or a socket in ``--dir``), prints one JSON line with
where it listens and the job token, and serves until its stdin closes; the fuzzer watches the
process (alive? how many threads?) from outside, so a crash is a dead process, not a guess.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

TOKEN = "fuzz-job-token"
"""The job token every host serves with (the fuzzer sends it, a wrong one, or none)."""

PROBE_TABLE = "probe"
"""The embedding table the embedding host creates for the fuzzer's valid probes."""

PROBE_STEP = 4
"""The step of the complete image the replica host serves as ``own/0``."""


def serve_master(_: Path) -> tuple[dict[str, object], Callable[[], None]]:
    """A JobMaster over gRPC (its asyncio server), in memory."""
    from dlrover.master.job import JobMaster, JobMasterConfig
    from dlrover.master.server import MasterServer
    from dlrover.master.state_store import MemoryStateStore

    server = MasterServer(
        JobMaster(JobMasterConfig(job_name="fuzz"), MemoryStateStore()), TOKEN, "127.0.0.1", 0
    ).start()
    return {"addr": f"127.0.0.1:{server.port}"}, lambda: server.stop(0.5)


def serve_master_heartbeats(_: Path) -> tuple[dict[str, object], Callable[[], None]]:
    """The master's heartbeat server (`HeartbeatLane`), with one registered node whose
    heartbeat is the valid probe."""
    from dlrover.api.master import NodeLimits, Registration
    from dlrover.master.job import JobMaster, JobMasterConfig
    from dlrover.master.server import MasterServer
    from dlrover.master.state_store import MemoryStateStore

    job = JobMaster(JobMasterConfig(job_name="fuzz"), MemoryStateStore())
    node = job.members.register_node(
        Registration(host="127.0.0.1", local_world_size=1, limits=NodeLimits(1, 1, 1, 1))
    )
    server = MasterServer(job, TOKEN, "127.0.0.1", 0, heartbeat_port=0).start()
    where = {
        "addr": f"127.0.0.1:{server.heartbeat_port}",
        "node_id": node.node_id,
        "incarnation": node.incarnation,
    }
    return where, lambda: server.stop(0.5)


def serve_embedding(_: Path) -> tuple[dict[str, object], Callable[[], None]]:
    """One `dlrover-ps` embedding server with the probe table."""
    from dlrover.embedding.server import EmbeddingServer
    from dlrover.proto import embedding_pb2 as pb

    server = EmbeddingServer(TOKEN).start()
    server.service.create_table(pb.TableSpec(name=PROBE_TABLE, dim=4))
    where = {"addr": server.address, "data_port": server.service.data_port}
    return where, lambda: server.stop(0.5)


def serve_saver(folder: Path) -> tuple[dict[str, object], Callable[[], None]]:
    """A CheckpointSaver on a unix socket; its shared memory lives in ``folder``."""
    from dlrover.checkpoint.saver import CheckpointSaver

    shm = folder / "shm"
    shm.mkdir()
    saver = CheckpointSaver(str(folder / "saver.sock"), "fuzz", shm_dir=str(shm))
    saver.start()
    return {"path": saver.socket_path}, lambda: saver.close(timeout=5.0)


def serve_replica(folder: Path) -> tuple[dict[str, object], Callable[[], None]]:
    """A ReplicaExchange holding one complete image (``own/0`` at PROBE_STEP) to probe with."""
    from dlrover.checkpoint.header import HEADER_SIZE, begin_write, publish
    from dlrover.checkpoint.replica import ReplicaExchange
    from dlrover.checkpoint.shm import SharedSegment

    shm = folder / "shm"
    shm.mkdir()
    seg = SharedSegment.create("fuzz-own", HEADER_SIZE + 8192, str(shm))
    meta = json.dumps({"step": PROBE_STEP, "rank": 0, "world_size": 1, "dir": "d"}).encode()
    publish(seg, begin_write(seg), PROBE_STEP, 1024, meta)
    exchange = ReplicaExchange(lambda: {0: seg}, "fuzz", str(shm), token=TOKEN)
    exchange.start()

    def stop() -> None:
        exchange.close()
        seg.close(unlink=True)

    return {"addr": exchange.addr}, stop


SERVERS: dict[str, Callable[[Path], tuple[dict[str, object], Callable[[], None]]]] = {
    "master": serve_master,
    "master-heartbeats": serve_master_heartbeats,
    "embedding": serve_embedding,
    "embedding-data": serve_embedding,
    "saver": serve_saver,
    "replica": serve_replica,
}
"""Target name -> the host of its server."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("target", choices=sorted(SERVERS))
    parser.add_argument("--dir", required=True, help="a folder of this host's own")
    args = parser.parse_args()
    where, stop = SERVERS[args.target](Path(args.dir))
    print(json.dumps({**where, "token": TOKEN, "pid": os.getpid()}), flush=True)
    sys.stdin.read()  # the fuzzer closes our stdin when it is done
    stop()


if __name__ == "__main__":
    main()
