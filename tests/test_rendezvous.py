"""Rendezvous policy: when a round closes, who is in it, and which arrivals make a world re-form."""

from __future__ import annotations

import pytest

from dlrover.master.rendezvous import RendezvousConfig, RendezvousError, RendezvousManager
from dlrover.master.state_store import MemoryStateStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def manager(lo: int, hi: int, unit: int = 1, last_call: float = 1.0):
    clock = Clock()
    store = MemoryStateStore()
    return RendezvousManager(RendezvousConfig(lo, hi, unit, last_call), store, clock), clock, store


def join(m: RendezvousManager, node: str, order: int, requested: int = -1, lws: int = 2) -> int:
    return m.join(node, lws, f"h{node}", f"h{node}", 1000 + order, requested, order)


def test_round_closes_at_once_when_max_nodes_wait():
    m, _, _ = manager(2, 2)
    assert join(m, "a", 0) == 1
    assert m.get_world("a", expected_nodes=2) is None
    join(m, "b", 1)
    world = m.get_world("a", expected_nodes=2)
    assert world is not None and world.round == 1
    assert [(x.node_id, x.node_rank) for x in world.members] == [("a", 0), ("b", 1)]
    assert world.world_size == 4 and world.rank_offset(1) == 2
    # The store lives where the rank-0 node said it would.
    assert (world.store_host, world.store_port) == ("ha", 1000)


def test_first_round_waits_for_last_call_between_min_and_max():
    m, clock, _ = manager(1, 3)
    join(m, "a", 0)
    join(m, "b", 1)
    assert m.get_world("a", expected_nodes=2) is None
    clock.now = 0.99
    assert m.get_world("a", expected_nodes=2) is None
    clock.now = 1.0
    world = m.get_world("a", expected_nodes=2)
    assert world is not None and len(world.members) == 2


def test_world_size_is_a_multiple_of_node_unit_and_extra_nodes_wait():
    m, clock, _ = manager(2, 4, unit=2)
    for i, n in enumerate("abc"):
        join(m, n, i)
    clock.now = 5.0
    world = m.get_world("a", expected_nodes=3)
    assert world is not None and [x.node_id for x in world.members] == ["a", "b"]
    assert m.get_world("c", expected_nodes=3) is None  # waits for a partner
    # One new node is not enough to re-form with node_unit 2 ...
    assert m.num_nodes_waiting("a", world.round)[0] == 0
    join(m, "d", 3)
    # ... two are.
    assert m.num_nodes_waiting("a", world.round)[0] == 2


def test_known_node_coming_back_makes_everybody_reform_now():
    m, _, _ = manager(2, 2)
    join(m, "a", 0)
    join(m, "b", 1)
    w1 = m.get_world("a", 2)
    assert w1 is not None
    join(m, "b", 1)  # b's workers failed; it re-joins
    waiting, latest = m.num_nodes_waiting("a", w1.round)
    assert waiting == 1 and latest == 1
    join(m, "a", 0)
    w2 = m.get_world("a", 2)
    assert w2 is not None and w2.round == 2
    assert [(x.node_id, x.node_rank) for x in w2.members] == [("a", 0), ("b", 1)]


def test_new_node_beyond_max_does_not_disturb_the_world():
    m, _, _ = manager(2, 2)
    join(m, "a", 0)
    join(m, "b", 1)
    w = m.get_world("a", 2)
    assert w is not None
    join(m, "c", 2)
    assert m.num_nodes_waiting("a", w.round)[0] == 0


def test_a_node_beyond_max_is_a_hot_spare_until_a_member_is_lost_then_it_is_taken_in():
    m, _, _ = manager(2, 2)
    join(m, "a", 0)
    join(m, "b", 1)
    w = m.get_world("a", 3)
    assert w is not None
    join(m, "spare", 2)
    assert m.is_spare("spare") and not m.is_spare("a")
    m.leave("b", "lost")
    assert not m.is_spare("spare")  # the round is broken: it is the next round's member
    join(m, "a", 0)
    w2 = m.get_world("a", 2)
    assert w2 is not None and [x.node_id for x in w2.members] == ["a", "spare"]
    join(m, "b2", 3)  # the lost node's replacement waits as the next spare
    assert m.is_spare("b2")


def test_a_survivor_late_to_re_join_keeps_its_place_from_spares_and_replacements():
    m, clock, _ = manager(2, 2)
    join(m, "a", 0)
    join(m, "b", 1)
    w = m.get_world("a", 3)
    assert w is not None
    join(m, "spare", 2)
    m.leave("b", "lost")
    join(m, "b2", 3)  # the lost node's replacement: two nodes wait, max is 2
    assert m.get_world("spare", 3) is None  # a, a member, is still leaving its step
    join(m, "a", 0)
    w2 = m.get_world("a", 3)
    assert w2 is not None and [x.node_id for x in w2.members] == ["a", "spare"]
    # A member that never comes is waited for only until the quiet last call.
    m.leave("spare", "lost")
    join(m, "b3", 4)
    assert m.get_world("b2", 3) is None
    clock.now += 1.5
    w3 = m.get_world("b2", 3)
    assert w3 is not None and {x.node_id for x in w3.members} == {"b2", "b3"}


def test_ranks_are_stable_and_requested_ranks_win():
    m, _, _ = manager(3, 3)
    join(m, "x", 0, requested=2)
    join(m, "y", 1, requested=0)
    join(m, "z", 2, requested=1)
    w = m.get_world("x", 3)
    assert w is not None
    assert {x.node_id: x.node_rank for x in w.members} == {"y": 0, "z": 1, "x": 2}


def test_lost_member_breaks_the_round_and_survivors_reform_smaller():
    m, clock, _ = manager(1, 3)
    for i, n in enumerate("abc"):
        join(m, n, i)
    clock.now = 2.0
    w = m.get_world("a", 3)
    assert w is not None and len(w.members) == 3
    m.leave("b", "lost")
    assert m.num_nodes_waiting("a", w.round)[0] >= 1
    join(m, "a", 0)
    join(m, "c", 2)
    w2 = m.get_world("a", expected_nodes=2)  # the two survivors are all the master expects
    assert w2 is not None and [x.node_id for x in w2.members] == ["a", "c"]
    assert [x.node_rank for x in w2.members] == [0, 1]


def test_world_survives_a_master_restart_through_the_state_store():
    m, clock, store = manager(2, 2)
    join(m, "a", 0)
    join(m, "b", 1)
    w = m.get_world("a", 2)
    assert w is not None
    again = RendezvousManager(m.config, store, clock)
    assert again.round == 1 and again.world == w


@pytest.mark.parametrize(
    "lo,hi,unit,match",
    [(3, 2, 1, "min nodes 3 > max nodes 2"), (0, 2, 1, ">= 1"), (3, 3, 2, "no multiple")],
)
def test_impossible_configs_are_refused(lo, hi, unit, match):
    with pytest.raises(RendezvousError, match=match):
        RendezvousConfig(lo, hi, unit).validate()
