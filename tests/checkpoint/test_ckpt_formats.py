"""The checkpoint format registry: who saves, persists and loads in each format, by name."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from dlrover.checkpoint.catalog import DEFAULT_NAMING, Catalog
from dlrover.checkpoint.engine import WorkerPlacement
from dlrover.checkpoint.errors import CheckpointError
from dlrover.checkpoint.formats import (
    FORMATS,
    DcpFormat,
    PlainFormat,
    TorchFilesFormat,
    format_named,
)
from dlrover.checkpoint.saver_messages import PersistSpec
from dlrover.checkpoint.storage import storage_for

# Rank 3 of a job of 2 nodes x 2 ranks: node 1, local rank 1.
PLACE = WorkerPlacement(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
                        round_id=1)  # fmt: skip
NODE_LEADER = WorkerPlacement(2, 0, 4, 2, 1, 1)
JOB_LEADER = WorkerPlacement(0, 0, 4, 2, 0, 1)


def test_the_registry_names_every_format_and_refuses_an_unknown_one() -> None:
    assert sorted(FORMATS) == ["dcp", "deepspeed", "megatron", "megatron_torch_dist", "plain"]
    # every format can be named in a persist request (the saver's socket checks the name)
    assert set(typing.get_args(typing.get_type_hints(PersistSpec)["fmt"])) == set(FORMATS)
    assert isinstance(format_named("plain"), PlainFormat)
    assert isinstance(format_named("dcp"), DcpFormat)
    assert isinstance(format_named("deepspeed"), TorchFilesFormat)
    with pytest.raises(
        CheckpointError,
        match=r"unknown checkpoint format 'zip'; known: dcp, deepspeed, megatron, megatron_torch",
    ):
        format_named("zip")
    with pytest.raises(TypeError):
        FORMATS["zip"] = PlainFormat()  # type: ignore[index]  # one place adds formats


def test_plain_keeps_one_copy_per_node_and_persists_one_per_job() -> None:
    plain = format_named("plain")
    assert [plain.saves_to_memory(p) for p in (PLACE, NODE_LEADER, JOB_LEADER)] == [
        False,
        True,
        True,
    ]
    assert [plain.persists(p) for p in (PLACE, NODE_LEADER, JOB_LEADER)] == [False, False, True]
    assert plain.slot(PLACE) == 0
    assert plain.saving_slots(PLACE) == {0: 2}  # the node's local rank 0
    assert plain.persist_nodes(PLACE) == 1
    assert plain.replicas(2) == 0  # every node holds its own copy already
    assert plain.ranks_to_match(PLACE) == {} and plain.world_size_to_match(PLACE) is None
    assert not plain.reads_directly(PLACE)
    assert plain.reads_directly(WorkerPlacement(0, 0, 1, 1, 0, 0))


def test_dcp_saves_and_persists_every_rank_and_loads_only_the_same_rank_and_world() -> None:
    dcp = format_named("dcp")
    assert all(dcp.saves_to_memory(p) and dcp.persists(p) for p in (PLACE, JOB_LEADER))
    assert dcp.slot(PLACE) == 1
    assert dcp.saving_slots(PLACE) == {0: 2, 1: 3}
    assert dcp.persist_nodes(PLACE) == 2
    assert dcp.replicas(2) == 2
    assert dcp.ranks_to_match(PLACE) == {0: 2, 1: 3} and dcp.world_size_to_match(PLACE) == 4
    assert dcp.reads_directly(PLACE)


def test_framework_formats_name_steps_and_the_marker_as_their_frameworks_do(tmp_path: Path) -> None:
    deepspeed, megatron = format_named("deepspeed"), format_named("megatron")
    assert (deepspeed.naming.dir(40), megatron.naming.dir(40)) == ("global_step40", "iter_0000040")
    assert deepspeed.naming.latest_file == "latest"
    assert megatron.naming.latest_file == "latest_checkpointed_iteration.txt"
    assert (
        deepspeed.naming.parse_dir("global_step7") == 7
        and megatron.naming.parse_dir("iter_0000007") == 7
    )
    assert (
        deepspeed.naming.parse_dir("step_7") is None
        and DEFAULT_NAMING.parse_dir("global_step7") is None
    )
    assert deepspeed.naming.parse_latest("global_step7") == 7
    assert (
        deepspeed.naming.parse_latest("7") is None
        and deepspeed.naming.parse_latest("global_stepx") is None
    )
    # Who saves and loads: as DCP's (every rank its own files, same ranks and world to load).
    assert all(megatron.saves_to_memory(p) and megatron.persists(p) for p in (PLACE, JOB_LEADER))
    assert (
        megatron.ranks_to_match(PLACE) == {0: 2, 1: 3} and megatron.world_size_to_match(PLACE) == 4
    )
    # A catalog in DeepSpeed's naming lists and marks only its own step directories.
    catalog = Catalog(storage_for(str(tmp_path)), 2, deepspeed.naming)
    for name in ("global_step3", "global_step12", "step_5", "zero_to_fp32.py"):
        (tmp_path / name).mkdir()
    assert catalog.steps() == [3, 12]
    catalog.commit(12, "deepspeed")
    assert (tmp_path / "latest").read_text() == "global_step12"
    assert catalog.latest_step() == 12
    assert (tmp_path / "global_step12" / "manifest.json").exists()


def test_deepspeed_steps_saved_under_a_tag_live_in_the_tags_directory(tmp_path: Path) -> None:
    """DeepSpeed's tags (``tag=step``, ``tag=loss.item()``): the step's directory and the marker
    are the tag, and the catalog finds the step of each tag again (a fresh catalog too)."""
    naming = format_named("deepspeed").naming
    catalog = Catalog(storage_for(str(tmp_path)), 2, naming)
    for step, tag in ((4, "4"), (8, "0.5257"), (12, "12")):
        catalog.name_step(step, tag)
        catalog.storage.makedirs(catalog.step_dir(step))
        catalog.commit(step, "deepspeed")
        assert (tmp_path / "latest").read_text() == tag
    (tmp_path / "global_step2").mkdir()  # an untagged save
    fresh = Catalog(storage_for(str(tmp_path)), 2, naming)
    assert fresh.steps() == [2, 4, 8, 12]
    assert [fresh.step_dir(s) for s in (2, 4, 8, 12)] == ["global_step2", "4", "0.5257", "12"]
    assert fresh.latest_step() == 12 and fresh.step_named("0.5257") == 8
    assert fresh.step_named("nothing") is None
    # A tag saved again holds the newer step only; its older step is gone with it.
    fresh.name_step(16, "4")
    fresh.commit(16, "deepspeed")
    assert fresh.steps() == [2, 8, 12, 16] and fresh.step_named("4") == 16
    fresh.collect_garbage()  # keeps the newest two committed steps: 12 and 16 ("4")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["12", "4"]
    with pytest.raises(CheckpointError, match="cannot name"):
        fresh.name_step(20, "../x")
    with pytest.raises(ValueError):
        Catalog(storage_for(str(tmp_path)), 2, DEFAULT_NAMING).name_step(1, "a")
