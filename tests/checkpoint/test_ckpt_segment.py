"""Shared segments and the seqlock layout, on real /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

from dlrover.checkpoint.errors import SegmentStateError, ShmSpaceError, StateDictError
from dlrover.checkpoint.header import complete_step, read_seq
from dlrover.checkpoint.layout import plan_layout, read_state, write_state
from dlrover.checkpoint.shm import SharedSegment, shm_free_bytes
from tests.checkpoint.harness import REPO, assert_same, expected_state


@pytest.fixture
def segment_name() -> str:
    return f"dlrtest-{uuid.uuid4().hex[:8]}"


def test_roundtrip_bit_for_bit_fresh_and_in_place(segment_name: str) -> None:
    state = expected_state(3)
    state["odd"] = {
        "empty": torch.zeros(0, 3),
        "strided": torch.randn(4, 6).t(),
        "flag": torch.tensor([True, False]),
        "nan": float("nan") != 0,
        "dtype": torch.float16,
        "none": None,
        7: "int key",
    }
    layout = plan_layout(state)
    seg = SharedSegment.create(segment_name, layout.required_bytes(3))
    try:
        write_state(seg, layout, 3)
        step, loaded, _ = read_state(seg)
        assert step == 3
        assert_same(state, loaded)
        target = expected_state(99)  # same shapes, other values: filled in place
        before = target["model"]["w"].data_ptr()
        _, loaded, _ = read_state(seg, target)
        assert loaded["model"]["w"].data_ptr() == before
        assert_same(state["model"], target["model"])
        loaded["model"]["w"].add_(1)  # a loaded state never aliases the segment
        assert_same(state, read_state(seg)[1])
    finally:
        seg.close(unlink=True)


def test_torn_copy_is_never_loaded(segment_name: str) -> None:
    layout = plan_layout(expected_state(1))
    seg = SharedSegment.create(segment_name, layout.required_bytes(1))
    try:
        write_state(seg, layout, 1)
        assert complete_step(seg) == 1

        class Crash(Exception):
            pass

        def crash(i: int) -> None:
            raise Crash

        with pytest.raises(Crash):
            write_state(seg, plan_layout(expected_state(2)), 2, after_tensor=crash)
        assert read_seq(seg) % 2 == 1
        assert complete_step(seg) is None
        with pytest.raises(SegmentStateError, match="torn"):
            read_state(seg)
        write_state(seg, layout, 1)  # a later complete copy is loadable again
        assert complete_step(seg) == 1
    finally:
        seg.close(unlink=True)


def test_another_process_attaches_and_reads(segment_name: str) -> None:
    layout = plan_layout(expected_state(5))
    seg = SharedSegment.create(segment_name, layout.required_bytes(5))
    try:
        write_state(seg, layout, 5)
        code = (
            "import sys; from dlrover.checkpoint.shm import SharedSegment;"
            "from dlrover.checkpoint.layout import read_state;"
            "from tests.checkpoint.harness import assert_same, expected_state;"
            "s = SharedSegment.attach(sys.argv[1]); step, st, _ = read_state(s);"
            "assert_same(expected_state(5), st); print(step)"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, seg.path],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        )
        assert out.stdout.strip() == "5"
    finally:
        seg.close(unlink=True)


def test_too_little_shm_is_a_clear_error_and_creates_nothing(segment_name: str) -> None:
    free = shm_free_bytes()
    with pytest.raises(ShmSpaceError) as info:
        SharedSegment.create(segment_name, free + 2**30)
    message = str(info.value)
    assert str(free + 2**30) in message and "--shm-size" in message and "emptyDir" in message
    assert info.value.needed == free + 2**30
    assert not os.path.exists(f"/dev/shm/{segment_name}")  # a refused allocation leaves nothing


def test_grow_keeps_the_name_and_enlarges(segment_name: str) -> None:
    seg = SharedSegment.create(segment_name, 8192)
    try:
        other = SharedSegment.attach(seg.path)
        seg.grow(3 * 8192)
        assert seg.size == 3 * 8192
        other.remap()
        assert other.size == 3 * 8192
        other.close()
    finally:
        seg.close(unlink=True)


def test_unsupported_value_names_its_path() -> None:
    with pytest.raises(StateDictError, match=r"model\.fn: a function"):
        plan_layout({"model": {"fn": test_unsupported_value_names_its_path}})
