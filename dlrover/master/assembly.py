"""One way to put a master together: state store + JobMaster + gRPC server, started.

`dlrover-run` (embedded master), `dlrover-master` and `dlrover submit` all call
`build_master()`; they differ only in the settings they pass.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from dlrover.constants import DEFAULT_HEARTBEAT_TIMEOUT_S
from dlrover.master.fencing import Fence, Leader
from dlrover.master.history import JobHistory
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.rendezvous import RendezvousConfig
from dlrover.master.server import FULL_GC_EVERY_S, MasterServer
from dlrover.master.state_store import StateMismatchError, StateStore, open_state_store
from dlrover.master.stragglers import DEFAULT_REPORT_S
from dlrover.master.tensorboard import TensorBoardError, TensorBoardExporter
from dlrover.master.web import LogReader, WebServer


@dataclass(frozen=True)
class MasterSettings:
    """What a master is built from."""

    job_name: str
    token: str
    host: str = "0.0.0.0"
    port: int = 0
    """0: a free port (read it back from `RunningMaster.port`)."""
    heartbeat_port: int | None = 0
    """The port of the server that serves heartbeats alone (`HeartbeatLane`; 0: a free one;
    None: none, heartbeats come to ``port``)."""
    state: str = "memory"
    """`memory`, or a SQLite file that keeps the job's state across a master restart."""
    rendezvous: RendezvousConfig | None = None
    """The node range; None: the first agent's --nnodes fixes it."""
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    straggler_report_s: float = DEFAULT_REPORT_S
    """How often runtime straggler scores are computed."""
    exclude_stragglers: bool = False
    """Replace runtime stragglers (through the node controller's engine)."""
    metrics_port: int | None = 0
    """The port of /metrics and the dashboard (0: a free one; None: none)."""
    tensorboard_dir: str = ""
    """Write the job's metrics as TensorBoard event files here ("": not)."""
    log_reader: LogReader | None = None
    """Where the dashboard reads a node's log (the local engine's files), if anywhere."""
    owns_process: bool = False
    """The master is its process's main work (dlrover-master, dlrover submit), so it may set the
    process's garbage-collection policy (see MasterServer); not for a master embedded in an
    agent."""


@dataclass
class RunningMaster:
    """A started master; `stop()` ends the server and closes the state store."""

    job: JobMaster
    server: MasterServer
    store: StateStore
    web: WebServer | None = None
    tensorboard: TensorBoardExporter | None = None
    history: JobHistory | None = None
    """The job over time (the dashboard's charts; an ended job's ``history.json``)."""

    @property
    def port(self) -> int:
        """The port the server listens on (the free one picked when the settings asked for 0)."""
        return self.server.port

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop the server (in-flight calls get ``grace_s`` seconds), then close the state store."""
        self.server.stop(grace_s)
        if self.web is not None:
            self.web.stop()
        if self.tensorboard is not None:
            self.tensorboard.close()
        self.store.close()


def claim_state(store: StateStore, job_name: str, token: str) -> None:
    """Mark a fresh state as this job's, or check that a saved one is.

    A master restarted on its job's state resumes the job; one started on another job's state
    (another name or token) would hand that job's nodes to strangers, so it is refused with
    StateMismatchError, and nothing in the state is changed.
    """
    mine = {"job_name": job_name, "token_sha256": hashlib.sha256(token.encode()).hexdigest()}
    saved = store.get_json("job", "identity")
    if saved is None:
        store.put_json("job", "identity", mine)
        return
    other_token = saved.get("token_sha256") != mine["token_sha256"]
    if saved.get("job_name") != job_name:
        raise StateMismatchError(
            f"the state in {store} belongs to job {saved.get('job_name')!r}, not {job_name!r}"
            + (" (and another token)" if other_token else "")
            + ": restart the master with that job's name and token, or give this job a new state"
        )
    if other_token:
        raise StateMismatchError(
            f"the state in {store} belongs to job {job_name!r} started with another token: "
            "restart the master with the job's token (--token, or $DLROVER_JOB_TOKEN), or give "
            "this job a new state"
        )


def build_master(
    settings: MasterSettings, on_fenced: Callable[[Leader], None] | None = None
) -> RunningMaster:
    """Open the state, build the job and start serving it.

    Raises StateStoreError (the state cannot be opened, is corrupt, or is another job's:
    StateMismatchError), RendezvousError (the saved node range differs from the given one),
    TensorBoardError (the --tensorboard-dir is not writable), MasterServerError (the gRPC address
    cannot be bound) or WebError (the metrics port cannot be bound); nothing is left open or
    listening when it raises, and nothing has listened before every setting was checked.

    The master claims the state's leadership (`Fence`): if a newer master claims it later, this
    one stops serving within a tick and calls ``on_fenced``.
    """
    store = open_state_store(settings.state)
    tensorboard: TensorBoardExporter | None = None
    web: WebServer | None = None
    try:
        claim_state(store, settings.job_name, settings.token)
        fence = Fence.claim(store)
        job = JobMaster(
            JobMasterConfig(
                job_name=settings.job_name,
                rendezvous=settings.rendezvous,
                heartbeat_timeout_s=settings.heartbeat_timeout_s,
                straggler_report_s=settings.straggler_report_s,
                exclude_stragglers=settings.exclude_stragglers,
            ),
            store,
        )
        # Every other setting is checked before the gRPC port is bound: grpc.aio releases a
        # port only when a started server stops, and no node may register with a master that
        # is about to fail.
        if settings.tensorboard_dir:
            try:
                tensorboard = TensorBoardExporter(job, settings.tensorboard_dir)
            except OSError as e:
                raise TensorBoardError(
                    f"cannot write TensorBoard events to {settings.tensorboard_dir}: "
                    f"{e.strerror or e}; give a writable --tensorboard-dir"
                ) from None
        history = JobHistory(job)
        if settings.metrics_port is not None:
            web = WebServer(job, settings.host, settings.metrics_port, settings.log_reader, history)
        server = MasterServer(
            job,
            settings.token,
            host=settings.host,
            port=settings.port,
            full_gc_every_s=FULL_GC_EVERY_S if settings.owns_process else 0.0,
            fence=fence,
            on_fenced=on_fenced,
            heartbeat_port=settings.heartbeat_port,
        )
    except BaseException:
        if web is not None:
            web.stop()
        if tensorboard is not None:
            tensorboard.writer.close()
        store.close()
        raise
    running = RunningMaster(
        job, server.start(), store, web.start() if web else None, tensorboard, history
    )
    if web is not None:
        job.status.serve_metrics_on(web.port)
    if tensorboard is not None:
        job.add_tick_hook(tensorboard.maybe_write)
    job.add_tick_hook(history.maybe_sample)
    return running
