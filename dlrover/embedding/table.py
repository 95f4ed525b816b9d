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


STEP_CHUNK_BYTES = 128 << 10
"""The optimizer's step goes over the rows in chunks of about this many bytes of each array."""
MAX_DIM = 1 << 16
"""The widest row a table takes (256 KiB of float32): a wider one is a mistake, and its first
1,024 rows alone would take gigabytes."""


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
        if not 1 <= dim <= MAX_DIM:
            raise EmbeddingError(f"table {name!r}: dim must be 1 .. {MAX_DIM}, got {dim}")
        self.name = name
        self.dim = dim
        self.optimizer = optimizer or Optimizer()
        self.seed = seed
        self.init_scale = init_scale if init_scale is not None else 1.0 / np.sqrt(dim)
        self._row_ids = np.empty(capacity, dtype=np.int64)  # the id of each row slot
        self._weights = np.empty((capacity, dim), dtype=np.float32)
        self._accum = np.empty((capacity, dim), dtype=np.float32)
        self._size = 0
        self._index = _HashIndex()

    def __len__(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        """Memory the rows and their optimizer state take."""
        return int(self._size * (self.dim * 4 * 2 + 8) + self._index.nbytes)

    # --- lookups and updates ------------------------------------------------------------------
    def lookup(self, ids: IdArray) -> Rows:
        """The rows of ``ids`` (any shape of int64 ids; a row per id, in order), creating the
        rows of ids seen for the first time."""
        flat = self._checked(ids)
        slots = self._slots_of(flat, create=True)  # first: it may grow (replace) the arrays
        return self._weights[slots]

    def apply_gradients(self, ids: IdArray, grads: Rows) -> IdArray:
        """Apply the optimizer to the rows of ``ids`` with ``grads`` (one row per id; gradients
        of a repeated id are summed first, as a dense embedding's backward does). Returns the
        distinct ids updated (what a replica is sent)."""
        flat = self._checked(ids)
        grads = np.asarray(grads, dtype=np.float32)
        if grads.shape != (flat.size, self.dim):
            raise EmbeddingError(
                f"table {self.name!r}: {flat.size} ids need gradients of shape "
                f"({flat.size}, {self.dim}), got {grads.shape}"
            )
        slots, summed = _summed_by_slot(flat, self._slots_of(flat, create=True), grads)
        self._step(slots, summed)
        return self._row_ids[slots]

    def _step(self, slots: npt.NDArray[np.int64], grads: Rows) -> None:
        """The optimizer's step for the rows at ``slots`` (distinct) with ``grads`` (not
        changed). Chunk by chunk, so each chunk's rows and temporaries stay in the CPU's cache
        across the step's passes (one pass over every gathered row per operation was memory
        bound), in the order torch's Adagrad computes it: sum += g*g; w -= lr*g/(sqrt(sum)+eps)."""
        opt = self.optimizer
        rows = max(1, min(slots.size, STEP_CHUNK_BYTES // (self.dim * 4)))
        step = np.empty((rows, self.dim), dtype=np.float32)
        gathered = np.empty((rows, self.dim), dtype=np.float32)
        for start in range(0, slots.size, rows):
            part = slots[start : start + rows]
            grad = grads[start : start + rows]
            s = step[: part.size]
            if opt.name == "adagrad":
                accum = np.take(self._accum, part, axis=0, out=gathered[: part.size])
                np.multiply(grad, grad, out=s)
                accum += s
                self._accum[part] = accum
                np.sqrt(accum, out=s)
                s += opt.eps
                np.divide(grad, s, out=s)
                s *= opt.lr
            else:
                np.multiply(grad, opt.lr, out=s)
            weights = np.take(self._weights, part, axis=0, out=gathered[: part.size])
            weights -= s
            self._weights[part] = weights

    def _checked(self, ids: IdArray) -> IdArray:
        array = np.asarray(ids)
        if array.dtype != np.int64:
            raise EmbeddingError(
                f"table {self.name!r}: ids must be int64, got {array.dtype} (use "
                f"tensor.long() or np.int64)"
            )
        return array.reshape(-1)

    def _slots_of(self, flat: IdArray, create: bool) -> npt.NDArray[np.int64]:
        slots = self._index.find(flat, self._row_ids)
        missing = slots < 0
        if missing.any():
            if not create:
                absent = np.unique(flat[missing])
                raise EmbeddingError(f"table {self.name!r}: no rows for ids {absent[:5]}...")
            new_ids = np.unique(flat[missing])
            first = self._size
            self._insert(new_ids)
            # New ids took consecutive slots in sorted order.
            slots[missing] = first + np.searchsorted(new_ids, flat[missing])
        return slots

    def _insert(
        self, new_ids: IdArray, rows: Rows | None = None, accum: Rows | None = None
    ) -> None:
        """Give ``new_ids`` (unique, none held yet) the next row slots."""
        count = new_ids.size
        self._reserve(self._size + count)
        slots = np.arange(self._size, self._size + count, dtype=np.int64)
        if rows is None:
            rows = initial_rows(new_ids, self.dim, self.seed, self.init_scale)
        self._weights[slots] = rows
        initial = self.optimizer.initial_accumulator
        self._accum[slots] = initial if accum is None else accum
        self._row_ids[slots] = new_ids
        self._size += count
        self._index.insert(new_ids, slots, self._row_ids[: self._size])

    def _reserve(self, size: int) -> None:
        capacity = self._weights.shape[0]
        if size <= capacity:
            return
        grown = max(size, capacity * 2)
        # Grown in place (realloc: large blocks are remapped, not copied): copying every row
        # into a new array was a third of a filling server's time. No view of these arrays
        # outlives a method of the table (rows go out as copies), so none is left dangling.
        self._weights.resize((grown, self.dim), refcheck=False)
        self._accum.resize((grown, self.dim), refcheck=False)
        self._row_ids.resize(grown, refcheck=False)

    def snapshot(self, ids: IdArray) -> tuple[Rows, Rows]:
        """The rows and optimizer state of ``ids``, which the table must hold."""
        slots = self._slots_of(self._checked(ids), create=False)
        return self._weights[slots], self._accum[slots]

    def export_all(self) -> tuple[IdArray, Rows, Rows]:
        """Every id the table holds, with its row and optimizer state."""
        size = self._size
        return self._row_ids[:size].copy(), self._weights[:size].copy(), self._accum[:size].copy()

    # --- buckets: what moves between servers --------------------------------------------------
    def export_buckets(
        self, buckets: npt.NDArray[np.int64], num_buckets: int
    ) -> tuple[IdArray, Rows, Rows]:
        """The ids, rows and optimizer state of every row whose id hashes into ``buckets``."""
        slots = np.flatnonzero(
            np.isin(bucket_of(self._row_ids[: self._size], num_buckets), buckets)
        )
        return self._row_ids[slots], self._weights[slots], self._accum[slots]

    def import_rows(self, ids: IdArray, rows: Rows, accum: Rows) -> None:
        """Take rows (with their optimizer state) moved from another server; an id this table
        already holds is overwritten."""
        ids = np.asarray(ids, dtype=np.int64)
        slots = self._index.find(ids, self._row_ids)
        present = slots >= 0
        if present.all():
            self._weights[slots] = rows
            self._accum[slots] = accum
            return
        if present.any():
            self._weights[slots[present]] = rows[present]
            self._accum[slots[present]] = accum[present]
        absent = ~present
        self._insert(ids[absent], rows[absent], accum[absent])

    def drop_buckets(self, buckets: npt.NDArray[np.int64], num_buckets: int) -> int:
        """Forget every row whose id hashes into ``buckets`` (they moved away); returns how many."""
        keep = ~np.isin(bucket_of(self._row_ids[: self._size], num_buckets), buckets)
        dropped = int(self._size - keep.sum())
        if not dropped:
            return 0
        kept = np.flatnonzero(keep)
        # Compact the rows so memory follows what the server owns; the index is rebuilt.
        self._weights[: kept.size] = self._weights[kept]
        self._accum[: kept.size] = self._accum[kept]
        self._row_ids[: kept.size] = self._row_ids[kept]
        self._size = kept.size
        self._index = _HashIndex()
        self._index.insert(
            self._row_ids[: kept.size], np.arange(kept.size), self._row_ids[: kept.size]
        )
        return dropped

    def holds(self, ids: IdArray) -> npt.NDArray[np.bool_]:
        """Whether the table has a row for each of ``ids``."""
        return self._present(np.asarray(ids, dtype=np.int64))

    def _present(self, ids: IdArray) -> npt.NDArray[np.bool_]:
        return self._index.find(ids, self._row_ids) >= 0


def _summed_by_slot(
    ids: IdArray, slots: npt.NDArray[np.int64], grads: Rows
) -> tuple[npt.NDArray[np.int64], Rows]:
    """The distinct ``slots`` (of ``ids``) and the sum of each one's gradient rows, added in
    the order they came. Increasing ids (ElasticEmbedding sends them sorted and unique) come
    back as they are, ``grads`` not copied; else a sort finds the repeats. Repeats are few in a
    batch of ids, so only they go through ``add.at`` (slow per row); ``add.reduceat`` over
    every id costs a call per id."""
    if ids.size < 2 or bool(np.all(ids[1:] > ids[:-1])):
        return slots, grads
    order = np.argsort(slots, kind="stable")
    ordered = slots[order]
    first = np.ones(ordered.size, dtype=bool)
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    if first.all():
        return slots, grads
    starts = np.flatnonzero(first)
    summed = grads[order[starts]]
    repeats = np.flatnonzero(~first)
    np.add.at(summed, np.cumsum(first)[repeats] - 1, grads[order[repeats]])
    return ordered[starts], summed


class _HashIndex:
    """id -> row slot, an open-addressing hash table probed for a whole batch of ids at once
    (linear probing, each round a vectorised gather over the ids still looking). It replaces a
    sorted id array with binary search, whose ~20 cache-missing probes per id and re-sort on
    every insert were most of a server's time per request (docs/embedding.md). Slots index the
    table's ``row_ids``; -1 is an empty cell. Kept at most half full."""

    def __init__(self) -> None:
        self._cells = np.full(1024, -1, dtype=np.int64)
        self._used = 0

    @property
    def nbytes(self) -> int:
        """Memory of the cells."""
        return int(self._cells.nbytes)

    def _start(self, ids: IdArray) -> npt.NDArray[np.int64]:
        # The top bits of the mix: its low bits pick the id's bucket, so a server owning some
        # buckets only would see them clustered.
        shift = np.uint64(64 - (self._cells.size.bit_length() - 1))
        return (mix64(ids.view(np.uint64)) >> shift).astype(np.int64)

    def find(self, ids: IdArray, row_ids: IdArray) -> npt.NDArray[np.int64]:
        """The slot of each id; -1 for an id not held."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        found = np.full(ids.size, -1, dtype=np.int64)
        if not self._used:
            return found
        mask = self._cells.size - 1
        position = self._start(ids)
        looking = np.arange(ids.size)
        while looking.size:
            cell = self._cells[position]
            empty = cell < 0
            hit = ~empty
            hit[hit] = row_ids[cell[hit]] == ids[looking[hit]]
            found[looking[hit]] = cell[hit]
            going_on = ~(empty | hit)
            looking = looking[going_on]
            position = (position[going_on] + 1) & mask
        return found

    def insert(self, ids: IdArray, slots: npt.NDArray[np.int64], row_ids: IdArray) -> None:
        """Index ``ids`` (unique, none held yet) at ``slots``; ``row_ids`` holds every id by slot
        (the new ones included), for a rebuild when the cells fill."""
        if (self._used + ids.size) * 2 > self._cells.size:
            size = self._cells.size
            while (self._used + ids.size) * 2 > size:
                size *= 2
            held = np.flatnonzero(self._cells >= 0)
            old_slots = self._cells[held]
            self._cells = np.full(size, -1, dtype=np.int64)
            self._used = 0
            if old_slots.size:
                self._place(row_ids[old_slots], old_slots)
        self._place(np.ascontiguousarray(ids, dtype=np.int64), slots)

    def _place(self, ids: IdArray, slots: npt.NDArray[np.int64]) -> None:
        mask = self._cells.size - 1
        position = self._start(ids)
        waiting = np.arange(ids.size)
        while waiting.size:
            free = self._cells[position] < 0
            claim = waiting[free]
            self._cells[position[free]] = slots[claim]
            # Two ids may claim one cell in a round: the one written last has it.
            won = np.zeros(waiting.size, dtype=bool)
            won[free] = self._cells[position[free]] == slots[claim]
            waiting = waiting[~won]
            position = (position[~won] + 1) & mask
        self._used += ids.size
