"""The master of a `--engine ray` job as a Ray actor that Ray restarts: `JobMasterActor`.

`dlrover submit --engine ray` (dlrover/cli/ray_master.py) creates one detached, named actor,
``<job>-master``, from this class and waits for the job's outcome; the actor serves the job
(`serve_job`: the master, the Ray engine, the node controller) on a fixed port with its state
in a store outside the actor's memory. When the actor's process dies (SIGKILL, OOM), Ray starts
it again with the same arguments: the new master resumes the job from the state (round, KV,
shards, commits, slot attempts), the Ray engine adopts the node actors, which are detached and
named by node id and kept running meanwhile, and the agents reconnect to the same address.
Workers do not restart.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from dlrover.jobspec import JobSpec
from dlrover.log import setup_logging
from dlrover.master.job import JobMaster
from dlrover.runner.serve import serve_job

__all__ = ["JobMasterActor", "master_actor_name"]


def master_actor_name(job_name: str) -> str:
    """The Ray actor name of a job's master (in the job's Ray namespace)."""
    return f"{job_name}-master"


class JobMasterActor:
    """Body of the master actor: serves the job from a thread (the actor's methods stay free to
    answer), and reports its outcome. Each incarnation Ray starts runs ``__init__`` again with
    the same arguments, which is how a restarted master resumes the job."""

    def __init__(
        self,
        spec: JobSpec,
        port: int,
        token: str,
        state: str,
        advertise: str,
        relaunch_delay_s: float,
    ) -> None:
        import ray

        setup_logging("dlrover")
        self._pid = os.getpid()
        self._job: JobMaster | None = None
        self._serving = threading.Event()
        self._code: int | None = None
        self._done = threading.Event()
        self._stop_reason = ""
        address = advertise or f"{ray.util.get_node_ip_address()}:{port}"
        self._address = address if ":" in address else f"{address}:{port}"

        def serve() -> None:
            try:
                self._code = serve_job(
                    spec,
                    port=port,
                    advertise=self._address,
                    token=token,
                    relaunch_delay_s=relaunch_delay_s,
                    state=state,
                    on_serving=self._on_serving,
                )
            except BaseException as error:  # the driver must hear of it, not wait forever
                print(
                    f"dlrover: error: the master of job {spec.name} failed: {error!r}",
                    file=sys.stderr,
                    flush=True,
                )
                self._code = 1
            finally:
                self._done.set()

        threading.Thread(target=serve, name="dlrover-master-job", daemon=True).start()

    def _on_serving(self, job: JobMaster) -> None:
        self._job = job
        self._serving.set()
        if self._stop_reason:
            job.lifecycle.stop(self._stop_reason)  # asked to stop before the master served

    def outcome(self, wait_s: float) -> dict[str, Any]:
        """After at most ``wait_s`` seconds: this incarnation's pid and address, whether it serves,
        and the job's exit code once the job ended (``code``: None while it runs)."""
        self._done.wait(wait_s)
        return {
            "pid": self._pid,
            "address": self._address,
            "serving": self._serving.is_set(),
            "code": self._code if self._done.is_set() else None,
        }

    def stop(self, reason: str) -> None:
        """End the job: its nodes are stopped and the job fails with ``reason`` (kept until
        the master serves, if it does not yet)."""
        self._stop_reason = reason
        if self._job is not None:
            self._job.lifecycle.stop(reason)
