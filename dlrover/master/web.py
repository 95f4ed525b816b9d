"""The master's HTTP side: Prometheus metrics, the dashboard and its JSON.

Routes (read-only, no token: bind it where only your network reaches, as the gRPC port):

- ``/metrics``: Prometheus text exposition (`dlrover.master.metrics`);
- ``/``: the dashboard, one static page (``static/dashboard.html``, plain JavaScript, no build
  step) that polls the JSON below every 2 s and charts it;
- ``/api/status``: the job, its nodes, goodput and badput, the goodput history and the event
  timeline;
- ``/api/history``: the job over time for the charts (`dlrover.master.history.JobHistory`):
  goodput and badput shares, each node's step time, throughput, CPU and memory, and markers;
- ``/uplot.js``, ``/uplot.css``: the charting library the page draws with (vendored, MIT; see
  ``dlrover/master/static/uPlot.LICENSE``);
- ``/api/log?node=ID&lines=N``: the tail of a node's own log (its agent), and with ``&rank=R``
  of its worker R's latest attempt, where the engine can read them back (local, Ray), else 404;
- ``/api/log/ranks?node=ID``: the ranks that node has logs of, as a JSON list;
- ``/api/log/nodes``: every node whose logs are kept (a TensorFlow job's roles too), JSON list;
- ``/api/log/read?node=ID[&rank=R]&stream=stdout|stderr&offset=B``: that stream from byte B on
  (-1: its end) as JSON ``{"text", "offset", "source"}`` (what `dlrover logs -f` polls).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlparse

from dlrover.engines.node_logs import LogChunk, NodeLogs
from dlrover.master.history import JobHistory
from dlrover.master.job import JobMaster
from dlrover.master.local_api import LocalMasterApi
from dlrover.master.metrics import JobMetrics

logger = logging.getLogger(__name__)

LogReader = NodeLogs
"""Where node logs are read (`dlrover.engines.node_logs.NodeLogs`)."""
MAX_LOG_LINES = 2000


class WebError(Exception):
    """The metrics/dashboard port cannot be bound.

    Not a MasterServerError: that one means the gRPC address is taken, which `dlrover-run`
    reads as "another node hosts the master"; a taken metrics port is a setting to change.
    """


_S = TypeVar("_S", bound="HttpService")


class HttpService:
    """One HTTP server on a port of its own, served from a daemon thread: the master's metrics
    and dashboard (`WebServer`), `dlrover dashboard` (`dlrover.cli.dashboard`)."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: type[BaseHTTPRequestHandler],
        name: str,
        refused: Callable[[str], Exception],
    ) -> None:
        """``refused(why)``: the error to raise when the port cannot be bound."""
        try:
            self._httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            why = "the port is taken" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            raise refused(why) from None
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name=name, daemon=True)

    @property
    def port(self) -> int:
        """The bound port (the free one picked for port 0)."""
        return int(self._httpd.server_address[1])

    def start(self: _S) -> _S:
        """Serve in a background thread; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving (if `start` was called) and close the socket."""
        if self._thread.is_alive():
            self._httpd.shutdown()  # waits for serve_forever to return: never called without it
        self._httpd.server_close()


class WebServer(HttpService):
    """Serves one job's metrics and dashboard on a port of its own."""

    def __init__(
        self,
        job: JobMaster,
        host: str = "0.0.0.0",
        port: int = 0,
        log_reader: LogReader | None = None,
        history: JobHistory | None = None,
    ) -> None:
        self._job = job
        self._history = history
        self._api = LocalMasterApi(job)
        self._metrics = JobMetrics(job)
        self.log_reader = log_reader
        super().__init__(
            host,
            port,
            _handler(self),
            "dlrover-web",
            lambda why: WebError(
                f"cannot serve metrics on {host}:{port}: {why}; pick another --metrics-port "
                "(0: a free one, -1: none)"
            ),
        )

    # --- pages ---------------------------------------------------------------------------------
    def metrics(self) -> bytes:
        """The /metrics page."""
        return self._metrics.render()

    def status(self) -> dict[str, Any]:
        """The /api/status document."""
        job = self._job
        status = dataclasses.asdict(self._api.get_job_status())
        g = job.diagnostics.goodput.snapshot(job.clock())
        status["goodput"] = {
            "ratio": g.ratio,
            "elapsed_s": g.elapsed_s,
            "productive_s": g.productive_s,
            "badput_s": g.badput_s,
            "steps": g.steps,
            "step_s": g.step_s,
            "recoveries_s": list(g.recoveries_s),
            "history": job.diagnostics.goodput.history(),
        }
        status["events"] = [
            {"at": at, "kind": kind, "text": text}
            for at, kind, text in list(job.diagnostics.events)
        ]
        status["has_logs"] = self.log_reader is not None
        return status

    def history(self) -> dict[str, Any] | None:
        """The /api/history document (None: this master keeps no history)."""
        return self._history.document() if self._history is not None else None

    def log(self, node_id: str, lines: int, rank: int | None = None) -> str | None:
        """The tail of ``node_id``'s own log, or of its worker ``rank`` (None: not kept)."""
        if self.log_reader is None:
            return None
        return self.log_reader.tail(node_id, rank, max(1, min(lines, MAX_LOG_LINES)))

    def read_log(self, node_id: str, rank: int | None, stream: str, offset: int) -> LogChunk | None:
        """A stream of ``node_id``'s log (or of its worker ``rank``) from ``offset`` on."""
        if self.log_reader is None:
            return None
        return self.log_reader.read(node_id, rank, stream, offset)

    def log_nodes(self) -> tuple[str, ...]:
        """The nodes whose logs are kept (() where none are)."""
        return self.log_reader.node_ids() if self.log_reader is not None else ()

    def log_ranks(self, node_id: str) -> tuple[int, ...]:
        """The ranks ``node_id`` has logs of (() where none are kept)."""
        return self.log_reader.ranks(node_id) if self.log_reader is not None else ()


STATIC = {
    "/": ("dashboard.html", "text/html; charset=utf-8"),
    "/index.html": ("dashboard.html", "text/html; charset=utf-8"),
    "/uplot.js": ("uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "/uplot.css": ("uPlot.min.css", "text/css; charset=utf-8"),
}
"""The pages and files served from ``dlrover/master/static`` (package data), by path."""


def static_file(name: str) -> bytes:
    """A file of ``dlrover/master/static`` (package data)."""
    return resources.files("dlrover.master").joinpath("static").joinpath(name).read_bytes()


class PageHandler(BaseHTTPRequestHandler):
    """What every page of the master's and `dlrover dashboard`'s servers shares: no access log
    (a page polls every 2 s) and uncached answers."""

    server_version = "dlrover"

    def log_message(self, format: str, *args: Any) -> None:
        """Nothing: scrapes and polls every few seconds would flood the log."""
        return

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)


def _handler(server: WebServer) -> type[BaseHTTPRequestHandler]:
    class Handler(PageHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            try:
                if url.path == "/metrics":
                    self._send(200, "text/plain; version=0.0.4; charset=utf-8", server.metrics())
                elif url.path in STATIC:
                    name, content_type = STATIC[url.path]
                    self._send(200, content_type, static_file(name))
                elif url.path == "/api/status":
                    body = json.dumps(server.status()).encode()
                    self._send(200, "application/json", body)
                elif url.path == "/api/history":
                    history = server.history()
                    if history is None:
                        self._send(404, "text/plain", b"this master keeps no history\n")
                    else:
                        self._send(200, "application/json", json.dumps(history).encode())
                elif url.path == "/api/log":
                    query = parse_qs(url.query)
                    node = query.get("node", [""])[0]
                    lines = int(query.get("lines", ["200"])[0])
                    rank_text = query.get("rank", [""])[0]
                    rank = int(rank_text) if rank_text else None
                    text = server.log(node, lines, rank)
                    if text is None:
                        what = f"rank {rank} of node {node}" if rank is not None else node
                        self._send(404, "text/plain", f"no log of {what} is kept here\n".encode())
                    else:
                        self._send(200, "text/plain; charset=utf-8", text.encode())
                elif url.path == "/api/log/read":
                    query = parse_qs(url.query)
                    rank_text = query.get("rank", [""])[0]
                    chunk = server.read_log(
                        query.get("node", [""])[0],
                        int(rank_text) if rank_text else None,
                        query.get("stream", ["stdout"])[0],
                        int(query.get("offset", ["0"])[0]),
                    )
                    if chunk is None:
                        self._send(404, "text/plain", b"no such log is kept here\n")
                    else:
                        body = json.dumps(dataclasses.asdict(chunk)).encode()
                        self._send(200, "application/json", body)
                elif url.path == "/api/log/nodes":
                    body = json.dumps(list(server.log_nodes())).encode()
                    self._send(200, "application/json", body)
                elif url.path == "/api/log/ranks":
                    node = parse_qs(url.query).get("node", [""])[0]
                    body = json.dumps(list(server.log_ranks(node))).encode()
                    self._send(200, "application/json", body)
                else:
                    self._send(404, "text/plain", b"not found: try / or /metrics\n")
            except (ValueError, KeyError) as e:
                self._send(400, "text/plain", f"bad request: {e}\n".encode())
            except Exception:  # a page must never take the master down
                logger.exception("web: %s failed", url.path)
                self._send(500, "text/plain", b"internal error (see the master's log)\n")

    return Handler
