"""The node check's master side: pairing, localising, stragglers, and a whole check driven the
way agents drive it (joins, reports, time-outs, a member lost), on a fake clock."""

from __future__ import annotations

import itertools

import pytest

from dlrover.api.master import NodeCheckState
from dlrover.master.node_check import (
    CheckResult,
    CheckSettings,
    NodeCheck,
    first_groups,
    localise,
    next_groups,
    stragglers,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_check(
    members: list[str],
    faulty: set[str] = frozenset(),  # type: ignore[assignment]
    times: dict[str, float] | None = None,
    settings: CheckSettings | None = None,
) -> NodeCheck:
    """Drive a check as agents would: a group fails when it holds a faulty node."""
    check = NodeCheck(7, members, settings or CheckSettings(), Clock())
    for check_round in (1, 2, 3):
        for node in members:
            check.join(node, check_round, f"{node}:1")
        tasks = {node: check.task(node, check_round) for node in members}
        if check.verdict is not None:
            break
        for node, task in tasks.items():
            assert task is not None and task.state is NodeCheckState.RUN
            if not task.peers:
                continue
            group = {p.split(":")[0] for p in task.peers}
            ok = not group & faulty
            t = (times or {}).get(node, 0.1)
            check.report(node, check_round, CheckResult(ok, t, 0.01, "" if ok else "boom"))
    assert check.verdict is not None
    return check


def test_first_round_pairs_in_rank_order_with_an_odd_node_alone() -> None:
    assert first_groups(["a", "b", "c", "d"]) == [("a", "b"), ("c", "d")]
    assert first_groups(["a", "b", "c"]) == [("a", "b"), ("c",)]
    assert first_groups(["a"]) == [("a",)]


def test_second_round_gives_every_suspect_a_healthy_partner() -> None:
    history = [[(("a", "b"), True), (("c", "d"), False)]]
    assert next_groups(history, list("abcd")) == [("a", "c"), ("b", "d")]
    # Nothing to learn after a clean round of pairs.
    assert next_groups([[(("a", "b"), True), (("c", "d"), True)]], list("abcd")) == []


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8])
def test_a_single_faulty_node_is_named_within_two_rounds(n: int) -> None:
    members = [f"n{i}" for i in range(n)]
    for bad in members:
        check = run_check(members, faulty={bad})
        v = check.verdict
        assert v is not None and v.rounds <= 2
        if n == 2:
            # Two nodes cannot tell which of them is broken: both leave, both are replaced.
            assert set(v.faulty) == set(members)
        else:
            assert set(v.faulty) == {bad}, (n, bad, v.summary)
        assert set(v.excluded) == set(v.faulty)


def test_healthy_nodes_pass_and_an_even_job_needs_one_round() -> None:
    check = run_check([f"n{i}" for i in range(4)])
    assert check.verdict is not None
    assert (check.verdict.rounds, check.verdict.faulty, check.verdict.excluded) == (1, {}, ())
    assert "all healthy" in check.verdict.summary
    odd = run_check([f"n{i}" for i in range(3)])
    assert odd.verdict is not None and odd.verdict.rounds == 2  # the odd node gets a partner
    assert odd.verdict.faulty == {}


def test_localise_names_the_fewest_nodes_that_explain_every_failure() -> None:
    assert localise([[(("a", "b"), False), (("c",), True)], [(("a", "c"), True)]]) == {"b"}
    assert localise([[(("a", "b"), False)], [(("a", "c"), False), (("b", "d"), True)]]) == {"a"}
    assert localise([[(("a", "b"), True)]]) == set()


def test_a_straggler_is_named_and_excluded_only_when_asked() -> None:
    assert stragglers({"a": 1.0, "b": 3.0, "c": 1.1}, 2.0) == {"b": pytest.approx(3.0 / 1.05)}
    assert stragglers({"a": 1.0, "b": 1.9}, 2.0) == {}
    times = {"n0": 0.1, "n1": 0.31, "n2": 0.1, "n3": 0.11}
    kept = run_check(list(times), times=times)
    assert kept.verdict is not None and set(kept.verdict.stragglers) == {"n1"}
    assert kept.verdict.excluded == ()
    out = run_check(list(times), times=times, settings=CheckSettings(exclude_stragglers=True))
    assert out.verdict is not None and out.verdict.excluded == ("n1",)
    task = out.task("n1", 2)
    assert task is not None and task.excluded and "straggler: 3.1x" in task.reason
    other = out.task("n0", 2)
    assert other is not None and other.state is NodeCheckState.REFORM  # the world lost n1


def test_a_round_waits_for_every_member_and_times_out_the_silent_ones() -> None:
    clock = Clock()
    check = NodeCheck(1, ["a", "b", "c", "d"], CheckSettings(round_timeout_s=60), clock)
    for node in ("a", "b", "c"):
        check.join(node, 1, f"{node}:1")
        assert check.task(node, 1) is None  # d has not joined
    assert check.deadline() == 160.0
    clock.now = 161.0
    assert check.tick()  # d never came: the others are paired without it
    ta, tc = check.task("a", 1), check.task("c", 1)
    assert ta is not None and ta.peers == ("a:1", "b:1")
    assert tc is not None and tc.peers == ("c:1",)
    check.report("a", 1, CheckResult(True, 0.1))
    check.report("c", 1, CheckResult(True, 0.1))
    clock.now = 161.5
    assert not check.tick()  # the groups get a whole time-out from their pairing
    assert check.deadline() == 221.0
    clock.now = 221.0
    assert check.tick()  # b never reported: its group failed
    for node in ("a", "b", "c"):
        check.join(node, 2, f"{node}:2")
    for node in ("a", "b", "c"):
        task = check.task(node, 2)
        if task is not None and task.peers:
            check.report(node, 2, CheckResult(node != "b", 0.1))
    check.tick()
    assert check.verdict is not None
    assert set(check.verdict.faulty) == {"b", "d"}, check.verdict.summary
    assert "no result within 60s" in check.verdict.faulty["b"]
    assert "did not join check round 1 within 60s" in check.verdict.faulty["d"]


def test_a_join_for_the_next_round_before_the_last_report_is_kept() -> None:
    check = NodeCheck(1, ["a", "b", "c"], CheckSettings(), Clock())
    for node in "abc":
        check.join(node, 1, f"{node}:1")
    check.report("a", 1, CheckResult(True, 0.1))
    check.join("a", 2, "a:2")  # a is quick; c has not reported round 1 yet
    check.report("b", 1, CheckResult(True, 0.1))
    check.report("c", 1, CheckResult(True, 0.1))
    check.join("b", 2, "b:2")
    check.join("c", 2, "c:2")
    task = check.task("a", 2)
    assert task is not None and task.state is NodeCheckState.RUN and task.peers == ("a:2", "c:2")


def test_a_join_for_a_check_this_master_never_ran_is_sent_back() -> None:
    """A master that restarted mid-check knows no round 1: agents on round 2 start over."""
    check = NodeCheck(1, ["a", "b"], CheckSettings(), Clock())
    check.join("a", 2, "a:2")
    task = check.task("a", 2)
    assert task is not None and task.state is NodeCheckState.REFORM
    assert check.deadline() is None  # nothing was started that could wait forever


def test_a_lost_member_sends_everyone_back_to_the_rendezvous() -> None:
    check = NodeCheck(3, ["a", "b"], CheckSettings(), Clock())
    check.join("a", 1, "a:1")
    check.abort("node b left (lost)")
    task = check.task("a", 1)
    assert task is not None and task.state is NodeCheckState.REFORM and "b left" in task.summary


def test_a_round_of_checked_nodes_is_done_at_once() -> None:
    check = NodeCheck(9, ["a", "b"], CheckSettings(), Clock(), already_checked={"a", "b", "c"})
    task = check.task("a", 1)
    assert task is not None and task.state is NodeCheckState.DONE and check.verdict is not None
    assert check.verdict.rounds == 0


def test_every_pairing_of_a_second_round_is_new() -> None:
    for n in range(2, 9):
        members = [f"n{i}" for i in range(n)]
        for bad in itertools.combinations(members, 2):
            first = first_groups(members)
            history = [[(g, not set(g) & set(bad)) for g in first]]
            seen = {frozenset(g) for g in first}
            for group in next_groups(history, members):
                assert frozenset(group) not in seen
