"""Double buffering of a slot: the buffer choice rules, and what a load or persist reads."""

from __future__ import annotations

import subprocess
import threading
import uuid
from pathlib import Path

import pytest
import torch

from dlrover.checkpoint.buffers import SlotBuffers, choose_buffer
from dlrover.checkpoint.config import DEFAULT_SHM_DIR, ENV_CHECKPOINT_SOCKET, buffers_from_env
from dlrover.checkpoint.engine import CheckpointEngine, WorkerPlacement
from dlrover.checkpoint.errors import ShmSpaceError
from dlrover.checkpoint.header import begin_write, publish
from dlrover.checkpoint.shm import shm_free_bytes
from dlrover.checkpoint.storage import LocalStorage
from tests.checkpoint.harness import assert_same, expected_state, running_saver
from tests.conftest import small_tmpfs


@pytest.mark.parametrize(
    ("pinned", "newest", "persist", "chosen"),
    [
        ([False, False], None, False, 0),  # first copy
        ([False, False], 0, False, 1),  # alternate: the newest step stays intact
        ([False, False], 1, True, 0),
        ([True, False], 0, False, 1),  # the persisted buffer is never written
        ([True, False], 1, False, 1),  # ... even if the other one holds the newest step
        ([False, True], 0, False, 0),
        ([True, False], 1, True, None),  # a DISK save waits: one pinned buffer at most
        ([False, True], 1, True, None),
        ([False], 0, False, 0),  # one buffer: written in place while free
        ([True], 0, False, None),  # ... and a memory save waits for the persist
        ([False, False, False], 1, False, 0),
    ],
)
def test_choose_buffer(pinned: list[bool], newest: int | None, persist: bool, chosen: int | None):
    assert choose_buffer(pinned, newest, persist) == chosen


def test_with_two_buffers_a_memory_copy_always_finds_one() -> None:
    # Every state reachable under the rules has at most one pinned buffer (rule 2).
    for pinned in ([False, False], [True, False], [False, True]):
        for newest in (None, 0, 1):
            assert choose_buffer(pinned, newest, persist=False) is not None


def _fill(seg_owner: SlotBuffers, i: int, step: int) -> None:
    seg = seg_owner.segments[i]
    meta = f'{{"version": 1, "step": {step}}}'.encode()
    publish(seg, begin_write(seg), step, 0, meta)


def test_newest_is_by_write_order_and_a_torn_copy_falls_back() -> None:
    slot = SlotBuffers(f"dlrtest-{uuid.uuid4().hex[:8]}-slot0", 2, DEFAULT_SHM_DIR)
    try:
        slot.ensure(1 << 16)
        assert slot.newest() is None and slot.steps() == [None, None]
        for step in (1, 2, 3):
            i = slot.target(persist=False)
            assert i is not None
            slot.begin(i, 1 << 16, step)
            _fill(slot, i, step)
        assert slot.steps() == [3, 2] and slot.newest_step() == 3
        i = slot.target(persist=False)
        assert i == 1  # not the buffer holding step 3
        slot.begin(i, 1 << 16, 4)
        begin_write(slot.segments[i])  # a worker killed mid-copy: seq left odd
        assert slot.newest_step() == 3 and slot.holding(2) is None
        assert slot.target(persist=False) == 1  # step 3, the only complete one, stays
        # The job went back to step 2 (loaded from storage): the abandoned step 3 must not
        # look newer than the steps that follow.
        slot.begin(1, 1 << 16, 2)
        _fill(slot, 1, 2)
        assert slot.steps() == [None, 2] and slot.newest_step() == 2
    finally:
        slot.close(unlink=True)
    assert not list(Path(DEFAULT_SHM_DIR).glob(f"{slot.name}-*"))


def test_a_copy_killed_before_its_first_byte_leaves_the_newer_step_newest() -> None:
    """Steps 115 and 116 are complete; the copy of 117 is begun in 115's buffer and the worker
    is killed before it writes anything (seen beside another stage: 115 was persisted, the
    step its save had returned for, 116, was lost)."""
    slot = SlotBuffers(f"dlrtest-{uuid.uuid4().hex[:8]}-slot0", 2, DEFAULT_SHM_DIR)
    try:
        slot.ensure(1 << 16)
        for step in (115, 116):
            i = slot.target(persist=False)
            assert i is not None
            slot.begin(i, 1 << 16, step)
            _fill(slot, i, step)
        i = slot.target(persist=False)
        assert i is not None and slot.steps()[i] == 115
        slot.begin(i, 1 << 16, 117)  # killed here: buffer i still holds 115, complete
        assert slot.newest_step() == 116
        one = SlotBuffers(f"dlrtest-{uuid.uuid4().hex[:8]}-slot1", 1, DEFAULT_SHM_DIR)
        try:  # one buffer: the older step it still holds is the newest there is
            one.ensure(1 << 16)
            one.begin(0, 1 << 16, 5)
            _fill(one, 0, 5)
            one.begin(0, 1 << 16, 6)
            assert one.newest_step() == 5
        finally:
            one.close(unlink=True)
    finally:
        slot.close(unlink=True)


def test_a_pinned_buffer_is_not_grown_or_written() -> None:
    slot = SlotBuffers(f"dlrtest-{uuid.uuid4().hex[:8]}-slot0", 2, DEFAULT_SHM_DIR)
    try:
        slot.ensure(1 << 16)
        slot.pending[0] = 7
        slot.ensure(1 << 17)
        assert [s.size for s in slot.segments] == [1 << 16, 1 << 17]
        assert slot.target(persist=False) == 1 and slot.target(persist=True) is None
    finally:
        slot.close(unlink=True)


def test_too_little_shm_for_both_buffers_says_the_whole_need_and_creates_nothing() -> None:
    name = f"dlrtest-{uuid.uuid4().hex[:8]}-slot0"
    slot = SlotBuffers(name, 2, DEFAULT_SHM_DIR)
    half = shm_free_bytes() // 2 + (1 << 20)
    with pytest.raises(ShmSpaceError, match="DLROVER_CKPT_BUFFERS=1") as info:
        slot.ensure(half)
    assert info.value.needed == 2 * half and info.value.path.endswith("-buf*")
    assert slot.segments == [] and not list(Path(DEFAULT_SHM_DIR).glob(f"{name}-*"))


def test_buffers_that_do_not_fit_in_shm_go_to_the_spill_folder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two 3 MiB buffers and a 4 MiB shared-memory folder: with a spill folder the buffers are
    made there (said, naming both folders); a need over half the spill folder's free space is
    refused as before, naming the whole need, and nothing is left half-made."""
    shm, small_spill, spill = tmp_path / "shm", tmp_path / "small-spill", tmp_path / "spill"
    small_tmpfs(shm, "4m")
    try:
        small_tmpfs(small_spill, "8m")
        spill.mkdir()
        name = f"dlrtest-{uuid.uuid4().hex[:8]}-slot0"
        slot = SlotBuffers(name, 2, str(shm), str(spill))
        try:
            with caplog.at_level("WARNING", logger="dlrover.checkpoint.buffers"):
                slot.ensure(3 << 20)
            assert [Path(s.path).parent for s in slot.segments] == [spill, spill]
            assert f"they are kept in {spill} instead" in caplog.text
            slot.ensure(3 << 20)  # made already: nothing more is asked
        finally:
            slot.close(unlink=True)
        assert not list(spill.iterdir())
        refused = SlotBuffers(name, 2, str(shm), str(small_spill))
        with pytest.raises(ShmSpaceError) as info:
            refused.ensure(3 << 20)  # 6 MiB > half of 8 MiB
        assert info.value.needed == 6 << 20 and info.value.path.endswith("-buf*")
        assert not list(shm.iterdir()) and not list(small_spill.iterdir())
    finally:
        for folder in (shm, small_spill):
            subprocess.run(["umount", "-l", str(folder)], check=False)


def test_buffer_count_setting_is_checked() -> None:
    assert buffers_from_env({}) == 2
    assert buffers_from_env({"DLROVER_CKPT_BUFFERS": "1"}) == 1
    with pytest.raises(ValueError, match="DLROVER_CKPT_BUFFERS='3': give 1 or 2"):
        buffers_from_env({"DLROVER_CKPT_BUFFERS": "3"})
    with pytest.raises(ValueError, match="at least one buffer"):
        SlotBuffers("dlrtest-x", 0, DEFAULT_SHM_DIR)


class GatedStorage(LocalStorage):
    """Local storage whose writes of one step block until the test opens the gate."""

    def __init__(self, root: str, gate: threading.Event, started: threading.Event) -> None:
        super().__init__(root)
        self.gate, self.started = gate, started

    def write_from(self, rel: str, data: memoryview) -> int:
        if rel.startswith("step_10/"):
            self.started.set()
            assert self.gate.wait(60)
        return super().write_from(rel, data)


def test_memory_saves_during_a_persist_are_taken_and_the_persist_writes_its_own_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, started = threading.Event(), threading.Event()
    ckpt = str(tmp_path / "ckpt")
    factory = lambda url: GatedStorage(url, gate, started)  # noqa: E731
    with running_saver(tmp_path, storage_factory=factory) as saver:
        monkeypatch.setenv(ENV_CHECKPOINT_SOCKET, saver.socket_path)
        engine = CheckpointEngine(ckpt, "plain", placement=WorkerPlacement(0, 0, 1, 1, 0, 0))
        try:
            assert engine.save(10, expected_state(10), persist=True)
            assert started.wait(60)  # the persist of step 10 is under way, and held
            for step in (11, 12, 13):  # each goes into the free buffer at once
                assert engine.save(step, expected_state(step), persist=False)
                assert engine.last_copy_wait_s < 1.0
            assert saver.held_steps() == {0: 13}
            gate.set()
            assert engine.wait_persisted(60)
            catalog = engine.catalog()
            assert catalog.latest_step() == 10
            assert_same(expected_state(10), dict(catalog.load_plain_part(10, "rank_0")))
            step, state, _ = engine.load_from_memory()
            assert step == 13
            assert_same(expected_state(13), state)
        finally:
            gate.set()
            engine.close()


def test_one_buffer_makes_a_memory_save_wait_instead_of_skipping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, started = threading.Event(), threading.Event()
    factory = lambda url: GatedStorage(url, gate, started)  # noqa: E731
    with running_saver(tmp_path, storage_factory=factory, buffers=1) as saver:
        monkeypatch.setenv(ENV_CHECKPOINT_SOCKET, saver.socket_path)
        engine = CheckpointEngine(
            str(tmp_path / "ckpt"), "plain", placement=WorkerPlacement(0, 0, 1, 1, 0, 0)
        )
        try:
            assert engine.save(10, {"w": torch.ones(4)}, persist=True)
            assert started.wait(60)
            threading.Timer(0.5, gate.set).start()  # the persist ends while the save waits
            assert engine.save(11, {"w": torch.full((4,), 2.0)}, persist=False)
            assert engine.last_copy_wait_s > 0.0
            assert engine.wait_persisted(60)
            assert engine.load_from_memory()[0] == 11
        finally:
            gate.set()
            engine.close()
