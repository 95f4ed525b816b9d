"""The channels the master and the parameter-server nodes speak through the master's KV store.

Each channel is defined once here, as a `KvChannel`: its key (dlrover/constants.py), whether it
is per node or kept per version, and its record type with one `encode` (the JSON value stored
under the key, the wire format the keys had before these types) and one `decode` (a
`MessageError` naming the bad field, not a KeyError in a caller). Both ends use the channel,
never the key: the master through its `KvStore`, a node or the CLI through its master client
(`KvAccess`). The embedding servers' placement is the one channel defined beside its type
(`dlrover.embedding.wire.PLACEMENT`). Standard library only: the master, the TensorFlow nodes and
the CLI import it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Generic, Protocol, TypeVar

from dlrover import constants as c
from dlrover.hang_spec import PhaseHistory
from dlrover.json_messages import from_fields, parse, to_fields

T = TypeVar("T")


class KvAccess(Protocol):
    """The master's key-value store as a channel uses it: `KvStore` in the master, the master
    client (`dlrover.client.master_client.MasterClient`) in a node."""

    def kv_get(self, key: str, wait_s: float = 0.0) -> bytes | None:
        """The value under ``key``, waiting up to ``wait_s`` for it; None when there is none."""
        ...

    def kv_set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``."""
        ...


@dataclass(frozen=True)
class KvChannel(Generic[T]):
    """One message through the master's KV store, defined once: both ends use it.

    ``per_node``: one value per node (the key ends with the node id). ``versioned``: each value is
    also kept under ``<key>/<version>``, so that a reader can wait for the next version."""

    key: str
    encode: Callable[[T], bytes]
    decode: Callable[[bytes], T]
    """The record a stored value holds; MessageError if it is not one."""
    per_node: bool = False
    versioned: bool = False

    def key_of(self, node: str = "", version: int | None = None) -> str:
        """The key of ``node``'s value (per-node channels), or of version ``version``."""
        if self.per_node != bool(node):
            raise ValueError(f"channel {self.key!r}: a node id is {'' if self.per_node else 'not '}"
                             "expected")  # fmt: skip
        if version is not None and not self.versioned:
            raise ValueError(f"channel {self.key!r} keeps no versions")
        key = self.key + node
        return key if version is None else f"{key}/{version}"

    def put(self, kv: KvAccess, value: T, node: str = "", version: int | None = None) -> None:
        """Store ``value`` (for ``version`` too, on a versioned channel: under both keys)."""
        raw = self.encode(value)
        if version is not None:
            kv.kv_set(self.key_of(node, version), raw)
        kv.kv_set(self.key_of(node), raw)

    def raw(
        self, kv: KvAccess, node: str = "", version: int | None = None, wait_s: float = 0.0
    ) -> bytes | None:
        """The stored bytes (None: nothing yet), waiting up to ``wait_s`` for them."""
        return kv.kv_get(self.key_of(node, version), wait_s)

    def get(
        self, kv: KvAccess, node: str = "", version: int | None = None, wait_s: float = 0.0
    ) -> T | None:
        """The stored record (None: nothing yet), waiting up to ``wait_s`` for it;
        MessageError if the value is not one."""
        raw = self.raw(kv, node, version, wait_s)
        return None if raw is None else self.decode(raw)


def _text(value: str) -> bytes:
    return value.encode()


def _untext(raw: bytes) -> str:
    return raw.decode()


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


# --------------------------------------------------------------------------- the channels
TF_CLUSTER: KvChannel[TfCluster] = KvChannel(
    c.TF_CLUSTER_KEY, TfCluster.encode, TfCluster.decode, versioned=True
)
"""The master publishes each cluster spec; the TensorFlow nodes wait for the next version."""
TF_PS_GENERATION: KvChannel[PsGeneration] = KvChannel(
    c.TF_PS_GENERATION_KEY, PsGeneration.encode, PsGeneration.decode, versioned=True
)
"""The master bumps it when every ps serves again; the chief waits for it to rebuild."""
TF_ADDRESS: KvChannel[str] = KvChannel(c.TF_ADDRESS_KEY, _text, _untext, per_node=True)
"""A TensorFlow node's host:port, registered before the cluster spec is made of them."""
TF_START_ERROR: KvChannel[str] = KvChannel(c.TF_START_ERROR_KEY, _text, _untext, per_node=True)
"""Why a TensorFlow node's program cannot start (the node then exits CANNOT_START_EXIT_CODE)."""
TF_READY: KvChannel[str] = KvChannel(c.TF_READY_KEY, _text, _untext, per_node=True)
"""A ps or worker's TF server target, set once it serves."""
TF_USAGE: KvChannel[TfNodeUsage] = KvChannel(
    c.TF_USAGE_KEY, TfNodeUsage.encode, TfNodeUsage.decode, per_node=True
)
"""A TensorFlow node's own measurement (the sizer and the status read it)."""
TF_PROGRESS: KvChannel[TfProgress] = KvChannel(
    c.TF_PROGRESS_KEY, TfProgress.encode, TfProgress.decode
)
"""The chief's progress (the master's throughput)."""
PS_SCALE: KvChannel[ScaleReport] = KvChannel(c.PS_SCALE_KEY, ScaleReport.encode, ScaleReport.decode)
"""The master's last ps scaling or failover (`dlrover scale` waits for its request's)."""
PS_ADDRESS: KvChannel[str] = KvChannel(c.PS_ADDRESS_KEY, _text, _untext, per_node=True)
"""An embedding server's address, registered as it starts."""
CKPT_PEER: KvChannel[str] = KvChannel("dlrover/ckpt-peer/", _text, _untext, per_node=True)
"""Where a node's flash-checkpoint peer serves (per round and node rank)."""
HANG_HISTORY: KvChannel[PhaseHistory] = KvChannel(
    "dlrover/hang-history", PhaseHistory.encode, PhaseHistory.decode
)
"""The job's phase durations that hang timeouts are learned from (`dlrover.hang_spec`): each
agent saves its own now and then and takes the job's in as it starts, so a restarted or
replacement node does not start from the defaults."""
"""A node's flash-checkpoint replica address in a round: the node is ``<round>/<node rank>``."""
