"""CommitCoordinator over the wire: the nodes' checkpoint savers agree through the master."""

from __future__ import annotations

import time

from dlrover.client.master_client import MasterClient
from dlrover.proto import master_pb2 as pb

_POLL_S = 5.0
"""One server-side wait; the client asks again until its own deadline."""


class MasterCommitCoordinator:
    """Implements dlrover.checkpoint.coordinator.CommitCoordinator through the job master."""

    def __init__(self, client: MasterClient) -> None:
        self._client = client

    def report_persisted(self, step: int, node_rank: int, total_nodes: int) -> bool:
        response = self._client._call(
            self._client._stub.CheckpointPersisted,
            pb.CheckpointPersistedRequest(step=step, node_rank=node_rank, total_nodes=total_nodes),
        )
        return bool(response.committer)

    def mark_committed(self, step: int) -> None:
        self._client._call(
            self._client._stub.CheckpointCommitted,
            pb.CheckpointCommittedRequest(step=step, mark=True),
        )

    def wait_committed(self, step: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            wait = min(_POLL_S, max(0.0, deadline - time.monotonic()))
            response = self._client._call(
                self._client._stub.CheckpointCommitted,
                pb.CheckpointCommittedRequest(step=step, wait_s=wait),
                wait + 10.0,
            )
            if response.committed:
                return True
            if time.monotonic() >= deadline:
                return False

    def agree_load_step(
        self,
        node_rank: int,
        total_nodes: int,
        local_step: int | None,
        round_id: int,
        timeout: float,
    ) -> int | None:
        deadline = time.monotonic() + timeout
        while True:
            wait = min(_POLL_S, max(0.0, deadline - time.monotonic()))
            request = pb.AgreeLoadStepRequest(
                node_rank=node_rank, total_nodes=total_nodes, round_id=round_id, wait_s=wait
            )
            if local_step is not None:
                request.local_step = local_step
            response = self._client._call(self._client._stub.AgreeLoadStep, request, wait + 10.0)
            if response.decided:
                return response.step if response.HasField("step") else None
            if time.monotonic() >= deadline:
                return None  # a node never voted: nobody loads from memory
