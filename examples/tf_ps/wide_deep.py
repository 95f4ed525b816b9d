"""Wide & Deep on synthetic click data with TensorFlow's ParameterServerStrategy, under DLRover.

The chief runs this script (`dlrover submit examples/tf_ps/job.yaml`); the ps and worker nodes
run TF servers that DLRover starts. Each sample is made from its id alone (Criteo-like: 4 dense
features, 8 categorical fields hashed into one 8,000-row vocabulary, a label drawn from a hidden
model), so the chief leases id ranges from the master and the workers generate the batches.
The embedding tables are partitioned over the ps. ``seen`` counts every sample id trained (a
variable on the ps, restored with the model), which is how the tests prove that no sample is
lost or trained twice across failures. At the end the chief writes the model, the counts, an
evaluation loss and the recoveries it went through to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from dlrover.sharding.types import DatasetSpec  # noqa: E402
from dlrover.trainer.tf.ps_trainer import (  # noqa: E402
    PsTrainer,
    TrainState,
    cluster_from_env,
    follow_checkpoints,
)

DENSE = 4
FIELDS = 8
BUCKETS = 1000
"""Rows of each categorical field (--buckets); the vocabulary is FIELDS x BUCKETS rows."""
DIM = 8
HIDDEN = 32
PRIME = 2147483647  # 2^31 - 1: products of two values below it fit in int64


def _hash(x: tf.Tensor, salt: int) -> tf.Tensor:
    """A deterministic int64 in [0, PRIME) from ids (two rounds of a multiplicative hash)."""
    x = (x % PRIME * 48271 + salt * 16807 + 11) % PRIME
    return (x * 69621 + salt + 7) % PRIME


def _uniform(x: tf.Tensor, salt: int) -> tf.Tensor:
    return tf.cast(_hash(x, salt), tf.float32) / PRIME


def features(
    ids: tf.Tensor, buckets: int = BUCKETS, skew: bool = False
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(dense [n, 4], categorical [n, 8] in [0, FIELDS x buckets), label [n]) of sample ids;
    the label does not depend on ``buckets``. ``skew``: every field's rows fall in the first
    half of the vocabulary (fields 4-7 share the rows of 0-3), the part of the table the first
    of two ps holds: a hot ps."""
    dense = tf.stack([_uniform(ids, 100 + k) * 2 - 1 for k in range(DENSE)], axis=1)
    values = [_hash(ids, 200 + f) % (BUCKETS // (1 + f % 4)) for f in range(FIELDS)]
    offsets = tf.constant([f * BUCKETS for f in range(FIELDS)], tf.int64)
    weight = _uniform(tf.stack(values, 1) + offsets, 300) * 2 - 1  # the hidden model
    rows = [(f % (FIELDS // 2) if skew else f) * buckets for f in range(FIELDS)]
    cats = tf.stack(values, axis=1) + tf.constant(rows, tf.int64)
    logit = tf.reduce_sum(weight, axis=1) + tf.reduce_sum(dense * [1.5, -1.0, 0.5, 0.0], axis=1)
    label = tf.cast(_uniform(ids, 400) < tf.sigmoid(2 * logit), tf.float32)
    return dense, cats, label


def worker_time(ids: tf.Tensor, seconds: float) -> tf.Tensor:
    """``ids`` after ``seconds`` on the worker that runs the step: a stand-in for a heavy model's
    compute, which more workers share (the worker scaling tests and benchmark need a step
    whose throughput grows with the workers on a 2-core machine)."""
    # TensorFlow's own sleep op is a tf.data transformation; it runs where the step runs.
    from tensorflow.python.data.experimental.ops.testing import sleep

    one = tf.data.Dataset.from_tensors(ids).apply(sleep(int(seconds * 1e6)))
    return one.get_single_element()


def build(
    strategy: tf.distribute.Strategy,
    size: int,
    lr: float,
    buckets: int = BUCKETS,
    step_time: float = 0.0,
    skew: bool = False,
    dim: int = DIM,
) -> TrainState:
    """The model's variables (on the ps) and its training step (run on a worker)."""
    init = tf.random.stateless_normal
    vocab = FIELDS * buckets
    with strategy.scope():
        deep = tf.Variable(init([vocab, dim], seed=[1, 1], stddev=0.05), name="deep")
        wide = tf.Variable(tf.zeros([vocab, 1]), name="wide")
        w1 = tf.Variable(init([FIELDS * dim + DENSE, HIDDEN], seed=[1, 2], stddev=0.1), name="w1")
        b1 = tf.Variable(tf.zeros([HIDDEN]), name="b1")
        w2 = tf.Variable(init([HIDDEN, 1], seed=[1, 3], stddev=0.1), name="w2")
        b2 = tf.Variable(tf.zeros([1]), name="b2")
        seen = tf.Variable(tf.zeros([size], tf.int32), name="seen")
    params = {"deep": deep, "wide": wide, "w1": w1, "b1": b1, "w2": w2, "b2": b2}

    def logits(dense: tf.Tensor, cats: tf.Tensor) -> tf.Tensor:
        embedded = tf.reshape(tf.nn.embedding_lookup(deep, cats), [-1, FIELDS * dim])
        hidden = tf.nn.relu(tf.matmul(tf.concat([embedded, dense], 1), w1) + b1)
        wide_part = tf.reduce_sum(tf.nn.embedding_lookup(wide, cats), axis=[1, 2])
        return tf.squeeze(tf.matmul(hidden, w2) + b2, 1) + wide_part

    targets = [s for v in params.values() for s in getattr(v, "variables", [v])]

    def step(ids: tf.Tensor) -> tf.Tensor:
        if step_time:
            ids = worker_time(ids, step_time)
        dense, cats, label = features(ids, buckets, skew)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(
                tf.nn.sigmoid_cross_entropy_with_logits(labels=label, logits=logits(dense, cats))
            )
        for variable, grad in zip(targets, tape.gradient(loss, targets), strict=True):
            if isinstance(grad, tf.IndexedSlices):
                variable.scatter_sub(tf.IndexedSlices(lr * 10 * grad.values, grad.indices))
            elif grad is not None:
                variable.assign_sub(lr * grad)
        seen.scatter_add(tf.IndexedSlices(tf.ones_like(ids, tf.int32), ids))
        return loss

    @tf.function(reduce_retracing=True)
    def train_batch(ids: tf.Tensor) -> tf.Tensor:
        return strategy.run(step, args=(ids,))

    @tf.function
    def evaluate(ids: tf.Tensor) -> tf.Tensor:
        dense, cats, label = features(ids, buckets, skew)
        return tf.reduce_mean(
            tf.nn.sigmoid_cross_entropy_with_logits(labels=label, logits=logits(dense, cats))
        )

    checkpoint = tf.train.Checkpoint(seen=seen, **params)
    return TrainState(
        train_batch, checkpoint, extra={"params": params, "seen": seen, "evaluate": evaluate}
    )


def evaluate_while_training(args: argparse.Namespace, out: Path, checkpoint_dir: Path) -> None:
    """The evaluator: the eval loss of each checkpoint the chief writes, on this process's own
    copy of the model (no ps), one JSON line each in OUT/eval.jsonl, until the chief's report."""
    state = build(
        tf.distribute.get_strategy(), args.size, args.lr, args.buckets, 0.0, args.skew, args.dim
    )
    holdout = tf.range(args.size, args.size + 5_000, dtype=tf.int64)
    with open(out / "eval.jsonl", "a") as lines:
        for latest in follow_checkpoints(checkpoint_dir, (out / "report.json").exists):
            state.checkpoint.read(latest["path"]).expect_partial()
            loss = float(state.extra["evaluate"](holdout))
            lines.write(json.dumps({"batches": latest["batches"], "eval_loss": loss}) + "\n")
            lines.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=40_000, help="Samples in the dataset.")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=200)
    p.add_argument("--shard-size", type=int, default=2_000, help="Samples per leased shard.")
    p.add_argument("--checkpoint-every", type=int, default=2, help="Shards between checkpoints.")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--buckets", type=int, default=BUCKETS, help="Embedding rows per field "
                   "(larger: a bigger table on the ps, the same data).")  # fmt: skip
    p.add_argument("--checkpoint-dir", default="", help="Default: OUT/checkpoints.")
    p.add_argument("--shard-delay", type=float, default=0.0, help="Seconds the chief waits per "
                   "shard (tests slow the job down to kill nodes mid-training).")  # fmt: skip
    p.add_argument("--pause-file", default="", help="While this file exists the chief waits "
                   "after each shard (tests hold the job mid-training until they saw a relaunch).")  # fmt: skip
    p.add_argument("--skew", action="store_true", help="Every categorical row in the first half "
                   "of the table: with two ps, the first one serves every lookup and update.")  # fmt: skip
    p.add_argument("--dim", type=int, default=DIM, help="Width of the deep embedding (wider: "
                   "more bytes per lookup on the ps).")  # fmt: skip
    p.add_argument("--grow-mb", type=int, default=0, help="MiB added to the ps per shard, "
                   "outside the model (a table that grows as new ids arrive).")  # fmt: skip
    p.add_argument("--step-time", type=float, default=0.0, help="Seconds each step takes on "
                   "its worker besides its compute (a heavier model: more workers, more "
                   "samples/s).")  # fmt: skip
    p.add_argument("--out", default="wide_deep_out", help="Directory of the results.")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress = open(out / "progress", "a")  # noqa: SIM115 (one line per shard, read by tests)

    grown: dict[str, Any] = {"strategy": None, "blocks": []}
    """--grow-mb: the blocks added to the ps of the current strategy so far."""
    times: dict[str, float] = {"imported_at": time.time()}
    """Wall-clock moments of the chief's run (the benchmark tells where a job's time went)."""

    def on_shard(trainer: PsTrainer, shards: int) -> None:
        times.setdefault("first_shard_at", time.time())
        progress.write(f"{shards} {trainer.batches} {len(trainer.recoveries)}\n")
        progress.flush()
        if args.grow_mb:
            if trainer.strategy is not grown["strategy"]:  # a ps was relaunched: empty ps
                grown.update(strategy=trainer.strategy, blocks=[])
            with trainer.strategy.scope():
                block = tf.Variable(tf.zeros([args.grow_mb << 18]), trainable=False)
            grown["blocks"].append(block)
        if args.shard_delay:
            time.sleep(args.shard_delay)
        deadline = time.monotonic() + 300
        while args.pause_file and os.path.exists(args.pause_file) and time.monotonic() < deadline:
            time.sleep(0.05)

    checkpoint_dir = args.checkpoint_dir or out / "checkpoints"
    if cluster_from_env()[1] == "evaluator":
        evaluate_while_training(args, out, Path(checkpoint_dir))
        return
    trainer = PsTrainer(
        lambda strategy: build(
            strategy, args.size, args.lr, args.buckets, args.step_time, args.skew, args.dim
        ),
        DatasetSpec("wide-deep", args.size, shard_size=args.shard_size, epochs=args.epochs),
        batch_size=args.batch_size,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every_shards=args.checkpoint_every,
        variable_partitioner=lambda num_ps: (
            tf.distribute.experimental.partitioners.MinSizePartitioner(
                min_shard_bytes=32 << 10, max_shards=num_ps
            )
        ),
        on_shard=on_shard,
    )
    started = time.monotonic()
    times["fit_started_at"] = time.time()
    trainer.fit()
    seconds = time.monotonic() - started
    times["fit_ended_at"] = time.time()
    assert trainer.state is not None
    extra = trainer.state.extra
    model = {name: tf.convert_to_tensor(v).numpy() for name, v in extra["params"].items()}
    seen = tf.convert_to_tensor(extra["seen"]).numpy()
    holdout = tf.range(args.size, args.size + 5_000, dtype=tf.int64)
    eval_loss = float(extra["evaluate"](holdout))
    np.savez(out / "model.npz", seen=seen, **model)
    shards = {
        name: len(v.variables) if hasattr(v, "variables") else 1
        for name, v in extra["params"].items()
    }
    report = {
        "eval_loss": eval_loss,
        "batches": trainer.batches,
        "seconds": seconds,
        "ps": len(trainer.cluster.get("ps", [])),
        "workers": len(trainer.cluster.get("worker", [])),
        "shards_per_variable": shards,
        "recoveries": [
            {
                "kind": r.kind,
                "what": r.error,
                "pause_s": r.pause_s,
                "waited_s": r.waited_s,
                "rebuilt_s": r.rebuilt_s,
                "restored": r.restored_sequence,
            }
            for r in trainer.recoveries
        ],
        **times,
        "ended_at": time.time(),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(
        f"trained {trainer.batches} batches in {seconds:.1f}s, eval loss {eval_loss:.4f}, "
        f"{len(trainer.recoveries)} ps recoveries; every sample seen "
        f"{int(seen.min())}..{int(seen.max())} times",
        flush=True,
    )
    os._exit(0)  # the coordinator's threads would wait for workers the job is about to stop


if __name__ == "__main__":
    main()
