"""TensorFlow jobs without TensorFlow: the job spec's roles, and the master's TfController on a
FakeEngine (cluster spec versions, ps generations, relaunches, OOM growth, the chief's end, the
nodes' usage and the job's throughput in the status and the metrics), and the seeds' ElasticJob
read as a job spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dlrover.api.wire import job_status_from_pb, job_status_to_pb
from dlrover.cli.status_view import status_table
from dlrover.constants import (
    PS_SCALE_KEY,
    TF_ADDRESS_KEY,
    TF_CLUSTER_KEY,
    TF_PROGRESS_KEY,
    TF_PS_GENERATION_KEY,
    TF_READY_KEY,
    TF_USAGE_KEY,
)
from dlrover.coordination import TfNodeUsage, TfProgress
from dlrover.engines.base import FailureReason, Resources
from dlrover.jobspec import JobSpecError, job_spec_from_dict, load_job_spec
from dlrover.master.job import JobMaster, JobMasterConfig, JobState
from dlrover.master.local_api import LocalMasterApi
from dlrover.master.metrics import JobMetrics
from dlrover.master.relaunch_policy import OomPolicy
from dlrover.master.state_store import MemoryStateStore
from dlrover.master.tensorboard import TensorBoardExporter
from dlrover.master.tf_controller import TfController
from dlrover.master.tf_sizing import TfSizer
from dlrover.operator.master_objects import job_spec_of
from dlrover.testing.fake_engine import FakeEngine
from tests.conftest import REPO
from tests.test_tensorboard import _job, _records, _scalar

ROLES = {
    "ps": {"count": 2, "resources": {"memory": "1Gi"}},
    "worker": {"count": 2},
    "evaluator": {"count": 1},
}


def _spec(**extra: object):  # type: ignore[no-untyped-def]
    raw = {
        "name": "tfjob",
        "entrypoint": "train.py",
        "distribution_strategy": "ParameterServerStrategy",
        "roles": ROLES,
        "max_relaunches": 2,
        **extra,
    }
    return job_spec_from_dict(raw)


def test_roles_of_a_parameter_server_job() -> None:
    spec = _spec()
    assert spec.tf is not None and spec.ps is None
    assert [spec.tf.count(r) for r in ("chief", "ps", "worker", "evaluator")] == [1, 2, 2, 1]
    assert spec.tf.roles["ps"].resources.memory_mib == 1024
    chief = spec.tf_node_spec("chief", 0, "m:1", "tok")
    assert chief.command[:3] == ("dlrover-tf-node", "--role", "chief")
    assert chief.command[-2:] == ("--", "train.py")
    assert "--" not in spec.tf_node_spec("ps", 1, "m:1", "tok").command


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"roles": {"worker": {"count": 2}}}, "add distribution_strategy: ParameterServerStrategy"),
        ({"roles": {"chief": {}}}, "roles.chief is a role of TensorFlow"),
        ({"distribution_strategy": "MirroredStrategy", "roles": ROLES}, "is not supported"),
        ({"distribution_strategy": "ParameterServerStrategy"}, "needs roles: ps and worker"),
        (
            {"distribution_strategy": "ParameterServerStrategy", "roles": {"ps": {"count": 1}}},
            "roles.worker.count must be >= 1",
        ),
        (
            {"distribution_strategy": "ParameterServerStrategy", "roles": {**ROLES, "chief": 2}},
            "roles.chief must be a mapping",
        ),
        (
            {"distribution_strategy": "ParameterServerStrategy", "roles": ROLES, "nodes": 2},
            "nodes does not apply",
        ),
        (
            {"distribution_strategy": "ParameterServerStrategy", "roles": {**ROLES, "gpu": {}}},
            "roles.gpu: unknown role",
        ),
    ],
)
def test_bad_tensorflow_specs_say_what_is_wrong(raw: dict[str, object], message: str) -> None:
    with pytest.raises(JobSpecError, match=message):
        job_spec_from_dict({"entrypoint": "train.py", **raw})


def test_roles_ps_without_a_strategy_are_still_embedding_servers() -> None:
    spec = job_spec_from_dict({"entrypoint": "t.py", "roles": {"ps": {"count": 2}}})
    assert spec.ps is not None and spec.ps.count == 2 and spec.tf is None


class Harness:
    def __init__(self) -> None:
        self.spec = _spec()
        self.job = JobMaster(JobMasterConfig("tfjob"), MemoryStateStore())
        self.engine = FakeEngine()
        self.controller = TfController(
            self.job, self.engine, self.spec, "m:1", "tok", oom_policy=OomPolicy(1.5, 2048)
        )
        self.job.roles.register_job(self.controller)
        self.controller.start()
        self.step()

    def step(self) -> None:
        self.controller.step(0.0)

    def register(self, node_id: str, address: str) -> None:
        self.job.kv.set(TF_ADDRESS_KEY + node_id, address.encode())

    def serve(self, node_id: str) -> None:
        self.job.kv.set(TF_READY_KEY + node_id, b"grpc://x")

    def cluster(self) -> dict[str, object]:
        raw = self.job.kv.get(TF_CLUSTER_KEY)
        return json.loads(raw) if raw else {}

    def generation(self) -> int:
        raw = self.job.kv.get(TF_PS_GENERATION_KEY)
        return int(json.loads(raw)["generation"]) if raw else 0

    def bring_up(self) -> None:
        for role, count in (("chief", 1), ("ps", 2), ("worker", 2)):
            for i in range(count):
                self.register(f"tfjob-{role}-{i}-0", f"h:{100 + 10 * len(role) + i}")
        self.step()
        for node in ("tfjob-ps-0-0", "tfjob-ps-1-0", "tfjob-worker-0-0", "tfjob-worker-1-0"):
            self.serve(node)
        self.step()


def test_the_cluster_spec_is_published_once_every_node_registered() -> None:
    h = Harness()
    assert sorted(s.node_id for s in h.engine.launched) == sorted(
        [
            "tfjob-chief-0-0",
            "tfjob-ps-0-0",
            "tfjob-ps-1-0",
            "tfjob-worker-0-0",
            "tfjob-worker-1-0",
            "tfjob-evaluator-0-0",
        ]
    )
    h.register("tfjob-chief-0-0", "h:1")
    h.step()
    assert h.cluster() == {}  # not before every slot of the cluster registered
    h.bring_up()
    assert h.cluster() == {
        "version": 1,
        "cluster": {"chief": ["h:1"], "ps": ["h:120", "h:121"], "worker": ["h:160", "h:161"]},
    }
    assert h.job.kv.get(f"{TF_CLUSTER_KEY}/1") is not None
    assert h.job.lifecycle.state is JobState.RUNNING
    assert h.generation() == 1


def test_a_node_relaunched_on_its_address_changes_no_version_a_ps_bumps_the_generation() -> None:
    h = Harness()
    h.bring_up()
    h.engine.fail("tfjob-worker-1-0", FailureReason.SIGNAL)
    h.engine.fail("tfjob-ps-1-0", FailureReason.SIGNAL)
    h.step()
    assert [s.node_id for s in h.engine.launched[-2:]] == ["tfjob-worker-1-1", "tfjob-ps-1-1"]
    h.register("tfjob-worker-1-1", "h:161")
    h.register("tfjob-ps-1-1", "h:121")
    h.step()
    assert h.cluster()["version"] == 1 and h.generation() == 1
    h.serve("tfjob-ps-1-1")
    h.step()
    assert h.generation() == 2
    assert h.cluster()["version"] == 1
    h.engine.fail("tfjob-ps-0-0", FailureReason.SIGNAL)
    h.step()
    h.register("tfjob-ps-0-1", "h:999")  # its port was taken: a new address, a new version
    h.serve("tfjob-ps-0-1")
    h.step()
    assert h.cluster()["version"] == 2 and h.generation() == 3
    assert h.cluster()["cluster"]["ps"] == ["h:999", "h:121"]  # type: ignore[index]


def test_an_oom_killed_ps_gets_more_memory_until_the_cap() -> None:
    h = Harness()
    h.bring_up()
    h.engine.fail("tfjob-ps-0-0", FailureReason.OOM_KILLED)
    h.step()
    assert h.engine.launched[-1].node_id == "tfjob-ps-0-1"
    assert h.engine.launched[-1].resources.memory_mib == 1536
    h.engine.fail("tfjob-ps-0-1", FailureReason.OOM_KILLED)
    h.step()
    assert h.engine.launched[-1].resources.memory_mib == 2048
    h.engine.fail("tfjob-ps-0-2", FailureReason.OOM_KILLED)
    h.step()
    assert h.job.lifecycle.state is JobState.FAILED
    assert (
        "used its 2 relaunches" in h.job.lifecycle.reason
        and "1024 MiB, 1536 MiB, 2048 MiB" in h.job.lifecycle.reason
    )


def test_the_job_ends_with_its_chief() -> None:
    h = Harness()
    h.bring_up()
    h.engine.succeed("tfjob-evaluator-0-0")
    h.step()
    assert not h.job.lifecycle.ended.is_set()
    h.engine.succeed("tfjob-chief-0-0")
    h.step()
    assert h.job.lifecycle.state is JobState.SUCCEEDED
    assert "the chief tfjob-chief-0-0 succeeded" in h.job.lifecycle.reason


def test_scaling_the_ps_out_publishes_a_new_cluster_and_generation() -> None:
    h = Harness()
    h.bring_up()
    with pytest.raises(ValueError, match="scales its ps on request"):
        h.job.roles.scale_role("worker", 3)
    with pytest.raises(ValueError, match="removing ps from a running TensorFlow job"):
        h.job.roles.scale_role("ps", 1)
    assert "scaling to 3" in h.job.roles.scale_role("ps", 3)[0]
    with pytest.raises(ValueError, match="in progress"):
        h.job.roles.scale_role("ps", 4)
    h.step()
    assert h.engine.launched[-1].node_id == "tfjob-ps-2-0"
    h.register("tfjob-ps-2-0", "h:122")
    h.step()
    assert h.cluster()["version"] == 2 and h.generation() == 1  # not before the new ps serves
    h.serve("tfjob-ps-2-0")
    h.step()
    assert h.generation() == 2
    report = json.loads(h.job.kv.get(PS_SCALE_KEY) or b"{}")
    assert report["action"] == "scale" and report["servers"] == 3 and report["tf"]


def test_every_role_is_in_the_status_the_metrics_and_the_table_with_its_usage() -> None:
    h = Harness()
    h.bring_up()
    usage = TfNodeUsage(
        cpu_percent=150.0, memory_bytes=300 * 2**20, peak_memory_bytes=310 * 2**20, pid=4321, at=1.0
    )
    h.job.kv.set(TF_USAGE_KEY + "tfjob-ps-1-0", usage.encode())
    h.job.kv.set(TF_PROGRESS_KEY, TfProgress(batches=10, samples=2000, at=100.0).encode())
    h.step()
    h.job.kv.set(TF_PROGRESS_KEY, TfProgress(batches=30, samples=6000, at=102.0).encode())
    h.engine.fail("tfjob-worker-0-0", FailureReason.SIGNAL)
    h.step()

    status = LocalMasterApi(h.job).get_job_status()
    rows = {n.node_id: n for n in status.nodes}
    assert [(n.role, n.node_rank) for n in status.nodes] == [
        ("chief", 0),
        ("ps", 0),
        ("ps", 1),
        ("worker", 0),
        ("worker", 1),
        ("evaluator", 0),
    ]
    ps1 = rows["tfjob-ps-1-0"]
    assert (ps1.state, ps1.cpu_percent, ps1.memory_bytes, ps1.pid) == (
        "running",
        150.0,
        300 * 2**20,
        4321,
    )
    assert ps1.memory_limit_bytes == 2**30  # roles.ps.resources.memory
    relaunched = rows["tfjob-worker-0-1"]
    assert (relaunched.state, relaunched.restart_count) == ("pending", 1)
    assert rows["tfjob-evaluator-0-0"].state == "pending"  # no report from it yet
    assert (status.steps_per_s, status.samples_per_s) == (10.0, 2000.0)

    # The status survives the wire, and `dlrover status` prints every role's row.
    assert job_status_from_pb(job_status_to_pb(status)) == status
    table = status_table(status)
    assert "throughput: 2000 samples/s, 10.0 steps/s" in table
    line = next(row for row in table.splitlines() if row.startswith("tfjob-ps-1-0"))
    assert line.split() == [
        "tfjob-ps-1-0",
        "ps",
        "1",
        "running",
        "-1",
        "0",
        "150",
        "300",
        "1024",
        "4321",
        "-",
    ]

    metrics = JobMetrics(h.job).render().decode()
    assert 'dlrover_node_memory_bytes{job_name="tfjob",node="tfjob-ps-1-0"} 3.145728e+08' in metrics
    assert (
        'dlrover_role_node_state{job_name="tfjob",node="tfjob-worker-0-1",role="worker",'
        'state="pending"} 1.0' in metrics
    )
    assert (
        'dlrover_role_node_relaunches{job_name="tfjob",node="tfjob-worker-0-1",role="worker"} 1.0'
        in metrics
    )
    assert 'dlrover_samples_per_second{job_name="tfjob"} 2000.0' in metrics


def test_a_report_that_does_not_decode_is_skipped_and_a_restore_restarts_the_rates() -> None:
    h = Harness()
    h.bring_up()
    h.job.kv.set(TF_USAGE_KEY + "tfjob-ps-0-0", b'{"cpu_percent": "lots"}')
    for batches, at in ((10, 100.0), (20, 101.0), (5, 102.0)):  # then a restored checkpoint
        h.job.kv.set(TF_PROGRESS_KEY, TfProgress(batches, batches * 200, at).encode())
        h.step()
    assert h.controller.role_nodes()[1].cpu_percent == 0.0
    assert h.controller.rates().steps_per_s == 0.0  # one report since the restore
    h.job.kv.set(TF_PROGRESS_KEY, TfProgress(9, 1800, 104.0).encode())
    h.step()
    assert h.controller.rates().steps_per_s == 2.0


SEEDS_SHAPE = REPO / "examples" / "tf_ps" / "elasticjob.yaml"


def test_the_seeds_elasticjob_without_resources_is_a_job_spec_of_one_ps_and_one_worker() -> None:
    spec = load_job_spec(SEEDS_SHAPE)
    assert spec.name == "wide-deep-auto" and spec.engine == "local" and spec.tf is not None
    assert spec.auto_scale  # the seeds' optimizeMode: the master sizes the roles
    assert {r: spec.tf.count(r) for r in spec.tf.roles} == {"chief": 1, "ps": 1, "worker": 1}
    assert all(role.resources == Resources() for role in spec.tf.roles.values())
    # The chief runs the worker's container command (no chief replica given).
    assert (spec.entrypoint, spec.args) == (
        "examples/tf_ps/wide_deep.py",
        ("--out", "/tmp/wide-deep-auto"),
    )
    # The operator reads the same resource the same way (engine kubernetes).
    body = yaml.safe_load(SEEDS_SHAPE.read_text())
    body["metadata"].update(uid="u", namespace="ns")
    operated = job_spec_of(body)
    assert (operated.tf, operated.entrypoint, operated.args) == (
        spec.tf,
        spec.entrypoint,
        spec.args,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"apiVersion": "v1"}, "apiVersion 'v1' of kind ElasticJob is not known"),
        ({"metadata": {}}, "metadata.name is missing"),
        (
            {
                "spec": {
                    "distributionStrategy": "ParameterServerStrategy",
                    "replicaSpecs": {"ps": {}, "worker": {}},
                }
            },
            "no entrypoint: give spec.entrypoint, or a command",
        ),
        ({"spec": {"replicaSpecs": [1]}}, "replicaSpecs must map each role"),
    ],
)
def test_a_bad_elasticjob_says_what_to_change(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    body = {**yaml.safe_load(SEEDS_SHAPE.read_text()), **change}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(body))
    with pytest.raises(JobSpecError, match=f"{path}: {message}"):
        load_job_spec(path)


def test_unsized_roles_are_sized_from_their_measured_peaks_and_relaunched_at_that_size() -> None:
    h = Harness()  # roles.ps has 1Gi: only the chief, the workers and the evaluator are sized
    h.bring_up()
    now = [0.0]
    h.controller.sizer = TfSizer(h.job, h.controller, sizing_window_s=10.0, clock=lambda: now[0])
    nodes = [n.node_id for n in h.controller.role_nodes()]

    def report(node: str, mib: int, cpu: float) -> None:
        usage = TfNodeUsage(cpu, mib * 2**20, mib * 2**20, 1, now[0])
        h.job.kv.set(TF_USAGE_KEY + node, usage.encode())

    for node in nodes:
        report(node, 300, 50.0)
    h.step()
    now[0] = 20.0
    h.step()
    assert not h.engine.deleted  # the chief trained no batch yet: the ps hold no slots yet
    h.job.kv.set(TF_PROGRESS_KEY, TfProgress(batches=10, samples=2000, at=1.0).encode())
    h.step()  # every node runs and the chief trains: the window starts
    now[0] = 25.0
    report("tfjob-worker-1-0", 400, 120.0)  # the hungriest worker sizes the role
    h.step()
    assert not h.engine.deleted  # not before the window is over
    now[0] = 30.0
    h.step()
    assert sorted(h.engine.deleted) == [
        "tfjob-chief-0-0",
        "tfjob-evaluator-0-0",
        "tfjob-worker-0-0",
        "tfjob-worker-1-0",
    ]
    launched = {s.node_id: s.resources for s in h.engine.launched[-4:]}
    assert launched["tfjob-worker-0-1"] == Resources(cpu=2.0, memory_mib=520)  # 400 x 1.3
    assert launched["tfjob-chief-0-1"] == Resources(cpu=1.0, memory_mib=390)
    plans = [text for _, kind, text in h.job.diagnostics.events if kind == "scale"]
    assert (
        "resize worker: measured peak 400 MiB and 1.2 cores per node: 520 MiB, 2 CPU (x1.3): "
        "relaunched (tfjob-worker-0-0, tfjob-worker-1-0: the FakeEngine cannot resize a running "
        "node)"
    ) in plans
    assert h.job.diagnostics.scale_summary.startswith("auto-scale: resize ")
    rows = {n.node_id: n for n in LocalMasterApi(h.job).get_job_status().nodes}
    assert rows["tfjob-worker-0-1"].memory_limit_bytes == 520 * 2**20
    # The resize used none of the slot's relaunches: max_relaunches (2) failures still relaunch.
    h.engine.fail("tfjob-worker-0-1", FailureReason.SIGNAL)
    h.step()
    h.engine.fail("tfjob-worker-0-2", FailureReason.SIGNAL)
    h.step()
    assert h.engine.launched[-1].node_id == "tfjob-worker-0-3"
    assert h.engine.launched[-1].resources == Resources(cpu=2.0, memory_mib=520)
    assert not h.job.lifecycle.ended.is_set()
    now[0] = 100.0
    h.step()
    assert len(plans) == len(
        [1 for _, kind, _ in h.job.diagnostics.events if kind == "scale"]
    )  # once


def test_a_chief_that_never_reports_progress_has_its_roles_sized_from_use_alone() -> None:
    """A plain TF_CONFIG program (no PsTrainer, so no progress reports): after one window the
    status says why nothing is planned yet; after three the roles are sized from their
    measured memory and CPU, and the reason says how."""
    h = Harness()
    h.bring_up()
    now = [0.0]
    h.controller.sizer = TfSizer(h.job, h.controller, sizing_window_s=10.0, clock=lambda: now[0])
    for node in [n.node_id for n in h.controller.role_nodes()]:
        usage = TfNodeUsage(50.0, 300 * 2**20, 300 * 2**20, 1, now[0])
        h.job.kv.set(TF_USAGE_KEY + node, usage.encode())
    h.step()
    now[0] = 12.0
    h.step()
    assert not h.engine.deleted
    assert h.job.diagnostics.scale_summary.startswith(
        "auto-scale: the chief reports no progress (its program does not use PsTrainer)"
    ), h.job.diagnostics.scale_summary
    now[0] = 31.0
    h.step()
    assert "tfjob-worker-0-0" in h.engine.deleted
    assert {s.node_id: s.resources for s in h.engine.launched[-4:]}["tfjob-worker-0-1"] == (
        Resources(cpu=1.0, memory_mib=390)
    )
    plans = [text for _, kind, text in h.job.diagnostics.events if kind == "scale"]
    assert any(
        p.startswith("resize worker: measured peak 300 MiB and 0.5 cores per node: 390 MiB")
        and "over 30s of running without progress reports (the program does not use PsTrainer" in p
        for p in plans
    ), plans


def test_where_the_engine_resizes_in_place_every_role_is_sized_without_a_restart() -> None:
    h = Harness()
    h.engine.resizable = True
    h.bring_up()
    launched = len(h.engine.launched)
    now = [0.0]
    h.controller.sizer = TfSizer(h.job, h.controller, sizing_window_s=1.0, clock=lambda: now[0])
    h.job.kv.set(TF_PROGRESS_KEY, TfProgress(batches=10, samples=2000, at=1.0).encode())
    for node in [n.node_id for n in h.controller.role_nodes()]:
        usage = TfNodeUsage(50.0, 300 * 2**20, 300 * 2**20, 1, 0.0)
        h.job.kv.set(TF_USAGE_KEY + node, usage.encode())
    for now[0] in (0.0, 2.0):
        h.step()
    sized = Resources(cpu=1.0, memory_mib=390)
    assert sorted(h.engine.resized) == [
        (node, sized)
        for node in (
            "tfjob-chief-0-0",
            "tfjob-evaluator-0-0",
            "tfjob-worker-0-0",
            "tfjob-worker-1-0",
        )
    ]
    assert not h.engine.deleted and len(h.engine.launched) == launched  # the chief goes on
    plans = [text for _, kind, text in h.job.diagnostics.events if kind == "scale"]
    assert (
        "resize chief: measured peak 300 MiB and 0.5 cores per node: 390 MiB, 1 CPU (x1.3): "
        "resized in place"
    ) in plans
    rows = {n.node_id: n for n in LocalMasterApi(h.job).get_job_status().nodes}
    assert rows["tfjob-chief-0-0"].memory_limit_bytes == 390 * 2**20
    assert h.generation() == 1  # no ps was relaunched: the chief is not told to rebuild


def test_nothing_is_sized_from_a_node_that_never_reported_its_usage() -> None:
    h = Harness()
    h.bring_up()
    now = [0.0]
    h.controller.sizer = TfSizer(h.job, h.controller, sizing_window_s=1.0, clock=lambda: now[0])
    h.job.kv.set(TF_PROGRESS_KEY, TfProgress(batches=10, samples=2000, at=1.0).encode())
    for node in [n.node_id for n in h.controller.role_nodes() if n.role != "worker"]:
        usage = TfNodeUsage(50.0, 300 * 2**20, 300 * 2**20, 1, 0.0)
        h.job.kv.set(TF_USAGE_KEY + node, usage.encode())
    for now[0] in (0.0, 50.0, 100.0):
        h.step()
    assert not h.engine.deleted  # the workers run without reports (DLROVER_TF_USAGE_INTERVAL_S=0)


def test_tensorboard_gets_the_role_nodes_and_the_throughput_at_the_chiefs_batch(
    tmp_path: Path,
) -> None:
    h = Harness()
    h.bring_up()
    usage = TfNodeUsage(80.0, 256 * 2**20, 256 * 2**20, 7, 0.0)
    h.job.kv.set(TF_USAGE_KEY + "tfjob-ps-0-0", usage.encode())
    for batches, at in ((10, 100.0), (30, 102.0)):
        h.job.kv.set(TF_PROGRESS_KEY, TfProgress(batches, batches * 200, at).encode())
        h.step()
    exporter = TensorBoardExporter(h.job, str(tmp_path))
    exporter.write(h.job.clock())
    exporter.writer.close()
    _, point = _records(exporter.writer.path)
    assert point[9:11] == b"\x10\x1e"  # step (field 2): the chief's 30 batches
    assert _scalar(point, "node/tfjob-ps-0-0/memory_mib") == 256.0
    assert _scalar(point, "job/samples_per_second") == 2000.0


def test_an_all_reduce_jobs_table_keeps_its_columns() -> None:
    job = _job()  # one agent node, of role "default"
    header = status_table(LocalMasterApi(job).get_job_status()).splitlines()[1]
    assert header.split()[:5] == ["node", "rank", "state", "step", "restarts"]  # no role column


def test_a_chiefs_program_that_cannot_start_is_named_before_the_cluster_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dlrover-tf-node`'s check of the chief's program (nothing is run): an executable that is
    not there, a module that is not found, a script that does not compile; "" when it can."""
    from dlrover.cli.tf_node import cannot_start

    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.py").write_text("print('hi')\n")
    (tmp_path / "bad.py").write_text("print(\n")
    (tmp_path / "here_mod.py").write_text("x = 1\n")
    assert cannot_start(["good.py"]) == "" and cannot_start(["python", "good.py", "--a"]) == ""
    assert cannot_start(["python", "-m", "here_mod"]) == ""
    assert "no such program: 'no-such-binary-x'" in cannot_start(["no-such-binary-x", "--a"])
    assert "SyntaxError in bad.py line 1" in cannot_start(["bad.py"])
    assert "cannot open 'missing.py'" in cannot_start(["python3", "missing.py"])
    why = cannot_start(["python3", "-m", "pkg_not_here.sub"])
    assert why.startswith("module 'pkg_not_here.sub' cannot be found: ModuleNotFoundError"), why
