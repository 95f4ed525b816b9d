"""The engine registry: names, typed settings, addresses and log readers of each engine kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrover.engines.base import Capacity
from dlrover.engines.registry import (
    BUILTIN_ENGINES,
    KUBERNETES,
    LOCAL,
    RAY,
    EngineKind,
    EngineSettingsError,
    KubernetesSettings,
    LocalSettings,
    RaySettings,
    UnknownEngineError,
    node_host,
)
from dlrover.engines.sizes import SizeError
from dlrover.jobspec import ENGINES, JobSpecError, job_spec_from_dict
from dlrover.testing.fake_engine import FakeEngine


def test_the_builtin_kinds_are_the_names_a_spec_may_give():
    assert BUILTIN_ENGINES.names == ENGINES == ("local", "ray", "kubernetes")
    with pytest.raises(UnknownEngineError, match="choose one of local, ray, kubernetes"):
        BUILTIN_ENGINES.get("slurm")


def test_each_kind_reads_its_own_typed_settings():
    assert LOCAL.settings({"capacity": "cpu=8,memory=1Gi"}) == LocalSettings(Capacity(8.0, 1024))
    assert LOCAL.settings({}) == LocalSettings(Capacity())
    with pytest.raises(SizeError, match="capacity cpu='x' is not a number"):
        LOCAL.settings({"capacity": "cpu=x"})
    assert RAY.settings({"address": "ray://h:1", "state": "redis://r/0"}) == RaySettings(
        "ray://h:1", "dlrover", "redis://r/0"
    )
    assert KUBERNETES.settings({"image": "img", "namespace": "ns"}) == KubernetesSettings(
        "img", "ns", ""
    )
    with pytest.raises(EngineSettingsError, match="needs engine_settings.image"):
        KUBERNETES.settings({"namespace": "ns"})


def test_where_nodes_and_the_master_are_reached():
    assert LOCAL.node_host == node_host("local") == "127.0.0.1"
    assert LOCAL.master_host() == "127.0.0.1"
    assert RAY.node_host == KUBERNETES.node_host == node_host("ray") == "0.0.0.0"
    assert node_host("not-registered") == "0.0.0.0"
    spec = job_spec_from_dict(
        {"name": "p", "entrypoint": "t.py", "engine": "kubernetes", "roles": {"ps": {"count": 1}}}
    )
    assert spec.ps_node_spec(0, "m:1", "t").command[-3] == "0.0.0.0"


def test_the_local_kind_reads_node_logs_from_the_job_directory(tmp_path: Path):
    node = tmp_path / "nodes" / "n-worker-0-0"
    node.mkdir(parents=True)
    (node / "stderr").write_text("a\nb\nc\n")
    # The agent's per-rank layout: an older attempt's rank moved to another node since.
    for attempt, rank, text in ((0, 5, "old\n"), (1, 2, "two\n"), (1, 3, "three\nmore\n")):
        rank_dir = node / "ranks" / "n" / f"attempt_{attempt}" / f"rank_{rank}"
        rank_dir.mkdir(parents=True)
        (rank_dir / "stdout.log").write_text(text)
    (node / "ranks" / "n" / "attempt_1" / "rank_3" / "stderr.log").write_text("oops\n")
    logs = LOCAL.logs(tmp_path)
    assert logs is not None
    assert logs.tail("n-worker-0-0", None, 2) == "b\nc"
    assert logs.ranks("n-worker-0-0") == (2, 3)
    assert logs.tail("n-worker-0-0", 3, 5) == "three\nmore\noops"
    assert logs.tail("n-worker-0-0", 5, 5) is None  # not this node's rank any more
    assert logs.tail("../etc", None, 2) is None and logs.tail("missing", None, 2) is None
    assert logs.ranks("missing") == ()
    # Reads by offset, whole lines only: what `dlrover logs -f` polls.
    end = logs.read("n-worker-0-0", 3, "stdout", -1)
    assert end is not None and end.text == "" and end.offset == len("three\nmore\n")
    with open(node / "ranks" / "n" / "attempt_1" / "rank_3" / "stdout.log", "a") as f:
        f.write("new\npart")
    chunk = logs.read("n-worker-0-0", 3, "stdout", end.offset)
    assert chunk is not None and chunk.text == "new\n" and chunk.source == end.source
    assert RAY.logs(tmp_path) is None


def test_a_registry_with_a_kind_of_ones_own_accepts_its_name_and_builds_it(tmp_path: Path):
    made: list[tuple[str, Path, int]] = []

    def factory(job: str, directory: Path, slots: int) -> FakeEngine:
        made.append((job, directory, slots))
        return FakeEngine()

    fake = EngineKind("fake", lambda raw: int(raw.get("slots", 1)), factory, loopback=True)
    engines = BUILTIN_ENGINES.with_kind(fake)
    assert "fake" in engines and "fake" not in BUILTIN_ENGINES  # the built-in one is unchanged
    spec = job_spec_from_dict({"entrypoint": "t.py", "engine": "fake"}, engines)
    with pytest.raises(JobSpecError, match="unknown engine 'fake'"):
        job_spec_from_dict({"entrypoint": "t.py", "engine": "fake"})
    assert isinstance(engines.get(spec.engine).create("j", tmp_path, {"slots": 3}), FakeEngine)
    assert made == [("j", tmp_path, 3)]
