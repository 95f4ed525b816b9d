"""Where an embedding server's time goes in one lookup + update: its table's operations alone.

Run: PYTHONPATH=. python benchmarks/embedding_table.py [--batch 8192] [--dim 64] [--rows 400000]
Prints the best of --repeats timings (ms) of each step of ``EmbeddingTable.lookup`` and
``apply_gradients`` on a table already holding --rows rows (random ids of a 1M id space, as
benchmarks/embedding.py uses), next to torch's gather / scatter of the same rows, and the
gradient sum done the old way (``np.add.at``) for comparison. The wire's share (gRPC, copies)
is what benchmarks/embedding.py adds on top; profile a running ``dlrover-ps`` with
``py-spy record -p PID`` for it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from dlrover.embedding.table import EmbeddingTable, Optimizer, _summed_by_slot, initial_rows


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``fn``, in ms (the machine is shared: the minimum is
    the least disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rows", type=int, default=400_000, help="rows the table holds")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    table = EmbeddingTable("items", args.dim, Optimizer("adagrad", 0.01))
    while len(table) < args.rows:
        table.lookup(rng.integers(0, 1_000_000, 65536).astype(np.int64))
    ids = rng.integers(0, 1_000_000, args.batch).astype(np.int64)
    grads = rng.standard_normal((args.batch, args.dim)).astype(np.float32)
    table.lookup(ids)
    slots = table._slots_of(ids, create=False)
    rows = table._weights[slots]

    def add_at() -> None:
        unique, inverse = np.unique(ids, return_inverse=True)
        summed = np.zeros((unique.size, args.dim), dtype=np.float32)
        np.add.at(summed, inverse, grads)

    unique = np.unique(ids)
    grads_u = grads[: unique.size]
    distinct, grads_d = _summed_by_slot(ids, slots, grads)
    sorted_ids = np.sort(table._row_ids[: len(table)])
    weights = torch.from_numpy(table._weights[: len(table)])
    index = torch.from_numpy(slots)
    steps: list[tuple[str, Callable[[], object]]] = [
        ("lookup (rows of existing ids)", lambda: table.lookup(ids)),
        ("apply_gradients (Adagrad)", lambda: table.apply_gradients(ids, grads)),
        ("  the optimizer's step, in cache-sized chunks", lambda: table._step(distinct, grads_d)),
        (
            "apply_gradients, sorted distinct ids (ElasticEmbedding)",
            lambda: table.apply_gradients(unique, grads_u),
        ),
        ("  hash index: find the slots", lambda: table._index.find(ids, table._row_ids)),
        ("  sorted ids + binary search (before)", lambda: np.searchsorted(sorted_ids, ids)),
        ("  gradient sum per row (sort + repeats)", lambda: _summed_by_slot(ids, slots, grads)),
        ("  gradient sum per id, np.add.at (before)", add_at),
        ("  gather the rows (numpy)", lambda: table._weights[slots]),
        ("  scatter the rows (numpy)", lambda: table._weights.__setitem__(slots, rows)),
        ("  gather the rows (torch index_select)", lambda: weights.index_select(0, index)),
        ("new rows' first values (initial_rows)", lambda: initial_rows(ids, args.dim, 0, 0.1)),
    ]
    print(
        f"{args.batch} ids x {args.dim} dims, table of {len(table)} rows, "
        f"torch threads {torch.get_num_threads()}; best of {args.repeats}\n"
    )
    width = max(len(name) for name, _ in steps)
    print(f"| {'step':{width}} | {'ms':>7} |")
    print(f"|{'-' * (width + 2)}|{'-' * 9}|")
    for name, fn in steps:
        print(f"| {name:{width}} | {best_ms(fn, args.repeats):7.3f} |")


if __name__ == "__main__":
    main()
