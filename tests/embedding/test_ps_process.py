"""`dlrover-ps` processes: ElasticEmbedding finds them through DLROVER_PS_ADDRS, a third one
joins mid-training, SIGTERM stops them cleanly; a missing token is a clear refusal."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dlrover.embedding.client import EmbeddingClient
from dlrover.embedding.cluster import EmbeddingCluster
from tests.conftest import clean_env, run_cmd

TOKEN = "ps-token"


class PsProcess:
    def __init__(self, directory: Path, name: str) -> None:
        env_file = directory / f"{name}.env"
        self.log = directory / f"{name}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [*run_cmd("dlrover.cli.ps"), "--write-env", str(env_file)],
                env=clean_env(DLROVER_JOB_TOKEN=TOKEN),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while not env_file.exists():  # another process: polled, with a deadline
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "dlrover-ps did not start within 30 s"
            time.sleep(0.02)
        self.address = env_file.read_text().strip().split("=", 1)[1]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(10)


def test_servers_in_their_own_processes_serve_a_model_and_grow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlrover.trainer.torch.embedding import ElasticEmbedding

    servers = [PsProcess(tmp_path, f"ps{i}") for i in range(3)]
    try:
        monkeypatch.setenv("DLROVER_PS_ADDRS", ",".join(s.address for s in servers[:2]))
        monkeypatch.setenv("DLROVER_JOB_TOKEN", TOKEN)
        emb = ElasticEmbedding("users", 4, lr=0.1)
        ids = torch.arange(1000).reshape(100, 10)
        emb(ids).sum().backward()  # every row pushed once: Adagrad moves each by lr
        before = emb.rows(ids.reshape(-1))
        report = EmbeddingCluster(emb.client).resize([s.address for s in servers])
        assert report.servers == 3 and report.moved_rows > 0
        assert torch.equal(emb.rows(ids.reshape(-1)), before)
        stats = emb.client.stats()
        assert [sum(t.rows for t in s.tables) > 0 for s in stats] == [True] * 3
        assert sum(t.rows for s in stats for t in s.tables) == 1000
    finally:
        codes = [s.stop() for s in servers]
    assert codes == [0, 0, 0]


def test_a_server_without_a_token_refuses_to_start() -> None:
    env = clean_env()
    env.pop("DLROVER_JOB_TOKEN", None)
    r = subprocess.run(
        [*run_cmd("dlrover.cli.ps")], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert "no job token: pass --token or set DLROVER_JOB_TOKEN" in r.stderr


def test_a_wrong_token_is_named(tmp_path: Path) -> None:
    server = PsProcess(tmp_path, "ps")
    try:
        client = EmbeddingClient([server.address], "wrong", timeout_s=5)
        with pytest.raises(Exception, match=f"at {server.address} refused the job token"):
            client.lookup("t", np.array([1], dtype=np.int64), 4)
    finally:
        server.stop()
    assert os.path.exists(server.log)


def test_a_killed_server_is_replaced_from_its_synchronous_replica_and_nothing_is_lost(
    tmp_path: Path,
) -> None:
    """SIGKILL one of three dlrover-ps processes mid-training: a new process takes its place
    with the rows of its replica, the training loop (never restarted) waits and goes on, and
    the model is bit for bit the one of a run without the failure."""
    from dlrover.embedding.server import EmbeddingServer
    from dlrover.proto import embedding_pb2 as pb
    from dlrover.trainer.torch.embedding import ElasticEmbedding
    from tests.embedding.training import train

    reference = [EmbeddingServer(TOKEN).start() for _ in range(3)]
    servers = [PsProcess(tmp_path, f"ps{i}") for i in range(3)]
    spare: list[PsProcess] = []
    try:
        plain = ElasticEmbedding(
            "items", 8, lr=0.05, client=EmbeddingClient([s.address for s in reference], TOKEN)
        )
        head_plain = train(plain, 30)

        client = EmbeddingClient([s.address for s in servers], TOKEN, timeout_s=5)
        cluster = EmbeddingCluster(client, replica=pb.SYNC)
        cluster.install()
        emb = ElasticEmbedding("items", 8, lr=0.05, client=client)
        reports = []
        failover: list[threading.Thread] = []

        def on_step(step: int) -> None:
            if step != 12:
                return

            def kill_and_replace() -> None:
                servers[1].proc.kill()  # SIGKILL: no goodbye
                servers[1].proc.wait(10)
                spare.append(PsProcess(tmp_path, "ps1-replacement"))
                reports.append(cluster.replace(1, spare[0].address))

            failover.append(threading.Thread(target=kill_and_replace))
            failover[0].start()

        head = train(emb, 30, on_step)
        failover[0].join(60)
        (report,) = reports
        assert report.index == 1 and report.restored_rows > 0
        every = torch.arange(5000, dtype=torch.int64)
        assert torch.equal(emb.rows(every), plain.rows(every))  # no update lost or doubled
        assert torch.equal(head.weight, head_plain.weight)
        assert client.addresses[1] == spare[0].address
        assert [gap.pushes for gap in client.failover_gaps] == [0]  # SYNC: nothing lost
    finally:
        for s in servers + spare:
            s.stop()
        for r in reference:
            r.stop(0.1)
