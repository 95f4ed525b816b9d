"""Typed records the master and the parameter-server nodes exchange through the master's KV store.

Each record has one `encode` (the JSON value stored under its key, the wire format the keys had
before these types) and one `decode` (a `MessageError` naming the bad field, not a KeyError in a
caller). The keys are in dlrover/constants.py: `TF_CLUSTER_KEY`, `TF_PS_GENERATION_KEY`,
`TF_USAGE_KEY`, `TF_PROGRESS_KEY`, `PS_SCALE_KEY`. Standard library only: the master, the TensorFlow nodes and the CLI import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from dlrover.json_messages import from_fields, parse, to_fields


@dataclass(frozen=True)
class TfCluster:
    """The job's TensorFlow cluster spec, version ``version`` (`TF_CLUSTER_KEY`; the same value
    is kept under ``TF_CLUSTER_KEY/<version>`` so a node can wait for the next one)."""

    version: int
    cluster: dict[str, list[str]] = field(default_factory=dict)
    """role -> the host:port of each of its tasks (chief, ps, worker; no evaluator)."""

    def encode(self) -> bytes:
        """The stored value: ``{"version": N, "cluster": {role: [host:port, ...]}}``."""
        return json.dumps(to_fields(self)).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> TfCluster:
        """The record stored as ``raw``; MessageError if it is not one."""
        return from_fields(cls, parse(raw, "the TensorFlow cluster spec"), "TfCluster")


@dataclass(frozen=True)
class PsGeneration:
    """The ps generation (`TF_PS_GENERATION_KEY`): bumped each time every ps of cluster version
    ``cluster_version`` serves again (1 the first time, +1 after a ps relaunch or scale-out)."""

    generation: int
    cluster_version: int

    def encode(self) -> bytes:
        """The stored value: ``{"generation": G, "cluster_version": N}``."""
        return json.dumps(to_fields(self)).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> PsGeneration:
        """The record stored as ``raw``; MessageError if it is not one."""
        return from_fields(cls, parse(raw, "the ps generation"), "PsGeneration")

    @classmethod
    def of(cls, raw: bytes | None) -> int:
        """The generation stored as ``raw``; 0 when none is stored yet."""
        return cls.decode(raw).generation if raw else 0


@dataclass(frozen=True)
class ScaleReport:
    """The master's last ps scaling or failover (`PS_SCALE_KEY`): what `dlrover scale` waits for
    and prints. Fields that do not apply to ``action`` are None and left out of the stored JSON,
    so each report stores exactly the keys it always had."""

    action: str
    """install | scale | replace (embedding servers), scale (a TensorFlow job's ps)."""
    servers: int
    """Servers (or TensorFlow ps) the job has after it."""
    request: int | None = None
    """The id `scale_role` returned for the request this answers (0: the auto-scaler's)."""
    tf: bool | None = None
    """True for a TensorFlow job's ps (the chief re-partitions from a checkpoint)."""
    error: str | None = None
    """Why it failed (the other fields then say nothing)."""
    seconds: float | None = None
    """From the request (or the failure) to done."""
    time: float | None = None
    """Wall time the report was written (embedding servers)."""
    count: int | None = None
    """The server count asked for."""
    moved_buckets: int | None = None
    moved_rows: int | None = None
    pause_s: float | None = None
    """The longest pause of a moving bucket's pushes."""
    index: int | None = None
    """The failed-over server's index (``replace``)."""
    node: str | None = None
    """The replacement's node id (``replace``)."""
    restored_rows: int | None = None
    replica_last_heard_s: float | None = None

    def encode(self) -> bytes:
        """The stored JSON object, without the fields that are None."""
        doc = to_fields(self)
        return json.dumps(
            {f.name: doc[f.name] for f in fields(self) if doc[f.name] is not None}
        ).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> ScaleReport:
        """The record stored as ``raw``; MessageError if it is not one."""
        return from_fields(cls, parse(raw, "the scale report"), "ScaleReport")


@dataclass(frozen=True)
class TfNodeUsage:
    """What a TensorFlow node measured of itself (`TF_USAGE_KEY` + its node id): the node's
    processes together (`dlrover-tf-node` and the chief's or evaluator's program; a ps or
    worker is one process, its TF server)."""

    cpu_percent: float
    """CPU since the node's previous report (100 = one core)."""
    memory_bytes: int
    """Resident memory now."""
    peak_memory_bytes: int
    """The highest resident memory any report of this attempt saw."""
    pid: int
    """The node's process id on its host."""
    at: float
    """Wall time of the measurement."""

    def encode(self) -> bytes:
        """The stored value: a JSON object of the fields."""
        return json.dumps(to_fields(self)).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> TfNodeUsage:
        """The record stored as ``raw``; MessageError if it is not one."""
        return from_fields(cls, parse(raw, "a TensorFlow node's usage"), "TfNodeUsage")


@dataclass(frozen=True)
class TfProgress:
    """The chief's training progress (`TF_PROGRESS_KEY`), set each time its scheduled batches
    finished: the master's step and sample rates of the job are differences of these."""

    batches: int
    """Batches (steps) finished since the job started (restored from the checkpoint)."""
    samples: int
    """Samples trained since the job started."""
    at: float
    """Wall time the batches were seen finished."""
    cluster_version: int = 0
    """The cluster version the chief's strategy trains on (0: not said): the master measures
    each worker count's throughput from its own cluster's reports, and removes a worker once
    the chief trains without it."""

    def encode(self) -> bytes:
        """The stored value: a JSON object of the fields."""
        return json.dumps(to_fields(self)).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> TfProgress:
        """The record stored as ``raw``; MessageError if it is not one."""
        return from_fields(cls, parse(raw, "the chief's progress"), "TfProgress")
