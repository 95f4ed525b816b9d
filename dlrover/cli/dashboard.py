"""`dlrover dashboard` and `dlrover top`: every job of ``$DLROVER_HOME`` in one place, in a
browser or live in a terminal.

`dlrover dashboard` serves, on one port:

- ``/``: the jobs, running and ended (``jobs.html``, polling ``/api/jobs`` every 2 s);
- ``/jobs/NAME/``: the job's own dashboard page (the one its master serves), whose JSON comes
  from the job's master while it runs (proxied to its web port) and from what it left in its
  directory once it ended (``final.json``, ``history.json``).

`dlrover top NAME` prints the same job's live table, refreshed in place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import quote, unquote, urlparse

from dlrover.cli.job_records import NoSuchJobError, pid_alive, read_record
from dlrover.master.web import STATIC, HttpService, PageHandler, static_file
from dlrover.runner.records import (
    JobRecord,
    dlrover_home,
    job_dir,
    job_names,
    read_final,
    read_history,
)

logger = logging.getLogger("dlrover.dashboard")

DEFAULT_PORT = 9265
"""`dlrover dashboard`'s port unless ``--port`` says otherwise (Ray's dashboard has 8265)."""
FETCH_TIMEOUT_S = 5.0
"""How long a running job's master may take to answer one page's JSON."""


class JobUnavailable(Exception):
    """The job's master does not answer (or serves no dashboard)."""


@dataclasses.dataclass(frozen=True)
class JobView:
    """One job of ``$DLROVER_HOME``: its live pages while its master serves them, else what it
    left when it ended."""

    record: JobRecord

    @classmethod
    def of(cls, name: str) -> JobView:
        """The job named ``name`` (NoSuchJobError if it has no record)."""
        return cls(read_record(name))

    @property
    def name(self) -> str:
        """The job's name."""
        return self.record.name

    @property
    def live(self) -> bool:
        """Whether its master should answer: recorded as running, by a process still alive."""
        return self.record.reachable and pid_alive(self.record.pid)

    def _web(self) -> str:
        if not self.record.web_port:
            raise JobUnavailable(
                f"job {self.name}'s master serves no dashboard (--metrics-port -1)"
            )
        host = self.record.master_addr.rsplit(":", 1)[0] or "127.0.0.1"
        return f"http://{host}:{self.record.web_port}"

    def fetch(self, path: str) -> tuple[int, str, bytes]:
        """A running job's page ``path`` from its master: (code, content type, body)."""
        try:
            with urllib.request.urlopen(self._web() + path, timeout=FETCH_TIMEOUT_S) as r:
                return r.status, r.headers.get("Content-Type", "application/json"), r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Content-Type", "text/plain"), e.read()
        except (OSError, ValueError) as e:
            raise JobUnavailable(f"job {self.name}'s master does not answer: {e}") from None

    def _live(self, path: str) -> dict[str, Any] | None:
        """A running job's JSON page ``path`` (None: not running, or not answering)."""
        if not self.live:
            return None
        try:
            code, _, body = self.fetch(path)
        except JobUnavailable:
            return None
        doc: dict[str, Any] | None = json.loads(body) if code == 200 else None
        return doc

    def status(self) -> dict[str, Any]:
        """The /api/status document: live, or the ended job's final one (also while a job
        that is ending no longer serves and has not yet recorded its end)."""
        return self._live("/api/status") or self.final_status()

    def history(self) -> dict[str, Any] | None:
        """The /api/history document: live, or the ended job's (None: none kept)."""
        return self._live("/api/history") or read_history(self.name)

    def final_status(self) -> dict[str, Any]:
        """An ended (or unreachable) job's status, in the shape of /api/status, from its records."""
        record = self.record
        final = read_final(self.name)
        history = read_history(self.name) or {}
        state = record.state if record.ended else f"{record.state} (its master does not answer)"
        doc: dict[str, Any] = {"job_name": self.name, "state": state, "round": 0, "nodes": []}
        if final is not None:
            doc.update(dataclasses.asdict(final.status))
        doc["state"], doc["reason"] = (record.state, record.reason) if record.ended else (state, "")
        steps = max((n["step"] for n in doc["nodes"]), default=0)
        totals = history.get("totals") or {}
        doc["goodput"] = {
            "ratio": float(totals.get("ratio", doc.get("goodput", 0.0))),
            "elapsed_s": float(totals.get("elapsed_s", 0.0)),
            "productive_s": float(totals.get("productive_s", 0.0)),
            "badput_s": dict(totals.get("badput_s", {})),
            "steps": int(totals.get("steps", max(0, steps))),
            "step_s": float(totals.get("step_s", 0.0)),
            "recoveries_s": [],
            "history": [],
        }
        doc["events"] = history.get("markers", [])
        doc["has_logs"] = False
        return doc

    def summary(self) -> dict[str, Any]:
        """The jobs page's row: state, nodes, steps, goodput, started and ended."""
        record = self.record
        row: dict[str, Any] = {
            "name": self.name,
            "state": record.state,
            "engine": record.engine,
            "reason": record.reason,
            "started_at": record.started_at or _mtime(self.name),
            "ended_at": record.ended_at,
        }
        try:
            status = self.status()
        except JobUnavailable as e:
            row.update(nodes=0, steps=0, goodput=None, reason=str(e))
            return row
        if self.live:
            row["state"] = status.get("state", record.state)
        nodes = status.get("nodes", [])
        row["nodes"] = sum(1 for n in nodes if n.get("state") not in ("lost", "deleted"))
        row["steps"] = max((int(n.get("step", 0)) for n in nodes), default=0)
        goodput = status.get("goodput")
        row["goodput"] = goodput.get("ratio") if isinstance(goodput, dict) else goodput
        return row


def _mtime(name: str) -> float:
    try:
        return (job_dir(name) / "job.json").stat().st_mtime
    except OSError:
        return 0.0


def jobs_summary() -> list[dict[str, Any]]:
    """Every job of ``$DLROVER_HOME``, newest first."""
    rows = []
    for name in job_names():
        try:
            rows.append(JobView.of(name).summary())
        except (NoSuchJobError, ValueError, TypeError) as e:  # a record being rewritten
            rows.append({"name": name, "state": "unknown", "reason": str(e), "started_at": 0.0})
    return sorted(rows, key=lambda r: -float(r.get("started_at") or 0.0))


# --- the dashboard server -----------------------------------------------------------------------
class DashboardError(Exception):
    """The dashboard's port cannot be bound."""


class DashboardServer(HttpService):
    """Serves the jobs page and each job's page (see the module)."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
        super().__init__(
            host,
            port,
            _handler(),
            "dlrover-dashboard",
            lambda why: DashboardError(
                f"cannot serve the dashboard on {host}:{port}: {why}; pick another --port "
                "(0: a free one)"
            ),
        )


def _handler() -> type[BaseHTTPRequestHandler]:
    class Handler(PageHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            try:
                self._route(url.path, url.query)
            except NoSuchJobError as e:
                self._send(404, "text/plain", f"{e}\n".encode())
            except JobUnavailable as e:
                self._send(502, "text/plain", f"{e}\n".encode())
            except Exception:  # a page must never take the server down
                logger.exception("dashboard: %s failed", url.path)
                self._send(500, "text/plain", b"internal error (see the dashboard's log)\n")

        def _route(self, path: str, query: str) -> None:
            if path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", static_file("jobs.html"))
                return
            if path == "/api/jobs":
                self._json(jobs_summary())
                return
            if path in ("/uplot.js", "/uplot.css"):
                name, content_type = STATIC[path]
                self._send(200, content_type, static_file(name))
                return
            parts = path.split("/", 3)  # "", "jobs", NAME, rest
            if len(parts) < 3 or parts[1] != "jobs" or not parts[2]:
                self._send(404, "text/plain", b"not found: try /\n")
                return
            view = JobView.of(unquote(parts[2]))
            if len(parts) == 3:  # relative URLs of the page need the trailing slash
                self.send_response(301)
                self.send_header("Location", f"/jobs/{quote(view.name)}/")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            rest = "/" + parts[3]
            if rest in STATIC:
                name, content_type = STATIC[rest]
                self._send(200, content_type, static_file(name))
            elif rest == "/api/status":
                self._json(view.status())
            elif view.live and rest.startswith("/api/") and rest != "/api/history":
                code, content_type, body = view.fetch(rest + (f"?{query}" if query else ""))
                self._send(code, content_type, body)
            elif rest == "/api/history":
                history = view.history()
                if history is None:
                    self._send(404, "text/plain", b"this job left no history\n")
                else:
                    self._json(history)
            else:
                self._send(404, "text/plain", b"not kept for an ended job\n")

        def _json(self, doc: object) -> None:
            self._send(200, "application/json", json.dumps(doc).encode())

    return Handler


def cmd_dashboard(host: str, port: int) -> int:
    """``dlrover dashboard``: serve until Ctrl-C."""
    try:
        server = DashboardServer(host, port).start()
    except DashboardError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 1
    shown = "127.0.0.1" if host in ("", "0.0.0.0") else host
    print(
        f"dlrover dashboard: the jobs of {dlrover_home()} on http://{shown}:{server.port}/ "
        "(Ctrl-C to stop)",
        flush=True,
    )
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


# --- dlrover top --------------------------------------------------------------------------------
def _cell(value: float | None, digits: int) -> str:
    return "-" if not value else f"{value:.{digits}f}"


def top_text(view: JobView) -> str:
    """The live table: the job's line, then per node its state, step, s/step, samples/s, memory,
    restarts and the last event that names it; the job's latest events below (a node's failure
    on a peer's error, collateral, only in its node's row)."""
    s = view.status()
    history = view.history() or {}
    events = s.get("events") or history.get("markers") or []
    g = s.get("goodput") if isinstance(s.get("goodput"), dict) else {}
    assert isinstance(g, dict)
    head = (
        f"job {s.get('job_name', view.name)}: {s.get('state', '?')}, round {s.get('round', 0)}, "
        f"step {g.get('steps', 0)}, goodput {float(g.get('ratio', 0.0)):.1%}"
        + (f" - {s['reason']}" if s.get("reason") else "")
    )
    lines = [
        head,
        f"{'node':<24} {'state':<10} {'step':>7} {'s/step':>7} {'samples/s':>9} "
        f"{'mem MiB':>8} {'restarts':>8}  last event",
    ]
    for n in s.get("nodes", []):
        node = str(n.get("node_id", ""))
        last = next((e for e in reversed(events) if node and node in e.get("text", "")), None)
        said = (
            f"{time.strftime('%H:%M:%S', time.localtime(last['at']))} {last['text']}"
            if last is not None
            else ""
        )
        lines.append(
            f"{node:<24} {n.get('state', ''):<10} {n.get('step', -1):>7} "
            f"{_cell(n.get('step_wall_s'), 3):>7} {_cell(n.get('samples_per_s'), 0):>9} "
            f"{n.get('memory_bytes', 0) / 2**20:>8.0f} {n.get('restart_count', 0):>8}  " + said[:60]
        )
    # A peer's failure seen by another node (collateral) would push the failure itself out of
    # these three lines; its node's row names it.
    events = [e for e in events if e.get("kind") != "collateral"]
    if events:
        lines.append("latest events:")
        for e in events[-3:]:
            stamp = time.strftime("%H:%M:%S", time.localtime(e["at"]))
            lines.append(f"  {stamp} {e['kind']:<7} {e['text'][:100]}")
    return "\n".join(lines)


def cmd_top(name: str, every_s: float, count: int = 0) -> int:
    """``dlrover top NAME``: the table every ``every_s`` seconds, in place on a terminal, until
    the job ends (then its final table) or ``count`` tables were shown; Ctrl-C stops."""
    if every_s <= 0:
        print("dlrover: error: --every needs a positive number of seconds", file=sys.stderr)
        return 2
    clear = "\033[H\033[2J" if sys.stdout.isatty() else ""
    shown = 0
    try:
        while True:
            view = JobView.of(name)  # again each time: the record says when the job ended
            try:
                text = top_text(view)
            except JobUnavailable as e:
                text = f"job {name}: {e}; trying again"
            if not view.live:
                print(text, flush=True)
                return 0
            print(f"{clear}{time.strftime('%H:%M:%S')}  {text}", flush=True)
            shown += 1
            if count and shown >= count:
                return 0
            time.sleep(every_s)
    except KeyboardInterrupt:
        return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``dashboard`` and ``top`` subcommands of ``dlrover``."""
    d = sub.add_parser(
        "dashboard", help="Serve a page listing every job of $DLROVER_HOME, and each job's page."
    )
    d.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1).")
    d.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"Port to serve on (default {DEFAULT_PORT}; 0: a free one, printed).",
    )
    t = sub.add_parser("top", help="A job's live table in the terminal, refreshed in place.")
    t.add_argument("name", help="The job's name.")
    t.add_argument(
        "--every", type=float, default=2.0, help="Seconds between refreshes (default 2)."
    )
    t.add_argument(
        "--count", type=int, default=0, help="Stop after this many tables (default 0: until "
        "the job ends or Ctrl-C).",
    )  # fmt: skip


def run_command(args: argparse.Namespace) -> int | None:
    """Run ``dashboard`` or ``top`` (None: another command)."""
    if args.command == "dashboard":
        return cmd_dashboard(args.host, args.port)
    if args.command == "top":
        return cmd_top(args.name, args.every, args.count)
    return None
