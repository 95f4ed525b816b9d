"""Kubernetes engine: one pod per node through the official client, a watch turned into events."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from typing import Any

from dlrover.backoff import Backoff
from dlrover.engines.base import (
    Capacity,
    Engine,
    EngineError,
    EventQueue,
    FailureReason,
    LaunchError,
    Node,
    NodeEvent,
    NodeNotFoundError,
    NodeSpec,
    NodeState,
    RateLimitedError,
    ResizeUnsupportedError,
    Resources,
)
from dlrover.engines.kube_capacity import free_capacity
from dlrover.engines.kube_logs import KubeNodeLogs
from dlrover.engines.kube_manifests import (
    DEFAULT_MASTER_PORT,
    PodSettings,
    container_resources,
    job_selector,
    master_service_manifest,
    pod_manifest,
)
from dlrover.engines.kube_pod_state import PodOutcome, pod_outcome

log = logging.getLogger(__name__)

DEFAULT_WATCH_TIMEOUT_S = 60
"""Server-side length of one watch request; the engine re-watches from the last version."""
DEFAULT_RECONNECT_DELAY_S = 0.5
"""Pause before re-watching after a dropped stream or an API error (doubles up to 10 s)."""


class KubernetesEngine(Engine):
    """Nodes are pods named by node id in `settings.namespace`, labelled with job, role, rank and
    relaunch count, owned by `settings.owner`. One watch over the job's label selector reports
    every pod change; a dropped stream resumes from the last resourceVersion, and 410 Gone (our
    version was compacted away) re-lists the pods and diffs them against what we knew.

    409 on create: the pod already exists (a retried launch): it is adopted, not recreated.
    404 on delete: it is already gone; the node ends as DELETED. A pod deleted by anyone else
    ends its node as FAILED/NODE_LOST, so the policy relaunches it.
    """

    def __init__(
        self,
        api_client: Any,
        job_name: str,
        settings: PodSettings,
        watch_timeout_s: int = DEFAULT_WATCH_TIMEOUT_S,
        reconnect_delay_s: float = DEFAULT_RECONNECT_DELAY_S,
    ) -> None:
        try:
            from kubernetes import client
        except ImportError as error:
            raise EngineError(
                "the kubernetes engine needs the kubernetes client: pip install 'dlrover[k8s]'"
            ) from error
        self._core = client.CoreV1Api(api_client)
        self._job_name = job_name
        self._settings = settings
        self._watch_timeout_s = watch_timeout_s
        self._reconnect_delay_s = reconnect_delay_s
        self._nodes: dict[str, Node] = {}
        self._deleting: set[str] = set()
        self._created: set[str] = set()
        self._queue = EventQueue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._response: Any = None
        self._version: str | None = None
        """resourceVersion to resume the watch from; None: re-list first."""
        self._capacity_warned = False
        self.relists = 0
        """How many times the pod list was read (start + each 410); for tests and metrics."""
        self._watcher = threading.Thread(
            target=self._watch_loop, daemon=True, name=f"kube-watch-{job_name}"
        )
        self._watcher.start()

    @classmethod
    def from_environment(cls, job_name: str, settings: PodSettings) -> KubernetesEngine:
        """In a pod: the service account; elsewhere: the user's kubeconfig."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.ApiClient(), job_name, settings)

    # --- Engine -----------------------------------------------------------------------------
    def launch(self, spec: NodeSpec) -> Node:
        """Create the node's pod (one that already exists, 409, is adopted); returns the node,
        PENDING until the watch sees it run. Raises LaunchError for another job's spec or a pod the
        API refuses."""
        from kubernetes.client.rest import ApiException

        if spec.job_name != self._job_name:
            raise LaunchError(
                f"{spec.node_id}: this engine runs job {self._job_name!r}, not {spec.job_name!r}"
            )
        namespace = self._settings.namespace
        with self._lock:
            existing = self._nodes.get(spec.node_id)
            if existing is not None:
                return dataclasses.replace(existing)
            # Registered before the create so watch events racing the reply are not dropped.
            node = self._nodes[spec.node_id] = Node(spec=spec)
        try:
            reply = self._core.create_namespaced_pod(
                namespace, pod_manifest(spec, self._settings), _preload_content=False
            )
            pod = json.loads(reply.data)
        except ApiException as error:
            if error.status != 409:
                with self._lock:
                    del self._nodes[spec.node_id]
            if error.status == 429:  # throttled (API priority and fairness): later, not never
                raise RateLimitedError(
                    f"{spec.node_id}: the API throttled the pod's creation (429)",
                    retry_after_s=_retry_after_s(error),
                ) from error
            if error.status != 409:
                raise LaunchError(
                    f"{spec.node_id}: the API refused the pod "
                    f"({error.status} {error.reason}): {_message(error)}"
                ) from error
            # A retried launch (our earlier reply was lost): adopt the pod that exists.
            log.info("node %s: pod exists already (409); adopting it", spec.node_id)
            try:
                pod = json.loads(
                    self._core.read_namespaced_pod(
                        spec.node_id, namespace, _preload_content=False
                    ).data
                )
            except ApiException as read_error:
                with self._lock:
                    del self._nodes[spec.node_id]
                raise LaunchError(
                    f"{spec.node_id}: pod exists but cannot be read ({read_error.status})"
                ) from read_error
        with self._lock:
            self._created.add(spec.node_id)
        self._queue.put(NodeEvent(spec.node_id, spec, NodeState.PENDING))
        self._apply(spec.node_id, "ADDED", pod)
        with self._lock:
            return dataclasses.replace(node)

    def delete(self, node_id: str) -> None:
        """Ask the API to delete the pod and return; the DELETED event comes from the watch (or at
        once if the pod is already gone). Nothing for a node that already ended. Raises
        NodeNotFoundError, or EngineError if the API refuses."""
        from kubernetes.client.rest import ApiException

        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                raise NodeNotFoundError(node_id)
            if node.state.is_final:
                return
            self._deleting.add(node_id)
        try:
            self._core.delete_namespaced_pod(
                node_id, self._settings.namespace, _preload_content=False
            )
        except ApiException as error:
            if error.status != 404:
                with self._lock:
                    self._deleting.discard(node_id)
                raise EngineError(
                    f"{node_id}: cannot delete pod ({error.status} "
                    f"{error.reason}): {_message(error)}"
                ) from error
            # Already gone: end it here; the watch's DELETED, if any, finds it final.
            self._end(node_id, PodOutcome(NodeState.DELETED, message="pod was already gone"))

    def resize(self, node_id: str, resources: Resources) -> Node:
        """Give the pod's container ``resources`` in place through the pod ``resize``
        subresource (Kubernetes 1.33+: the kubelet applies it without restarting the
        container); returns the node with its new spec once the API accepted it. Raises
        NodeNotFoundError, or ResizeUnsupportedError where it cannot be done in place: a node
        that ended, other GPUs or /dev/shm (not resizable), or the API's refusal (404: a server
        without the subresource; 403: grant ``patch`` on ``pods/resize``; 422: e.g. a pod
        without resources, whose QoS class may not change)."""
        from kubernetes.client.rest import ApiException

        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                raise NodeNotFoundError(node_id)
            if node.state.is_final:
                raise ResizeUnsupportedError(f"node {node_id} ended ({node.state.value})")
            old = node.spec
        if (resources.gpu, resources.shm_mib) != (old.resources.gpu, old.resources.shm_mib):
            raise ResizeUnsupportedError(
                f"{node_id}: GPUs and /dev/shm cannot change in place, only CPU and memory"
            )
        body = {
            "spec": {
                "containers": [{"name": old.role, "resources": container_resources(resources)}]
            }
        }
        try:
            self._core.patch_namespaced_pod_resize(
                node_id, self._settings.namespace, body, _preload_content=False
            )
        except ApiException as error:
            raise ResizeUnsupportedError(
                f"{node_id}: the API refused the pod resize ({error.status} {error.reason}): "
                f"{_message(error)}"
            ) from error
        with self._lock:
            node.spec = dataclasses.replace(node.spec, resources=resources)
            log.info("node %s: pod resized in place: %s", node_id, container_resources(resources))
            return dataclasses.replace(node)

    def capacity(self) -> Capacity:
        """What one more node may still get: the ready machine with the most free memory (its
        allocatable less its running pods' requests). Unknown when the service account may not
        list nodes and pods cluster-wide (see deploy/kubernetes/rbac.yaml), said once."""
        from kubernetes.client.rest import ApiException

        try:
            machines = self._core.list_node(_preload_content=False, _request_timeout=10)
            pods = self._core.list_pod_for_all_namespaces(
                field_selector="status.phase!=Succeeded,status.phase!=Failed",
                _preload_content=False,
                _request_timeout=10,
            )
            return free_capacity(
                json.loads(machines.data).get("items", []), json.loads(pods.data).get("items", [])
            )
        except (ApiException, OSError, ValueError) as e:
            if not self._capacity_warned:
                self._capacity_warned = True
                log.warning(
                    "cannot read the cluster's free resources (%s); capacity unknown: grant "
                    "list on nodes and pods cluster-wide to the master's service account",
                    _message(e) if isinstance(e, ApiException) else e,
                )
            return Capacity()

    def logs(self) -> KubeNodeLogs:
        """The pods' logs through the API, split by the agents' rank tags."""

        def live() -> tuple[str, ...]:
            return tuple(sorted(n.node_id for n in self.list_nodes() if not n.state.is_final))

        return KubeNodeLogs(self._core, self._settings.namespace, live)

    def list_nodes(self) -> list[Node]:
        """Copies of every node this engine knows, with their last watched states."""
        with self._lock:
            return [dataclasses.replace(node) for node in self._nodes.values()]

    def events(self, timeout: float) -> list[NodeEvent]:
        """Queued node events (from launches and the pod watch), waiting up to ``timeout`` seconds
        for the first."""
        return self._queue.drain(timeout)

    def close(self, delete_nodes: bool = True) -> None:
        """With ``delete_nodes``, delete every live pod; then stop the watch, waiting at most the
        watch timeout + 5 s for it."""
        if delete_nodes:
            self.delete_many([n.node_id for n in self.list_nodes() if not n.state.is_final])
        self._stop.set()
        response = self._response
        if response is not None:
            # Unblock the watcher's read instead of waiting out the server-side timeout.
            try:
                response.shutdown()
            except Exception as error:
                log.debug("closing the watch stream: %s", error)
        self._watcher.join(timeout=self._watch_timeout_s + 5)

    def create_master_service(self, port: int = DEFAULT_MASTER_PORT) -> dict[str, Any]:
        """Create `<job>-master` (idempotent: an existing Service is kept and returned)."""
        from kubernetes.client.rest import ApiException

        namespace = self._settings.namespace
        manifest = master_service_manifest(self._job_name, namespace, port, self._settings.owner)
        try:
            reply = self._core.create_namespaced_service(
                namespace, manifest, _preload_content=False
            )
        except ApiException as error:
            if error.status != 409:
                raise EngineError(
                    f"cannot create the master Service ({error.status}): {_message(error)}"
                ) from error
            reply = self._core.read_namespaced_service(
                manifest["metadata"]["name"], namespace, _preload_content=False
            )
        return dict(json.loads(reply.data))

    # --- watching ---------------------------------------------------------------------------
    def _relist(self) -> str:
        """Read every pod of the job; end nodes whose pod vanished. Returns the list version."""
        # Only pods created before the list was asked for can be missing from it; a launch
        # racing this re-list must not be mistaken for a deleted pod.
        with self._lock:
            created_before = set(self._created)
        reply = self._core.list_namespaced_pod(
            self._settings.namespace,
            label_selector=job_selector(self._job_name),
            _preload_content=False,
        )
        listing = json.loads(reply.data)
        self.relists += 1
        present = set()
        for pod in listing.get("items", []):
            name = pod["metadata"]["name"]
            present.add(name)
            self._apply(name, "MODIFIED", pod)
        with self._lock:
            vanished = [
                n
                for n, node in self._nodes.items()
                if n in created_before and n not in present and not node.state.is_final
            ]
        for name in vanished:
            self._apply(name, "DELETED", None)
        return str(listing["metadata"]["resourceVersion"])

    def _watch_loop(self) -> None:
        from kubernetes.client.rest import ApiException

        backoff = Backoff(self._reconnect_delay_s, 10.0)
        while not self._stop.is_set():
            version = self._version
            try:
                if version is None:
                    self._version = version = self._relist()
                self._watch_once(version)
                backoff.reset()
            except _Expired as expired:
                log.info(
                    "watch version %s expired (410 Gone: %s); re-listing pods", version, expired
                )
                self._version = None
            except ApiException as error:
                if error.status == 410:
                    self._version = None
                    continue
                pause = backoff.next()
                log.warning(
                    "pod watch failed (%s %s); retrying in %.1fs", error.status, error.reason, pause
                )
                self._stop.wait(pause)
            except Exception as error:  # dropped connection, protocol error, DNS...
                if self._stop.is_set():
                    break
                log.info(
                    "pod watch stream dropped (%s: %s); resuming from version %s",
                    type(error).__name__,
                    error,
                    self._version,
                )
                self._stop.wait(backoff.next())

    def _watch_once(self, version: str) -> None:
        """One watch request from `version`; `self._version` follows every event, so a stream
        that drops mid-way resumes exactly after the last event applied.

        Reads the raw newline-delimited JSON events (no model deserialisation: the engine works
        on plain dicts, and a field the client's models do not know can never break the watch).
        """
        from kubernetes.watch.watch import iter_resp_lines

        response = self._core.list_namespaced_pod(
            self._settings.namespace,
            label_selector=job_selector(self._job_name),
            resource_version=version,
            timeout_seconds=self._watch_timeout_s,
            watch=True,
            _preload_content=False,
        )
        self._response = response
        try:
            if self._stop.is_set():
                return  # close() ran before this stream existed; it could not shut it
            for line in iter_resp_lines(response):
                if not line:
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    if obj.get("code") == 410:
                        raise _Expired(str(obj.get("message", "")))
                    raise EngineError(f"watch error {obj.get('code')}: {obj.get('message')}")
                if event.get("type") != "BOOKMARK":
                    self._apply(obj["metadata"]["name"], str(event["type"]), obj)
                self._version = str(obj["metadata"]["resourceVersion"])
                if self._stop.is_set():
                    break
        finally:
            self._response = None
            response.close()
            response.release_conn()

    def _apply(self, name: str, change: str, pod: dict[str, Any] | None) -> None:
        with self._lock:
            node = self._nodes.get(name)
            deleting = name in self._deleting
        if node is None or node.state.is_final:
            return  # not ours (another attempt's pod) or already ended
        outcome: PodOutcome | None
        if change == "DELETED" or pod is None:
            outcome = (
                PodOutcome(NodeState.DELETED, message="deleted on request")
                if deleting
                else PodOutcome(
                    NodeState.FAILED,
                    FailureReason.NODE_LOST,
                    message="pod was deleted by someone else",
                )
            )
        else:
            outcome = pod_outcome(pod)
            if outcome is None:
                return
        self._end(name, outcome) if outcome.state.is_final else self._move(name, outcome)

    def _move(self, name: str, outcome: PodOutcome) -> None:
        with self._lock:
            node = self._nodes[name]
            if node.state is outcome.state and node.host == outcome.host:
                return
            if node.state is NodeState.RUNNING and outcome.state is NodeState.PENDING:
                return  # a replayed older event; states only move forward
            old, node.state, node.host = node.state, outcome.state, outcome.host
        log.info("node %s: %s -> %s", name, old.value, outcome.state.value)
        self._queue.put(NodeEvent(name, node.spec, outcome.state, host=outcome.host))

    def _end(self, name: str, outcome: PodOutcome) -> None:
        with self._lock:
            node = self._nodes[name]
            if node.state.is_final:
                return
            if name in self._deleting and outcome.state is not NodeState.DELETED:
                outcome = dataclasses.replace(outcome, state=NodeState.DELETED, reason=None)
            old, node.state = node.state, outcome.state
            node.host = outcome.host or node.host
        event = NodeEvent(
            name,
            node.spec,
            outcome.state,
            outcome.reason,
            outcome.exit_code,
            outcome.signal,
            outcome.message,
            host=node.host,
        )
        log.info("node %s: %s -> %s", name, old.value, event.outcome())
        self._queue.put(event)


class _Expired(Exception):
    """The watch's resourceVersion is older than the API server keeps (410 Gone)."""


def _message(error: Any) -> str:
    try:
        return str(json.loads(error.body).get("message", error.body))
    except (TypeError, ValueError, AttributeError):
        return str(getattr(error, "body", "") or error)


def _retry_after_s(error: Any) -> float:
    """The wait a 429 asks for (its Retry-After header, in seconds), 1 s when it names none."""
    try:
        return max(0.1, float((error.headers or {}).get("Retry-After", 1.0)))
    except (TypeError, ValueError):
        return 1.0
