"""Checkpoint formats by name: who saves a step, how its slots are persisted, how it loads."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

from dlrover.checkpoint.catalog import DEFAULT_NAMING, Catalog, FileTable, Finalizer, StepNaming
from dlrover.checkpoint.errors import CheckpointError
from dlrover.checkpoint.header import read_metadata
from dlrover.checkpoint.shm import SharedSegment


class Placement(Protocol):
    """What a format needs to know of a worker's place (``engine.WorkerPlacement`` has it)."""

    @property
    def rank(self) -> int:
        """The global rank."""
        ...

    @property
    def local_rank(self) -> int:
        """The rank within the node."""
        ...

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        ...

    @property
    def local_world_size(self) -> int:
        """Ranks on each node."""
        ...

    @property
    def node_rank(self) -> int:
        """The node's rank."""
        ...

    @property
    def num_nodes(self) -> int:
        """Nodes in the job."""
        ...


class CheckpointFormat(Protocol):
    """One way to save and store a step, named in each persist request and in each manifest.

    The worker side asks it which ranks copy into memory and persist (the methods taking a
    ``Placement``); the agent side asks it to write a step's slots
    (``write_parts``, no torch needed unless the format's files are torch's); the trainer side
    asks it for the newest intact step on storage (``load_newest``)."""

    name: str
    """The name on the saver's socket (``PersistSpec.fmt``) and in the manifest ("format")."""

    naming: StepNaming
    """How its step directories and the newest-step marker are named on storage."""

    def saves_to_memory(self, place: Placement) -> bool:
        """Whether ``place`` copies into shared memory: every rank its own part (sharded state),
        or local rank 0 the node's copy (replicated state)."""

    def saving_slots(self, place: Placement) -> dict[int, int]:
        """Local slot -> global rank, for every saving rank of ``place``'s node."""

    def slot(self, place: Placement) -> int:
        """The saver slot ``place`` copies into."""

    def persists(self, place: Placement) -> bool:
        """Whether ``place``'s save asks its node to persist (the others keep a memory copy)."""

    def persist_nodes(self, place: Placement) -> int:
        """How many nodes write parts of a step (its commit waits for all of them)."""

    def replicas(self, replica_count: int) -> int:
        """How many next nodes of the ring each copy is pushed to."""

    def ranks_to_match(self, place: Placement) -> dict[int, int]:
        """Slot -> the global rank whose part a memory copy in it must be to load ({}: any)."""

    def world_size_to_match(self, place: Placement) -> int | None:
        """The world size a memory copy must have been saved at to load (None: any)."""

    def reads_directly(self, place: Placement) -> bool:
        """Whether ``place`` alone reads its slot (so a peer's copy goes straight into its
        tensors) rather than sharing it with its node's other ranks."""

    def write_parts(
        self, catalog: Catalog, step: int, ranks: Mapping[int, int], segs: dict[int, SharedSegment]
    ) -> tuple[FileTable, dict[str, Any], Finalizer | None]:
        """Stream ``step`` of every slot in ``segs`` (``ranks``: slot -> global rank) to
        ``catalog``: (the files written, what the node part records for the committer, the
        committer's finalizer or None)."""

    def load_newest(
        self, catalog: Catalog, target: Any, not_newer_than: int | None
    ) -> tuple[int, Any] | None:
        """(step, state) of the newest committed step that reads back intact, into ``target``'s
        tensors where it can; None when there is none."""


class PlainFormat:
    """Replicated state (DDP, a full state gathered on rank 0): one ``rank_<r>.bin`` and its
    ``rank_<r>.meta.json`` per saving rank, loaded by reading ``rank_0`` back."""

    name = "plain"
    naming = DEFAULT_NAMING

    def saves_to_memory(self, place: Placement) -> bool:
        """Local rank 0 keeps the node's copy (every rank holds the same state)."""
        return place.local_rank == 0

    def saving_slots(self, place: Placement) -> dict[int, int]:
        """Slot 0 holds the node's copy, saved by its local rank 0."""
        return {0: place.rank - place.local_rank}

    def slot(self, place: Placement) -> int:
        """Every rank of the node reads slot 0 (only local rank 0 writes it)."""
        return 0

    def persists(self, place: Placement) -> bool:
        """Only global rank 0 persists: storage needs one copy of a replicated state."""
        return place.rank == 0

    def persist_nodes(self, place: Placement) -> int:
        """One node writes the step."""
        return 1

    def replicas(self, replica_count: int) -> int:
        """No push: every peer's own copy of a replicated state serves."""
        return 0

    def ranks_to_match(self, place: Placement) -> dict[int, int]:
        """Any rank's copy of a replicated state will do."""
        return {}

    def world_size_to_match(self, place: Placement) -> int | None:
        """A replicated state loads at any world size."""
        return None

    def reads_directly(self, place: Placement) -> bool:
        """Alone only in a one-process node; otherwise the saver copies a peer's step in once."""
        return place.local_world_size == 1

    def write_parts(
        self, catalog: Catalog, step: int, ranks: Mapping[int, int], segs: dict[int, SharedSegment]
    ) -> tuple[FileTable, dict[str, Any], Finalizer | None]:
        """Each slot's bytes and metadata as ``rank_<r>.bin`` + ``rank_<r>.meta.json``."""
        files: FileTable = {}
        for slot, seg in segs.items():
            seq, meta = read_metadata(seg)
            if meta["step"] != step:
                raise CheckpointError(f"slot {slot} moved on from step {step}")
            files.update(catalog.persist_plain_part(step, f"rank_{ranks[slot]}", seg, meta, seq))
        return files, {}, None

    def load_newest(
        self, catalog: Catalog, target: Any, not_newer_than: int | None
    ) -> tuple[int, Any] | None:
        """Rank 0's part of the newest intact step (see ``Catalog.load_newest_plain``)."""
        return catalog.load_newest_plain("rank_0", target, not_newer_than)


class DcpFormat:
    """Sharded state (FSDP): every rank copies its own shards; the agent writes them as
    torch.distributed.checkpoint files, so DCP reads a step directory at any world size."""

    name = "dcp"
    naming = DEFAULT_NAMING

    def saves_to_memory(self, place: Placement) -> bool:
        """Every rank copies its own shards."""
        return True

    def saving_slots(self, place: Placement) -> dict[int, int]:
        """Every local rank saves into its own slot."""
        base = place.node_rank * place.local_world_size
        return {s: base + s for s in range(place.local_world_size)}

    def slot(self, place: Placement) -> int:
        """A rank's slot is its local rank."""
        return place.local_rank

    def persists(self, place: Placement) -> bool:
        """Every rank's part goes to storage."""
        return True

    def persist_nodes(self, place: Placement) -> int:
        """Every node writes its ranks' parts."""
        return place.num_nodes

    def replicas(self, replica_count: int) -> int:
        """Each part is pushed to ``replica_count`` peers (no other node holds it)."""
        return replica_count

    def ranks_to_match(self, place: Placement) -> dict[int, int]:
        """Each slot must hold its own rank's shards."""
        return self.saving_slots(place)

    def world_size_to_match(self, place: Placement) -> int | None:
        """A memory copy is one rank's shards: only the same world size can load it."""
        return place.world_size

    def reads_directly(self, place: Placement) -> bool:
        """Each rank reads its own slot."""
        return True

    def write_parts(
        self, catalog: Catalog, step: int, ranks: Mapping[int, int], segs: dict[int, SharedSegment]
    ) -> tuple[FileTable, dict[str, Any], Finalizer | None]:
        """DCP data files per rank; the committer merges every node's chunks into .metadata."""
        # torch only here: the agent imports this module without it.
        from dlrover.checkpoint.dcp_writer import persist_dcp, write_dcp_metadata

        files, doc = persist_dcp(catalog, step, {ranks[s]: seg for s, seg in segs.items()})
        return files, {"dcp": doc}, write_dcp_metadata

    def load_newest(
        self, catalog: Catalog, target: Any, not_newer_than: int | None
    ) -> tuple[int, Any] | None:
        """The newest step that verifies, loaded by DCP into ``target`` (which must hold
        every sharded tensor to fill; the saved ``extra`` entries are added to it)."""
        from dlrover.checkpoint.dcp_reader import load_dcp

        found = catalog.newest_valid(not_newer_than)
        if found is None:
            return None
        load_dcp(catalog.storage.url(catalog.step_dir(found[0])), target)
        return found[0], target


class TorchFilesFormat(DcpFormat):
    """A framework's own checkpoint files (DeepSpeed's, Megatron-LM's): every rank copies the
    files it would ``torch.save`` (and those it needs to load) into its own slot; the agent
    writes them with ``torch.save`` into a step directory named as the framework names it, so
    the framework's own loader reads storage. Who saves, persists and loads: as DCP's."""

    def __init__(self, name: str, naming: StepNaming) -> None:
        self.name = name
        self.naming = naming

    def write_parts(
        self, catalog: Catalog, step: int, ranks: Mapping[int, int], segs: dict[int, SharedSegment]
    ) -> tuple[FileTable, dict[str, Any], Finalizer | None]:
        """Each slot's files, written with ``torch.save`` (torch only here, as DCP's)."""
        from dlrover.checkpoint.torch_files import persist_torch_files

        return persist_torch_files(catalog, step, ranks, segs), {}, None

    def load_newest(
        self, catalog: Catalog, target: Any, not_newer_than: int | None
    ) -> tuple[int, Any] | None:
        """The newest step that verifies, not read: ``{"dir": its directory's URL, "files":
        its file names}``, for the framework's own loader to read."""
        found = catalog.newest_valid(not_newer_than)
        if found is None:
            return None
        step, manifest = found
        return step, {
            "dir": catalog.storage.url(catalog.step_dir(step)),
            "files": manifest["files"],
        }


class MegatronTorchDistFormat(TorchFilesFormat):
    """Megatron-LM's ``torch_dist`` checkpoints (megatron.core's ``dist_checkpointing``): every
    rank copies its sharded tensors and objects (and rank 0 the common state) into its own slot;
    the agent writes them as megatron.core does (DCP files, ``common.pt``, ``metadata.json``),
    so megatron.core's loader reads the step at any parallel layout. Who saves, persists and
    loads from memory: as DCP's; from storage, megatron.core's own loader reads the directory."""

    def __init__(self) -> None:
        super().__init__("megatron_torch_dist", MEGATRON_NAMING)

    def write_parts(
        self, catalog: Catalog, step: int, ranks: Mapping[int, int], segs: dict[int, SharedSegment]
    ) -> tuple[FileTable, dict[str, Any], Finalizer | None]:
        """``common.pt`` (rank 0's) and each rank's DCP data files; the committer writes
        ``.metadata`` and ``metadata.json`` (torch only here, as DCP's)."""
        from dlrover.checkpoint.mcore_writer import finish_torch_dist, persist_torch_dist

        files, doc = persist_torch_dist(catalog, step, ranks, segs)
        return files, {"dcp": doc}, finish_torch_dist


DEEPSPEED_NAMING = StepNaming(
    dir_prefix="global_step", latest_file="latest", latest_prefix="global_step", tagged=True
)
"""DeepSpeed's: ``<tag>/`` and ``latest`` holding ``<tag>``, the tag ``global_step<n>`` unless
the user names the step."""

MEGATRON_NAMING = StepNaming(
    dir_prefix="iter_", digits=7, latest_file="latest_checkpointed_iteration.txt"
)
"""Megatron-LM's: ``iter_<n, 7 digits>/`` and ``latest_checkpointed_iteration.txt`` holding ``<n>``."""

FORMATS: Mapping[str, CheckpointFormat] = MappingProxyType(
    {
        f.name: f
        for f in (
            PlainFormat(),
            DcpFormat(),
            TorchFilesFormat("deepspeed", DEEPSPEED_NAMING),
            TorchFilesFormat("megatron", MEGATRON_NAMING),
            MegatronTorchDistFormat(),
        )
    }
)
"""Every checkpoint format by name (read-only: a format is added here, in one place)."""


def format_named(name: str) -> CheckpointFormat:
    """The format called ``name``; CheckpointError naming the known ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise CheckpointError(
            f"unknown checkpoint format {name!r}; known: {', '.join(sorted(FORMATS))}"
        ) from None
