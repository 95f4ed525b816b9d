"""The zygote channel's messages: every type survives a round trip, a malformed line is named."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrover.agent.zygote import PendingZygote, ZygoteError
from dlrover.agent.zygote_messages import (
    EVENT_TYPES,
    FDS_MARKER,
    REQUEST_TYPES,
    ErrorEvent,
    ExitedEvent,
    ExitRequest,
    ReadyEvent,
    SpawnedEvent,
    SpawnFailedEvent,
    SpawnRequest,
    WarmedEvent,
    WarmRequest,
    ZygoteEvent,
    ZygoteRequest,
    decode_event,
    decode_request,
    encode_event,
    encode_request,
)
from dlrover.agent.zygote_server import _Server
from dlrover.json_messages import MessageError

SPAWN = SpawnRequest(
    request_id=3,
    argv=["-m", "trainer", "--lr=0.1", "ünïcode"],
    env={"RANK": "1", "EMPTY": "", "QUOTES": 'a "b" \\n'},
    cwd="/work",
    unbuffered=True,
)
REQUESTS: list[ZygoteRequest] = [SPAWN, ExitRequest(), WarmRequest()]
EVENTS: list[ZygoteEvent] = [
    ReadyEvent(pid=41, preload_s=1.2345, threads=2),
    SpawnedEvent(request_id=3, pid=42),
    SpawnFailedEvent(request_id=3, error="cwd '/nope' is not a directory"),
    ExitedEvent(pid=42, returncode=-9),
    ErrorEvent(error="zygote request is not JSON"),
    WarmedEvent(seconds=1.25, skipped=["is clang"], error=""),
]


def test_every_message_type_is_exercised() -> None:
    assert {type(r) for r in REQUESTS} == set(REQUEST_TYPES)
    assert {type(e) for e in EVENTS} == set(EVENT_TYPES)


@pytest.mark.parametrize("request_", REQUESTS, ids=repr)
def test_request_round_trip_is_lossless(request_: ZygoteRequest) -> None:
    line = encode_request(request_)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_request(line) == request_


@pytest.mark.parametrize("event", EVENTS, ids=repr)
def test_event_round_trip_is_lossless(event: ZygoteEvent) -> None:
    line = encode_event(event)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_event(line) == event


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"spawn\n", "zygote request is not JSON"),
        (b'"spawn"\n', "not a JSON object"),
        (b'{"op": "fork_bomb"}\n', "unknown op 'fork_bomb' \\(known: exit, spawn, warm\\)"),
        (b'{"op": "exit", "now": true}\n', r"'exit': unknown fields \['now'\]"),
        (b'{"op": "spawn", "request_id": 1}\n', "'spawn': field 'argv' is missing"),
        (
            b'{"op": "spawn", "request_id": 1, "argv": "train.py", "env": {}, "cwd": "/", '
            b'"unbuffered": true}\n',
            "field 'argv' must be a list, got 'train.py'",
        ),
        (
            b'{"op": "spawn", "request_id": 1, "argv": ["t.py"], "env": {"RANK": 1}, '
            b'"cwd": "/", "unbuffered": true}\n',
            r"field 'env\[RANK\]' must be a string, got 1",
        ),
        (
            b'{"op": "spawn", "request_id": null, "argv": ["t.py"], "env": {}, "cwd": "/", '
            b'"unbuffered": true}\n',
            "field 'request_id' must be an int, got None",
        ),
    ],
)
def test_malformed_request_names_what_is_wrong(line: bytes, error: str) -> None:
    with pytest.raises(MessageError, match=error):
        decode_request(line)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"", "zygote event is not JSON"),
        (b'{"pid": 1}\n', "unknown event None"),
        (b'{"event": "exited", "pid": 1}\n', "field 'returncode' is missing"),
        (b'{"event": "ready", "pid": 1, "preload_s": "1s", "threads": 2}\n', "must be a number"),
    ],
)
def test_malformed_event_names_what_is_wrong(line: bytes, error: str) -> None:
    with pytest.raises(MessageError, match=error):
        decode_event(line)


def test_sender_refuses_a_message_it_could_not_decode() -> None:
    bad = SpawnRequest(1, ["t.py"], {"RANK": 1}, "/", True)  # type: ignore[dict-item]
    with pytest.raises(MessageError, match=r"cannot send SpawnRequest: field 'env\[RANK\]'"):
        encode_request(bad)


@pytest.fixture()
def server_and_peer() -> Iterator[tuple[_Server, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.settimeout(10)
    with ours, theirs:
        yield _Server(theirs), ours


def test_zygote_answers_a_malformed_line_without_forking(
    server_and_peer: tuple[_Server, socket.socket], tmp_path: Path
) -> None:
    server, peer = server_and_peer
    reader = peer.makefile("rb")
    assert server._handle(b"{not json") is None
    error = decode_event(reader.readline())
    assert isinstance(error, ErrorEvent) and "zygote request is not JSON" in error.error
    # Well-formed but impossible: refused with the request's id (nothing is forked).
    missing = SpawnRequest(7, ["t.py"], {}, str(tmp_path / "missing"), False)
    assert server._handle(encode_request(missing)) is None
    assert decode_event(reader.readline()) == SpawnFailedEvent(
        7, f"cwd {str(tmp_path / 'missing')!r} is not a directory"
    )
    empty = SpawnRequest(8, [], {}, str(tmp_path), False)
    assert server._handle(encode_request(empty)) is None
    failed = decode_event(reader.readline())
    assert isinstance(failed, SpawnFailedEvent) and "argv must be a non-empty" in failed.error
    assert server._handle(encode_request(ExitRequest())) == ExitRequest()


@pytest.mark.parametrize(
    ("first_line", "error"),
    [
        (b"Traceback (most recent call last):\n", "did not start cleanly: zygote event is not"),
        (encode_event(ExitedEvent(1, 0)), r"sent ExitedEvent\(pid=1, returncode=0\) before"),
    ],
)
def test_a_zygote_that_does_not_say_ready_is_ended(first_line: bytes, error: str) -> None:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with theirs:
        theirs.sendall(first_line)
        pending = PendingZygote(process, ours, ["json"])
        with pytest.raises(ZygoteError, match=error):
            pending.result(timeout=10)
    assert process.wait(10) is not None  # cancelled: killed and reaped


def test_output_descriptors_pair_with_their_lines(
    server_and_peer: tuple[_Server, socket.socket], tmp_path: Path
) -> None:
    server, peer = server_and_peer
    files = {name: open(tmp_path / name, "wb") for name in ("a", "junk", "c")}  # noqa: SIM115
    sent = [
        (encode_request(SPAWN), [files["a"].fileno(), files["a"].fileno()]),
        (b"{not json\n", [files["junk"].fileno()]),
        (encode_request(ExitRequest()), []),
        (encode_request(SPAWN), [files["c"].fileno(), files["c"].fileno()]),
    ]
    for line, fds in sent:
        if fds:
            socket.send_fds(peer, [FDS_MARKER + line], fds)
        else:
            peer.sendall(line)
    received: list[tuple[bytes, list[int]]] = []
    while len(received) < len(sent):
        got = server._receive()
        assert got is not None
        received.extend(got)
    try:
        assert [line + b"\n" for line, _ in received] == [line for line, _ in sent]
        inodes = [[os.fstat(fd).st_ino for fd in fds] for _, fds in received]
        ino = {name: os.fstat(f.fileno()).st_ino for name, f in files.items()}
        assert inodes == [[ino["a"]] * 2, [ino["junk"]], [], [ino["c"]] * 2]
    finally:
        for _, fds in received:
            for fd in fds:
                os.close(fd)
        for f in files.values():
            f.close()


def test_a_spawn_without_its_descriptors_is_refused(
    server_and_peer: tuple[_Server, socket.socket], tmp_path: Path
) -> None:
    server, peer = server_and_peer
    request = SpawnRequest(9, ["t.py"], {}, str(tmp_path), False)
    with open(tmp_path / "out", "wb") as out:
        assert server._handle(encode_request(request), [os.dup(out.fileno())]) is None
    failed = decode_event(peer.makefile("rb").readline())
    assert failed == SpawnFailedEvent(
        9, "a spawn request comes with 2 descriptors (stdout, stderr) in the same sendmsg; got 1"
    )
