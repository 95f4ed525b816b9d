"""The workers of a TensorFlow job scaled from measured throughput, without TensorFlow: the
policy on a FakeEngine-driven TfController with a fake clock and the chief's progress reports
written by the test (samples/s at each worker count), and roles.worker.max_count in the spec."""

from __future__ import annotations

import json

import pytest

from dlrover.constants import (
    TF_ADDRESS_KEY,
    TF_PROGRESS_KEY,
    TF_PS_GENERATION_KEY,
    TF_READY_KEY,
    TF_USAGE_KEY,
)
from dlrover.coordination import TfNodeUsage, TfProgress
from dlrover.engines.base import Capacity
from dlrover.jobspec import JobSpecError, job_spec_from_dict
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.optimizer import OptimizerConfig, ResourceOptimizer
from dlrover.master.roles import RoleNode
from dlrover.master.state_store import MemoryStateStore
from dlrover.master.tf_controller import TfController
from dlrover.master.tf_scaling import TfWorkerScaler, saturated_ps
from dlrover.master.tf_sizing import TfSizer
from dlrover.testing.fake_engine import FakeEngine
from dlrover.trainer.tf.grow import workers_added

INTERVAL_S = 5.0
WINDOW_S = 4.0


class Job:
    """A job of 1 chief, 1 ps and 1..``most`` workers whose chief reports ``rate(workers)``
    samples/s, one report per second of the fake clock."""

    def __init__(
        self,
        most: int = 3,
        capacity: Capacity | None = None,
        ps_cpu: float = 0,
        worker_cpu: float = 0,
    ) -> None:
        ps: dict[str, object] = {"count": 1}
        if ps_cpu:
            ps["resources"] = {"cpu": ps_cpu}
        worker: dict[str, object] = {"count": 1, "max_count": most}
        if worker_cpu:
            worker["resources"] = {"cpu": worker_cpu}
        self.spec = job_spec_from_dict(
            {
                "name": "w",
                "entrypoint": "train.py",
                "distribution_strategy": "ParameterServerStrategy",
                "roles": {"ps": ps, "worker": worker},
            }
        )
        self.now = 0.0
        self.store = MemoryStateStore()
        self.job = JobMaster(JobMasterConfig("w"), self.store)
        self.engine = FakeEngine()
        self.controller = TfController(
            self.job, self.engine, self.spec, "m:1", "t", clock=self.clock, store=self.store
        )
        config = OptimizerConfig(1, most, cooldown_s=0.0, unit="worker", rate_unit="samples/s")
        self.scaler = TfWorkerScaler(
            self.job,
            self.controller,
            ResourceOptimizer(config, self.clock),
            lambda: capacity or Capacity(),
            2.0,
            INTERVAL_S,
            WINDOW_S,
            self.clock,
        )
        self.controller.worker_scaler = self.scaler
        self.controller.start()
        self.samples = 0
        self.chief_version = 0
        self.ps_cpu_percent = 10.0
        self.bring_up()

    def clock(self) -> float:
        return self.now

    def bring_up(self) -> None:
        """Every launched node registers and serves; the chief builds on the newest cluster
        once a generation names it (as PsTrainer does)."""
        for slot in list(self.controller.slots.values()):
            node = slot.spec.node_id
            self.job.kv.set(TF_ADDRESS_KEY + node, f"h:{slot.role}{slot.index}".encode())
        self.controller.step(0.0)
        for slot in list(self.controller.slots.values()):
            self.job.kv.set(TF_READY_KEY + slot.spec.node_id, b"grpc://x")
        self.controller.step(0.0)
        generation = json.loads(self.job.kv.get(TF_PS_GENERATION_KEY) or b"{}")
        self.chief_version = int(generation.get("cluster_version", 0))

    def workers(self) -> int:
        return self.controller.counts["worker"]

    def run(self, seconds: int, rate: dict[int, float]) -> None:
        """``seconds`` of training at ``rate[workers]`` samples/s, the chief reporting each."""
        for _ in range(seconds):
            self.now += 1.0
            self.samples += int(rate[self.workers()])
            progress = TfProgress(self.samples // 200, self.samples, self.now, self.chief_version)
            self.job.kv.set(TF_PROGRESS_KEY, progress.encode())
            usage = TfNodeUsage(self.ps_cpu_percent, 300 << 20, 300 << 20, 1, self.now)
            self.job.kv.set(
                TF_USAGE_KEY + self.controller.slots[("ps", 0)].spec.node_id, usage.encode()
            )
            self.controller.step(0.0)
            if self.controller.workers_changing or self.chief_version != self._published():
                self.bring_up()

    def _published(self) -> int:
        generation = json.loads(self.job.kv.get(TF_PS_GENERATION_KEY) or b"{}")
        return int(generation.get("cluster_version", 0))

    def plans(self) -> list[str]:
        return [
            text
            for _, kind, text in self.job.diagnostics.events
            if kind == "scale" and "->" in text
        ]


def test_workers_are_added_while_each_raises_samples_per_second_up_to_max_count() -> None:
    job = Job(most=3)
    job.run(60, {1: 1000.0, 2: 1900.0, 3: 2700.0})
    assert job.workers() == 3
    assert [p.nodes for p in job.scaler.plans] == [2, 3]
    assert "scale_out worker 2 -> 3: worker 2 added +90% (1e+03 -> 1.9e+03 samples/s)" in (
        job.plans()
    )
    assert "at max workers (3)" in job.job.diagnostics.scale_summary
    launched = [s.node_id for s in job.engine.launched if s.role == "worker"]
    assert launched == ["w-worker-0-0", "w-worker-1-0", "w-worker-2-0"]


def test_a_worker_that_adds_nothing_is_removed_once_the_chief_trains_without_it() -> None:
    job = Job(most=3)
    job.run(30, {1: 1000.0, 2: 1010.0, 3: 1010.0})
    assert job.workers() == 1
    assert [p.nodes for p in job.scaler.plans] == [2, 1]
    assert any("scale_in worker 2 -> 1: worker 2 added +1%" in p for p in job.plans())
    assert job.engine.deleted == ["w-worker-1-0"]  # after the chief's report on the new cluster
    job.run(20, {1: 1000.0, 2: 1010.0})
    assert job.workers() == 1  # a count found not to pay is not tried again
    assert "worker 2 added +1% when tried: staying" in job.job.diagnostics.scale_summary


def test_a_removed_worker_is_deleted_only_after_the_chief_left_its_cluster() -> None:
    job = Job(most=2)
    job.run(12, {1: 1000.0, 2: 1000.0})
    assert job.workers() == 2
    job.controller.scale_workers(1)
    job.controller.step(0.0)
    assert not job.engine.deleted  # the chief still trains on the cluster with it
    assert job._published() > job.chief_version  # a generation tells the chief to move
    job.run(1, {1: 1000.0})  # its last report on the old cluster; then it moves
    assert not job.engine.deleted
    job.run(1, {1: 1000.0})  # its first report on the new cluster
    assert job.engine.deleted == ["w-worker-1-0"]
    job.controller.scale_workers(2)  # the slot used again gets a new name
    assert job.engine.launched[-1].node_id == "w-worker-1-1"


def test_no_worker_is_added_beyond_capacity_or_while_the_ps_are_saturated() -> None:
    full = Job(capacity=Capacity(cpu=0.5), worker_cpu=1.0)
    full.run(20, {1: 1000.0})
    assert full.workers() == 1
    assert "no capacity for another worker" in full.job.diagnostics.scale_summary
    roomy = Job(most=2, capacity=Capacity(cpu=1.0), worker_cpu=1.0)
    roomy.run(12, {1: 1000.0, 2: 2000.0})
    assert roomy.workers() == 2
    busy = Job(ps_cpu=1.0)
    busy.ps_cpu_percent = 95.0
    busy.run(20, {1: 1000.0, 2: 2000.0})
    assert busy.workers() == 1
    assert (
        "the ps are saturated: ps 0 (w-ps-0-0) uses 0.9 of 1 cores"
        in busy.job.diagnostics.scale_summary
    )


def test_saturated_ps_names_the_first_one_at_its_cpu_limit() -> None:
    def ps(index: int, cpu: float) -> RoleNode:
        return RoleNode(f"ps-{index}", "ps", index, "running", 0, cpu_percent=cpu)

    assert saturated_ps([ps(0, 50.0), ps(1, 190.0)], [2.0, 2.0]) == (
        "ps 1 (ps-1) uses 1.9 of 2 cores"
    )
    assert saturated_ps([ps(0, 50.0)], [2.0]) is None


@pytest.mark.parametrize(
    ("worker", "message"),
    [
        (
            {"count": 2, "max_count": 1},
            "roles.worker.max_count is 1; it must be an integer >= count",
        ),
        ({"count": 1, "max_count": "many"}, "roles.worker.max_count is 'many'"),
    ],
)
def test_a_bad_max_count_says_what_to_change(worker: dict[str, object], message: str) -> None:
    raw = {
        "entrypoint": "t.py",
        "distribution_strategy": "ParameterServerStrategy",
        "roles": {"ps": {"count": 1}, "worker": worker},
    }
    with pytest.raises(JobSpecError, match=message.replace("(", r"\(")):
        job_spec_from_dict(raw)
    with pytest.raises(JobSpecError, match="allowed: count, resources"):
        job_spec_from_dict({**raw, "roles": {"chief": {"max_count": 2}, "ps": {}, "worker": {}}})


def test_a_sizer_made_before_the_nodes_launch_leaves_the_given_sizes_alone() -> None:
    """The job runner makes the sizer before `start`: roles given resources are still not
    measured and relaunched (they were, after the sizing window, before this was fixed)."""
    spec = job_spec_from_dict(
        {
            "name": "g",
            "entrypoint": "train.py",
            "distribution_strategy": "ParameterServerStrategy",
            "auto_scale": True,
            "roles": {"ps": {"resources": {"memory": "1Gi"}}, "worker": {}},
        }
    )
    now = [0.0]
    job = JobMaster(JobMasterConfig("g"), MemoryStateStore())
    engine = FakeEngine()
    controller = TfController(job, engine, spec, "m:1", "t", clock=lambda: now[0])
    controller.sizer = TfSizer(job, controller, sizing_window_s=1.0)
    controller.start()
    for slot in controller.slots.values():
        job.kv.set(TF_ADDRESS_KEY + slot.spec.node_id, f"h:{slot.role}".encode())
        job.kv.set(TF_READY_KEY + slot.spec.node_id, b"grpc://x")
        usage = TfNodeUsage(50.0, 300 << 20, 300 << 20, 1, 0.0)
        job.kv.set(TF_USAGE_KEY + slot.spec.node_id, usage.encode())
    job.kv.set(TF_PROGRESS_KEY, TfProgress(10, 2000, 1.0, 1).encode())
    for now[0] in (0.0, 1.0, 5.0, 10.0):
        controller.step(0.0)
    assert sorted(engine.deleted) == ["g-chief-0-0", "g-worker-0-0"]  # the ps kept its 1Gi


def test_a_master_restarted_mid_change_finishes_it() -> None:
    """The change underway is in the master's state: a master restarted after adding a worker
    still tells the chief once the worker serves, and one restarted after removing a worker
    still deletes it once the chief trains without it."""
    job = Job(most=3)
    job.run(12, {1: 1000.0, 2: 1000.0})
    assert job.workers() == 2
    job.controller.scale_workers(3)
    job.controller.step(0.0)

    def restart() -> None:
        job.engine = FakeEngine()
        job.job = JobMaster(JobMasterConfig("w"), job.store)
        job.controller = TfController(
            job.job, job.engine, job.spec, "m:1", "t", clock=job.clock, store=job.store
        )
        job.controller.start()

    restart()
    assert job.controller.workers_changing and job.workers() == 3
    published = job._published()
    job.bring_up()
    assert job._published() > published  # the new worker serves: a generation names it
    job.controller.scale_workers(2)
    restart()
    job.bring_up()
    job.run(2, {2: 1000.0})  # the chief's report on the old cluster, then on the new one
    assert job.engine.deleted == ["w-worker-2-0"]


def test_only_workers_appended_to_the_cluster_join_the_chief_in_place() -> None:
    old = {"chief": ["c:1"], "ps": ["p:1", "p:2"], "worker": ["w:1"]}
    assert workers_added(old, {**old, "worker": ["w:1", "w:2", "w:3"]}) == ["w:2", "w:3"]
    assert workers_added(old, old) == []
    # Anything else changed: the chief starts again on the new cluster, as before.
    assert workers_added(old, {**old, "worker": ["w:9", "w:2"]}) == []  # a worker moved
    assert workers_added(old, {**old, "worker": []}) == []  # fewer workers
    assert workers_added(old, {**old, "ps": ["p:1", "p:2", "p:3"], "worker": ["w:1", "w:2"]}) == []
    assert workers_added(old, {**old, "evaluator": ["e:1"], "worker": ["w:1", "w:2"]}) == []
