"""The saver socket's messages: every type survives a round trip, a malformed line is named."""

from __future__ import annotations

import socket
import threading
import uuid
from pathlib import Path

import pytest

from dlrover.checkpoint.client import SaverClient
from dlrover.checkpoint.errors import SaverError, ShmSpaceError
from dlrover.checkpoint.saver import CheckpointSaver
from dlrover.checkpoint.saver_messages import (
    REPLY_TYPES,
    REQUEST_TYPES,
    AllocateReply,
    AllocateRequest,
    AttachReply,
    AttachRequest,
    BeginCopyReply,
    BeginCopyRequest,
    CopiedReply,
    CopiedRequest,
    HeldReply,
    HeldRequest,
    LoadStepReply,
    LoadStepRequest,
    PersistSpec,
    Refused,
    SaverReply,
    SaverRequest,
    ShmSpaceRefused,
    WaitPersistedReply,
    WaitPersistedRequest,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from dlrover.json_messages import MessageError

SPEC = PersistSpec("/ckpt", {0: 8, 1: 9}, "dcp", node_rank=1, persist_nodes=2, keep_last=3)

REQUESTS: list[SaverRequest[SaverReply]] = [
    AllocateRequest(slot=1, nbytes=1 << 40),
    AttachRequest(slot=0),
    AttachRequest(slot=1, step=12),
    BeginCopyRequest(slot=2, nbytes=1 << 30, step=7, persist=True, timeout=0.5),
    BeginCopyRequest(slot=0, nbytes=4096, step=8),
    CopiedRequest(slot=0, step=7, spec=SPEC, persist=True),
    CopiedRequest(slot=0, step=7),
    HeldRequest(),
    LoadStepRequest([0, 1], node_rank=1, total_nodes=2, round_id=3, ranks={0: 8, 1: 9}),
    LoadStepRequest([0], node_rank=0, total_nodes=1, round_id=1_000_002, world_size=None),
    WaitPersistedRequest("s3://bucket/ckpt", step=7, timeout_s=30.0),
]

REPLIES: list[SaverReply] = [
    AllocateReply("/dev/shm/dlrover-ckpt-1-slot0", 4096),
    AttachReply(None),
    AttachReply("/dev/shm/x"),
    BeginCopyReply("/dev/shm/dlrover.job.node-0.42.ckpt-slot0-buf1", 4096, 0.25),
    CopiedReply(),
    HeldReply({0: 5, 1: None}),
    LoadStepReply(None),
    LoadStepReply(12),
    WaitPersistedReply(persisted=False, committed=6, failure="step 7: disk full"),
    Refused("CheckpointError: slot 0 is still being persisted; retry later"),
    ShmSpaceRefused("shared memory needs more", "/dev/shm/x", needed=10, free=3),
]


def test_every_message_type_is_exercised() -> None:
    assert {type(r) for r in REQUESTS} == set(REQUEST_TYPES)
    assert {type(r) for r in REPLIES} == set(REPLY_TYPES)


@pytest.mark.parametrize("request_", REQUESTS, ids=repr)
def test_request_round_trip_is_lossless(request_: SaverRequest[SaverReply]) -> None:
    line = encode_request(request_)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_request(line) == request_


@pytest.mark.parametrize("reply", REPLIES, ids=repr)
def test_reply_round_trip_is_lossless(reply: SaverReply) -> None:
    # A refusal may answer any request; other replies are decoded as their request expects.
    expected = AllocateReply if isinstance(reply, Refused) else type(reply)
    assert decode_reply(encode_reply(reply), expected) == reply


def test_refusals_keep_their_wire_form() -> None:
    assert encode_reply(Refused("KeyError: 'x'")) == b'{"ok": false, "error": "KeyError: \'x\'"}\n'
    shm = encode_reply(ShmSpaceRefused("no room", "/dev/shm/x", 10, 3))
    assert shm == (
        b'{"ok": false, "kind": "ShmSpaceError", "error": "no room", '
        b'"path": "/dev/shm/x", "needed": 10, "free": 3}\n'
    )


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"allocate 0\n", "saver request is not JSON"),
        (b"[1, 2]\n", "not a JSON object"),
        (b'{"slot": 0}\n', "unknown op None"),
        (b'{"op": "format_disk"}\n', "unknown op 'format_disk'"),
        (b'{"op": "allocate", "slot": 0}\n', "'allocate': field 'nbytes' is missing"),
        (b'{"op": "allocate", "slot": "0", "nbytes": 1}\n', "field 'slot' must be an int, got '0'"),
        (b'{"op": "allocate", "slot": true, "nbytes": 1}\n', "field 'slot' must be an int"),
        (b'{"op": "attach", "slot": 0, "path": "/x"}\n', r"unknown fields \['path'\]"),
        (
            b'{"op": "begin_copy", "slot": 0, "nbytes": 8, "step": 1, "persist": 1}\n',
            "field 'persist' must be a bool",
        ),
        (
            b'{"op": "copied", "slot": 0, "step": 1, "spec": {"checkpoint_dir": "/c", '
            b'"slots": {"0": 0}, "fmt": "zip", "node_rank": 0, "persist_nodes": 1, '
            b'"keep_last": 1}}\n',
            "field 'spec.fmt' must be 'plain' or 'dcp' or 'deepspeed' or 'megatron' or 'megatron_torch_dist', got 'zip'",
        ),
        (
            b'{"op": "load_step", "slots": [0], "node_rank": 0, "total_nodes": 1, '
            b'"round_id": 0, "ranks": {"first": 0}}\n',
            "key 'first' of field 'ranks' must be an integer",
        ),
        (
            b'{"op": "load_step", "slots": [0, "1"], "node_rank": 0, "total_nodes": 1, '
            b'"round_id": 0}\n',
            r"field 'slots\[1\]' must be an int",
        ),
        # Found by benchmarks/protocol_fuzz.py: a key given twice was read as its last value
        # (a 7 s wait_persisted behind a 0.1 s one), and deep nesting raised RecursionError,
        # which killed the connection's thread without an answer.
        (
            b'{"op": "allocate", "slot": 0, "nbytes": 8, "nbytes": 1099511627776}\n',
            r"keys given more than once: \['nbytes'\]",
        ),
        (b'{"op": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "nests too deeply"),
        # A wait_persisted of NaN (or 1e308) seconds never answered; a load_step of Infinity
        # raised OverflowError, which dropped the connection without an answer.
        (
            b'{"op": "wait_persisted", "checkpoint_dir": "/c", "step": 1, "timeout_s": NaN}\n',
            "'wait_persisted': a wait of nan s; at most 86400 s",
        ),
        (
            b'{"op": "wait_persisted", "checkpoint_dir": "/c", "step": 1, "timeout_s": 1e308}\n',
            "a wait of 1e.308 s",
        ),
        (
            b'{"op": "load_step", "slots": [0], "node_rank": 0, "total_nodes": 2, "round_id": 1, '
            b'"timeout": Infinity}\n',
            "'load_step': a wait of inf s",
        ),
        (b'{"op": "attach", "slot": 0, "timeout": 1e9}\n', "'attach': a wait of 1000000000.0 s"),
        (
            b'{"op": "begin_copy", "slot": 0, "nbytes": 8, "step": 1, "timeout": NaN}\n',
            "'begin_copy': a wait of nan s",
        ),
    ],
)
def test_malformed_request_names_what_is_wrong(line: bytes, error: str) -> None:
    with pytest.raises(MessageError, match=error):
        decode_request(line)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"", "saver reply .* is not JSON"),
        (b'{"path": "/x", "nbytes": 1}\n', "expected ok true.* got ok None"),
        (b'{"ok": false, "kind": "Other", "error": "x"}\n', "got ok False, kind 'Other'"),
        (b'{"ok": true, "path": "/x"}\n', "field 'nbytes' is missing"),
        (b'{"ok": false}\n', "field 'error' is missing"),
    ],
)
def test_malformed_reply_names_what_is_wrong(line: bytes, error: str) -> None:
    with pytest.raises(MessageError, match=error):
        decode_reply(line, AllocateReply)


def test_sender_refuses_a_message_it_could_not_decode() -> None:
    with pytest.raises(MessageError, match="cannot send AllocateRequest: field 'slot'"):
        encode_request(AllocateRequest(slot="0", nbytes=1))  # type: ignore[arg-type]


def test_saver_answers_a_malformed_line_with_a_refusal_and_keeps_serving(tmp_path: Path) -> None:
    saver = CheckpointSaver(str(tmp_path / "s.sock"), shm_prefix=f"dlrtest-{uuid.uuid4().hex[:8]}")
    saver.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(saver.socket_path)
            reader = sock.makefile("rb")
            sock.sendall(b'{"op": "attach", "slot": "zero"}\n')
            refusal = decode_reply(reader.readline(), AttachReply)
            assert isinstance(refusal, Refused)
            assert refusal.error.startswith("MessageError: saver request 'attach': field 'slot'")
            sock.sendall(encode_request(AttachRequest(0)))
            assert decode_reply(reader.readline(), AttachReply) == AttachReply(None)
            sock.sendall(b"[" * 100_000 + b"]" * 100_000 + b"\n")  # answered, not dropped
            refusal = decode_reply(reader.readline(), AttachReply)
            assert isinstance(refusal, Refused) and "nests too deeply" in refusal.error
        client = SaverClient(saver.socket_path)
        try:
            assert client.request(HeldRequest()) == HeldReply({})
            bad = PersistSpec("/c", {0: "r"}, "plain", 0, 1, 1)  # type: ignore[dict-item]
            with pytest.raises(
                SaverError, match=r"malformed .* request: .*field 'spec.slots\[0\]' must be an int"
            ):
                client.request(CopiedRequest(0, 1, bad))
        finally:
            client.close()
    finally:
        saver.close(unlink=True)


def _one_reply_server(path: Path, reply: bytes) -> threading.Thread:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def serve() -> None:
        with server, server.accept()[0] as conn:
            conn.makefile("rb").readline()
            conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    ("reply", "error", "match"),
    [
        (b"<html>\n", SaverError, "malformed answer .*: saver reply .* is not JSON"),
        (b'{"ok": true, "path": 3, "nbytes": 1}\n', SaverError, "field 'path' must be a string"),
        (encode_reply(Refused("CheckpointError: busy")), SaverError, "refused 'allocate': Check"),
        (encode_reply(ShmSpaceRefused("x", "/dev/shm/x", 10, 3)), ShmSpaceError, "/dev/shm/x"),
    ],
)
def test_client_raises_saver_errors(
    tmp_path: Path, reply: bytes, error: type[Exception], match: str
) -> None:
    thread = _one_reply_server(tmp_path / "fake.sock", reply)
    client = SaverClient(str(tmp_path / "fake.sock"), timeout=10)
    try:
        with pytest.raises(error, match=match) as info:
            client.request(AllocateRequest(0, 1))
    finally:
        client.close()
        thread.join(10)
    if isinstance(info.value, ShmSpaceError):
        assert (info.value.path, info.value.needed, info.value.free) == ("/dev/shm/x", 10, 3)
