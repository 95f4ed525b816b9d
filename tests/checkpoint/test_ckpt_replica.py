"""Checkpoint replicas in a peer's memory: a node whose saver and shared memory are gone restores
its ranks' step from the other node's memory (two savers in this process, real sockets and
shared memory; nothing is ever persisted, so the state cannot have come from storage)."""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from dlrover.checkpoint.config import ENV_CHECKPOINT_SOCKET
from dlrover.checkpoint.coordinator import LocalCommitCoordinator
from dlrover.checkpoint.engine import CheckpointEngine, WorkerPlacement
from dlrover.checkpoint.errors import SegmentStateError
from dlrover.checkpoint.header import HEADER_SIZE, complete_step, image_len, read_header
from dlrover.checkpoint.layout import plan_layout, write_state
from dlrover.checkpoint.peer_load import load_from_peer
from dlrover.checkpoint.replica import (
    LocalPeerDirectory,
    ReplicaError,
    ReplicaExchange,
    ReplicaReply,
    Trailer,
    _recv_image,
    _send_line,
)
from dlrover.checkpoint.saver import PREFETCH_SEARCH_S, CheckpointSaver
from dlrover.checkpoint.saver_messages import HeldRequest
from dlrover.checkpoint.shm import SharedSegment
from tests.checkpoint.harness import assert_same


class Node:
    """One simulated node: its saver (the agent's side) with its own shared memory."""

    def __init__(
        self, tmp: Path, name: str, coordinator: LocalCommitCoordinator, peers: LocalPeerDirectory
    ) -> None:
        tag = f"{name}-{os.getpid()}-{time.monotonic_ns()}"
        self.saver = CheckpointSaver(
            str(tmp / f"{tag}.sock"),
            shm_prefix=f"dlrtest-{tag}",
            coordinator=coordinator,
            peers=peers,
            replica_token="job-token",
        )
        self.saver.start()

    def engine(
        self, ckpt: str, place: WorkerPlacement, sharded: bool, monkeypatch: pytest.MonkeyPatch
    ) -> CheckpointEngine:
        monkeypatch.setenv(ENV_CHECKPOINT_SOCKET, self.saver.socket_path)
        return CheckpointEngine(
            ckpt, "dcp" if sharded else "plain", placement=place, replica_count=1
        )

    def lose(self) -> None:
        """The machine is gone: its saver stops and its shared memory is freed."""
        self.saver.close(unlink=True)


def _place(node: int, round_id: int) -> WorkerPlacement:
    """One rank per node, two nodes."""
    return WorkerPlacement(node, 0, 2, 1, node, round_id)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(1000, generator=g),
        "opt": {"m": torch.randn(300, generator=g)},
        "step": seed,
    }


def _together(*calls: Callable[[], Any]) -> list[Any]:
    """Run the nodes' calls at once (a load vote waits for every node)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(c) for c in calls]]


def _wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)  # the pushing thread has no event a test can wait on


@contextlib.contextmanager
def _replaced(
    tmp: Path, n0: Node, job: Any, ckpt: str, sharded: bool, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[CheckpointEngine, CheckpointEngine, list[Any]]]:
    """Node 1 was lost: a replacement machine (empty memory) and node 0 start round 2 and vote
    the step to load; yields both engines and their votes, then closes them."""
    n1b = Node(tmp, "n1b", *job)
    try:
        e0b = n0.engine(ckpt, _place(0, 2), sharded, monkeypatch)
        e1b = n1b.engine(ckpt, _place(1, 2), sharded, monkeypatch)
        yield e0b, e1b, _together(lambda: e0b.memory_step(None), lambda: e1b.memory_step(None))
        e0b.close()
        e1b.close()
    finally:
        n1b.lose()


def _holds(saver: CheckpointSaver, key: str, step: int) -> bool:
    assert saver._exchange is not None
    return any(i.key == key and i.step == step for i in saver._exchange.holdings())


@pytest.fixture
def job(tmp_path: Path) -> tuple[LocalCommitCoordinator, LocalPeerDirectory]:
    return LocalCommitCoordinator(), LocalPeerDirectory()


def test_sharded_parts_are_pushed_to_the_next_node_and_a_replaced_node_restores_from_it(
    tmp_path: Path, job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator, peers = job
    ckpt = str(tmp_path / "ckpt")
    n0, n1 = Node(tmp_path, "n0", coordinator, peers), Node(tmp_path, "n1", coordinator, peers)
    try:
        e0 = n0.engine(ckpt, _place(0, 1), True, monkeypatch)
        e1 = n1.engine(ckpt, _place(1, 1), True, monkeypatch)
        assert _together(lambda: e0.memory_step(None), lambda: e1.memory_step(None)) == [None] * 2
        parts = {0: _state(10), 1: _state(11)}
        assert e0.save(3, parts[0], persist=False) and e1.save(3, parts[1], persist=False)
        # Each node's part reaches the other (the ring of two), as a replica of its source.
        _wait_until(
            lambda: any(
                i.key == "replica/1/0" and i.step == 3 for i in n0.saver._exchange.holdings()
            )
        )  # type: ignore[union-attr]
        _wait_until(
            lambda: any(
                i.key == "replica/0/0" and i.step == 3 for i in n1.saver._exchange.holdings()
            )
        )  # type: ignore[union-attr]
        e1.close()
        n1.lose()

        with _replaced(tmp_path, n0, job, ckpt, True, monkeypatch) as (e0b, e1b, steps):
            assert steps == [3, 3]
            assert e1b.restored_from_peer == 0 and e0b.restored_from_peer is None
            step, state, _ = e1b.load_from_memory()
            assert step == 3
            assert_same(state, parts[1])
            assert_same(e0b.load_from_memory()[1], parts[0])
            assert not os.path.exists(os.path.join(ckpt, "latest"))  # storage never written
        e0.close()
    finally:
        n0.lose()
        n1.lose()


def test_replicated_state_needs_no_push_a_peer_s_own_copy_restores_a_replaced_node(
    tmp_path: Path, job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator, peers = job
    ckpt = str(tmp_path / "ckpt")
    n0, n1 = Node(tmp_path, "n0", coordinator, peers), Node(tmp_path, "n1", coordinator, peers)
    try:
        e0 = n0.engine(ckpt, _place(0, 1), False, monkeypatch)
        e1 = n1.engine(ckpt, _place(1, 1), False, monkeypatch)
        _together(lambda: e0.memory_step(None), lambda: e1.memory_step(None))
        state = _state(7)
        assert e0.save(5, state, persist=False) and e1.save(5, state, persist=False)
        e1.close()
        n1.lose()
        assert [i.key for i in n0.saver._exchange.holdings()] == ["own/0"]  # type: ignore[union-attr]

        with _replaced(tmp_path, n0, job, ckpt, False, monkeypatch) as (_, e1b, steps):
            assert steps == [5, 5]
            assert e1b.restored_from_peer == 0
            assert_same(e1b.load_from_memory()[1], state)
        e0.close()
    finally:
        n0.lose()


def _segments_of(node_name: str) -> list[str]:
    """The shared-memory files of this process's simulated node ``node_name``."""
    return glob.glob(f"/dev/shm/dlrtest-{node_name}-{os.getpid()}-*")


def test_a_rank_receives_a_peer_s_step_straight_into_its_tensors_and_the_vote_copies_nothing(
    tmp_path: Path, job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank per node reads its slot alone: its load takes the peer's bytes from the socket
    into the target's own tensors (a bfloat16 one too); a non-contiguous target tensor is filled
    after the transfer, one of another shape is left alone and a fresh tensor returned. The
    replaced node allocates no shared memory for it, before or after the load."""
    coordinator, peers = job
    ckpt = str(tmp_path / "ckpt")
    n0 = Node(tmp_path, "n0", coordinator, peers)
    try:
        e0 = n0.engine(ckpt, _place(0, 1), False, monkeypatch)
        state = _state(7)
        state["half"] = torch.arange(10, dtype=torch.bfloat16)
        state["strided"] = torch.randn(4, 6)
        assert e0.save(5, state, persist=False)
        e0.close()
        with _replaced(tmp_path, n0, job, ckpt, False, monkeypatch) as (_, e1b, steps):
            assert steps == [5, 5] and e1b.restored_from_peer == 0
            assert e1b.client.request(HeldRequest()).steps == {}
            assert _segments_of("n1b") == []  # the vote copied nothing
            target = {
                "w": torch.zeros(1000),
                "opt": {"m": torch.zeros(5)},  # another shape: a fresh tensor comes back
                "half": torch.zeros(10, dtype=torch.bfloat16),
                "strided": torch.zeros(6, 4).t(),  # not contiguous: filled after the transfer
            }
            kept = dict(target)
            step, got, _ = e1b.load_from_memory(target, 5)
            assert step == 5
            assert_same(got, state)
            for key in ("w", "half", "strided"):
                assert got[key] is kept[key]  # the target's own tensors were filled
            assert got["opt"]["m"] is not target["opt"]["m"]
            assert torch.equal(target["opt"]["m"], torch.zeros(5))
            assert _segments_of("n1b") == []  # nor did the load: no copy in between
    finally:
        n0.lose()


def test_a_slot_two_local_ranks_read_is_copied_from_the_peer_once_at_the_first_load(
    tmp_path: Path, job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DDP with two ranks per node: the replaced node's ranks both read slot 0, so its saver
    copies the peer's step into one buffer when the first of them loads (not at the vote), and
    both load it from there."""
    coordinator, peers = job
    ckpt = str(tmp_path / "ckpt")

    def place(node: int, local: int, round_id: int) -> WorkerPlacement:
        return WorkerPlacement(node * 2 + local, local, 4, 2, node, round_id)

    n0, n1b = Node(tmp_path, "n0", coordinator, peers), Node(tmp_path, "n1b", coordinator, peers)
    try:
        e0 = n0.engine(ckpt, place(0, 0, 1), False, monkeypatch)
        state = _state(9)
        assert e0.save(6, state, persist=False)
        e0.close()
        engines = [
            node.engine(ckpt, place(n, local, 2), False, monkeypatch)
            for n, node in enumerate((n0, n1b))
            for local in (0, 1)
        ]
        assert _together(*(functools.partial(e.memory_step, None) for e in engines)) == [6] * 4
        assert engines[2].client.request(HeldRequest()).steps == {}  # nothing copied yet
        loads = _together(*(functools.partial(e.load_from_memory, None, 6) for e in engines[2:]))
        for step, got, _ in loads:
            assert step == 6
            assert_same(got, state)
        assert engines[2].client.request(HeldRequest()).steps == {0: 6}
        assert len(_segments_of("n1b")) == 1  # one buffer: the second comes with a save
        assert engines[2].save(7, _state(10), persist=False)
        assert len(_segments_of("n1b")) == 2
        for e in engines:
            e.close()
    finally:
        n0.lose()
        n1b.lose()


def test_a_replaced_node_copies_the_peer_s_step_while_its_workers_start(
    tmp_path: Path, job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DDP with two ranks per node: once the new round forms, the agents prepare it (before
    their workers start); the replaced node's saver copies the survivor's step into its slot
    then, so its ranks' vote finds it in memory, names the peer it came from, and their loads
    read it without asking the peer again."""
    coordinator, peers = job
    ckpt = str(tmp_path / "ckpt")

    def place(node: int, local: int, round_id: int) -> WorkerPlacement:
        return WorkerPlacement(node * 2 + local, local, 4, 2, node, round_id)

    n0, n1 = Node(tmp_path, "n0", coordinator, peers), Node(tmp_path, "n1", coordinator, peers)
    n1b = None
    try:
        first = [
            node.engine(ckpt, place(n, local, 1), False, monkeypatch)
            for n, node in enumerate((n0, n1))
            for local in (0, 1)
        ]  # the job's start: every rank asks for a step to load, none is held
        assert _together(*(functools.partial(e.memory_step, None) for e in first)) == [None] * 4
        state = _state(9)
        assert first[0].save(6, state, persist=False) and first[2].save(6, state, persist=False)
        for e in first:
            e.close()
        n1.lose()
        n1b = Node(tmp_path, "n1b", coordinator, peers)
        n1b.saver.prepare_round(2, 1, 2, 2)
        n0.saver.prepare_round(2, 0, 2, 2)  # publishes where it serves for round 2
        _wait_until(lambda: n1b.saver.held_steps() == {0: 6})  # before any rank asked
        engines = [
            node.engine(ckpt, place(n, local, 2), False, monkeypatch)
            for n, node in enumerate((n0, n1b))
            for local in (0, 1)
        ]
        assert _together(*(functools.partial(e.memory_step, None) for e in engines)) == [6] * 4
        assert [e.restored_from_peer for e in engines] == [None, None, 0, 0]
        assert n0.saver._exchange is not None
        n0.saver._exchange.close(unlink=False)  # the peer is asked nothing more
        loads = _together(*(functools.partial(e.load_from_memory, None, 6) for e in engines[2:]))
        for step, got, _ in loads:
            assert step == 6
            assert_same(got, state)
        assert len(_segments_of("n1b")) == 1  # one buffer: the second comes with a save
        for e in engines:
            e.close()
    finally:
        n0.lose()
        if n1b is not None:
            n1b.lose()


def test_a_step_a_rank_saved_before_the_peer_was_found_is_not_overwritten(
    tmp_path: Path, job: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The replaced node's rank saves (its script skipped the load) while the round's search
    still waits for a peer; the peer then publishes an older step: it is not copied over the
    rank's own."""
    coordinator, peers = job
    ckpt = str(tmp_path / "ckpt")
    caplog.set_level("INFO", logger="dlrover.checkpoint.saver")
    n0, n1b = Node(tmp_path, "n0", coordinator, peers), Node(tmp_path, "n1b", coordinator, peers)
    try:
        e0 = n0.engine(ckpt, WorkerPlacement(0, 0, 4, 2, 0, 1), False, monkeypatch)
        assert e0.save(6, _state(9), persist=False)
        assert n0.saver._publish(1, 0)  # it serves, as after round 1's vote
        n1b.saver.prepare_round(2, 1, 2, 2)
        e1 = n1b.engine(ckpt, WorkerPlacement(2, 0, 4, 2, 1, 2), False, monkeypatch)
        assert e1.save(7, _state(10), persist=False)
        n0.saver.prepare_round(2, 0, 2, 2)
        _wait_until(lambda: "saved a step meanwhile" in caplog.text)
        assert n1b.saver.held_steps() == {0: 7}
        e0.close()
        e1.close()
    finally:
        n0.lose()
        n1b.lose()


def test_a_replaced_node_whose_peers_hold_nothing_votes_without_waiting_for_them(
    tmp_path: Path, job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No peer ever publishes an address (no replicas in the job): the search the round's
    preparation started ends at the vote, which does not wait for it."""
    coordinator, peers = job
    ckpt = str(tmp_path / "ckpt")
    n0, n1b = Node(tmp_path, "n0", coordinator, peers), Node(tmp_path, "n1b", coordinator, peers)
    try:
        n1b.saver.prepare_round(2, 1, 2, 2)
        monkeypatch.setenv(ENV_CHECKPOINT_SOCKET, n0.saver.socket_path)
        e0 = CheckpointEngine(ckpt, "plain", placement=WorkerPlacement(0, 0, 4, 2, 0, 2))
        monkeypatch.setenv(ENV_CHECKPOINT_SOCKET, n1b.saver.socket_path)
        e1 = CheckpointEngine(ckpt, "plain", placement=WorkerPlacement(2, 0, 4, 2, 1, 2))
        started = time.monotonic()
        assert _together(lambda: e0.memory_step(None), lambda: e1.memory_step(None)) == [None] * 2
        assert time.monotonic() - started < PREFETCH_SEARCH_S / 4
        assert n1b.saver.held_steps() == {}
        e0.close()
        e1.close()
    finally:
        n0.lose()
        n1b.lose()


def test_a_peer_gone_between_the_vote_and_the_load_is_a_clear_error(
    tmp_path: Path, job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load raises SegmentStateError naming the peer, which sends the checkpointers to
    storage."""
    coordinator, peers = job
    ckpt = str(tmp_path / "ckpt")
    n0 = Node(tmp_path, "n0", coordinator, peers)
    try:
        e0 = n0.engine(ckpt, _place(0, 1), False, monkeypatch)
        assert e0.save(5, _state(7), persist=False)
        e0.close()
        with _replaced(tmp_path, n0, job, ckpt, False, monkeypatch) as (_, e1b, steps):
            assert steps == [5, 5]
            n0.lose()
            with pytest.raises(SegmentStateError, match="cannot reach the checkpoint peer"):
                e1b.load_from_memory(None, 5)
    finally:
        n0.lose()


def test_a_peer_image_that_changed_while_it_was_sent_is_refused(tmp_path: Path) -> None:
    """A peer that answers a read with its image and then a trailer: intact, the state loads;
    not intact (the peer's segment changed meanwhile), the load is refused."""
    state = _state(3)
    seg = SharedSegment.create(f"dlrtest-read-{os.getpid()}", 1 << 20)
    write_state(seg, plan_layout(state, {"dir": "d"}), 4)
    _, _, data_len, meta_offset, meta_len = read_header(seg)

    def serve(listener: socket.socket, intact: bool) -> None:
        conn, _ = listener.accept()
        with conn, conn.makefile("rb") as stream:
            stream.readline()
            _send_line(conn, ReplicaReply(ok=True, nbytes=data_len, meta_len=meta_len))
            conn.sendall(seg.buffer[meta_offset : meta_offset + meta_len])
            conn.sendall(seg.buffer[HEADER_SIZE : HEADER_SIZE + data_len])
            _send_line(conn, Trailer(intact=intact))

    try:
        for intact in (True, False):
            with socket.create_server(("127.0.0.1", 0)) as listener:
                thread = threading.Thread(target=serve, args=(listener, intact), daemon=True)
                thread.start()
                addr = f"127.0.0.1:{listener.getsockname()[1]}"
                if intact:
                    assert_same(load_from_peer(addr, "", "own/0", 4)[1], state)
                else:
                    with pytest.raises(SegmentStateError, match="changed while"):
                        load_from_peer(addr, "", "own/0", 4)
                thread.join(30)
                assert not thread.is_alive()
        server = ReplicaExchange(lambda: {0: seg}, "dlrtest-readsrv", "/dev/shm", token="t")
        server.start()
        try:
            assert_same(load_from_peer(server.addr, "t", "own/0", 4)[1], state)
            with pytest.raises(SegmentStateError, match="no step 5 at own/0"):
                load_from_peer(server.addr, "t", "own/0", 5)
            with pytest.raises(SegmentStateError, match="wrong token"):
                load_from_peer(server.addr, "x", "own/0", 4)
        finally:
            server.close()
    finally:
        seg.close(unlink=True)


def test_without_replicas_a_replaced_node_makes_every_node_load_from_storage(
    tmp_path: Path, job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The behaviour replica_count changes: the peer holds the step, but nobody asks it."""
    coordinator, peers = job
    ckpt = str(tmp_path / "ckpt")
    n0 = Node(tmp_path, "n0", coordinator, peers)
    n1b = Node(tmp_path, "n1b", coordinator, peers)
    try:
        monkeypatch.setenv(ENV_CHECKPOINT_SOCKET, n0.saver.socket_path)
        e0 = CheckpointEngine(ckpt, "plain", placement=_place(0, 1))
        assert e0.save(5, _state(7), persist=False)
        monkeypatch.setenv(ENV_CHECKPOINT_SOCKET, n1b.saver.socket_path)
        e1b = CheckpointEngine(ckpt, "plain", placement=_place(1, 1))
        assert _together(lambda: e0.memory_step(None), lambda: e1b.memory_step(None)) == [None] * 2
        e0.close()
        e1b.close()
    finally:
        n0.lose()
        n1b.lose()


def test_a_peer_refuses_a_wrong_token_and_a_gone_peer_is_a_clear_error(tmp_path: Path) -> None:
    server = ReplicaExchange(dict, "dlrtest-tok", "/dev/shm", token="right")
    server.start()
    try:
        assert server.list_peer(server.addr) == []
        intruder = ReplicaExchange(dict, "dlrtest-tok2", "/dev/shm", token="wrong")
        with pytest.raises(ReplicaError, match="wrong token"):
            intruder.list_peer(server.addr)
        gone = server.addr
    finally:
        server.close()
    with pytest.raises(ReplicaError, match=f"cannot reach the checkpoint peer at {gone}"):
        server.list_peer(gone)


def test_a_push_with_a_wrong_token_says_so(tmp_path: Path) -> None:
    peer = ReplicaExchange(dict, "dlrtest-peer", "/dev/shm", token="right")
    peer.start()
    seg = SharedSegment.create(f"dlrtest-push-{os.getpid()}", 8 << 20)
    try:
        from dlrover.checkpoint.header import begin_write, publish

        publish(seg, begin_write(seg), 3, (8 << 20) - 8192, b'{"version": 1, "step": 3}')
        sender = ReplicaExchange(dict, "dlrtest-sender", "/dev/shm", token="wrong")
        with pytest.raises(ReplicaError, match="wrong token"):
            sender.push(peer.addr, 0, 0, seg)
        assert peer.holdings() == []
    finally:
        seg.close(unlink=True)
        peer.close()


def test_an_image_torn_at_the_sender_is_never_installed(tmp_path: Path) -> None:
    """The sender's trailer says its segment changed while it was sent: the receiving segment
    stays marked as being written, so it is never loaded."""
    src = SharedSegment.create(f"dlrtest-src-{os.getpid()}", 1 << 16)
    dst = SharedSegment.create(f"dlrtest-dst-{os.getpid()}", 1 << 16)
    try:
        from dlrover.checkpoint.header import begin_write, publish

        publish(src, begin_write(src), 9, 128, b'{"version": 1, "step": 9}')
        nbytes = image_len(src)
        for intact, expected in ((False, None), (True, 9)):
            a, b = socket.socketpair()
            with a, b, b.makefile("rb") as stream:
                a.sendall(src.buffer[:nbytes])
                _send_line(a, Trailer(intact=intact))
                assert _recv_image(stream, dst, nbytes) is intact
            assert complete_step(dst) == expected
        assert bytes(dst.buffer[HEADER_SIZE:nbytes]) == bytes(src.buffer[HEADER_SIZE:nbytes])
    finally:
        src.close(unlink=True)
        dst.close(unlink=True)


def test_the_replica_bandwidth_cap_comes_from_the_environment_with_a_clear_error() -> None:
    from dlrover.checkpoint.config import replica_bandwidth_from_env

    assert replica_bandwidth_from_env({}) == 1024 * 2**20
    assert replica_bandwidth_from_env({"DLROVER_CKPT_REPLICA_MIB_S": "200"}) == 200 * 2**20
    assert replica_bandwidth_from_env({"DLROVER_CKPT_REPLICA_MIB_S": "0"}) is None
    for bad in ("fast", "-5", "nan"):
        with pytest.raises(ValueError, match="DLROVER_CKPT_REPLICA_MIB_S.*number >= 0"):
            replica_bandwidth_from_env({"DLROVER_CKPT_REPLICA_MIB_S": bad})


@pytest.mark.e2e
def test_fsdp_shards_of_a_node_that_lost_its_memory_come_back_from_the_next_node(
    tmp_path: Path,
) -> None:
    """Two nodes of one FSDP rank each save their shards to memory only (FsdpShardCheckpointer,
    replica_count=1); node 1's saver and memory are lost; its replacement's rank loads its shards
    from node 0's replica and the gathered model equals the saved one."""
    from tests.checkpoint.harness import free_port, run_workers, running_saver, worker_env

    ckpt, oracle = str(tmp_path / "ckpt"), str(tmp_path / "oracle.pt")
    coordinator, peers = LocalCommitCoordinator(), LocalPeerDirectory()

    def envs(sockets: list[str], restart: int, **extra: str) -> list[dict[str, str]]:
        port, out = free_port(), []
        for rank, sock in enumerate(sockets):
            env = worker_env(sock, rank=rank, world=2, port=port, restart=restart)
            env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
            env.update(CKPT_REPLICAS="1", **extra)
            out.append(env)
        return out

    job = {"coordinator": coordinator, "peers": peers, "replica_token": "job-token"}
    with running_saver(tmp_path, **job) as node0:
        node1 = Node(tmp_path, "n1", coordinator, peers).saver
        try:
            sockets = [node0.socket_path, node1.socket_path]
            run_workers(
                ["fsdp_save", ckpt, "4", oracle], envs(sockets, 0, CKPT_STORAGE="memory"), 120
            )
            for saver, key in ((node0, "replica/1/0"), (node1, "replica/0/0")):
                _wait_until(functools.partial(_holds, saver, key, 4))
        finally:
            node1.close(unlink=True)
        with running_saver(tmp_path, **job) as node1b:
            sockets = [node0.socket_path, node1b.socket_path]
            loads = envs(sockets, 1)
            loads[0]["EXPECT_PEER"], loads[1]["EXPECT_PEER"] = "-1", "0"
            run_workers(["fsdp_load", ckpt, "4", oracle, "memory"], loads, 120)
    assert not (tmp_path / "ckpt" / "latest").exists()  # nothing ever reached storage
