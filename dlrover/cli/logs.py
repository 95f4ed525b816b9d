"""`dlrover logs NAME [--node N] [--rank R] [-f]`: a job's node and per-rank logs, read from the
job directory (local engine) or from its master's dashboard (Ray, Kubernetes)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence

from dlrover.api.master import NodeStatus
from dlrover.client.master_client import MasterClient, MasterClientError
from dlrover.engines.node_logs import STREAMS, LocalNodeLogs, LogChunk, NodeLogs
from dlrover.runner.records import JobRecord, job_dir, read_final, read_record

FOLLOW_POLL_S = 0.5
"""How often ``-f`` looks for new lines (files and a dashboard offer nothing to wait on)."""
HTTP_TIMEOUT_S = 10.0
"""How long one request to the master's dashboard may take."""
_TAIL_WINDOW = 256 << 10
"""How far back ``-f`` reads for the lines it shows before following."""


class LogsError(Exception):
    """What was asked for has no log; the message says what exists instead."""


class _StopFlag:
    """Set by Ctrl-C (from the signal handler: one attribute store, no lock that the
    interrupted code could be holding); `wait` sleeps in short slices until it is set."""

    SLICE_S = 0.05

    def __init__(self) -> None:
        self.requested = False

    def set(self) -> None:
        """Ask the loop to stop (safe in a signal handler)."""
        self.requested = True

    def is_set(self) -> bool:
        """Whether stopping was asked for."""
        return self.requested

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True as soon as the flag is set."""
        end = time.monotonic() + seconds
        while not self.requested:
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(self.SLICE_S, left))
        return True


class HttpNodeLogs:
    """`NodeLogs` read from a running master's dashboard (``/api/log...``): the engine behind it
    reads where the nodes run (the Ray actors)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def _get(self, path: str, **query: object) -> bytes | None:
        params = urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        try:
            with urllib.request.urlopen(  # noqa: S310 - the job's own dashboard
                f"{self.base_url}{path}?{params}", timeout=HTTP_TIMEOUT_S
            ) as r:
                return bytes(r.read())
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise LogsError(f"the master's dashboard answered {e.code} for {path}") from None
        except OSError as e:
            raise LogsError(
                f"cannot reach the master's dashboard at {self.base_url}: {e}"
            ) from None

    def tail(self, node_id: str, rank: int | None, lines: int) -> str | None:
        """See `NodeLogs.tail`."""
        body = self._get("/api/log", node=node_id, rank=rank, lines=lines)
        return body.decode(errors="replace") if body is not None else None

    def ranks(self, node_id: str) -> tuple[int, ...]:
        """See `NodeLogs.ranks`."""
        body = self._get("/api/log/ranks", node=node_id)
        return tuple(int(r) for r in json.loads(body)) if body else ()

    def node_ids(self) -> tuple[str, ...]:
        """See `NodeLogs.node_ids`."""
        body = self._get("/api/log/nodes")
        return tuple(str(n) for n in json.loads(body)) if body else ()

    def read(self, node_id: str, rank: int | None, stream: str, offset: int) -> LogChunk | None:
        """See `NodeLogs.read`."""
        body = self._get("/api/log/read", node=node_id, rank=rank, stream=stream, offset=offset)
        if body is None:
            return None
        doc = json.loads(body)
        return LogChunk(str(doc["text"]), int(doc["offset"]), str(doc["source"]))


@dataclasses.dataclass(frozen=True)
class Target:
    """One log `dlrover logs` shows: a node's own (``rank`` None) or one of its workers'."""

    node_id: str
    rank: int | None

    @property
    def label(self) -> str:
        """How its lines are prefixed when several logs are shown."""
        return self.node_id if self.rank is None else f"rank {self.rank}"


def _relaunch(node_id: str) -> int:
    """The attempt number that ends an engine's node id (``<job>-<role>-<rank>-<n>``)."""
    match = re.search(r"-(\d+)$", node_id)
    return int(match.group(1)) if match else 0


def _preferred(nodes: Sequence[NodeStatus]) -> list[NodeStatus]:
    """Running nodes first, then the latest attempts: which node's log of a rank to show."""
    return sorted(nodes, key=lambda n: (n.state == "running", _relaunch(n.node_id)), reverse=True)


def _describe(nodes: Sequence[NodeStatus]) -> str:
    return ", ".join(f"{n.node_id} (node rank {n.node_rank}, {n.state})" for n in nodes) or "none"


def pick_node(nodes: Sequence[NodeStatus], wanted: str, job: str) -> NodeStatus:
    """The node ``wanted`` names: its id, or its node rank (a running one first)."""
    for n in nodes:
        if n.node_id == wanted:
            return n
    if wanted.isdigit():
        same = [n for n in nodes if n.node_rank == int(wanted)]
        if same:
            return _preferred(same)[0]
    raise LogsError(f"job {job} has no node {wanted!r}; its nodes: {_describe(nodes)}")


def resolve(
    logs: NodeLogs, nodes: Sequence[NodeStatus], node: str | None, rank: int | None, job: str
) -> list[Target]:
    """The logs to show: ``rank`` (on ``node`` if given), else ``node``'s own log, else every
    rank's (each from its running or latest node; the nodes' own logs where no rank has any)."""
    chosen = [pick_node(nodes, node, job)] if node is not None else list(nodes)
    ranks = {n.node_id: logs.ranks(n.node_id) for n in chosen}
    if rank is not None:
        holders = [n for n in chosen if rank in ranks[n.node_id]]
        if not holders:
            known = sorted({r for rs in ranks.values() for r in rs})
            where = f"node {node}" if node is not None else f"job {job}"
            raise LogsError(
                f"{where} has no log of rank {rank}; ranks with logs: "
                + (", ".join(map(str, known)) or "none yet")
            )
        return [Target(_preferred(holders)[0].node_id, rank)]
    if node is not None:
        return [Target(chosen[0].node_id, None)]
    best: dict[int, str] = {}
    for n in reversed(_preferred(chosen)):  # preferred last: it wins
        for r in ranks[n.node_id]:
            best[r] = n.node_id
    if best:
        return [Target(node_id, r) for r, node_id in sorted(best.items())]
    if not chosen:
        raise LogsError(f"job {job} has no nodes yet")
    return [Target(n.node_id, None) for n in chosen]


def _nodes_and_logs(record: JobRecord) -> tuple[list[NodeStatus], NodeLogs]:
    """The job's nodes (its master's table, or the final one it left) and where their logs are
    read."""
    status = None
    if record.reachable:
        client = MasterClient(record.master_addr, record.token, rpc_timeout_s=5)
        try:
            status = client.get_job_status()
        except MasterClientError:
            status = None  # it just ended, or is restarting: the records say the rest
        finally:
            client.close()
    if status is None:
        final = read_final(record.name)
        status = final.status if final is not None else None
    nodes = list(status.nodes) if status is not None else []
    logs: NodeLogs
    if record.engine in ("", "local"):
        logs = LocalNodeLogs(job_dir(record.name) / "nodes")
    elif not record.reachable or status is None:
        raise LogsError(
            f"job {record.name} ran on engine {record.engine} and {record.state}: its logs were "
            "kept where its nodes ran, which are gone (see your cluster's own logs)"
        )
    elif not status.metrics_port:
        raise LogsError(
            f"job {record.name}'s master serves no dashboard (--metrics-port -1), which is "
            f"where the logs of {record.engine} nodes are read"
        )
    else:
        host = record.master_addr.rsplit(":", 1)[0]
        logs = HttpNodeLogs(f"http://{host}:{status.metrics_port}")
    known = {n.node_id for n in nodes}
    # Nodes the table does not name (a TensorFlow job's roles, a job that left no table).
    nodes += [
        NodeStatus(i, "-", -1, "", -1, 0, 0.0, "", 0.0, 0)
        for i in logs.node_ids()
        if i not in known
    ]
    return nodes, logs


def _show_tail(
    logs: NodeLogs, targets: Sequence[Target], lines: int, out: Callable[[str], None]
) -> None:
    for t in targets:
        text = logs.tail(t.node_id, t.rank, lines)
        if len(targets) > 1:
            out(f"==> {t.label} ({t.node_id}) <==")
        if text:
            out(text)


def _follow(
    name: str,
    logs: NodeLogs,
    refresh: Callable[[], list[Target]],
    lines: int,
    out: Callable[[str], None],
    stop: _StopFlag,
) -> None:
    """Print the last ``lines`` lines of each target, then new lines as they come, until the job
    ends (a last read after that) or ``stop`` is set (Ctrl-C)."""
    position: dict[tuple[Target, str], tuple[str, int]] = {}
    targets = refresh()
    several = len(targets) > 1

    def emit(t: Target, text: str) -> None:
        for line in text.splitlines():
            out(f"[{t.label}] {line}" if several else line)

    for t in targets:  # the tail: whole lines from a window before each stream's end
        if stop.is_set():
            return
        for stream in STREAMS:
            end = logs.read(t.node_id, t.rank, stream, -1)
            if end is None:
                continue
            chunk = logs.read(t.node_id, t.rank, stream, max(0, end.offset - _TAIL_WINDOW))
            if chunk is None:
                continue
            shown = chunk.text.splitlines()
            if end.offset > _TAIL_WINDOW:
                shown = shown[1:]  # the window starts inside a line
            emit(t, "\n".join(shown[-lines:]))
            position[(t, stream)] = (chunk.source, chunk.offset)
    while not stop.is_set():
        ended = read_record(name).ended
        try:
            for t in targets:
                if stop.is_set():
                    return
                for stream in STREAMS:
                    source, offset = position.get((t, stream), ("", 0))
                    chunk = logs.read(t.node_id, t.rank, stream, offset)
                    if chunk is not None and chunk.source != source and source:
                        chunk = logs.read(t.node_id, t.rank, stream, 0)  # a new attempt's file
                        out(f"--- {t.label}: {chunk.source if chunk else '?'} ---")
                    if chunk is None:
                        continue
                    emit(t, chunk.text)
                    position[(t, stream)] = (chunk.source, chunk.offset)
        except LogsError:
            if not ended:
                # The master is ending the job (the record says so next) or is restarted.
                stop.wait(FOLLOW_POLL_S)
                continue
        if ended or stop.wait(FOLLOW_POLL_S):
            return
        try:
            newer = refresh()
        except LogsError:
            continue  # between a node's end and its replacement: keep the ones we have
        for t in newer:
            if t not in targets:
                out(f"--- {t.label}: now on {t.node_id} ---")
        targets = newer
        several = several or len(targets) > 1


def cmd_logs(
    name: str,
    node: str | None = None,
    rank: int | None = None,
    follow: bool = False,
    lines: int = 100,
    out: Callable[[str], None] = print,
) -> int:
    """``dlrover logs NAME``: print the logs ``resolve`` picks (``follow``: and keep printing
    new lines until the job ends or Ctrl-C). Returns the exit code; raises NoSuchJobError."""
    if lines < 1:
        print("dlrover: error: --lines must be at least 1", file=sys.stderr)
        return 2
    record = read_record(name)
    try:
        nodes, logs = _nodes_and_logs(record)
        targets = resolve(logs, nodes, node, rank, name)
        if not follow:
            _show_tail(logs, targets, lines, out)
            return 0

        def refresh() -> list[Target]:
            return resolve(logs, _nodes_and_logs(read_record(name))[0], node, rank, name)

        def flushed(line: str) -> None:
            out(line)
            sys.stdout.flush()  # a pipe reader sees each line as it comes

        stop = _StopFlag()
        with _ctrl_c_sets(stop):
            _follow(name, logs, refresh, lines, flushed, stop)
        return 0
    except LogsError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


@contextlib.contextmanager
def _ctrl_c_sets(stop: _StopFlag) -> Iterator[None]:
    """Within the block, Ctrl-C (SIGINT) sets ``stop`` instead of raising KeyboardInterrupt
    wherever the main thread is: an exception raised inside a gRPC call (the follow loop asks
    the master for the job's nodes) can be lost there, and the follower then never ended.
    Only over Python's own handler, on the main thread: an inherited SIG_IGN (started with
    `&` by a script) or a caller's handler stays as it is."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
