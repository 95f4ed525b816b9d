"""A sparse embedding table: id -> row and optimizer state, rows created on first use.

Everything is vectorised over numpy arrays: a lookup or an update of a batch of ids does no
Python loop per id. A new row's values depend only on the table's seed and the id, so the
same id starts equal on whichever server creates it (and equal to a dense table initialised
with ``initial_rows``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dlrover.embedding.buckets import IdArray, bucket_of, mix64

Rows = npt.NDArray[np.float32]


class EmbeddingError(ValueError):
    """A request an embedding table cannot serve: the message says what is wrong."""


@dataclass(frozen=True)
class Optimizer:
    """The sparse optimizer applied where the rows live: ``adagrad`` (the default for
    recommendation models) or ``sgd``."""

    name: str = "adagrad"
    lr: float = 0.01
    initial_accumulator: float = 0.0
    eps: float = 1e-10

    def __post_init__(self) -> None:
        if self.name not in ("adagrad", "sgd") or self.lr <= 0:
            raise EmbeddingError(
                f"optimizer {self.name!r} with lr {self.lr}: use adagrad or sgd with lr > 0"
            )


def initial_rows(ids: IdArray, dim: int, seed: int, scale: float) -> Rows:
    """The first values of the rows of ``ids``: uniform in [-scale, scale), from (seed, id)."""
    ids64 = np.asarray(ids, dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        keys = (
            mix64(ids64 ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF))[:, None]
            + np.arange(dim, dtype=np.uint64)[None, :]
        )
    unit = (mix64(keys) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return ((unit * 2.0 - 1.0) * scale).astype(np.float32)


class EmbeddingTable:
    """Rows of ``dim`` float32 values for any int64 id, with the optimizer's state per row."""

    def __init__(
        self,
        name: str,
        dim: int,
        optimizer: Optimizer | None = None,
        seed: int = 0,
        init_scale: float | None = None,
        capacity: int = 1024,
    ) -> None:
        if dim < 1:
            raise EmbeddingError(f"table {name!r}: dim must be >= 1, got {dim}")
        self.name = name
        self.dim = dim
        self.optimizer = optimizer or Optimizer()
        self.seed = seed
        self.init_scale = init_scale if init_scale is not None else 1.0 / np.sqrt(dim)
        self._ids = np.empty(0, dtype=np.int64)  # sorted
        self._slots = np.empty(0, dtype=np.int64)  # row of each id in _ids
        self._weights = np.empty((capacity, dim), dtype=np.float32)
        self._accum = np.empty((capacity, dim), dtype=np.float32)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        """Memory the rows and their optimizer state take."""
        return int(self._size * self.dim * 4 * 2 + self._ids.nbytes + self._slots.nbytes)

    # --- lookups and updates ------------------------------------------------------------------
    def lookup(self, ids: IdArray) -> Rows:
        """The rows of ``ids`` (any shape of int64 ids; a row per id, in order), creating the
        rows of ids seen for the first time."""
        flat = self._checked(ids)
        slots = self._slots_of(flat, create=True)  # first: it may grow (replace) the arrays
        return self._weights[slots]

    def apply_gradients(self, ids: IdArray, grads: Rows) -> None:
        """Apply the optimizer to the rows of ``ids`` with ``grads`` (one row per id; gradients
        of a repeated id are summed first, as a dense embedding's backward does)."""
        flat = self._checked(ids)
        grads = np.asarray(grads, dtype=np.float32)
        if grads.shape != (flat.size, self.dim):
            raise EmbeddingError(
                f"table {self.name!r}: {flat.size} ids need gradients of shape "
                f"({flat.size}, {self.dim}), got {grads.shape}"
            )
        unique, inverse = np.unique(flat, return_inverse=True)
        summed = np.zeros((unique.size, self.dim), dtype=np.float32)
        np.add.at(summed, inverse, grads)
        slots = self._slots_of(unique, create=True)
        opt = self.optimizer
        if opt.name == "sgd":
            self._weights[slots] -= opt.lr * summed
            return
        accum = self._accum[slots] + summed * summed
        self._accum[slots] = accum
        self._weights[slots] -= opt.lr * summed / (np.sqrt(accum) + opt.eps)

    def _checked(self, ids: IdArray) -> IdArray:
        array = np.asarray(ids)
        if array.dtype != np.int64:
            raise EmbeddingError(
                f"table {self.name!r}: ids must be int64, got {array.dtype} (use "
                f"tensor.long() or np.int64)"
            )
        return array.reshape(-1)

    def _slots_of(self, flat: IdArray, create: bool) -> npt.NDArray[np.int64]:
        pos = np.searchsorted(self._ids, flat)
        found = pos < self._ids.size
        found[found] = self._ids[pos[found]] == flat[found]
        if not found.all():
            if not create:
                missing = np.unique(flat[~found])
                raise EmbeddingError(f"table {self.name!r}: no rows for ids {missing[:5]}...")
            self._insert(np.unique(flat[~found]))
            pos = np.searchsorted(self._ids, flat)
        return self._slots[pos]

    def _insert(
        self, new_ids: IdArray, rows: Rows | None = None, accum: Rows | None = None
    ) -> None:
        count = new_ids.size
        self._reserve(self._size + count)
        slots = np.arange(self._size, self._size + count, dtype=np.int64)
        if rows is None:
            rows = initial_rows(new_ids, self.dim, self.seed, self.init_scale)
        self._weights[slots] = rows
        initial = self.optimizer.initial_accumulator
        self._accum[slots] = initial if accum is None else accum
        self._size += count
        ids = np.concatenate([self._ids, new_ids])
        order = np.argsort(ids, kind="stable")
        self._ids = ids[order]
        self._slots = np.concatenate([self._slots, slots])[order]

    def _reserve(self, size: int) -> None:
        capacity = self._weights.shape[0]
        if size <= capacity:
            return
        grown = max(size, capacity * 2)
        for name in ("_weights", "_accum"):
            old = getattr(self, name)
            new = np.empty((grown, self.dim), dtype=np.float32)
            new[: self._size] = old[: self._size]
            setattr(self, name, new)

    def snapshot(self, ids: IdArray) -> tuple[Rows, Rows]:
        """The rows and optimizer state of ``ids``, which the table must hold."""
        slots = self._slots_of(self._checked(ids), create=False)
        return self._weights[slots], self._accum[slots]

    def export_all(self) -> tuple[IdArray, Rows, Rows]:
        """Every id the table holds, with its row and optimizer state."""
        slots = self._slots
        return self._ids.copy(), self._weights[slots], self._accum[slots]

    # --- buckets: what moves between servers --------------------------------------------------
    def export_buckets(
        self, buckets: npt.NDArray[np.int64], num_buckets: int
    ) -> tuple[IdArray, Rows, Rows]:
        """The ids, rows and optimizer state of every row whose id hashes into ``buckets``."""
        mask = np.isin(bucket_of(self._ids, num_buckets), buckets)
        slots = self._slots[mask]
        return self._ids[mask].copy(), self._weights[slots].copy(), self._accum[slots].copy()

    def import_rows(self, ids: IdArray, rows: Rows, accum: Rows) -> None:
        """Take rows (with their optimizer state) moved from another server; an id this table
        already holds is overwritten."""
        ids = np.asarray(ids, dtype=np.int64)
        present = self._present(ids)
        if present.any():
            slots = self._slots_of(ids[present], create=False)
            self._weights[slots] = rows[present]
            self._accum[slots] = accum[present]
        if (~present).any():
            self._insert(ids[~present], rows[~present], accum[~present])

    def drop_buckets(self, buckets: npt.NDArray[np.int64], num_buckets: int) -> int:
        """Forget every row whose id hashes into ``buckets`` (they moved away); returns how many."""
        mask = np.isin(bucket_of(self._ids, num_buckets), buckets)
        dropped = int(mask.sum())
        if not dropped:
            return 0
        keep_slots = self._slots[~mask]
        keep_ids = self._ids[~mask]
        # Compact the rows so memory follows what the server owns.
        self._weights[: keep_slots.size] = self._weights[keep_slots]
        self._accum[: keep_slots.size] = self._accum[keep_slots]
        self._ids = keep_ids
        self._slots = np.arange(keep_slots.size, dtype=np.int64)
        self._size = keep_slots.size
        return dropped

    def holds(self, ids: IdArray) -> npt.NDArray[np.bool_]:
        """Whether the table has a row for each of ``ids``."""
        return self._present(np.asarray(ids, dtype=np.int64))

    def _present(self, ids: IdArray) -> npt.NDArray[np.bool_]:
        pos = np.searchsorted(self._ids, ids)
        present = pos < self._ids.size
        present[present] = self._ids[pos[present]] == ids[present]
        return present
