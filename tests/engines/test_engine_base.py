"""Engine contract pieces: NodeSpec validation, parallel launch_many, FakeEngine, OOM relaunch."""

from __future__ import annotations

import threading

import pytest

from dlrover.engines.base import (
    FailureReason,
    InvalidNodeSpecError,
    LaunchManyError,
    NodeSpec,
    NodeState,
    Resources,
)
from dlrover.master.relaunch_policy import OomPolicy, memory_after_oom, replacement_spec
from dlrover.testing.fake_engine import FakeEngine


def _spec(rank: int, memory_mib: int = 1024) -> NodeSpec:
    return NodeSpec(
        job_name="job-a",
        rank=rank,
        command=("dlrover-run", "train.py"),
        resources=Resources(cpu=1, memory_mib=memory_mib, shm_mib=memory_mib // 2),
    )


def test_node_id_is_a_function_of_the_slot_and_attempt() -> None:
    spec = _spec(3)
    assert spec.node_id == "job-a-worker-3-0"
    assert spec.replacement().node_id == "job-a-worker-3-1"
    assert spec.replacement().rank == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"job_name": "Bad_Name"}, "job name 'Bad_Name'"),
        ({"role": "driver"}, "role 'driver'"),
        ({"rank": -1}, "rank \\(-1\\)"),
        ({"command": ()}, "command must be"),
    ],
)
def test_invalid_node_spec_names_the_field(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"job_name": "ok", "rank": 0, "command": ("x",)}
    with pytest.raises(InvalidNodeSpecError, match=message):
        NodeSpec(**{**base, **kwargs})  # type: ignore[arg-type]


def test_negative_resources_are_refused() -> None:
    with pytest.raises(InvalidNodeSpecError, match="resources.memory_mib is -1"):
        Resources(memory_mib=-1)


def test_launch_many_runs_launches_concurrently() -> None:
    engine = FakeEngine()
    # A 30-party barrier only opens if all 30 launches are in flight at the same time;
    # a one-at-a-time loop would time out on the first launch.
    engine.launch_barrier = threading.Barrier(30)
    specs = [_spec(rank) for rank in range(30)]
    nodes = engine.launch_many(specs)
    assert [node.node_id for node in nodes] == [spec.node_id for spec in specs]
    assert sorted(s.rank for s in engine.launched) == list(range(30))


def test_launch_many_reports_partial_failure_and_keeps_the_rest() -> None:
    engine = FakeEngine()
    engine.fail_launch_of = {"job-a-worker-2-0"}
    with pytest.raises(LaunchManyError) as info:
        engine.launch_many([_spec(rank) for rank in range(4)])
    assert [n.spec.rank for n in info.value.launched] == [0, 1, 3]
    assert list(info.value.failures) == ["job-a-worker-2-0"]
    assert "1 of 4 launches failed" in str(info.value)


def test_fake_engine_records_and_emits() -> None:
    engine = FakeEngine()
    node = engine.launch(_spec(0))
    assert engine.events(0)[0].state is NodeState.PENDING
    engine.run(node.node_id)
    engine.fail(node.node_id, FailureReason.OOM_KILLED, message="OOMKilled")
    events = engine.events(0)
    assert [(e.state, e.reason) for e in events] == [
        (NodeState.RUNNING, None),
        (NodeState.FAILED, FailureReason.OOM_KILLED),
    ]
    engine.delete(node.node_id)  # already final: recorded, no event
    assert engine.deleted == [node.node_id] and engine.events(0) == []


def test_oom_replacement_grows_memory_up_to_the_cap() -> None:
    policy = OomPolicy(factor=2.0, max_memory_mib=3000)
    engine = FakeEngine()
    node = engine.launch(_spec(0, memory_mib=1000))
    event = engine.fail(node.node_id, FailureReason.OOM_KILLED)
    first = replacement_spec(event, policy)
    assert first is not None
    assert (first.relaunch_count, first.resources.memory_mib, first.resources.shm_mib) == (
        1,
        2000,
        1000,
    )
    second = memory_after_oom(first.resources, policy)
    assert second is not None and second.memory_mib == 3000  # capped, not 4000
    assert memory_after_oom(second, policy) is None  # at the cap: do not relaunch the same size
    crash = engine.fail(node.node_id, FailureReason.EXIT_CODE, exit_code=1)
    same = replacement_spec(crash, policy)
    assert same is not None and same.resources == crash.spec.resources


def test_oom_policy_refuses_a_factor_that_does_not_grow() -> None:
    with pytest.raises(InvalidNodeSpecError, match="factor is 1.0"):
        OomPolicy(factor=1.0)


def test_delete_many_deletes_every_node_and_reports_unknown_ids() -> None:
    from dlrover.engines.base import NodeNotFoundError

    engine = FakeEngine()
    nodes = engine.launch_many([_spec(rank) for rank in range(5)])
    with pytest.raises(NodeNotFoundError):
        engine.delete_many([n.node_id for n in nodes] + ["job-a-worker-99-0"])
    assert sorted(engine.deleted) == sorted(n.node_id for n in nodes)
    assert all(n.state is NodeState.DELETED for n in engine.list_nodes())


def test_node_spec_is_hashable_and_compares_env() -> None:
    spec = _spec(0)
    with_env = NodeSpec(job_name="job-a", rank=0, command=("x",), env={"A": "1"})
    assert {spec, spec.replacement()} == {spec, spec.replacement()}
    assert hash(with_env) == hash(NodeSpec(job_name="job-a", rank=0, command=("x",)))
    assert with_env != NodeSpec(job_name="job-a", rank=0, command=("x",), env={"A": "2"})
