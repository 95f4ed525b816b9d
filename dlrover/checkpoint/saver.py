"""CheckpointSaver: the agent-side owner of the checkpoint segments, their load vote and replicas."""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any

from dlrover.checkpoint.bounded_server import BoundedThreadingMixIn
from dlrover.checkpoint.buffers import DEFAULT_BUFFERS, SlotBuffers
from dlrover.checkpoint.config import (
    DEFAULT_COPY_WAIT_S,
    DEFAULT_PERSIST_WAIT_S,
    DEFAULT_SHM_DIR,
    MAX_SAVER_CONNECTIONS,
    run_in_background,
)
from dlrover.checkpoint.coordinator import CommitCoordinator, LocalCommitCoordinator
from dlrover.checkpoint.errors import CheckpointError, ShmSpaceError
from dlrover.checkpoint.formats import format_named
from dlrover.checkpoint.header import image_len, read_metadata
from dlrover.checkpoint.persister import Persister
from dlrover.checkpoint.replica import (
    DEFAULT_BANDWIDTH_BYTES_S,
    PeerDirectory,
    ReplicaError,
    ReplicaExchange,
    SegmentInfo,
)
from dlrover.checkpoint.saver_messages import (
    AllocateReply,
    AllocateRequest,
    AttachReply,
    AttachRequest,
    BeginCopyReply,
    BeginCopyRequest,
    CopiedReply,
    CopiedRequest,
    HeldReply,
    HeldRequest,
    LoadStepReply,
    LoadStepRequest,
    PersistSpec,
    Refused,
    SaverReply,
    SaverRequest,
    ShmSpaceRefused,
    WaitPersistedRequest,
    decode_request,
    encode_reply,
)
from dlrover.checkpoint.shm import SharedSegment
from dlrover.checkpoint.storage import Storage, storage_for

log = logging.getLogger(__name__)

PREFETCH_SEARCH_S = 30.0
"""How long a replaced node looks for a peer holding its replicated state while its workers
start (the ranks' vote ends the search sooner)."""
PREFETCH_WAIT_S = 0.25
"""How long one look for a peer's address waits for it to be published."""


class _SaverServer(BoundedThreadingMixIn, socketserver.UnixStreamServer):
    max_connections = MAX_SAVER_CONNECTIONS
    what = "checkpoint saver"


class CheckpointSaver:
    """Owns one shared segment per local saving rank ("slot") and persists them to storage
    (through its ``Persister``, persister.py).

    Workers talk to it over a unix socket (the messages: ``saver_messages.py``). Invariants:
    a slot is never copied into while it is being persisted (``begin_copy`` waits or reports
    busy), a segment only grows, and at most one persist runs at a time.
    """

    def __init__(
        self,
        socket_path: str,
        shm_prefix: str | None = None,
        coordinator: CommitCoordinator | None = None,
        shm_dir: str = DEFAULT_SHM_DIR,
        storage_factory: Callable[[str], Storage] = storage_for,
        peers: PeerDirectory | None = None,
        replica_token: str = "",
        replica_host: str = "127.0.0.1",
        replica_bandwidth: float | None = DEFAULT_BANDWIDTH_BYTES_S,
        buffers: int = DEFAULT_BUFFERS,
        spill_dir: str | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.shm_prefix = shm_prefix or f"dlrover-ckpt-{os.getpid()}"
        self.shm_dir = shm_dir
        self.spill_dir = spill_dir
        """Where a slot's buffers go when ``shm_dir`` has no room for them (None: the save
        raises ShmSpaceError); see SlotBuffers."""
        self.coordinator: CommitCoordinator = coordinator or LocalCommitCoordinator()
        self._cond = threading.Condition()
        self.buffers = buffers
        self._slots: dict[int, SlotBuffers] = {}  # slot -> its buffers and their pins
        self._persister = Persister(
            self._cond,
            self._slots,
            self.coordinator,
            storage_factory,
            self._common_step,
            self._push_deferred,
        )
        self._votes: dict[int, int | None] = {}
        self._memory_epoch = 0  # +1 each time memory changes under a vote (votes cleared)
        self._closed = threading.Event()
        self._early: threading.Thread | None = None  # the agent's vote of the current round
        self._server: _SaverServer | None = None
        self._threads: list[threading.Thread] = []
        # Replicas in peers' memory (only with a PeerDirectory): see replica.py.
        self._peers = peers
        self._exchange = (
            ReplicaExchange(
                self._own_segments,
                self.shm_prefix,
                shm_dir,
                replica_token,
                replica_host,
                replica_bandwidth,
            )
            if peers is not None
            else None
        )
        self._replica_deferred: PersistSpec | None = None  # a push that waits for a persist
        self._replica_jobs: queue.Queue[tuple[int, PersistSpec] | None] = queue.Queue()
        self._published: set[tuple[int, int]] = set()  # (round, node rank) told to the peers
        self._exchange_lock = threading.Lock()
        self._load_lock = threading.Lock()  # one load vote (and peer restore) at a time
        self._restored: dict[int, int] = {}  # round -> the peer node whose step it voted
        # Slot -> (peer address, image) of a step voted from a peer's memory, not copied yet:
        # the first rank that loads it receives it (see _attach).
        self._remote: dict[int, tuple[str, SegmentInfo]] = {}
        self._replica_token = replica_token
        # A round's preparation (prepare_round): its thread, and the flag that stops it looking
        # for a peer once the node's ranks vote; the step it copied in: (round, peer, step).
        self._round_prep: tuple[threading.Thread, threading.Event] | None = None
        self._prep_lock = threading.Lock()  # the agent starts one, a vote ends it
        self._prefetched: tuple[int, int, int] | None = None
        # The ranks' last load-step vote with a format: the node's next vote is cast from it
        # as the round forms (prepare_round), before the workers start.
        self._load_template: LoadStepRequest | None = None
        self.last_replica_s = 0.0
        """How long the latest push of this node's slots to its peers took (0.0: none yet)."""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Listen on ``socket_path`` and start the persist thread."""
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # left by a previous agent of this node
        saver = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    self.wfile.write(encode_reply(saver._handle_line(line)))
                    self.wfile.flush()

        server = _SaverServer(self.socket_path, Handler)
        self._server = server
        self._threads = [
            threading.Thread(target=server.serve_forever, name="ckpt-saver-socket", daemon=True),
            self._persister.thread(),
        ]
        for t in self._threads:
            t.start()
        log.info("checkpoint saver listening on %s", self.socket_path)

    def close(self, unlink: bool = True, timeout: float = 30.0) -> None:
        """Stop serving and persisting; with ``unlink`` free the shared memory."""
        self._closed.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._persister.stop()
        self._replica_jobs.put(None)
        with self._prep_lock:
            if self._round_prep is not None:
                self._round_prep[1].set()  # a search ends; a copy under way is joined below
        if self._exchange is not None:
            self._exchange.close(unlink=unlink)
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():
                log.warning("checkpoint saver thread %s did not stop in %.0f s", t.name, timeout)
        self._threads = []
        with self._cond:
            for slot_buffers in self._slots.values():
                slot_buffers.close(unlink=unlink)
            self._slots.clear()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    # ------------------------------------------------------------------ agent API
    def held_steps(self) -> dict[int, int | None]:
        """The newest complete step in each slot's buffers (None: empty or torn)."""
        with self._cond:
            return {slot: b.newest_step() for slot, b in self._slots.items()}

    def _own_segments(self) -> dict[int, SharedSegment]:
        """Each slot's buffer holding its newest complete step (what peers may copy)."""
        with self._cond:
            out = {}
            for slot, b in self._slots.items():
                i = b.newest()
                if i is not None:
                    out[slot] = b.segments[i]
            return out

    def last_persisted(self, checkpoint_dir: str) -> int | None:
        """The newest step this saver committed to ``checkpoint_dir``, or None."""
        with self._cond:
            return self._persister.committed.get(checkpoint_dir)

    @property
    def last_persist_s(self) -> float:
        """How long the latest successful persist took (0.0: none yet): heartbeats carry it."""
        return self._persister.last_persist_s

    def persist_latest_if_newer(self, timeout: float = DEFAULT_PERSIST_WAIT_S) -> int | None:
        """Persist the newest step complete in every saving slot if storage lacks it.

        Called by the agent after its workers died and before it restarts them, so the step
        they last copied survives even if the node is lost later. Returns the persisted step.
        """
        return self._persister.persist_latest_if_newer(timeout)

    # ------------------------------------------------------------------ socket protocol
    def _handle_line(self, line: bytes) -> SaverReply:
        try:
            return self._dispatch(decode_request(line))
        except ShmSpaceError as exc:
            return ShmSpaceRefused(str(exc), exc.path, exc.needed, exc.free)
        except (CheckpointError, KeyError, ValueError, TypeError, OSError) as exc:
            # ValueError covers a malformed line (MessageError names the field).
            log.warning("checkpoint saver rejected a request: %r", exc)
            return Refused(f"{type(exc).__name__}: {exc}")

    def _dispatch(self, request: SaverRequest[Any]) -> SaverReply:
        if isinstance(request, AllocateRequest):
            with self._cond:
                buffers = self._slot(request.slot, request.nbytes)
                buffers.ensure(request.nbytes)  # reserve now: a full /dev/shm is said at once
                seg = buffers.segments[buffers.newest() or 0]
                return AllocateReply(seg.path, seg.size)
        if isinstance(request, AttachRequest):
            return self._attach(request)
        if isinstance(request, BeginCopyRequest):
            return self._begin_copy(request)
        if isinstance(request, CopiedRequest):
            self._copied(request.slot, request.step, request.spec, request.persist)
            return CopiedReply()
        if isinstance(request, HeldRequest):
            return HeldReply(self.held_steps())
        if isinstance(request, LoadStepRequest):
            return LoadStepReply(*self._agree_load_step(request))
        if isinstance(request, WaitPersistedRequest):
            return self._persister.wait_persisted(
                request.checkpoint_dir, request.step, request.timeout_s
            )
        raise CheckpointError(f"unknown saver request {request.op!r}")

    def _slot(self, slot: int, nbytes: int, count: int | None = None) -> SlotBuffers:
        """The buffers of ``slot``, created (the first ``count``, default all of them,
        ``nbytes`` each) on first use. Called under the lock."""
        buffers = self._slots.get(slot)
        if buffers is None:
            buffers = SlotBuffers(
                f"{self.shm_prefix}-slot{slot}", self.buffers, self.shm_dir, self.spill_dir
            )
            buffers.ensure(nbytes, count)
            self._slots[slot] = buffers
            log.info(
                "allocated %d x %d bytes of shared memory for slot %d at %s-buf*",
                len(buffers.segments),
                nbytes,
                slot,
                os.path.join(os.path.dirname(buffers.segments[0].path), buffers.name),
            )
        return buffers

    def _allocate(
        self, slot: int, nbytes: int, step: int, only_if_empty: bool = False
    ) -> tuple[SharedSegment, tuple[SlotBuffers, int]]:
        """A buffer of ``slot`` to copy a step into from elsewhere (a peer's memory), at least
        ``nbytes`` long for ``step``, pinned (``receiving``) until the caller releases it: the buffer and
        (the slot's buffers, its index). It becomes the slot's latest, and what the other
        buffers held is dropped (the copied step replaces the slot's memory). The vote stands:
        the step copied in is the one it agreed on (or, copied before the vote, the one the
        node votes). A slot with no buffers yet gets one now, the others at its next save: a
        restore pays for the memory it fills, not more. ``only_if_empty``: CheckpointError if
        a rank of this node copied a step into any slot since the saver started."""
        with self._cond:
            if only_if_empty and any(b.latest is not None for b in self._slots.values()):
                raise CheckpointError("a rank of this node saved a step meanwhile")
            buffers = self._slot(slot, nbytes, count=1)
            buffers.ensure(nbytes, count=1)
            if not self._cond.wait_for(lambda: buffers.target(False) is not None, 60.0):
                raise CheckpointError(f"slot {slot}: every buffer is still being read")
            target = buffers.target(False)
            assert target is not None
            seg = buffers.begin(target, nbytes, -1)  # drops every other buffer's step
            buffers.writing = step  # the step this buffer holds once the copy is done
            buffers.receiving.add(target)
            return seg, (buffers, target)

    def _begin_copy(self, request: BeginCopyRequest) -> BeginCopyReply:
        """Pick the buffer the worker copies ``request.step`` into (``choose_buffer``): with
        two buffers a memory-only copy never waits; a copy that asks for a persist waits while
        the previous persist or push of the slot still reads a buffer."""
        slot = request.slot
        with self._cond:
            buffers = self._slot(slot, request.nbytes)
            started = time.monotonic()  # the wait for a pin, not the first allocation
            waited = buffers.target(request.persist) is None
            ready = self._cond.wait_for(
                lambda: buffers.target(request.persist) is not None, request.timeout
            )
            target = buffers.target(request.persist)
            if not ready or target is None:
                what = (
                    ", ".join(f"step {step}" for step in sorted(set(buffers.pending.values())))
                    or "the previous step"
                )
                raise CheckpointError(
                    f"slot {slot}: no buffer became free for step {request.step} within "
                    f"{request.timeout:.0f} s: the persist or peer push of {what} still reads "
                    "it. Check that storage is reachable and fast enough for the save interval "
                    "(the agent's log says how long persists take)"
                )
            self._votes.clear()  # memory is about to change: a new restart round must re-vote
            self._memory_epoch += 1
            self._remote.pop(slot, None)  # and a step voted from a peer is no longer the newest
            seg = buffers.begin(target, request.nbytes, request.step)
            return BeginCopyReply(seg.path, seg.size, time.monotonic() - started if waited else 0.0)

    def _attach(self, request: AttachRequest) -> AttachReply:
        """Where ``request.slot``'s step is loaded from: the buffer holding it (or the newest);
        for a step voted from a peer's memory, that peer (a ``direct`` rank receives it
        itself), else the buffer it is first copied into, once for all the node's ranks."""
        slot, step = request.slot, request.step
        with self._cond:
            path = self._held_path(slot, step)
            remote = self._remote.get(slot)
        if path is not None or remote is None or step not in (None, remote[1].step):
            return AttachReply(path)
        addr, info = remote
        if request.direct:
            return AttachReply(None, addr, info.key, info.step, self._replica_token)
        with self._load_lock:  # the node's ranks ask together: the first one copies
            with self._cond:
                path = self._held_path(slot, step)
                copy = path is None and self._remote.get(slot) == remote
            if copy:
                path = self._copy_from_peer(slot, addr, info)
        return AttachReply(path)

    def _held_path(self, slot: int, step: int | None) -> str | None:
        """The buffer of ``slot`` holding ``step`` (None: the newest), or None; under the lock."""
        buffers = self._slots.get(slot)
        if buffers is None:
            return None
        i = buffers.newest() if step is None else buffers.holding(step)
        return None if i is None else buffers.segments[i].path

    def _copied(self, slot: int, step: int, spec: PersistSpec | None, persist: bool) -> None:
        with self._cond:
            if spec is not None and spec.persists:
                self._persister.spec = spec
                self._persister.errors.pop(spec.checkpoint_dir, None)
            buffers = self._slots.get(slot)
            held = buffers.holding(step) if buffers is not None else None
            if persist and spec is not None and buffers is not None and held is not None:
                # Until this step is out, its buffer is pinned: copies go into the other one.
                buffers.pending[held] = step
            self._cond.notify_all()
        # Every saving slot sends "copied"; one job per step is enough (the first one).
        if persist and spec is not None and slot == min(spec.slots):
            self._persister.submit(step, spec)
        replicate = spec is not None and spec.replicas and slot == min(spec.slots)
        if replicate and spec is not None and self._publish(spec.round_id, spec.node_rank):
            self._replica_jobs.put((step, spec))

    def _common_step(self, spec: PersistSpec) -> int | None:
        """The newest step complete in every slot of ``spec`` (in either of its buffers)."""
        with self._cond:
            held = [self._loadable_steps(s, None, None) for s in spec.slots]
        return _newest_common(held)

    def _agree_load_step(
        self, request: LoadStepRequest, early: bool = False
    ) -> tuple[int | None, int | None]:
        """The step the nodes agreed on for the request's round, and the peer node this node
        copied it from (None: its own memory held it). ``early``: the agent's vote as the
        round forms; a round it leaves undecided (no common step yet, or a node not voted in
        time) is voted again by the ranks."""
        round_id = request.round_id
        deadline = time.monotonic() + request.timeout  # the restore and the vote share it
        with self._load_lock:  # the node's ranks ask together; the first one votes
            if request.fmt and not early:
                self._load_template = request
            with self._cond:
                if round_id in self._votes:
                    return self._votes[round_id], self._restored.get(round_id)
                epoch = self._memory_epoch
            # A copy started as the round formed is waited for (half the vote's time at most,
            # the other half is the vote's), not repeated.
            self._end_round_prep(time.monotonic() + request.timeout / 2)
            with self._cond:
                held = [
                    self._loadable_steps(s, request.ranks.get(s), request.world_size)
                    for s in request.slots
                ]
            local = _newest_common(held)
            prefetched = self._prefetched
            if prefetched is not None and prefetched[0] == round_id and prefetched[2] == local:
                self._restored[round_id] = prefetched[1]
            published = request.replica_count and self._publish(round_id, request.node_rank)
            if published and local is None and request.total_nodes > 1:
                local, peer = self._find_on_peers(request)
                if local is not None and peer is not None:
                    self._restored[round_id] = peer
            agreed = self.coordinator.agree_load_step(
                request.node_rank,
                request.total_nodes,
                local,
                round_id,
                max(1.0, deadline - time.monotonic()),
            )
            with self._cond:
                # An early vote is kept only if memory did not change while it waited for the
                # other nodes (a rank's save): else the ranks vote again.
                if not early or (agreed is not None and epoch == self._memory_epoch):
                    self._votes[round_id] = agreed
            return agreed, self._restored.get(round_id)

    def _loadable_steps(self, slot: int, rank: int | None, world_size: int | None) -> list[int]:
        """The complete steps in ``slot``'s buffers saved by ``rank`` at ``world_size`` (when
        given), newest by write order first; none newer than the newest write (a free buffer
        can still hold a step of a timeline the job went back from)."""
        buffers = self._slots.get(slot)
        newest = buffers.newest_step() if buffers is not None else None
        if buffers is None or newest is None:
            return []
        out = []
        for seg in buffers.segments:
            try:
                _, meta = read_metadata(seg)
            except CheckpointError:
                continue
            if rank is not None and meta.get("rank") != rank:
                continue
            if world_size is not None and meta.get("world_size") != world_size:
                continue
            if int(meta["step"]) <= newest:
                out.append(int(meta["step"]))
        return sorted(out, reverse=True)

    # ------------------------------------------------------------------ a new round
    def prepare_round(
        self,
        round_id: int,
        node_rank: int,
        num_nodes: int,
        local_ranks: int,
        world_size: int | None = None,
        rank_offset: int | None = None,
    ) -> None:
        """What the agent calls once a round formed, before it starts the workers; returns at
        once (the work runs on threads of their own).

        - The node casts its load-step vote now, while its workers start: with the round's
          ``world_size`` and this node's ``rank_offset``, from the ranks' last vote (its
          format, checkpoint directory, replicas), when its memory holds a step. The ranks'
          own vote then finds the round decided and asks the master nothing.
        - A node that serves replicas tells its peers where for this round now, not when its
          ranks load; a replaced node (no step in its memory) whose ``local_ranks`` ranks will
          read one slot copies the newest replicated step a peer holds (DDP's state, any
          node's own copy) into that slot meanwhile, so that copy runs while its workers start
          instead of at their first load. The ranks' vote waits for a copy under way and stops
          a search that found nothing."""
        self._prepare_replicas(round_id, node_rank, num_nodes, local_ranks)
        if world_size is None or rank_offset is None:
            return
        request = self._early_vote(
            _RoundPlace(rank_offset, world_size, local_ranks, node_rank, num_nodes), round_id
        )
        if request is None:
            return
        # Not joined by close(): it may wait for the other nodes' votes as long as the ranks
        # would; it reads nothing once the saver is closed.
        self._early = threading.Thread(
            target=self._vote_early, args=(request,), name="ckpt-early-vote", daemon=True
        )
        self._early.start()

    def _early_vote(self, place: _RoundPlace, round_id: int) -> LoadStepRequest | None:
        """The vote the node's ranks would cast in ``round_id`` at ``place`` (the last vote's
        format, directory and replicas), or None: no vote yet with a format, or nothing in
        memory to vote for (a node with empty memory votes when its ranks load: they may find
        the step on a peer)."""
        template = self._load_template
        if template is None:
            return None
        with self._cond:
            if all(b.newest() is None for b in self._slots.values()):
                return None
        try:
            fmt = format_named(template.fmt)
        except CheckpointError:
            return None
        return dataclasses.replace(
            template,
            slots=list(fmt.saving_slots(place)),
            node_rank=place.node_rank,
            total_nodes=place.num_nodes,
            round_id=round_id,
            ranks=dict(fmt.ranks_to_match(place)),
            world_size=fmt.world_size_to_match(place),
        )

    def _vote_early(self, request: LoadStepRequest) -> None:
        started = time.monotonic()
        try:
            step, _ = self._agree_load_step(request, early=True)
        except Exception as exc:  # the ranks vote when they load
            if self._closed.is_set():
                return  # the agent is going: its memory went with it
            log.warning(
                "round %d: the node's load-step vote failed (%s); its ranks vote when they load",
                request.round_id,
                exc,
            )
            return
        log.info(
            "round %d: the nodes agreed on step %s for the ranks' load %.3fs after it formed",
            request.round_id,
            step,
            time.monotonic() - started,
        )

    def _prepare_replicas(
        self, round_id: int, node_rank: int, num_nodes: int, local_ranks: int
    ) -> None:
        if self._exchange is None or self._peers is None or num_nodes < 2:
            return
        with self._prep_lock:
            earlier, self._round_prep = self._round_prep, None
        if earlier is not None:  # its ranks never voted: its search ends, a copy is waited for
            earlier[1].set()
        stop = threading.Event()
        thread = threading.Thread(
            target=self._prepare_round,
            args=(round_id, node_rank, num_nodes, local_ranks, stop, earlier),
            name="ckpt-round-prep",
            daemon=True,
        )
        with self._prep_lock:
            self._round_prep = (thread, stop)
        # close() joins it before it frees the slots: a copy it starts is never left behind.
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _prepare_round(
        self,
        round_id: int,
        node_rank: int,
        num_nodes: int,
        local_ranks: int,
        stop: threading.Event,
        earlier: tuple[threading.Thread, threading.Event] | None,
    ) -> None:
        assert self._exchange is not None and self._peers is not None
        if earlier is not None:
            earlier[0].join(DEFAULT_COPY_WAIT_S)  # one copy at a time; what it brought counts
        if self._exchange.addr:
            self._publish(round_id, node_rank)
        with self._cond:
            empty = all(b.latest is None and b.newest() is None for b in self._slots.values())
        # In a job's first round no peer holds a step in memory yet: nothing to look for.
        if not empty or local_ranks < 2 or round_id < 2:
            return
        # The peers publish as their own agents prepare the round (or their ranks vote): look
        # for the first one of the ring holding a replicated step until the ranks vote. One
        # short wait for one peer's address at a time: a few requests a second to the master,
        # and the vote (which ends the search) waits at most one of them.
        deadline = time.monotonic() + PREFETCH_SEARCH_S
        ring = [(node_rank + i) % num_nodes for i in range(1, num_nodes)]
        tried: set[int] = set()
        while not stop.is_set() and time.monotonic() < deadline and len(tried) < len(ring):
            for peer in ring:
                if peer in tried or stop.is_set():
                    continue
                addr = self._peers.lookup(round_id, peer, PREFETCH_WAIT_S)
                if addr is None:
                    continue
                tried.add(peer)
                try:
                    held = [info for info in self._exchange.list_peer(addr) if info.replicated]
                except ReplicaError as exc:
                    log.warning("listing the images of node %d (%s) failed: %s", peer, addr, exc)
                    continue
                if not held:
                    continue
                info = max(held, key=lambda info: info.step)
                if stop.is_set():
                    return
                log.info(
                    "node %d's memory (%s) holds step %d of this job's replicated state: "
                    "copying it in while the workers start",
                    peer, addr, info.step,
                )  # fmt: skip
                # Only into a node that still saved nothing: a rank that saved meanwhile
                # (its script skipped the load) keeps its own, newer step.
                if self._copy_from_peer(0, addr, info, only_if_empty=True) is not None:
                    self._prefetched = (round_id, peer, info.step)
                return

    def _end_round_prep(self, deadline: float) -> None:
        """Stop the round's search for a peer and wait (until ``deadline``) for a copy it
        started; called before the ranks' vote (under the load lock)."""
        with self._prep_lock:
            prep, self._round_prep = self._round_prep, None
        if prep is None:
            return
        thread, stop = prep
        stop.set()
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.warning(
                "the copy of a peer's step started as this round formed is still running: "
                "the vote goes on without it (its ranks may load from a peer or storage)"
            )

    # ------------------------------------------------------------------ replicas in peers
    def _publish(self, round_id: int, node_rank: int) -> bool:
        """Serve replicas (from the first job that asks for them on) and tell the peers where,
        once per round; False if this saver has no PeerDirectory (no replicas)."""
        if self._exchange is None or self._peers is None or self._closed.is_set():
            return False
        with self._exchange_lock:
            if not self._exchange.addr:
                self._exchange.start()
                pusher = threading.Thread(
                    target=self._replica_loop, name="ckpt-replica-push", daemon=True
                )
                pusher.start()
                self._threads.append(pusher)
            if (round_id, node_rank) not in self._published:
                self._peers.publish(round_id, node_rank, self._exchange.addr)
                self._published.add((round_id, node_rank))
        return True

    def _push_deferred(self) -> None:
        """After a persist unpinned its buffers: send the push it deferred, of the newest step."""
        with self._cond:
            deferred, self._replica_deferred = self._replica_deferred, None
        if deferred is not None:
            newest = self._common_step(deferred)
            if newest is not None:
                self._replica_jobs.put((newest, deferred))

    def _replica_loop(self) -> None:
        run_in_background()
        while (job := self._replica_jobs.get()) is not None:
            # Only the newest step matters: a backlog of older ones is skipped.
            while not self._replica_jobs.empty():
                newer = self._replica_jobs.get()
                if newer is None:
                    return
                job = newer
            self._push_replicas(*job)

    def _push_replicas(self, step: int, spec: PersistSpec) -> None:
        """Send every slot of ``spec`` holding ``step`` to the next ``spec.replicas`` nodes of
        the ring. The buffers sent are pinned meanwhile (copies go into the other buffer, a
        DISK save waits), so the bytes sent are the step's. Only the buffer written last is
        sent, and only while no other buffer of the slot is pinned (at most one pinned buffer
        per slot, so a memory save always finds a free one): a push that finds a persist
        running is deferred until it ends, and then sends the newest step."""
        assert self._exchange is not None and self._peers is not None
        if not self._persister.wait_ready(step, spec, DEFAULT_COPY_WAIT_S, "replicating"):
            return
        with self._cond:
            if not self._persister.slots_hold(spec, step):
                return
            held = {slot: self._slots[slot].holding(step) for slot in spec.slots}
            for slot, i in held.items():
                buffers = self._slots[slot]
                if i != buffers.latest or buffers.replicating:
                    return  # a newer copy is under way (it is pushed next), or a push runs
                if any(buffers.pinned(j) for j in range(buffers.count) if j != i):
                    self._replica_deferred = spec
                    log.debug(
                        "replica push of step %d deferred: a persist reads slot %d", step, slot
                    )
                    return
            segs = {}
            for slot, i in held.items():
                assert i is not None
                self._slots[slot].replicating.add(i)
                segs[slot] = self._slots[slot].segments[i]
        started = time.monotonic()
        sent = 0
        try:
            for i in range(1, min(spec.replicas, spec.num_nodes - 1) + 1):
                target = (spec.node_rank + i) % spec.num_nodes
                addr = self._peers.lookup(spec.round_id, target, 10.0)
                if addr is None:
                    log.warning(
                        "not replicating step %d to node %d: it has no address", step, target
                    )
                    continue
                try:
                    for slot, seg in segs.items():
                        if self._exchange.push(addr, spec.node_rank, slot, seg):
                            sent += image_len(seg)
                except (ReplicaError, CheckpointError) as exc:
                    log.warning("replicating step %d to node %d failed: %s", step, target, exc)
        finally:
            with self._cond:
                for slot in spec.slots:
                    self._slots[slot].replicating.clear()
                self._cond.notify_all()
        if sent:
            self.last_replica_s = took = time.monotonic() - started
            log.info(
                "replicated step %d to %d peer(s): %.0f MiB in %.2f s (%.0f MiB/s)",
                step,
                min(spec.replicas, spec.num_nodes - 1),
                sent / 2**20,
                took,
                sent / 2**20 / max(took, 1e-9),
            )

    def _find_on_peers(self, request: LoadStepRequest) -> tuple[int | None, int | None]:
        """The newest step of this node's ranks a peer's memory holds (this node lost its
        own), and that peer; Nones if none holds one. Nothing is copied: the images are
        recorded for the ranks' loads (``_attach``)."""
        assert self._exchange is not None and self._peers is not None
        with self._cond:
            for slot in request.slots:
                self._remote.pop(slot, None)  # what an earlier round found
        deadline = time.monotonic() + min(20.0, request.timeout / 2)
        for i in range(1, request.total_nodes):
            peer = (request.node_rank + i) % request.total_nodes
            addr = self._peers.lookup(request.round_id, peer, max(0.0, deadline - time.monotonic()))
            if addr is None:
                continue
            try:
                choice = _choose_images(self._exchange.list_peer(addr), request)
            except ReplicaError as exc:
                log.warning("listing the images of node %d (%s) failed: %s", peer, addr, exc)
                continue
            if choice is None:
                continue
            with self._cond:
                for slot, info in choice.items():
                    self._remote[slot] = (addr, info)
            step = next(iter(choice.values())).step
            log.info("node %d's memory (%s) holds step %d of this node's ranks", peer, addr, step)
            return step, peer
        log.info("no peer holds a step of this node's ranks in memory")
        return None, None

    def _copy_from_peer(
        self, slot: int, addr: str, info: SegmentInfo, only_if_empty: bool = False
    ) -> str | None:
        """Copy image ``info`` from the peer at ``addr`` into a buffer of ``slot`` (for the
        slots several ranks read); its path, or None if the copy failed (the ranks then load
        from storage)."""
        assert self._exchange is not None
        started = time.monotonic()
        pinned: tuple[SlotBuffers, int] | None = None
        try:
            seg, pinned = self._allocate(slot, info.nbytes, info.step, only_if_empty)
            if not self._exchange.fetch(addr, info, seg):
                raise ReplicaError(f"{info.key} changed while it was sent")
        except (ReplicaError, CheckpointError, OSError) as exc:
            log.warning("copying step %d from %s failed: %s", info.step, addr, exc)
            return None
        finally:
            with self._cond:
                if not only_if_empty:  # a copy for the vote's marker; a round's copy has none
                    self._remote.pop(slot, None)
                if pinned is not None:
                    pinned[0].receiving.discard(pinned[1])
                    self._cond.notify_all()
        log.info(
            "copied step %d of slot %d from %s: %.0f MiB in %.2f s",
            info.step,
            slot,
            addr,
            info.nbytes / 2**20,
            time.monotonic() - started,
        )
        return seg.path


def _newest_common(held: list[list[int]]) -> int | None:
    """The newest step found in every list of ``held`` (one list per slot), or None."""
    if not held:
        return None
    common = set(held[0]).intersection(*held[1:])
    return max(common) if common else None


def _choose_images(
    held: list[SegmentInfo], request: LoadStepRequest
) -> dict[int, SegmentInfo] | None:
    """For each slot of ``request``, an image of the newest step held for all of them: saved by
    the slot's rank (any rank when none is given: a replicated checkpoint), at the request's
    world size if it gives one, of its checkpoint directory if it names one."""
    usable = [
        info
        for info in held
        if (not request.checkpoint_dir or info.checkpoint_dir == request.checkpoint_dir)
        and (request.world_size is None or info.world_size == request.world_size)
    ]
    for step in sorted({info.step for info in usable}, reverse=True):
        choice: dict[int, SegmentInfo] = {}
        for slot in request.slots:
            rank = request.ranks.get(slot)
            found = [i for i in usable if i.step == step and (rank is None or i.rank == rank)]
            if not found:
                break
            choice[slot] = found[0]
        else:
            return choice
    return None


@dataclasses.dataclass(frozen=True)
class _RoundPlace:
    """Local rank 0's place in a new round (a `formats.Placement`), as the agent knows it."""

    rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    local_rank: int = 0
