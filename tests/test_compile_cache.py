"""The job's compile caches through the master (``--compile-cache master``): the master's store
over real gRPC on port 0, and two nodes' folders synchronised through it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrover.agent.compile_cache import CacheSync, local_cache_folder
from dlrover.api.errors import MasterRequestError
from dlrover.api.master import CACHE_CHUNK_BYTES, cache_digest
from dlrover.client.master_client import MasterClient
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.server import MasterServer
from dlrover.master.state_store import MemoryStateStore


@pytest.fixture
def client() -> Iterator[MasterClient]:
    server = MasterServer(JobMaster(JobMasterConfig(), MemoryStateStore()), "t", "127.0.0.1", 0)
    server.start()
    c = MasterClient(f"127.0.0.1:{server.port}", "t")
    try:
        yield c
    finally:
        c.close()
        server.stop(0.1)


def _put(client: MasterClient, name: str, data: bytes) -> list[bool]:
    digest = cache_digest(data)
    return [
        client.cache_write(name, len(data), digest, at, data[at : at + CACHE_CHUNK_BYTES])
        for at in range(0, len(data), CACHE_CHUNK_BYTES)
    ]


def test_a_file_of_several_parts_is_whole_once_its_last_part_arrived(client: MasterClient):
    data = os.urandom(2 * CACHE_CHUNK_BYTES + 123)
    assert _put(client, "inductor/ab/kernel.so", data) == [False, False, True]
    (entry,) = client.cache_files()
    assert (entry.name, entry.size, entry.digest) == (
        "inductor/ab/kernel.so",
        len(data),
        cache_digest(data),
    )
    read = b"".join(
        client.cache_read(entry.name, at, CACHE_CHUNK_BYTES)
        for at in range(0, len(data), CACHE_CHUNK_BYTES)
    )
    assert read == data
    assert _put(client, "inductor/ab/kernel.so", data) == [True, True, True]  # written once


@pytest.mark.parametrize("name", ["../escape", "/abs/path", "a/../../b", "a//b", ""])
def test_a_name_outside_the_cache_folder_is_refused(client: MasterClient, name: str):
    with pytest.raises(MasterRequestError, match="not a relative path inside the folder"):
        client.cache_write(name, 1, cache_digest(b"x"), 0, b"x")
    assert client.cache_files() == ()


def test_parts_out_of_order_damaged_content_and_unknown_files_are_refused(client: MasterClient):
    data = os.urandom(CACHE_CHUNK_BYTES + 10)
    with pytest.raises(MasterRequestError, match="out of order"):
        client.cache_write("f", len(data), cache_digest(data), CACHE_CHUNK_BYTES, data[-10:])
    with pytest.raises(MasterRequestError, match="does not match"):
        client.cache_write("g", 3, cache_digest(b"abc"), 0, b"abd")
    with pytest.raises(MasterRequestError, match="does not hold it"):
        client.cache_read("g", 0, 10)
    assert client.cache_files() == ()


def test_a_full_cache_refuses_new_files_and_keeps_the_ones_it_has():
    from dlrover.master.compile_cache import CacheError, CompileCacheStore

    store = CompileCacheStore(max_bytes=10)
    assert store.cache_write("a", 6, cache_digest(b"123456"), 0, b"123456")
    with pytest.raises(CacheError, match="is full"):
        store.cache_write("b", 6, cache_digest(b"654321"), 0, b"654321")
    assert [f.name for f in store.cache_files()] == ["a"]


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_what_one_node_compiled_reaches_a_node_on_a_fresh_machine(
    client: MasterClient, tmp_path: Path
):
    """Node A's cache entries settle and go to the master (not its locks or files still being
    written); node B, an empty folder, fetches them before its workers start; nothing B
    fetched is sent back."""
    a, b = tmp_path / "a", tmp_path / "b"
    entries = {
        "inductor/fxgraph/ab/key/entry": os.urandom(100),
        "inductor/cd/kernel.so": os.urandom(3 * CACHE_CHUNK_BYTES // 2),
        "triton/xyz/kernel.json": b"{}",
    }
    for name, data in entries.items():
        (a / name).parent.mkdir(parents=True, exist_ok=True)
        (a / name).write_bytes(data)
    (a / "inductor/locks").mkdir(parents=True)
    (a / "inductor/locks/x.lock").write_bytes(b"")
    (a / "inductor/cd/.1234.5678.tmp").write_bytes(b"half written")
    node_a = CacheSync(client, str(a))
    later = time.time() + 5  # as a scan five seconds on would see them
    assert node_a.push_new(now=later) == 0  # first seen: not settled yet
    assert node_a.push_new(now=later) == 3
    assert node_a.push_new(now=later) == 0
    assert sorted(f.name for f in client.cache_files()) == sorted(entries)

    node_b = CacheSync(client, str(b))
    assert node_b.pull() == (3, sum(map(len, entries.values())))
    assert _tree(b) == entries
    assert node_b.push_new(now=later) == 0 and node_b.push_new(now=later) == 0

    (b / "inductor/ef").mkdir()
    (b / "inductor/ef/new.so").write_bytes(b"compiled on b")
    node_b.close()  # the last push sends what settled meanwhile
    assert "inductor/ef/new.so" in {f.name for f in client.cache_files()}
    assert node_a.pull() == (1, len(b"compiled on b"))


def test_an_unreachable_master_costs_a_local_compile_not_an_error(tmp_path: Path):
    dead = MasterClient("127.0.0.1:1", "t", rpc_timeout_s=1.0)
    try:
        sync = CacheSync(dead, str(tmp_path / "c"))
        assert sync.pull() == (0, 0)
        (tmp_path / "c" / "f").write_bytes(b"x")
        sync.push_new(now=time.time() + 5)
        assert sync.push_new(now=time.time() + 5) == 0  # kept for the next scan
    finally:
        dead.close()


def test_each_job_has_its_folder_under_the_machine_s_temp_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    assert local_cache_folder("my job/1") == str(tmp_path / "dlrover-compile-cache-my_job_1")
