"""`MasterApi` on a JobMaster in this process: each call runs on the part that serves it.

Derived from the interfaces like the gRPC client (`dlrover.api.rpc.derive_client`): a call binds
its arguments by the interface's signature, runs on the part `JobMaster.services` names (a long
poll held in the calling thread), and a refusal becomes the same error a gRPC caller sees
(`dlrover.master.refusals`). An embedded master or a test hands it to an agent directly, with no
server and no processes in between.
"""

from __future__ import annotations

from typing import Any

from dlrover.api.master import MASTER_PARTS, MasterApi
from dlrover.api.rpc import Rpc, Run, derive_client
from dlrover.api.wire import RPCS
from dlrover.master.changes import LongPoll
from dlrover.master.job import JobMaster
from dlrover.master.refusals import as_refusal

__all__ = ["LocalMasterApi"]

_LocalCalls: Any = derive_client(
    "_LocalCalls", {m: call for m, call in RPCS.items() if call.interface in MASTER_PARTS}
)


class LocalMasterApi(_LocalCalls, MasterApi):  # type: ignore[misc]
    """Implements `dlrover.api.master.MasterApi` by calling the JobMaster's parts directly.

    The long polls (`get_comm_world`, `num_nodes_waiting`, `report_node_status`,
    `join_node_check` with a ``wait_s``) block the calling thread here; the gRPC server holds
    the same `LongPoll`s on its event loop instead, so that 10,000 held calls cost no threads.
    Waits are not capped here, unlike the gRPC servicer.
    """

    def __init__(self, job: JobMaster) -> None:
        self.job = job
        self._parts = job.services()

    def invoke(self, call: Rpc, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``call`` with these arguments on its part; refusals raise the API's errors."""
        bound = call.signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.pop("self")
        part = self._parts[call.interface]
        try:
            if call.options.run is Run.POLL:
                wait_s = arguments.pop("wait_s")
                poll: LongPoll[Any] = getattr(part, call.options.poll)(**arguments)
                return poll.run_here(wait_s, self.job.clock)
            return getattr(part, call.method)(**arguments)
        except Exception as error:
            refusal = as_refusal(error)
            if refusal is None or refusal is error:
                raise
            raise refusal from None
