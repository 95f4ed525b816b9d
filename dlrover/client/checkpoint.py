"""CommitCoordinator over the master's API: the nodes' checkpoint savers agree through the master."""

from __future__ import annotations

from dlrover.api.master import MasterApi


class MasterCommitCoordinator:
    """Implements dlrover.checkpoint.coordinator.CommitCoordinator through the job master
    (over gRPC with a MasterClient, or in process with a LocalMasterApi)."""

    def __init__(self, master: MasterApi) -> None:
        self._master = master

    def report_persisted(self, step: int, node_rank: int, total_nodes: int) -> bool:
        """This node wrote all its files of ``step``; True for the step's one committer."""
        return self._master.checkpoint_persisted(step, node_rank, total_nodes)

    def mark_committed(self, step: int) -> None:
        """Announce that ``step`` is committed; the master persists it and wakes waiters."""
        self._master.checkpoint_committed(step)

    def wait_committed(self, step: int, timeout: float) -> bool:
        """Whether ``step`` or a newer one is committed within ``timeout`` seconds."""
        return self._master.wait_checkpoint_committed(step, timeout)

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
        return self._master.vote_load_step(node_rank, total_nodes, local_step, round_id, timeout)[1]
