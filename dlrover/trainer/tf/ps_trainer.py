"""The chief's training loop of a TensorFlow parameter-server job: a ParameterServerStrategy and
ClusterCoordinator from the cluster spec the master published, batches of sample ids leased
from the master's dynamic sharding and scheduled as closures, checkpoints that hold the shard
position, and recovery from a lost ps without a job restart.

What fails and what happens:
- a worker dies: the coordinator re-runs its closures on the other workers (TensorFlow's own
  retry) and uses the relaunched worker, which the master starts on the same address, when it
  is back. Nothing here notices.
- a ps dies: its variables are gone and the coordinator raises UnavailableError. The trainer
  waits for the master's word that every ps serves again (the next ps generation), builds a
  new strategy and coordinator, has the model built again (``build``), restores the latest
  checkpoint and puts the master's shard queue back to the position saved with it, so the
  samples trained since are trained again, once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dlrover import constants as c
from dlrover.api.errors import MasterClientError, MasterUnreachableError
from dlrover.api.retry import while_unreachable
from dlrover.client.master_client import MasterClient
from dlrover.client.sharding import GrpcShardingTransport
from dlrover.client.sharding_client import ShardingClient
from dlrover.constants import ENV_TF_PS_SCALED as ENV_PS_SCALED
from dlrover.constants import ENV_TF_RESCALE as ENV_RESCALE
from dlrover.coordination import TF_CLUSTER, TF_PROGRESS, TF_PS_GENERATION, PsGeneration, TfProgress
from dlrover.sharding.types import DatasetSpec, Position, Shard
from dlrover.trainer.tf.grow import grow_workers, workers_added

logger = logging.getLogger(__name__)

DEFAULT_PS_WAIT_S = 300.0
"""How long the chief waits for the master to report a lost ps serving again."""
LATEST = "latest.json"
"""The checkpoint directory's marker: the newest complete checkpoint and its shard position,
written last and atomically (temp + rename)."""
KEEP_CHECKPOINTS = 2
SHARDS_PER_PS_AFTER_SCALING = 4
"""A table is split into this many shards per ps once the ps were scaled (by default: one per
ps before). The strategy places a variable's shards on the ps in turn, so a hot range of rows
(the part that made a ps hot, wherever it lies) ends up spread over every ps, not on the ps
that holds its position."""
MAX_FAILURES_WITHOUT_PROGRESS = 5
"""Rebuilds after a lost ps that may fail in a row before the chief gives up."""


class PsTrainingError(Exception):
    """The training cannot go on (no ps came back in time, a checkpoint cannot be read)."""


@dataclasses.dataclass
class TrainState:
    """What ``build(strategy)`` returns: everything that lives on the ps, made again after a ps
    is lost.

    ``train_batch`` is a tf.function taking one int64 vector of sample ids; it runs a step on a
    worker (``strategy.run`` inside) and returns a value the chief may fetch (the loss).
    ``checkpoint`` tracks every variable whose value must survive a lost ps."""

    train_batch: Callable[..., Any]
    checkpoint: Any
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Whatever else the script wants back (the model's variables, for its own use)."""


@dataclasses.dataclass
class Recovery:
    """One recovery from a lost ps, or one re-partition over a new number of ps, as measured by
    the chief."""

    error: str
    """What happened (the error's first line, or ``ps N -> M``)."""
    waited_s: float
    """From the error to the master's word that every ps serves again (rescale: writing the
    checkpoint on the ps before)."""
    rebuilt_s: float
    """Building the strategy, the model and restoring the checkpoint."""
    restored_sequence: int
    """The checkpoint restored (its sequence number; -1: none, trained from the start)."""
    kind: str = "ps_lost"
    """``ps_lost``; ``rescale``: the cluster changed (more ps, fewer workers, a node relaunched
    at another address) and the chief started again on it; or ``grow``: workers were added to
    the running strategy (no checkpoint, no restart)."""

    @property
    def pause_s(self) -> float:
        """From the error to training again."""
        return self.waited_s + self.rebuilt_s


def follow_checkpoints(
    checkpoint_dir: str | os.PathLike[str],
    done: Callable[[], bool],
    poll_s: float = 0.5,
) -> Iterator[dict[str, Any]]:
    """Each new complete checkpoint of ``checkpoint_dir`` as it appears (its `latest.json`
    marker: ``path``, ``sequence``, ``batches``), until ``done()`` is true once no newer one is
    there: what an evaluator reads."""
    marker = Path(checkpoint_dir) / LATEST
    seen = -1
    while True:
        finished = done()  # read before the marker: a last checkpoint before it is not missed
        try:
            latest = dict(json.loads(marker.read_text()))
        except (FileNotFoundError, ValueError):
            latest = {}
        if latest and int(latest["sequence"]) != seen:
            seen = int(latest["sequence"])
            yield latest
            continue
        if finished:
            return
        time.sleep(poll_s)  # the chief writes the marker; a file offers nothing to wait on


def cluster_from_env(env: dict[str, str] | None = None) -> tuple[dict[str, list[str]], str, int]:
    """(cluster, task type, task index) from TF_CONFIG."""
    env = dict(os.environ) if env is None else env
    try:
        config = json.loads(env["TF_CONFIG"])
        return (
            {k: list(v) for k, v in config["cluster"].items()},
            str(config["task"]["type"]),
            int(config["task"]["index"]),
        )
    except (KeyError, ValueError, TypeError) as e:
        raise PsTrainingError(
            f"TF_CONFIG is missing or names no cluster and task ({e!r}); run the script with "
            "dlrover submit (a job with distribution_strategy: ParameterServerStrategy)"
        ) from None


class PsTrainer:
    """Trains ``build``'s model over the samples of ``dataset`` in batches of ``batch_size``
    ids, one closure per batch. Call `fit`; then `state` is the final model.

    Invariant: a checkpoint is written only when every scheduled closure has finished and every
    shard they came from is reported done, so its shard position says exactly which samples
    the variables in it have seen.

    ``variable_partitioner(shards)`` makes the strategy's partitioner from the number of shards
    to split a table into: the ps count at first, SHARDS_PER_PS_AFTER_SCALING times it once the
    ps were scaled (the shards go to the ps in turn, so a hot range spreads over all of them);
    default ``FixedShardsPartitioner(shards)``."""

    def __init__(
        self,
        build: Callable[[Any], TrainState],
        dataset: DatasetSpec,
        batch_size: int,
        checkpoint_dir: str | os.PathLike[str],
        checkpoint_every_shards: int = 4,
        variable_partitioner: Callable[[Any], Any] | None = None,
        ps_wait_s: float = DEFAULT_PS_WAIT_S,
        client: MasterClient | None = None,
        on_shard: Callable[[PsTrainer, int], None] | None = None,
    ) -> None:
        self._build_fn = build
        self.dataset = dataset
        self.batch_size = batch_size
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoint_every_shards = checkpoint_every_shards
        self._partitioner = variable_partitioner
        self.ps_wait_s = ps_wait_s
        self._client = client or MasterClient.from_env()
        self._on_shard = on_shard
        self.cluster, self.task_type, self.task_index = cluster_from_env()
        self.cluster_version = int(os.environ.get(c.ENV_TF_CLUSTER_VERSION, "0") or 0)
        self.generation = 0
        """The ps generation the current strategy was built against."""
        self.strategy: Any = None
        self.coordinator: Any = None
        self.state: TrainState | None = None
        self.sequence = -1
        self.shards = 0
        """Shards per partitioned variable of the current strategy (see ``_shards``)."""
        """The latest checkpoint's sequence number (-1: none yet)."""
        self.recoveries: list[Recovery] = []
        self.batches = 0
        """Closures that finished (re-runs after a ps recovery count again)."""
        self.samples = 0
        """Samples of the closures that finished."""
        self.shards_done = 0
        self._sharding = ShardingClient(
            GrpcShardingTransport(self._client), dataset, worker_id=f"{self.task_type}-0"
        )
        self._restores = 0
        self._progress_since_build = False
        self._joined: dict[str, list[str]] = {}
        """The cluster this process joined (TensorFlow allows one per process)."""

    # --- building -----------------------------------------------------------------------------
    def _wait_generation(self, after: int) -> int:
        """The master's ps generation once it is above ``after`` (every ps serves)."""
        current = self._current_generation()
        if current > after:
            return current
        logger.info("waiting for every ps to serve (ps generation %d)", after + 1)
        next_one = TF_PS_GENERATION.get(self._client, version=after + 1, wait_s=self.ps_wait_s)
        if next_one is None:
            raise PsTrainingError(
                f"the master did not report every ps serving within {self.ps_wait_s:.0f}s "
                f"(ps generation {after + 1}); see `dlrover diagnose`"
            )
        return next_one.generation

    def _read_cluster(self) -> None:
        published = TF_CLUSTER.get(self._client)
        if published is not None:
            self.cluster = {k: list(v) for k, v in published.cluster.items()}
            self.cluster_version = published.version

    def _build(self, generation: int, started: float = 0.0, saved_s: float = 0.0) -> None:
        """A strategy, coordinator and model over the master's current cluster; when it is not
        the cluster this process joined, the script starts again (`_start_again`), ``started``
        (wall time; default now) and ``saved_s`` saying since when training stopped."""
        import tensorflow as tf

        self._read_cluster()
        if self._joined and self.cluster != self._joined:
            self._start_again(self.cluster, started or time.time(), saved_s)
        self._joined = self.cluster
        started = time.monotonic()
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.cluster),
            task_type=self.task_type,
            task_id=self.task_index,
            rpc_layer="grpc",
        )
        num_ps = len(self.cluster.get("ps", []))
        self.shards = self._shards(num_ps)
        partitioner = (
            self._partitioner(self.shards)
            if self._partitioner is not None
            else tf.distribute.experimental.partitioners.FixedShardsPartitioner(self.shards)
        )
        self.strategy = tf.distribute.experimental.ParameterServerStrategy(
            resolver, variable_partitioner=partitioner
        )
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        self.state = self._build_fn(self.strategy)
        self.generation = generation
        logger.info(
            "strategy over %d ps and %d workers built in %.2fs (cluster version %d, ps "
            "generation %d)",
            num_ps,
            len(self.cluster.get("worker", [])),
            time.monotonic() - started,
            self.cluster_version,
            generation,
        )

    def _shards(self, num_ps: int) -> int:
        """Shards per table: one per ps, until the ps were scaled (this run's cluster changed
        its ps count, or the checkpoint it resumes was written after that): then
        SHARDS_PER_PS_AFTER_SCALING per ps."""
        latest = self._latest() or {}
        scaled = bool(os.environ.get(ENV_PS_SCALED)) or bool(latest.get("ps_scaled"))
        return num_ps * SHARDS_PER_PS_AFTER_SCALING if scaled else num_ps

    # --- checkpoints --------------------------------------------------------------------------
    def _latest(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads((self.checkpoint_dir / LATEST).read_text()))
        except FileNotFoundError:
            return None

    def save(self) -> int:
        """Write a checkpoint of the variables and the shard position (every closure must have
        finished: `fit` calls it after a join). Returns its sequence number."""
        assert self.state is not None
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        sequence = self.sequence + 1
        started = time.monotonic()
        path = self.state.checkpoint.write(str(self.checkpoint_dir / f"ckpt-{sequence}"))
        position = while_unreachable(
            self._sharding.get_position, time.monotonic() + self.ps_wait_s, "reading the position"
        )
        marker = {
            "sequence": sequence,
            "path": path,
            "position": position.to_dict(),
            "batches": self.batches,
            "samples": self.samples,
            "shards_done": self.shards_done,
            "ps_scaled": bool(os.environ.get(ENV_PS_SCALED)),
        }
        tmp = self.checkpoint_dir / f"{LATEST}.tmp"
        tmp.write_text(json.dumps(marker))
        os.replace(tmp, self.checkpoint_dir / LATEST)  # the commit: written last, atomically
        self.sequence = sequence
        for old in self.checkpoint_dir.glob("ckpt-*"):
            number = old.name.split("-", 1)[1].split(".", 1)[0]
            if number.isdigit() and int(number) <= sequence - KEEP_CHECKPOINTS:
                old.unlink(missing_ok=True)
        logger.info(
            "checkpoint %d written in %.2fs (%d batches)",
            sequence,
            time.monotonic() - started,
            self.batches,
        )
        return sequence

    def restore(self) -> int:
        """Load the latest checkpoint into the current variables and put the master's shard
        queue back to its position; returns its sequence (-1: none, the position goes back to
        the start)."""
        assert self.state is not None
        latest = self._latest()
        self._restores += 1
        # Unique per restore: a chief started again by exec has the same pid and count.
        token = f"{self.task_type}-restore-{self._restores}-{uuid.uuid4().hex}"
        if latest is None:
            position = Position(self.dataset.name, 0, 0)
            self._sharding.restore_position(position, token)
            self.batches = self.samples = self.shards_done = 0
            return -1
        self.state.checkpoint.read(latest["path"]).assert_consumed()
        self._sharding.restore_position(Position.from_dict(latest["position"]), token)
        self.sequence = int(latest["sequence"])
        self.batches = int(latest["batches"])
        self.samples = int(latest.get("samples", self.batches * self.batch_size))
        self.shards_done = int(latest["shards_done"])
        logger.info("restored checkpoint %d (%d batches)", self.sequence, self.batches)
        return self.sequence

    # --- training -----------------------------------------------------------------------------
    def fit(self) -> None:
        """Train over every shard the master hands out, surviving lost workers and ps."""
        import tensorflow as tf

        ps_errors = (tf.errors.UnavailableError, tf.errors.AbortedError)
        self._sharding.start()
        generation = self._wait_generation(0)
        lost: tuple[str, float, float] | None = None
        """(error, when, waited) of the ps failure being recovered from."""
        failures = 0
        while True:
            try:
                if lost is not None or self.state is None:
                    self._build(generation)
                    restored = self.restore()  # a relaunched chief resumes where the job was
                    self._rescaled(restored)
                    if lost is not None:
                        self._recovered(lost, restored)
                        lost = None
                self._progress_since_build = False
                done = self._train_until_end()
                break
            except ps_errors as error:
                failures = 0 if self._progress_since_build else failures + 1
                if failures > MAX_FAILURES_WITHOUT_PROGRESS:
                    raise PsTrainingError(
                        f"{failures} ps failures in a row without a finished batch: {error}"
                    ) from error
                first_line = str(error).splitlines()[0][:200] if str(error) else repr(error)
                logger.warning("lost a ps: %s", first_line)
                when = time.monotonic() if lost is None else lost[1]
                if self._progress_since_build or failures == 0:
                    generation = self._wait_generation(self.generation)
                else:
                    # The ps serves (its generation came) but a channel of the strategy before
                    # did not know yet: build again shortly, without another generation.
                    time.sleep(1.0)
                    generation = max(generation, self._current_generation())
                lost = (first_line, when, time.monotonic() - when)
        self._sharding.close()
        logger.info("training done: %d batches, %d shards", self.batches, done)

    def _current_generation(self) -> int:
        current = TF_PS_GENERATION.get(self._client)
        return current.generation if current is not None else 0

    def _recovered(self, lost: tuple[str, float, float], restored: int) -> None:
        error, when, waited = lost
        recovery = Recovery(error, waited, time.monotonic() - when - waited, restored)
        self.recoveries.append(recovery)
        logger.info(
            "recovered from a lost ps in %.2fs (waited %.2fs for it, rebuilt and restored "
            "checkpoint %d in %.2fs)",
            recovery.pause_s,
            recovery.waited_s,
            restored,
            recovery.rebuilt_s,
        )

    def _batches(self, shard: Shard) -> Sequence[list[int]]:
        ids = list(shard.indices())
        return [ids[i : i + self.batch_size] for i in range(0, len(ids), self.batch_size)]

    def _train_until_end(self) -> int:
        import tensorflow as tf

        assert self.state is not None and self.coordinator is not None
        open_shards: list[Shard] = []
        since_checkpoint = 0
        while True:
            # With shards of ours open, stop waiting once the master has nothing to hand out:
            # the dataset cannot finish before we report them.
            shard = self._sharding.next_shard(until_drained=bool(open_shards))
            if shard is None:
                if open_shards:
                    self._finish(open_shards)
                    open_shards = []
                    since_checkpoint = 0
                    continue
                break
            for ids in self._batches(shard):
                self.coordinator.schedule(
                    self.state.train_batch, args=(tf.constant(ids, dtype=tf.int64),)
                )
            open_shards.append(shard)
            since_checkpoint += 1
            rescale = self._rescale_due()
            if rescale is not None:
                self._finish(open_shards)
                open_shards = []
                since_checkpoint = 0
                self._rescale(rescale)
                continue
            if since_checkpoint >= self.checkpoint_every_shards:
                self._finish(open_shards)
                open_shards = []
                since_checkpoint = 0
                self.save()
            if self._on_shard is not None:
                self._on_shard(self, self.shards_done + len(open_shards))
        self.save()
        return self.shards_done

    def _rescale_due(self) -> PsGeneration | None:
        """The ps generation of a newer cluster whose ps all serve (the master scaled them), or
        None. While the master is unreachable (it is being restarted) none is due: the check
        runs again after the next shard, and training goes on meanwhile."""
        try:
            published = TF_PS_GENERATION.get(self._client)
        except MasterUnreachableError as exc:
            logger.debug("no rescale check while the master does not answer: %s", exc)
            return None
        if published is None:
            return None
        if published.cluster_version > self.cluster_version:
            return published
        return None

    def _rescale(self, published: PsGeneration) -> None:
        """Train on the master's new cluster. Workers added (nothing else changed) join this
        process's strategy in place (`grow_workers`); any other change checkpoints on the
        current ps, then builds over the new cluster, which starts this script again
        (`_build`): the new process restores the checkpoint, which re-partitions the variables
        over the new number of ps."""
        started = time.time()
        if self._grow(published):
            return
        self.save()
        self._build(published.generation, started=started, saved_s=time.time() - started)

    def _grow(self, published: PsGeneration) -> bool:
        """Add the workers of ``published``'s cluster to the running strategy, when adding
        workers is all that changed and TensorFlow lets it; every scheduled closure is done."""
        version = published.cluster_version
        spec = TF_CLUSTER.get(self._client, version=version)
        if spec is None:
            return False
        cluster = {k: list(v) for k, v in spec.cluster.items()}
        added = workers_added(self._joined, cluster)
        if not added:
            return False
        started = time.monotonic()
        if not grow_workers(self.strategy, self.coordinator, cluster):
            return False
        before = len(self._joined.get("worker", []))
        self.cluster = self._joined = cluster
        self.cluster_version = version
        self.generation = published.generation
        recovery = Recovery(
            f"worker {before} -> {len(cluster['worker'])}",
            0.0,
            time.monotonic() - started,
            self.sequence,
            kind="grow",
        )
        self.recoveries.append(recovery)
        logger.info(
            "workers %d -> %d joined the running strategy in %.2fs (cluster version %d): %s",
            before,
            len(cluster["worker"]),
            recovery.rebuilt_s,
            version,
            ", ".join(added),
        )
        self._report_progress()  # the master learns that the chief trains on the new cluster
        return True

    def _start_again(self, cluster: dict[str, list[str]], started: float, saved_s: float) -> None:
        """Start this script again in this process (exec, same pid): TensorFlow cannot change
        the cluster of a process that joined one ("Could not start gRPC server"). The new process
        builds over ``cluster`` and restores the latest checkpoint."""
        changes = [
            f"{role} {len(self._joined.get(role, []))} -> {len(cluster.get(role, []))}"
            for role in ("ps", "worker")
            if len(self._joined.get(role, [])) != len(cluster.get(role, []))
        ]
        what = ", ".join(changes) or "ps addresses changed"
        note = {"started": started, "saved_s": saved_s, "what": what}
        logger.info("the cluster changed (%s): starting again on it", what)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        env = {**os.environ, ENV_RESCALE: json.dumps(note)}
        if len(self._joined.get("ps", [])) != len(cluster.get("ps", [])):
            env[ENV_PS_SCALED] = "1"  # re-partitioned finer from now on (see _shards)
        self._sharding.close()
        os.execve(sys.executable, list(sys.orig_argv), env)

    def _rescaled(self, restored: int) -> None:
        """Record the re-partition this process was started for (ENV_RESCALE), if it was."""
        raw = os.environ.pop(ENV_RESCALE, "")
        if not raw:
            return
        note = json.loads(raw)
        pause = time.time() - float(note["started"])
        saved = float(note["saved_s"])
        recovery = Recovery(str(note["what"]), saved, pause - saved, restored, kind="rescale")
        self.recoveries.append(recovery)
        logger.info(
            "re-partitioned over %s: training paused %.2fs (checkpoint %.2fs, a new process, "
            "build and restore %.2fs)",
            recovery.error,
            pause,
            saved,
            recovery.rebuilt_s,
        )

    def _finish(self, shards: list[Shard]) -> None:
        """Wait for every scheduled closure, then report their shards done."""
        assert self.coordinator is not None
        self.coordinator.join()
        self._progress_since_build = True
        for shard in shards:
            batches = self._batches(shard)
            self.batches += len(batches)
            self.samples += sum(len(ids) for ids in batches)
            # A master being restarted answers again within seconds: ride it out (a shard
            # reported twice is ignored the second time).
            while_unreachable(
                lambda: self._sharding.report_done(shard),  # noqa: B023 (called at once)
                time.monotonic() + self.ps_wait_s,
                f"reporting shard {shard.id} done",
            )
            self.shards_done += 1
        self._report_progress()

    def _report_progress(self) -> None:
        """Tell the master the batches and samples finished (its job throughput, from which
        it sizes the workers). Training never waits on it: a master that does not answer (it is
        being restarted) misses one report."""
        progress = TfProgress(self.batches, self.samples, time.time(), self.cluster_version)
        try:
            TF_PROGRESS.put(self._client, progress)
        except MasterClientError as exc:
            logger.debug("progress report skipped: %s", exc)
