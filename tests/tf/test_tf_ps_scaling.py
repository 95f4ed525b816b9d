"""The ps of a TensorFlow job scaled from their load, without TensorFlow: the policy on
recorded loads, and the TfPsScaler on a FakeEngine-driven TfController with a fake clock and the
ps' usage reports written by the test (a hot ps, a saturated one, memory creeping to the limit)."""

from __future__ import annotations

import json

from dlrover.constants import (
    PS_SCALE_KEY,
    TF_ADDRESS_KEY,
    TF_READY_KEY,
    TF_USAGE_KEY,
)
from dlrover.coordination import TfNodeUsage
from dlrover.engines.base import FailureReason, Resources
from dlrover.jobspec import job_spec_from_dict
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.optimizer import ScaleAction
from dlrover.master.state_store import MemoryStateStore
from dlrover.master.tf_controller import TfController
from dlrover.master.tf_scaling import PsLoad, TfPsScaler, hot_ps, plan_ps
from dlrover.testing.fake_engine import FakeEngine

SIZE = Resources(cpu=1.0, memory_mib=1000)


def test_a_hot_ps_is_named_and_one_more_ps_planned_up_to_max_count() -> None:
    load = [PsLoad("j-ps-0-0", 0, 0.8, 600), PsLoad("j-ps-1-0", 1, 0.1, 600)]
    assert hot_ps(load) == "ps 0 (j-ps-0-0) is hot: 0.80 cores, 8.0x the others' 0.10"
    plan = plan_ps(load, SIZE, 2.0, max_count=3)
    assert plan.action is ScaleAction.SCALE_OUT and plan.nodes == 3
    assert plan.reason.startswith("ps 0 (j-ps-0-0) is hot")
    held = plan_ps(load, SIZE, 2.0, max_count=2)
    assert held.action is ScaleAction.NONE and held.reason.endswith("; at max ps (2)")
    even = [PsLoad("a", 0, 0.5, 600), PsLoad("b", 1, 0.4, 600)]
    assert plan_ps(even, SIZE, 2.0, 3).reason == "ps load even (0.50, 0.40 cores)"
    idle = [PsLoad("a", 0, 0.1, 600), PsLoad("b", 1, 0.01, 600)]  # 10x, but idle: noise
    assert plan_ps(idle, SIZE, 2.0, 3).action is ScaleAction.NONE


def test_a_saturated_ps_adds_one_even_alone() -> None:
    plan = plan_ps([PsLoad("a", 0, 0.95, 600)], SIZE, 1.0, max_count=2)
    assert plan.action is ScaleAction.SCALE_OUT and plan.nodes == 2
    assert plan.reason == "the ps are saturated: ps 0 (a) uses 0.9 of 1 cores"


def test_memory_creeping_to_the_limit_resizes_first() -> None:
    load = [PsLoad("a", 0, 0.9, 920), PsLoad("b", 1, 0.1, 700)]  # hot too: memory comes first
    plan = plan_ps(load, SIZE, 2.0, max_count=3)
    assert plan.action is ScaleAction.RESIZE
    assert plan.resources == Resources(cpu=1.0, memory_mib=1196)
    assert plan.reason == "ps 0 (a) memory creeps to 920 of 1000 MiB: 1196 MiB (x1.3)"
    unlimited = plan_ps(load, Resources(), 2.0, max_count=3)
    assert unlimited.action is ScaleAction.SCALE_OUT  # no limit: nothing to creep to


class Job:
    """A job of 1 chief, 2 ps (1 CPU, 1000 MiB each, at most ``most``) and 1 worker; the ps
    report their usage once per second of the fake clock."""

    def __init__(self, most: int = 3, resizable: bool = False) -> None:
        spec = job_spec_from_dict(
            {
                "name": "j",
                "entrypoint": "train.py",
                "distribution_strategy": "ParameterServerStrategy",
                "roles": {
                    "ps": {
                        "count": 2,
                        "max_count": most,
                        "resources": {"cpu": 1, "memory": "1000Mi"},
                    },
                    "worker": {},
                },
            }
        )
        self.now = 0.0
        self.job = JobMaster(JobMasterConfig("j"), MemoryStateStore())
        self.engine = FakeEngine()
        self.engine.resizable = resizable
        self.controller = TfController(self.job, self.engine, spec, "m:1", "t", clock=self.clock)
        self.scaler = TfPsScaler(self.job, self.controller, most, 2.0, 2.0, self.clock)
        self.controller.ps_scaler = self.scaler
        self.controller.start()
        self.bring_up()

    def clock(self) -> float:
        return self.now

    def bring_up(self) -> None:
        for slot in list(self.controller.slots.values()):
            self.job.kv.set(
                TF_ADDRESS_KEY + slot.spec.node_id, f"h:{slot.role}{slot.index}".encode()
            )
        self.controller.step(0.0)
        for slot in list(self.controller.slots.values()):
            self.job.kv.set(TF_READY_KEY + slot.spec.node_id, b"grpc://x")
        self.controller.step(0.0)

    def run(self, seconds: int, cpu: list[float], mib: list[int]) -> None:
        """``seconds`` with ps i at ``cpu[i]`` percent and ``mib[i]`` MiB resident."""
        for _ in range(seconds):
            self.now += 1.0
            for i, (percent, memory) in enumerate(zip(cpu, mib, strict=False)):
                node = self.controller.slots[("ps", i)].spec.node_id
                usage = TfNodeUsage(percent, memory << 20, memory << 20, 1, self.now)
                self.job.kv.set(TF_USAGE_KEY + node, usage.encode())
            self.controller.step(0.0)
            self.bring_up()  # whatever was launched serves at once

    def plans(self) -> list[str]:
        return [text for _, kind, text in self.job.diagnostics.events if kind == "scale"]


def test_a_hot_ps_found_in_two_plans_in_a_row_adds_a_ps_through_the_re_partition() -> None:
    job = Job()
    job.run(3, [80.0, 10.0], [600, 600])  # a plan every 2 s of samples
    assert job.controller.counts["ps"] == 2  # one plan found it hot: a vote, no action
    assert job.job.diagnostics.scale_summary.endswith("(vote 1)")
    job.run(3, [80.0, 10.0], [600, 600])
    assert job.controller.counts["ps"] == 3
    assert any(
        p.startswith("scale_out ps 2 -> 3: ps 0 (j-ps-0-0) is hot: 0.80") for p in job.plans()
    )
    assert job.engine.launched[-1].node_id == "j-ps-2-0"
    report = json.loads(job.job.kv.get(PS_SCALE_KEY) or b"{}")
    assert report["servers"] == 3  # the new ps served: a generation the chief re-partitions on
    job.run(8, [30.0, 30.0, 30.0], [600, 600, 600])
    assert job.controller.counts["ps"] == 3
    assert job.job.diagnostics.scale_summary == "auto-scale: ps load even (0.30, 0.30, 0.30 cores)"


def test_a_ps_whose_memory_creeps_is_resized_before_the_oom_kill() -> None:
    job = Job()
    job.run(3, [20.0, 20.0], [700, 850])
    assert not job.engine.deleted
    job.run(3, [20.0, 20.0], [700, 950])  # past 90% of 1000 MiB
    assert sorted(job.engine.deleted) == ["j-ps-0-0", "j-ps-1-0"]
    assert {s.node_id: s.resources.memory_mib for s in job.engine.launched[-2:]} == {
        "j-ps-0-1": 1235,
        "j-ps-1-1": 1235,
    }
    assert (
        "resize ps: ps 1 (j-ps-1-0) memory creeps to 950 of 1000 MiB: 1235 MiB (x1.3): relaunched "
        "(j-ps-0-0, j-ps-1-0: the FakeEngine cannot resize a running node)"
    ) in job.plans()
    # The resize used none of the slot's relaunches: a later OOM kill still grows it 1.5x.
    job.engine.fail("j-ps-1-1", FailureReason.OOM_KILLED)
    job.controller.step(0.0)
    assert job.engine.launched[-1].resources.memory_mib == 1853


def test_an_engine_that_resizes_in_place_keeps_the_ps_running_and_relaunches_nothing() -> None:
    job = Job(resizable=True)
    launched = len(job.engine.launched)
    job.run(6, [20.0, 20.0], [700, 950])
    grown = Resources(cpu=1.0, memory_mib=1235)
    assert job.engine.resized == [("j-ps-0-0", grown), ("j-ps-1-0", grown)]
    assert not job.engine.deleted and len(job.engine.launched) == launched
    assert (
        "resize ps: ps 1 (j-ps-1-0) memory creeps to 950 of 1000 MiB: 1235 MiB (x1.3): "
        "resized in place"
    ) in job.plans()
    rows = {n.node_id: n for n in job.controller.role_nodes() if n.role == "ps"}
    assert set(rows) == {"j-ps-0-0", "j-ps-1-0"}  # the same attempts, serving on
    assert all(r.memory_limit_bytes == 1235 << 20 and r.state == "running" for r in rows.values())
    assert job.controller.role_resources("ps") == grown
    # A ps that failed meanwhile and waits for its relaunch starts at the next size.
    job.controller._relaunch_delay_s = 60.0
    job.engine.fail("j-ps-0-0", FailureReason.SIGNAL)
    job.engine.fail("j-worker-0-0", FailureReason.SIGNAL)  # another role's: keeps its size
    job.run(6, [20.0, 20.0], [1200, 1200])  # past 90% of 1235 MiB
    assert ("j-ps-1-0", Resources(cpu=1.0, memory_mib=1560)) in job.engine.resized
    assert job.controller.slots[("ps", 0)].spec.resources.memory_mib == 1560
    assert job.controller.slots[("worker", 0)].spec.resources == Resources()
    job.now += 60.0
    job.controller.step(0.0)
    launched = {spec.node_id: spec.resources for spec in job.engine.launched}
    assert launched["j-ps-0-1"].memory_mib == 1560 and launched["j-worker-0-1"] == Resources()
