"""Kubernetes engine through the official client against a fake API server over real HTTP."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dlrover.engines.base import (
    FailureReason,
    NodeEvent,
    NodeSpec,
    NodeState,
    ResizeUnsupportedError,
    Resources,
)
from dlrover.engines.base import wait_for_event as wait_for
from dlrover.engines.kube_manifests import OwnerReference, PodSettings
from dlrover.engines.kube_pod_state import pod_outcome
from dlrover.master.relaunch_policy import OomPolicy, replacement_spec

pytestmark = [
    pytest.mark.extras,
    pytest.mark.skipif(
        importlib.util.find_spec("kubernetes") is None,
        reason="kubernetes is not installed (pip install 'dlrover[k8s]')",
    ),
]

NS = "train"
OWNER = OwnerReference("dlrover.io/v1alpha1", "ElasticJob", "kjob", "uid-1234")


@pytest.fixture
def api() -> Iterator[Any]:
    from tests.engines.kube_fake_api import FakeKubeApi

    server = FakeKubeApi()
    yield server
    server.close()


@pytest.fixture
def engine(api: Any) -> Iterator[Any]:
    from kubernetes import client

    from dlrover.engines.kubernetes_engine import KubernetesEngine

    config = client.Configuration()
    config.host = api.host
    settings = PodSettings(
        image="dlrover:test", namespace=NS, owner=OWNER, service_account="dlrover-worker"
    )
    kube = KubernetesEngine(
        client.ApiClient(config), "kjob", settings, watch_timeout_s=30, reconnect_delay_s=0.05
    )
    _until(lambda: api.open_watches() == 1, "the engine's first watch")
    yield kube
    kube.close()


def _until(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _spec(rank: int = 0, memory_mib: int = 1024, attempt: int = 0) -> NodeSpec:
    return NodeSpec(
        job_name="kjob",
        rank=rank,
        relaunch_count=attempt,
        command=("dlrover-run", "--nnodes=2:4", "train.py"),
        env={"DLROVER_MASTER_ADDR": "kjob-master.train.svc:50001", "DLROVER_JOB_TOKEN": "tok"},
        resources=Resources(cpu=1.5, memory_mib=memory_mib, gpu=1),
    )


RUNNING = {"phase": "Running"}
OOM = {
    "phase": "Failed",
    "containerStatuses": [
        {
            "name": "worker",
            "image": "dlrover:test",
            "imageID": "sha256:0",
            "ready": False,
            "restartCount": 0,
            "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
        }
    ],
}


def test_pod_spec_content(engine: Any, api: Any) -> None:
    engine.launch(_spec(rank=1))
    pod = api.pod(NS, "kjob-worker-1-0")
    assert pod["metadata"]["labels"] == {
        "app.kubernetes.io/name": "dlrover",
        "dlrover.io/job": "kjob",
        "dlrover.io/role": "worker",
        "dlrover.io/rank": "1",
        "dlrover.io/relaunch-count": "0",
    }
    assert pod["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "dlrover.io/v1alpha1",
            "kind": "ElasticJob",
            "name": "kjob",
            "uid": "uid-1234",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["serviceAccountName"] == "dlrover-worker"
    container = spec["containers"][0]
    assert container["command"] == ["dlrover-run", "--nnodes=2:4", "train.py"]
    assert container["image"] == "dlrover:test"
    assert {e["name"]: e["value"] for e in container["env"]} == {
        "DLROVER_MASTER_ADDR": "kjob-master.train.svc:50001",
        "DLROVER_JOB_TOKEN": "tok",
        # Per-rank logs in the pod, echoed to its log with rank tags (`dlrover logs` reads them).
        "DLROVER_RANK_LOG_DIR": "/tmp/dlrover-ranks",
        "DLROVER_RANK_LOG_ECHO": "1",
    }
    assert container["resources"] == {
        "requests": {"cpu": "1500m", "memory": "1024Mi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "1024Mi", "nvidia.com/gpu": "1"},
    }
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert spec["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "512Mi"}}
    ]


def test_oom_killed_pod_is_relaunched_with_more_memory(engine: Any, api: Any) -> None:
    engine.launch(_spec(memory_mib=1000))
    api.set_pod_status(NS, "kjob-worker-0-0", RUNNING, node_name="k8s-node-a")
    running = wait_for(engine, lambda e: e.state is NodeState.RUNNING, 10)
    assert running.host == "k8s-node-a"
    api.set_pod_status(NS, "kjob-worker-0-0", OOM)
    oom = wait_for(engine, lambda e: e.state.is_final, 10)
    assert (oom.state, oom.reason, oom.exit_code) == (
        NodeState.FAILED,
        FailureReason.OOM_KILLED,
        137,
    )
    replacement = replacement_spec(oom, OomPolicy(factor=1.5, max_memory_mib=1200))
    assert replacement is not None
    engine.launch(replacement)
    pod = api.pod(NS, "kjob-worker-0-1")
    assert pod["spec"]["containers"][0]["resources"]["limits"]["memory"] == "1200Mi"  # capped
    assert pod["metadata"]["labels"]["dlrover.io/relaunch-count"] == "1"


def test_pod_deleted_by_someone_else_is_node_lost_and_relaunched(engine: Any, api: Any) -> None:
    engine.launch(_spec())
    api.remove_pod(NS, "kjob-worker-0-0")
    lost = wait_for(engine, lambda e: e.state.is_final, 10)
    assert (lost.state, lost.reason) == (NodeState.FAILED, FailureReason.NODE_LOST)
    engine.launch(lost.spec.replacement())
    assert [p["metadata"]["name"] for p in api.pods(NS)] == ["kjob-worker-0-1"]


def test_dropped_watch_resumes_from_the_last_version(engine: Any, api: Any) -> None:
    engine.launch(_spec())
    api.set_pod_status(NS, "kjob-worker-0-0", RUNNING)
    wait_for(engine, lambda e: e.state is NodeState.RUNNING, 10)
    version = api.pod(NS, "kjob-worker-0-0")["metadata"]["resourceVersion"]
    assert api.drop_watches() == 1
    # This change happens while no stream is open; the resumed watch must still deliver it.
    api.set_pod_status(NS, "kjob-worker-0-0", {"phase": "Succeeded"})
    done = wait_for(engine, lambda e: e.state.is_final, 10)
    assert done.state is NodeState.SUCCEEDED
    assert engine.relists == 1  # resumed, not re-listed
    assert api.watch_requests[-1]["resourceVersion"] == version, api.watch_requests


def test_expired_version_410_relists_and_diffs(engine: Any, api: Any) -> None:
    engine.launch_many([_spec(rank=0), _spec(rank=1)])
    api.hold_watches.set()  # the stream is slow: these changes are not delivered on it
    api.set_pod_status(NS, "kjob-worker-0-0", {"phase": "Succeeded"})
    api.remove_pod(NS, "kjob-worker-1-0")
    api.compact()
    api.drop_watches()
    api.hold_watches.clear()
    seen: list[NodeEvent] = []
    while len([e for e in seen if e.state.is_final]) < 2:
        wait_for(engine, lambda e: e.state.is_final, 10, seen)
    finals = {e.node_id: e for e in seen if e.state.is_final}
    assert finals["kjob-worker-0-0"].state is NodeState.SUCCEEDED
    assert finals["kjob-worker-1-0"].reason is FailureReason.NODE_LOST
    assert engine.relists == 2


def test_409_on_create_adopts_the_existing_pod(engine: Any, api: Any) -> None:
    from kubernetes import client

    from dlrover.engines.kube_manifests import pod_manifest
    from dlrover.engines.kubernetes_engine import KubernetesEngine

    # A previous master created the pod, then died before recording it.
    config = client.Configuration()
    config.host = api.host
    core = client.CoreV1Api(client.ApiClient(config))
    settings = PodSettings(image="dlrover:test", namespace=NS)
    core.create_namespaced_pod(NS, pod_manifest(_spec(), settings))
    api.set_pod_status(NS, "kjob-worker-0-0", RUNNING)
    node = engine.launch(_spec())
    assert node.state is NodeState.RUNNING
    assert len(api.pods(NS)) == 1
    assert engine.launch(_spec()).node_id == node.node_id  # idempotent, no request either
    assert isinstance(engine, KubernetesEngine)


def test_a_throttled_create_429_is_handed_over_again_at_the_engine_s_rate(
    engine: Any, api: Any
) -> None:
    """A busy API answers 429: that launch is refused for now (RateLimitedError with the wait
    the API asked for), not failed; the master's launch queue hands it over again."""
    from dlrover.engines.base import RateLimitedError
    from dlrover.master.launch_queue import LaunchQueue

    api.throttle_creates = 1
    with pytest.raises(RateLimitedError) as refused:
        engine.launch(_spec())
    assert refused.value.retry_after_s == 1.0
    assert api.pods(NS) == []  # nothing half-made: the same launch goes again
    api.throttle_creates = 2
    queue = LaunchQueue(engine, capacity=4)
    queue.put([_spec(0), _spec(1), _spec(2)])
    deadline = time.monotonic() + 30
    while len(queue):
        assert time.monotonic() < deadline
        queue.pump()
        time.sleep(queue.next_due_s() or 0.0)
    assert sorted(p["metadata"]["name"] for p in api.pods(NS)) == [
        f"kjob-worker-{rank}-0" for rank in range(3)
    ]
    assert queue.stats.refused_for_now == 2 and queue.stats.handed == 3


def test_404_on_delete_of_a_pod_already_gone(engine: Any, api: Any) -> None:
    from dlrover.engines.base import NodeNotFoundError

    engine.launch(_spec())
    api.hold_watches.set()
    api.remove_pod(NS, "kjob-worker-0-0")
    engine.delete("kjob-worker-0-0")  # the API answers 404; not an error
    api.hold_watches.clear()
    seen: list[NodeEvent] = []
    deleted = wait_for(engine, lambda e: e.state.is_final, 10, seen)
    assert deleted.state is NodeState.DELETED
    # The watch stream is ordered: once the engine reports a later change, it has handled the
    # late DELETED of the first pod too, which must not have added a second final event.
    engine.launch(_spec(rank=1))
    api.set_pod_status(NS, "kjob-worker-1-0", RUNNING)
    wait_for(
        engine, lambda e: e.node_id == "kjob-worker-1-0" and e.state is NodeState.RUNNING, 10, seen
    )
    assert [e for e in seen if e.node_id == deleted.node_id and e.state.is_final] == [deleted]
    with pytest.raises(NodeNotFoundError):
        engine.delete("kjob-worker-7-0")


def test_master_service_is_created_once(engine: Any, api: Any) -> None:
    first = engine.create_master_service(port=50001)
    second = engine.create_master_service(port=50001)  # 409 -> the existing one
    assert first["metadata"]["uid"] == second["metadata"]["uid"]
    (service,) = api.services(NS)
    assert service["metadata"]["name"] == "kjob-master"
    assert service["spec"]["selector"]["dlrover.io/role"] == "master"
    assert service["spec"]["ports"] == [{"name": "grpc", "port": 50001, "targetPort": 50001}]


def test_thirty_pods_are_launched_in_parallel(engine: Any, api: Any) -> None:
    started = time.monotonic()
    nodes = engine.launch_many([_spec(rank=r) for r in range(30)])
    elapsed = time.monotonic() - started
    assert len(nodes) == 30 and len(api.pods(NS)) == 30
    assert elapsed < 10


@pytest.mark.parametrize(
    "status, expected",
    [
        (
            {"phase": "Failed", "reason": "Evicted", "message": "low memory"},
            (NodeState.FAILED, FailureReason.PREEMPTED, None, None),
        ),
        (
            {
                "phase": "Failed",
                "containerStatuses": [
                    {"state": {"terminated": {"exitCode": 137, "reason": "Error"}}}
                ],
            },
            (NodeState.FAILED, FailureReason.SIGNAL, 137, 9),
        ),
        (
            {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"exitCode": 2}}}]},
            (NodeState.FAILED, FailureReason.EXIT_CODE, 2, None),
        ),
        (
            {
                "phase": "Pending",
                "containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff"}}}],
            },
            (NodeState.FAILED, FailureReason.LAUNCH_FAILED, None, None),
        ),
        (
            {
                "phase": "Failed",
                "conditions": [
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "reason": "PreemptionByScheduler",
                    }
                ],
            },
            (NodeState.FAILED, FailureReason.PREEMPTED, None, None),
        ),
    ],
)
def test_pod_status_mapping(status: dict[str, Any], expected: tuple[Any, ...]) -> None:
    outcome = pod_outcome({"status": status, "spec": {}})
    assert outcome is not None
    assert (outcome.state, outcome.reason, outcome.exit_code, outcome.signal) == expected
    assert pod_outcome({"status": {"phase": "Unknown"}}) is None


def test_a_master_restarted_on_its_state_adopts_every_pod_of_the_job(api: Any, tmp_path) -> None:
    """The master pod's container dies and the kubelet restarts it on its state volume: the new
    master launches each slot's current attempt again (its saved relaunch count and grown
    memory), which the API answers with 409, so the job keeps exactly the pods it had."""
    from kubernetes import client

    from dlrover.engines.kubernetes_engine import KubernetesEngine
    from dlrover.jobspec import job_spec_from_dict
    from dlrover.master.job import JobMaster, JobMasterConfig
    from dlrover.master.node_controller import NodeController
    from dlrover.master.rendezvous import RendezvousConfig
    from dlrover.master.state_store import SqliteStateStore

    spec = job_spec_from_dict(
        {
            "name": "kjob",
            "entrypoint": "train.py",
            "nodes": 2,
            "resources": {"memory": "1Gi"},
            "max_relaunches": 3,
            "engine": "kubernetes",
            "engine_settings": {"image": "dlrover:test", "namespace": NS},
        }
    )

    def master(db: str) -> tuple[NodeController, Any, SqliteStateStore]:
        config = client.Configuration()
        config.host = api.host
        kube = KubernetesEngine(
            client.ApiClient(config),
            "kjob",
            PodSettings(image="dlrover:test", namespace=NS),
            watch_timeout_s=30,
            reconnect_delay_s=0.05,
        )
        store = SqliteStateStore(db)
        job = JobMaster(JobMasterConfig("kjob", RendezvousConfig(2, 2)), store)
        return NodeController(job, kube, spec, "kjob-master:1", "tok", store=store), kube, store

    db = str(tmp_path / "master.db")
    controller, kube, store = master(db)
    controller.start()
    api.set_pod_status(NS, "kjob-worker-1-0", OOM)
    deadline = time.monotonic() + 10
    while "kjob-worker-1-1" not in {p["metadata"]["name"] for p in api.pods(NS)}:
        assert time.monotonic() < deadline, "the OOM-killed node was not replaced"
        controller.step(0.2)
    grown = api.pod(NS, "kjob-worker-1-1")["spec"]["containers"][0]["resources"]["limits"]
    kube.close(delete_nodes=False)  # SIGKILL of the master: its pods live on
    store.close()
    api.remove_pod(NS, "kjob-worker-1-0")  # the failed pod is cleaned up meanwhile
    before = sorted(p["metadata"]["name"] for p in api.pods(NS))
    assert before == ["kjob-worker-0-0", "kjob-worker-1-1"]

    controller, kube, store = master(db)
    try:
        controller.start()
        assert sorted(p["metadata"]["name"] for p in api.pods(NS)) == before  # nothing new
        pod = api.pod(NS, "kjob-worker-1-1")
        assert pod["spec"]["containers"][0]["resources"]["limits"] == grown
    finally:
        kube.close(delete_nodes=False)
        store.close()


def test_capacity_is_the_roomiest_ready_machine_less_its_pods_requests(
    engine: Any, api: Any
) -> None:
    from dlrover.engines.base import Capacity

    api.add_machine("small", cpu="4", memory="8Gi")
    api.add_machine("big", cpu="3920m", memory="16Gi")
    api.add_machine("cordoned", cpu="64", memory="512Gi", unschedulable=True)
    api.add_machine("broken", cpu="64", memory="512Gi", ready=False)
    engine.launch(_spec(rank=0, memory_mib=4096))  # asks 1.5 CPU, 4096 MiB
    api.set_pod_status(NS, "kjob-worker-0-0", RUNNING, node_name="big")
    assert engine.capacity() == Capacity(2.42, 12288)  # big: 16 Gi - 4 Gi > small's 8 Gi
    api.set_pod_status(NS, "kjob-worker-0-0", {"phase": "Succeeded"})
    assert engine.capacity() == Capacity(3.92, 16384)  # an ended pod holds nothing
    api.forbid_cluster_reads = True  # no ClusterRole for nodes: unknown, not an error
    assert engine.capacity() == Capacity()


def test_a_running_pod_is_resized_in_place_and_what_the_api_refuses_is_said(
    engine: Any, api: Any
) -> None:
    spec = _spec(memory_mib=1024)
    engine.launch(spec)
    api.set_pod_status(NS, spec.node_id, RUNNING)
    wait_for(engine, lambda e: e.state is NodeState.RUNNING, 10)
    grown = Resources(cpu=2.0, memory_mib=1536, gpu=1)
    node = engine.resize(spec.node_id, grown)
    assert node.node_id == spec.node_id and node.spec.resources == grown
    assert ("PATCH", f"/api/v1/namespaces/{NS}/pods/{spec.node_id}/resize") in api.requests
    resources = api.pod(NS, spec.node_id)["spec"]["containers"][0]["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "1536Mi"
    assert resources["requests"]["cpu"] == "2"
    assert [p["metadata"]["name"] for p in api.pods(NS)] == [spec.node_id]  # the same pod
    with pytest.raises(ResizeUnsupportedError, match="GPUs and /dev/shm cannot change in place"):
        engine.resize(spec.node_id, Resources(cpu=2.0, memory_mib=2048, gpu=2))
    # A pod launched without resources is BestEffort: the API keeps its QoS class.
    bare = NodeSpec(job_name="kjob", rank=1, command=("dlrover-run", "train.py"))
    engine.launch(bare)
    with pytest.raises(ResizeUnsupportedError, match="422 .*Pod QoS is immutable"):
        engine.resize(bare.node_id, Resources(memory_mib=512))
    assert api.pod(NS, bare.node_id)["spec"]["containers"][0]["resources"] == {
        "requests": {},
        "limits": {},
    }
    api.resize_subresource = False  # an API server before Kubernetes 1.33
    with pytest.raises(ResizeUnsupportedError, match="refused the pod resize \\(404"):
        engine.resize(spec.node_id, Resources(cpu=2.0, memory_mib=2048, gpu=1))
    assert {n.node_id: n.spec.resources for n in engine.list_nodes()}[spec.node_id] == grown
    assert not [e for e in engine.events(0.2) if e.state.is_final]  # nothing restarted
