"""The hot path's hand-written messages are protobuf's bytes: what frames.py writes the generated
classes read, and what they write frames.py reads, field by field."""

from __future__ import annotations

import numpy as np
import pytest

from dlrover.embedding import frames
from dlrover.proto import embedding_pb2 as pb


def test_a_push_written_by_frames_parses_as_the_generated_message() -> None:
    ids = np.array([3, -1, 1 << 40], dtype="<i8")
    grads = np.arange(12, dtype="<f4").reshape(3, 4)
    message = pb.PushRequest.FromString(
        frames.join(frames.push_request("items", ids, grads, "c1", 1 << 35))
    )
    assert message.table == "items" and message.client == "c1" and message.seq == 1 << 35
    assert np.array_equal(np.frombuffer(message.ids, "<i8"), ids)
    assert np.array_equal(np.frombuffer(message.grads, "<f4").reshape(3, 4), grads)


def test_a_push_written_by_the_generated_message_reads_the_same_in_frames() -> None:
    ids = np.array([7, 8], dtype="<i8")
    grads = np.full((2, 3), 0.5, dtype="<f4")
    raw = pb.PushRequest(
        table="t", ids=ids.tobytes(), grads=grads.tobytes(), client="ü", seq=-3
    ).SerializeToString()
    push = frames.read_push_request(raw)
    assert (push.table, push.client, push.seq) == ("t", "ü", -3)
    assert np.array_equal(np.frombuffer(push.ids, "<i8"), ids)
    assert bytes(push.grads) == grads.tobytes()


def test_lookups_both_ways_and_a_refusal() -> None:
    ids = np.arange(5, dtype="<i8")
    request = pb.LookupRequest.FromString(frames.join(frames.lookup_request("emb", ids)))
    assert request.table == "emb" and request.ids == ids.tobytes()
    table, got = frames.read_lookup_request(request.SerializeToString())
    assert table == "emb" and bytes(got) == ids.tobytes()

    rows = np.linspace(0, 1, 10, dtype="<f4").reshape(5, 2)
    response = pb.LookupResponse.FromString(frames.join(frames.lookup_response(rows, 2)))
    assert response.dim == 2 and response.rows == rows.tobytes()
    answer = frames.read_lookup_response(response.SerializeToString())
    assert answer.error is None and answer.dim == 2 and bytes(answer.rows) == rows.tobytes()

    refusal = pb.LookupResponse(
        error=pb.EmbeddingError(message="moving", kind=pb.EmbeddingError.MOVING)
    )
    answer = frames.read_lookup_response(refusal.SerializeToString())
    assert answer.error is not None and answer.error.kind == pb.EmbeddingError.MOVING


def test_empty_fields_are_left_out_as_protobuf_does() -> None:
    empty = np.empty(0, dtype="<i8")
    assert frames.join(frames.push_request("", empty, np.empty((0, 4), "<f4"), "", 0)) == b""
    push = frames.read_push_request(b"")
    assert (push.table, bytes(push.ids), bytes(push.grads), push.client, push.seq) == (
        "",
        b"",
        b"",
        "",
        0,
    )


@pytest.mark.parametrize(
    "raw",
    [
        b"\x0a\xff\xff\xff\xff\x0f",  # a length far past the end
        b"\x12\x05abc",  # a field cut short
        b"\x08\xff",  # a varint cut short
        b"\x00\x01",  # field number 0
        b"\x0b",  # a group (wire type 3)
        b"\x08" + b"\xff" * 11,  # a varint over 10 bytes
        b"\x0a\x02\xff\xfe",  # a table name that is not UTF-8
    ],
)
def test_bytes_that_are_no_such_message_are_refused(raw: bytes) -> None:
    with pytest.raises(frames.MalformedMessage):
        frames.read_push_request(raw)


def test_a_varint_where_bytes_belong_is_refused() -> None:
    with pytest.raises(frames.MalformedMessage):
        frames.read_lookup_request(b"\x10\x05")  # ids (field 2) as a varint


def test_a_varint_over_64_bits_is_cut_to_64_as_protobuf_reads_it() -> None:
    raw = b"\x28" + b"\xff" * 9 + b"\x7f"  # seq (field 5) = 2**70 - 1
    assert frames.read_push_request(raw).seq == pb.PushRequest.FromString(raw).seq == -1
