"""A plain TensorFlow parameter-server program, as TensorFlow's own tutorial writes one: the
cluster from TF_CONFIG, a ParameterServerStrategy and a ClusterCoordinator that schedules steps
on the workers; nothing of DLRover's (no PsTrainer, so no progress reports). It trains an
embedding table for ``--seconds`` and writes ``OUT/done.json``."""

from __future__ import annotations

import argparse
import json
import os
import time

import tensorflow as tf


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        table = tf.Variable(tf.random.stateless_normal([50_000, 16], seed=[1, 2]))
        weights = tf.Variable(tf.zeros([16, 1]))

    @tf.function
    def step() -> tf.Tensor:
        ids = tf.random.uniform([512], maxval=50_000, dtype=tf.int64)
        with tf.GradientTape() as tape:
            rows = tf.gather(table, ids)
            loss = tf.reduce_mean(tf.square(tf.matmul(rows, weights) - 1.0))
        grad_table, grad_weights = tape.gradient(loss, [table, weights])
        table.scatter_sub(tf.IndexedSlices(0.1 * grad_table.values, grad_table.indices))
        weights.assign_sub(0.1 * grad_weights)
        return loss

    started, steps = time.monotonic(), 0
    while time.monotonic() - started < args.seconds:
        for _ in range(20):
            coordinator.schedule(step)
        coordinator.join()
        steps += 20
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "done.json"), "w") as f:
        json.dump({"steps": steps}, f)


if __name__ == "__main__":
    main()
