"""The resource optimiser's policies on recorded traces, with a fake clock."""

from __future__ import annotations

from dlrover.engines.base import Capacity, Resources
from dlrover.master.optimizer import (
    NodeUsage,
    OptimizerConfig,
    ResourceOptimizer,
    ScaleAction,
    size_from_usage,
)

SIZE = Resources(cpu=2, memory_mib=1000)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_trace(throughput, lo=2, hi=5, rounds=12):
    """Plan every 5 min (the cooldown) on a job whose throughput at n nodes is throughput(n)."""
    clock = Clock()
    opt = ResourceOptimizer(OptimizerConfig(lo, hi), clock)
    nodes, history = lo, []
    for _ in range(rounds):
        opt.observe_throughput(nodes, throughput(nodes))
        plan = opt.plan(nodes, SIZE, [], Capacity(), sized=True)
        history.append((nodes, plan.action, plan.reason))
        nodes = plan.nodes
        clock.now += 300
    return nodes, history


def test_linear_speed_up_scales_out_to_max_and_stays() -> None:
    nodes, history = run_trace(lambda n: 10.0 * n)
    assert nodes == 5
    outs = [h for h in history if h[1] is ScaleAction.SCALE_OUT]
    assert [n for n, _, _ in outs] == [2, 3, 4]
    assert history[-1][2] == "at max nodes (5)"


def test_flat_throughput_tries_one_node_then_gives_it_back_and_stays() -> None:
    nodes, history = run_trace(lambda n: 20.0 if n == 2 else 20.5)
    actions = [a for _, a, _ in history if a is not ScaleAction.NONE]
    assert actions == [ScaleAction.SCALE_OUT, ScaleAction.SCALE_IN]  # no flapping after
    assert nodes == 2
    assert any("scale-in vote 1" in r for _, _, r in history)  # two votes before scaling in
    assert "node 3 added +2% when tried: staying" in history[-1][2]


def test_diminishing_returns_stop_at_the_threshold() -> None:
    gains = {2: 20.0, 3: 29.0, 4: 33.0, 5: 35.0}  # +45%, +14%, +6%
    nodes, history = run_trace(lambda n: gains[n])
    assert nodes == 4  # +45% from the 3rd node was worth a 4th; +14% from the 4th is not a 5th
    assert history[-1][2] == "node 4 added +14% (< 20%): staying"
    assert all(n < 5 for n, _, _ in history)


def test_cooldown_and_capacity_hold_actions_back() -> None:
    clock = Clock()
    opt = ResourceOptimizer(OptimizerConfig(1, 4), clock)
    opt.observe_throughput(1, 10)
    assert opt.plan(1, SIZE, [], Capacity(cpu=1.0), sized=True).reason == (
        "no capacity for another node"
    )
    assert opt.plan(1, SIZE, [], Capacity(), sized=True).action is ScaleAction.SCALE_OUT
    clock.now = 100
    opt.observe_throughput(2, 20)
    held = opt.plan(2, SIZE, [], Capacity(), sized=True)
    assert held.action is ScaleAction.NONE and held.reason == "cooldown (200s left)"


def test_a_job_without_resources_is_sized_from_its_first_minute() -> None:
    clock = Clock()
    opt = ResourceOptimizer(OptimizerConfig(2, 2), clock)
    usage = [NodeUsage("a", 1.1, 700), NodeUsage("b", 0.9, 810)]
    first = opt.plan(2, Resources(), usage, Capacity(), sized=False)
    assert first.action is ScaleAction.NONE and first.reason == "measuring use for sizing"
    clock.now = 61
    plan = opt.plan(2, Resources(), usage, Capacity(), sized=False)
    assert plan.action is ScaleAction.RESIZE
    assert plan.resources == Resources(cpu=1.5, memory_mib=1053)  # 810 x 1.3, 1.1 x 1.3 -> 1.5
    assert "measured peak 810 MiB and 1.1 cores per node" in plan.reason


def test_memory_creeping_towards_the_size_resizes() -> None:
    clock = Clock()
    opt = ResourceOptimizer(OptimizerConfig(1, 1), clock)
    clock.now = 61
    calm = opt.plan(1, SIZE, [NodeUsage("a", 1.0, 600)], Capacity(), sized=True)
    assert calm.action is ScaleAction.NONE
    plan = opt.plan(1, SIZE, [NodeUsage("a", 1.0, 950)], Capacity(), sized=True)
    assert plan.action is ScaleAction.RESIZE and plan.resources is not None
    assert plan.resources.memory_mib == 1235 and "memory creeps to peak 950 MiB" in plan.reason


def test_size_from_usage_has_floors() -> None:
    assert size_from_usage([], 1.3) == Resources(cpu=0.5, memory_mib=64)


def test_embedding_servers_grow_while_the_fullest_passes_its_fill_up_to_their_max() -> None:
    from dlrover.master.optimizer import plan_ps

    mib = 1 << 20
    # 2 servers of 1 GiB: 300 MiB of rows each, 600 MiB with the neighbour's replica: 59%
    assert plan_ps(2, [300 * mib, 280 * mib], 1024, 4, replicated=True).action is ScaleAction.NONE
    grow = plan_ps(2, [300 * mib, 380 * mib], 1024, 4, replicated=True)
    assert grow.action is ScaleAction.SCALE_OUT and grow.nodes == 3
    assert "760 MiB of 1024 MiB (74% > 70%)" in grow.reason
    assert plan_ps(2, [380 * mib], 1024, 4, replicated=False).action is ScaleAction.NONE
    held = plan_ps(4, [900 * mib], 1024, 4, replicated=False)
    assert held.action is ScaleAction.NONE and "at their max (4)" in held.reason
    assert plan_ps(2, [900 * mib], 0, 4, replicated=False).action is ScaleAction.NONE  # no size
