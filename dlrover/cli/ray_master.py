"""`dlrover submit --engine ray`: the job's master runs as a Ray actor that Ray restarts.

The submitting process is a Ray driver that starts one detached, named actor, ``<job>-master``,
from the library's `dlrover.runner.ray_master.JobMasterActor` (which says how a restarted master
resumes the job), and waits for the job's outcome; Ray restarts the actor up to
MAX_MASTER_RESTARTS times.

The actor is placed on the driver's Ray node when it can be (soft affinity), so the port and a
SQLite state in the job's directory stay where they were; `engine_settings.state:
redis://host:port/db` keeps the state where a master on another Ray node finds it too.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from typing import Any

from dlrover import constants as c
from dlrover.cli.serve_job import MAX_MASTER_RESTARTS, free_port
from dlrover.engines.registry import RAY
from dlrover.jobspec import JobSpec
from dlrover.master.server import new_token
from dlrover.runner.ray_master import JobMasterActor, master_actor_name
from dlrover.runner.records import fresh_state

OUTCOME_POLL_S = 10.0
"""How long one `outcome` call waits for the job's end (the driver calls it in a loop)."""
RESTART_DEADLINE_S = 120.0
"""How long the driver waits for a dead master actor to answer again before giving up."""


def submit_to_ray(
    spec: JobSpec, port: int = 0, advertise: str = "", relaunch_delay_s: float = 0.0
) -> int:
    """Start the job's master actor on the Ray cluster of ``engine_settings.address`` (default: a
    running local cluster, else a new one) and wait for the job's end; returns its exit code.
    SIGINT/SIGTERM stop the job. A master actor that dies is restarted by Ray up to
    MAX_MASTER_RESTARTS times; the driver says so and keeps waiting."""
    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    except ImportError:
        print("dlrover: error: engine ray needs ray: pip install 'dlrover[ray]'", file=sys.stderr)
        return 1
    settings = RAY.settings(spec.engine_settings)
    ray.init(address=settings.address, namespace=settings.namespace, log_to_driver=True)
    try:
        return _drive(spec, ray, NodeAffinitySchedulingStrategy, port, advertise, relaunch_delay_s)
    finally:
        ray.shutdown()


def _remove_node_actors(ray: Any, job_name: str) -> list[str]:
    """Kill the job's node actors (``<job>-<role>-<rank>-<attempt>``) and their placement
    groups still on the cluster: left by a master that died for good, or by an earlier
    submission of the same name. Returns their names."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    mine = re.compile(rf"{re.escape(job_name)}-[a-z]+-\d+-\d+")  # exactly this job's nodes
    names = [n for n in ray.util.list_named_actors() if mine.fullmatch(n)]
    for name in names:
        try:
            ray.kill(ray.get_actor(name), no_restart=True)
        except ValueError:
            pass  # gone meanwhile
        try:
            remove_placement_group(get_placement_group(name))
        except ValueError:
            pass
    return names


def _forwarded_env() -> dict[str, str]:
    return {
        k: v
        for k, v in os.environ.items()
        if k.startswith("DLROVER_") or k in ("PATH", "PYTHONPATH")
    }


def _drive(
    spec: JobSpec,
    ray: Any,
    affinity: Any,
    port: int,
    advertise: str,
    relaunch_delay_s: float,
) -> int:
    name = master_actor_name(spec.name)
    try:
        ray.get_actor(name)
    except ValueError:
        pass
    else:
        print(
            f"dlrover: error: job {spec.name!r} already has a master actor {name!r} on this Ray "
            f"cluster; `dlrover stop {spec.name}` first, or give the job another name",
            file=sys.stderr,
        )
        return 1
    orphans = _remove_node_actors(ray, spec.name)
    if orphans:
        print(
            f"dlrover: removed {len(orphans)} node actor(s) left on the cluster by an earlier "
            f"run of job {spec.name}: {', '.join(sorted(orphans))}",
            file=sys.stderr,
        )
    state = RAY.settings(spec.engine_settings).state or str(fresh_state(spec.name))
    token = os.environ.get(c.ENV_JOB_TOKEN, "") or new_token()
    port = port or free_port("0.0.0.0")
    actor = (
        ray.remote(JobMasterActor)
        .options(
            name=name,
            lifetime="detached",
            max_restarts=MAX_MASTER_RESTARTS,
            max_concurrency=8,
            num_cpus=0,
            # The submitter's DLRover settings (DLROVER_HOME, ...) reach the master and, by
            # inheritance, its node actors, whatever environment the Ray nodes started with.
            runtime_env={"env_vars": _forwarded_env()},
            scheduling_strategy=affinity(ray.get_runtime_context().get_node_id(), soft=True),
        )
        .remote(spec, port, token, state, advertise, relaunch_delay_s)
    )
    stopping: list[str] = []

    def forward(signum: int, frame: object) -> None:
        reason = f"dlrover submit received {signal.Signals(signum).name}"
        stopping.append(reason)
        actor.stop.remote(reason)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    pid = 0
    unanswered_since: float | None = None
    try:
        while True:
            try:
                wait_s = OUTCOME_POLL_S if pid else 0.0  # learn the first pid at once
                # (The first answer may wait for Ray to place and start the actor.)
                seen = ray.get(
                    actor.outcome.remote(wait_s),
                    timeout=wait_s + (30 if pid else RESTART_DEADLINE_S),
                )
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
                now = time.monotonic()
                if unanswered_since is None:
                    unanswered_since = now
                    print(
                        f"dlrover: the master of job {spec.name} (pid {pid}) is gone "
                        f"({type(error).__name__}); Ray restarts it on its state",
                        file=sys.stderr,
                        flush=True,
                    )
                elif now - unanswered_since > RESTART_DEADLINE_S:
                    print(
                        f"dlrover: error: the master actor of job {spec.name} has not answered "
                        f"for {RESTART_DEADLINE_S:.0f}s (Ray restarts it at most "
                        f"{MAX_MASTER_RESTARTS} times): {error}",
                        file=sys.stderr,
                    )
                    return 1
                time.sleep(0.5)
                continue
            if seen["pid"] != pid:
                if pid:
                    print(
                        f"dlrover: the master of job {spec.name} runs again (pid {seen['pid']}, "
                        f"{seen['address']})",
                        file=sys.stderr,
                        flush=True,
                    )
                pid = seen["pid"]
            unanswered_since = None
            if seen["code"] is not None:
                return int(seen["code"])
            if stopping:
                actor.stop.remote(stopping[0])  # idempotent; a restarted master may not know it
    finally:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # gone already
            pass
        _remove_node_actors(ray, spec.name)  # after a normal end the master removed them
