"""A small real HTTP server that speaks the Kubernetes core/v1 pod and service API, for tests."""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import re
import socket
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

_PATH = re.compile(
    r"^/api/v1/namespaces/(?P<ns>[^/]+)/(?P<kind>pods|services)(?:/(?P<name>[^/]+))?$"
)
_KINDS = {"pods": "Pod", "services": "Service"}
_LOG_PATH = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)/log$")
_RESIZE_PATH = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)/resize$")


def _qos(pod: dict[str, Any]) -> str:
    """The pod's QoS class as the API computes it (from its containers' requests and limits)."""
    containers = [c.get("resources", {}) for c in pod["spec"]["containers"]]
    if not any(r.get("requests") or r.get("limits") for r in containers):
        return "BestEffort"
    guaranteed = all(
        (r.get("limits") or {}).get(k)
        and (r.get("requests") or {}).get(k, r["limits"][k]) == r["limits"][k]
        for r in containers
        for k in ("cpu", "memory")
    )
    return "Guaranteed" if guaranteed else "Burstable"


@dataclasses.dataclass
class _Change:
    resource_version: int
    kind: str
    namespace: str
    type: str
    obj: dict[str, Any]


def _status(code: int, reason: str, message: str, name: str = "", kind: str = "") -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": {"name": name, "kind": kind},
        "code": code,
    }


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class _QuietServer(ThreadingHTTPServer):
    # The default backlog of 5 resets connections when 30 launches arrive at once on a busy host.
    request_queue_size = 128
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients hanging up mid-request (a closed watch, pool shutdown) are normal here.
        return


class FakeKubeApi:
    """Pods and services in memory behind real HTTP, with the API's semantics the engine relies on:

    - every write bumps a cluster-wide resourceVersion, stored in metadata.resourceVersion;
    - list returns the collection's resourceVersion; `?watch=true&resourceVersion=N` streams every
      change after N as newline-delimited JSON events over a chunked response, then new ones
      until timeoutSeconds; a version older than the retained history gets an ERROR event
      with a 410 Expired Status (as the real API does);
    - create of an existing name -> 409 AlreadyExists; get/delete of a missing one -> 404
      NotFound, both as Status objects;
    - PATCH of a pod's ``resize`` subresource (a strategic merge of its containers' resources,
      Kubernetes 1.33+) changes them in place, 422 where the QoS class would change (as the
      API refuses); ``resize_subresource = False`` answers 404, as an older server.

    Test hooks play the kubelet and the cluster: `set_pod_status`, `remove_pod` (someone else
    deletes), `drop_watches` (cut every open stream mid-flight), `compact` (forget history).
    """

    def __init__(self) -> None:
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._history: list[_Change] = []
        self._oldest_watchable = 0
        self._version = 1
        self._cond = threading.Condition()
        self._watch_sockets: set[socket.socket] = set()
        self.hold_watches = threading.Event()
        """While set, open streams deliver nothing (a slow watch); changes queue up."""
        self.requests: list[tuple[str, str]] = []
        self.machines: list[dict[str, Any]] = []
        """Cluster nodes (``add_machine``), listed at /api/v1/nodes."""
        self.forbid_cluster_reads = False
        """Answer 403 to cluster-wide lists (a service account without the ClusterRole)."""
        self.watch_requests: list[dict[str, str]] = []
        self.pod_logs: dict[tuple[str, str], str] = {}
        self.throttle_creates = 0
        """Answer this many of the next pod creations 429 (Retry-After: 1), as a busy API."""
        self.resize_subresource = True
        """False: an API server before pods/resize (1.33): its PATCH is a 404."""
        """(namespace, pod) -> its container's log, served at .../pods/NAME/log (test-written)."""
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return

            def do_GET(self) -> None:
                api._handle(self, "GET")

            def do_POST(self) -> None:
                api._handle(self, "POST")

            def do_DELETE(self) -> None:
                api._handle(self, "DELETE")

            def do_PATCH(self) -> None:
                api._handle(self, "PATCH")

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, daemon=True, name="fake-kube-api"
        )
        self._thread.start()

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self.drop_watches()
        self._server.shutdown()
        self._server.server_close()

    # --- test hooks -------------------------------------------------------------------------
    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        with self._cond:
            return copy.deepcopy(self._objects[("pods", namespace, name)])

    def pods(self, namespace: str) -> list[dict[str, Any]]:
        with self._cond:
            return [
                copy.deepcopy(o)
                for (k, ns, _), o in self._objects.items()
                if k == "pods" and ns == namespace
            ]

    def services(self, namespace: str) -> list[dict[str, Any]]:
        with self._cond:
            return [
                copy.deepcopy(o)
                for (k, ns, _), o in self._objects.items()
                if k == "services" and ns == namespace
            ]

    def set_pod_status(
        self, namespace: str, name: str, status: dict[str, Any], node_name: str = ""
    ) -> None:
        with self._cond:
            pod = self._objects[("pods", namespace, name)]
            pod["status"] = copy.deepcopy(status)
            if node_name:
                pod["spec"]["nodeName"] = node_name
            self._record("pods", namespace, "MODIFIED", pod)

    def add_machine(
        self, name: str, cpu: str, memory: str, ready: bool = True, unschedulable: bool = False
    ) -> None:
        with self._cond:
            self.machines.append(
                {
                    "metadata": {"name": name},
                    "spec": {"unschedulable": unschedulable},
                    "status": {
                        "allocatable": {"cpu": cpu, "memory": memory},
                        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                    },
                }
            )

    def remove_pod(self, namespace: str, name: str) -> None:
        with self._cond:
            pod = self._objects.pop(("pods", namespace, name))
            self._record("pods", namespace, "DELETED", pod)

    def drop_watches(self) -> int:
        """Cut every open watch stream without the final chunk (a dropped connection)."""
        with self._cond:
            sockets = list(self._watch_sockets)
            self._watch_sockets.clear()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return len(sockets)

    def compact(self) -> None:
        """Forget the change history: a watch from any earlier resourceVersion gets 410."""
        with self._cond:
            self._history.clear()
            self._oldest_watchable = self._version

    def open_watches(self) -> int:
        with self._cond:
            return len(self._watch_sockets)

    # --- the API ----------------------------------------------------------------------------
    def _record(self, kind: str, namespace: str, change: str, obj: dict[str, Any]) -> None:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        self._history.append(_Change(self._version, kind, namespace, change, copy.deepcopy(obj)))
        self._cond.notify_all()

    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(request.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self.requests.append((method, url.path))
        if method == "GET" and url.path in ("/api/v1/nodes", "/api/v1/pods"):
            self._cluster_list(request, url.path)
            return
        log_match = _LOG_PATH.match(url.path)
        if method == "GET" and log_match is not None:
            self._pod_log(request, log_match["ns"], log_match["name"], query)
            return
        if method == "PATCH":
            # Read before any answer: a body left unread would corrupt the kept-alive connection.
            length = int(request.headers.get("Content-Length") or 0)
            patch = json.loads(request.rfile.read(length) or b"{}")
        resize = _RESIZE_PATH.match(url.path) if self.resize_subresource else None
        if method == "PATCH" and resize is not None:
            kind = request.headers.get("Content-Type", "")
            with self._cond:
                code, reply = self._resize(resize["ns"], resize["name"], patch, kind)
            self._reply(request, code, reply)
            return
        match = _PATH.match(url.path)
        if match is None:
            self._reply(request, 404, _status(404, "NotFound", f"no route {url.path}"))
            return
        kind, namespace, name = match["kind"], match["ns"], match["name"]
        length = int(request.headers.get("Content-Length") or 0)
        body = json.loads(request.rfile.read(length)) if length and method != "PATCH" else None
        if method == "GET" and name is None and query.get("watch") in ("true", "1", "True"):
            self._watch(request, kind, namespace, query)
            return
        if method == "POST" and kind == "pods" and self.throttle_creates > 0:
            self.throttle_creates -= 1  # API priority and fairness: too many requests, later
            status = _status(429, "TooManyRequests", "too many requests, please try again later")
            self._reply(request, 429, status, {"Retry-After": "1"})
            return
        with self._cond:
            code, reply = self._apply(method, kind, namespace, name, query, body)
        self._reply(request, code, reply)

    def _cluster_list(self, request: BaseHTTPRequestHandler, path: str) -> None:
        if self.forbid_cluster_reads:
            message = f"cannot list resource at the cluster scope: {path}"
            self._reply(request, 403, _status(403, "Forbidden", message))
            return
        with self._cond:
            if path.endswith("nodes"):
                items = copy.deepcopy(self.machines)
            else:
                items = [copy.deepcopy(o) for (k, _, _), o in self._objects.items() if k == "pods"]
            version = str(self._version)
        kind = "NodeList" if path.endswith("nodes") else "PodList"
        body = {"kind": kind, "apiVersion": "v1", "items": items}
        self._reply(request, 200, {**body, "metadata": {"resourceVersion": version}})

    def _apply(
        self,
        method: str,
        kind: str,
        namespace: str,
        name: str | None,
        query: dict[str, str],
        body: Any,
    ) -> tuple[int, dict[str, Any]]:
        if method == "GET" and name is None:
            selector = query.get("labelSelector", "")
            items = [
                copy.deepcopy(o)
                for (k, ns, _), o in sorted(self._objects.items())
                if k == kind
                and ns == namespace
                and _matches(o["metadata"].get("labels", {}), selector)
            ]
            return 200, {
                "kind": f"{_KINDS[kind]}List",
                "apiVersion": "v1",
                "items": items,
                "metadata": {"resourceVersion": str(self._version)},
            }
        if method == "POST" and name is None:
            obj = copy.deepcopy(body)
            obj_name = obj["metadata"]["name"]
            if (kind, namespace, obj_name) in self._objects:
                return 409, _status(
                    409, "AlreadyExists", f'{kind} "{obj_name}" already exists', obj_name, kind
                )
            now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            obj["metadata"].update(
                namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=now
            )
            if kind == "pods":
                obj.setdefault("status", {"phase": "Pending"})
            self._objects[(kind, namespace, obj_name)] = obj
            self._record(kind, namespace, "ADDED", obj)
            return 201, copy.deepcopy(obj)
        key = (kind, namespace, name or "")
        if key not in self._objects:
            return 404, _status(404, "NotFound", f'{kind} "{name}" not found', name or "", kind)
        if method == "GET":
            return 200, copy.deepcopy(self._objects[key])
        if method == "DELETE":
            obj = self._objects.pop(key)
            self._record(kind, namespace, "DELETED", obj)
            return 200, copy.deepcopy(obj)
        return 405, _status(405, "MethodNotAllowed", f"{method} not supported here")

    def _resize(
        self, namespace: str, name: str, patch: dict[str, Any], content_type: str
    ) -> tuple[int, dict[str, Any]]:
        """A strategic merge of the containers' resources, as the resize subresource takes."""
        if content_type != "application/strategic-merge-patch+json":
            message = f"the fake takes a strategic merge patch, not {content_type}"
            return 415, _status(415, "UnsupportedMediaType", message)
        pod = self._objects.get(("pods", namespace, name))
        if pod is None:
            return 404, _status(404, "NotFound", f'pods "{name}" not found', name, "pods")
        resized = copy.deepcopy(pod)
        containers = {c["name"]: c for c in resized["spec"]["containers"]}
        for change in patch.get("spec", {}).get("containers", []):
            if change["name"] not in containers:
                message = f'pods "{name}" has no container "{change["name"]}"'
                return 422, _status(422, "Invalid", message, name, "pods")
            containers[change["name"]]["resources"] = change["resources"]
        if _qos(resized) != _qos(pod):
            message = f'Pod "{name}" is invalid: spec: Invalid value: "{_qos(resized)}": Pod QoS is immutable'
            return 422, _status(422, "Invalid", message, name, "pods")
        self._objects[("pods", namespace, name)] = resized
        self._record("pods", namespace, "MODIFIED", resized)
        return 200, copy.deepcopy(resized)

    def _pod_log(
        self, request: BaseHTTPRequestHandler, namespace: str, name: str, query: dict[str, str]
    ) -> None:
        """A pod's log as text (``tailLines``: its last lines), or 404 as the API says it."""
        with self._cond:
            text = self.pod_logs.get((namespace, name))
        if text is None:
            message = f'pods "{name}" not found'
            self._reply(request, 404, _status(404, "NotFound", message, name, "pods"))
            return
        if "tailLines" in query:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-int(query["tailLines"]) :])
        data = text.encode()
        request.send_response(200)
        request.send_header("Content-Type", "text/plain")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def _reply(
        self,
        request: BaseHTTPRequestHandler,
        code: int,
        body: dict[str, Any],
        headers: dict[str, str] | None = None,
    ) -> None:
        data = json.dumps(body).encode()
        request.send_response(code)
        for key, value in (headers or {}).items():
            request.send_header(key, value)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def _watch(
        self, request: BaseHTTPRequestHandler, kind: str, namespace: str, query: dict[str, str]
    ) -> None:
        self.watch_requests.append(dict(query))
        selector = query.get("labelSelector", "")
        timeout = float(query.get("timeoutSeconds", "30"))
        since = int(query.get("resourceVersion") or 0)
        request.send_response(200)
        request.send_header("Content-Type", "application/json")
        request.send_header("Transfer-Encoding", "chunked")
        request.end_headers()
        sock = request.connection
        with self._cond:
            self._watch_sockets.add(sock)

        def send(event: dict[str, Any]) -> None:
            line = json.dumps(event).encode() + b"\n"
            request.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            request.wfile.flush()

        deadline = threading.Event()
        timer = threading.Timer(timeout, deadline.set)
        timer.start()
        try:
            with self._cond:
                expired = since < self._oldest_watchable
            if expired:
                send(
                    {
                        "type": "ERROR",
                        "object": _status(
                            410,
                            "Expired",
                            f"too old resource version: {since} ({self._oldest_watchable})",
                        ),
                    }
                )
            cursor = since
            while not expired and not deadline.is_set():
                with self._cond:
                    if sock not in self._watch_sockets:
                        return  # dropped: no terminating chunk
                    pending = [
                        c
                        for c in self._history
                        if c.resource_version > cursor
                        and c.kind == kind
                        and c.namespace == namespace
                    ]
                    if not pending or self.hold_watches.is_set():
                        self._cond.wait(0.05)
                        continue
                for change in pending:
                    cursor = change.resource_version
                    if _matches(change.obj["metadata"].get("labels", {}), selector):
                        send({"type": change.type, "object": change.obj})
            request.wfile.write(b"0\r\n\r\n")
            request.wfile.flush()
        except OSError:
            return
        finally:
            timer.cancel()
            with self._cond:
                self._watch_sockets.discard(sock)
            request.close_connection = True
