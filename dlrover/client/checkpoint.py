"""CommitCoordinator and PeerDirectory over the master's API: the nodes' checkpoint savers agree,
and find each other's replica servers, through the master."""

from __future__ import annotations

import logging
import threading
import time

from dlrover.api.errors import MasterClientError, MasterUnreachableError
from dlrover.api.master import MasterApi
from dlrover.api.retry import while_unreachable
from dlrover.constants import DEFAULT_MASTER_RECONNECT_S
from dlrover.coordination import CKPT_PEER

log = logging.getLogger(__name__)


class MasterCommitCoordinator:
    """Implements dlrover.checkpoint.coordinator.CommitCoordinator through the job master
    (over gRPC with a MasterClient, or in process with a LocalMasterApi).

    Once ``master_lost`` is set (the agent took the master for gone), a call is tried once
    instead of for DEFAULT_MASTER_RECONNECT_S: the node is stopping and persists its newest
    step on its way out. The one node that writes every part of a step (DDP) then commits it on
    its own; a step whose parts come from several nodes cannot be committed without the master.
    """

    def __init__(self, master: MasterApi, master_lost: threading.Event | None = None) -> None:
        self._master = master
        self._lost = master_lost or threading.Event()

    def _deadline(self) -> float:
        return time.monotonic() + (0.0 if self._lost.is_set() else DEFAULT_MASTER_RECONNECT_S)

    def report_persisted(self, step: int, node_rank: int, total_nodes: int) -> bool:
        """This node wrote all its files of ``step``; True for the step's one committer."""
        try:
            return while_unreachable(
                lambda: self._master.checkpoint_persisted(step, node_rank, total_nodes),
                self._deadline(),
                f"report checkpoint step {step} persisted",
            )
        except MasterUnreachableError:
            if self._lost.is_set() and total_nodes == 1:
                log.warning("the master is gone: committing step %d on this node alone", step)
                return True
            raise

    def mark_committed(self, step: int) -> None:
        """Announce that ``step`` is committed; the master persists it and wakes waiters."""
        try:
            while_unreachable(
                lambda: self._master.checkpoint_committed(step),
                self._deadline(),
                f"mark checkpoint step {step} committed",
            )
        except MasterUnreachableError:
            if not self._lost.is_set():
                raise
            log.warning("the master is gone: it does not learn that step %d is committed", step)

    def wait_committed(self, step: int, timeout: float) -> bool:
        """Whether ``step`` or a newer one is committed within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        return while_unreachable(
            lambda: self._master.wait_checkpoint_committed(
                step, max(0.0, deadline - time.monotonic())
            ),
            deadline,
            f"wait for checkpoint step {step}",
        )

    def agree_load_step(
        self,
        node_rank: int,
        total_nodes: int,
        local_step: int | None,
        round_id: int,
        timeout: float,
    ) -> int | None:
        """The step every node can load from memory in round ``round_id``, or None (the nodes
        differ, or one did not vote within ``timeout`` seconds)."""
        # Undecided at the deadline (a node never voted): None, nobody loads from memory.
        deadline = time.monotonic() + timeout
        return while_unreachable(
            lambda: self._master.vote_load_step(
                node_rank, total_nodes, local_step, round_id, max(0.0, deadline - time.monotonic())
            ),
            deadline,
            "agree on the step to load",
        )[1]


class MasterPeerDirectory:
    """Implements dlrover.checkpoint.replica.PeerDirectory in the job master's KV store."""

    def __init__(self, master: MasterApi) -> None:
        self._master = master

    def publish(self, round_id: int, node_rank: int, addr: str) -> None:
        """Store the address under this round and node rank (logged, not raised, if the master
        cannot be reached: peers then restore from storage)."""
        try:
            while_unreachable(
                lambda: CKPT_PEER.put(self._master, addr, f"{round_id}/{node_rank}"),
                time.monotonic() + DEFAULT_MASTER_RECONNECT_S,
                "publish the checkpoint replica address",
            )
        except MasterClientError as exc:
            log.warning("cannot publish this node's checkpoint replica address: %s", exc)

    def lookup(self, round_id: int, node_rank: int, timeout: float) -> str | None:
        """The address, waiting up to ``timeout`` seconds for the node to publish it; None if
        it did not (or the master cannot be reached)."""
        deadline = time.monotonic() + timeout
        try:
            value = while_unreachable(
                lambda: CKPT_PEER.get(
                    self._master,
                    f"{round_id}/{node_rank}",
                    wait_s=max(0.0, deadline - time.monotonic()),
                ),
                deadline,
                f"look up node {node_rank}'s checkpoint replica address",
            )
        except MasterClientError as exc:
            log.warning("cannot look up node %d's checkpoint replica address: %s", node_rank, exc)
            return None
        return value
