"""The targets of protocol_fuzz.py: each server's host process and how to abuse and probe it."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import psutil
from protocol_fuzz_cases import (
    ACCEPTED,
    CASE_DEADLINE_S,
    CLEAR,
    EXTREME_WAITS,
    HANG,
    OVERSIZED_BYTES,
    OVERSIZED_LINE_BYTES,
    UNCLEAR,
    grpc_outcome,
    line_outcome,
    mutate_doc,
    mutate_message,
    random_message,
    read_line,
)

REPO = Path(__file__).resolve().parent.parent
HOST = str(Path(__file__).resolve().with_name("protocol_fuzz_servers.py"))
MAX_HOLD_S = 30.0
"""The longest either gRPC server may take over a call by design (the master holds long polls
and key-value waits up to 30 s, asks a Kafka broker up to 10 s): a gRPC case is a hang only
when it is not answered within this much more than CASE_DEADLINE_S."""

Case = Callable[[], tuple[str, str]]
"""One case: sends its abuse, returns (outcome, detail)."""


# ---------------------------------------------------------------------------- the server host
class Host:
    """One target's server in a process of its own."""

    def __init__(self, target: str, folder: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DLROVER_")}
        env["PYTHONPATH"] = str(REPO)
        self.proc = subprocess.Popen(
            [sys.executable, HOST, target, "--dir", folder],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(os.path.join(folder, "server.log"), "wb"),  # noqa: SIM115
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the host prints its address once it listens
        if not line:
            raise RuntimeError(f"the {target} server did not start (exit {self.proc.wait(10)})")
        self.where: dict[str, Any] = json.loads(line)
        self.token: str = self.where["token"]
        self._ps = psutil.Process(self.proc.pid)

    def alive(self) -> bool:
        """Whether the server's process still runs."""
        return self.proc.poll() is None

    def threads(self) -> int:
        """The server process's thread count now (0 once it died)."""
        try:
            return int(self._ps.num_threads())
        except psutil.Error:
            return 0

    def stop(self) -> None:
        """Close its stdin (it stops its server and exits); kill it after 20 s."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# ---------------------------------------------------------------------------- targets
class Target:
    """What the fuzzer knows of one server: how to make its cases, probe it, stall it."""

    name = ""

    def __init__(self, host: Host) -> None:
        self.host = host

    def case(self, rng: random.Random) -> tuple[str, Case]:
        """(kind, the case) drawn from ``rng``."""
        raise NotImplementedError

    def probe(self) -> tuple[str, str]:
        """A valid request's outcome."""
        raise NotImplementedError

    def stall(self, rng: random.Random) -> socket.socket:
        """A connection that sends a little and then nothing."""
        raise NotImplementedError

    def warm(self, pool: futures.Executor) -> None:
        """Start the server's lazily started threads with valid requests (beyond the probe)."""

    def close(self) -> None:
        """Release what the target holds (channels)."""


def _tcp(addr: str) -> socket.socket:
    host, _, port = addr.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=CASE_DEADLINE_S)


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class GrpcTarget(Target):
    """A gRPC server: raw bytes to each method of its service, read back as its response."""

    error_fields: tuple[str, ...] = ()

    def __init__(self, host: Host, service: Any) -> None:
        super().__init__(host)
        from google.protobuf import message_factory

        self.addr = host.where["addr"]
        self.service = service
        self.channel = grpc.insecure_channel(
            self.addr, options=[("grpc.max_receive_message_length", 128 << 20)]
        )
        self.methods = [
            (
                f"/{service.full_name}/{m.name}",
                message_factory.GetMessageClass(m.input_type),
                message_factory.GetMessageClass(m.output_type),
            )
            for m in service.methods
        ]

    def _call(
        self, path: str, data: bytes, token: str | None, timeout_s: float = CASE_DEADLINE_S
    ) -> Callable[[], bytes]:
        metadata = () if token is None else (("x-dlrover-token", token),)
        stub = self.channel.unary_unary(path)  # no (de)serializers: bytes in, bytes out
        return lambda: stub(data, metadata=metadata, timeout=timeout_s)  # type: ignore[no-any-return]

    def case(self, rng: random.Random) -> tuple[str, Case]:
        path, request_type, response_type = rng.choice(self.methods)
        roll = rng.random()
        token: str | None = self.host.token
        if roll < 0.1:
            kind, data = "random_bytes", rng.randbytes(rng.randint(0, 300))
        elif roll < 0.15:
            kind, data = "oversized", b"\x0a" + _varint(OVERSIZED_BYTES) + bytes(OVERSIZED_BYTES)
        elif roll < 0.2:
            kind, path, data = "unknown_method", path + "X", b""
        elif roll < 0.25:
            return "truncated_stream", lambda: self._truncated(rng.randbytes(rng.randint(0, 40)))
        else:
            kind, data = mutate_message(rng, random_message(rng, request_type))
            if roll < 0.35:
                kind, token = "wrong_token", self.host.token + "x"
            elif roll < 0.45:
                kind, token = "no_token", None
        call = self._call(path, data, token, CASE_DEADLINE_S + MAX_HOLD_S)

        def run() -> tuple[str, str]:
            outcome, detail = grpc_outcome(call, response_type, self.error_fields)
            if outcome in (UNCLEAR, HANG):  # what was sent, to reproduce it
                detail = f"{detail} ({path.rsplit('/', 1)[1]} {data[:80]!r})"
            return outcome, detail

        return kind, run

    def _truncated(self, garbage: bytes) -> tuple[str, str]:
        """An HTTP/2 connection cut in the middle of a frame: the server must close it."""
        with _tcp(self.addr) as sock:
            sock.sendall(_H2_PREFACE + b"\x00\x00\x40\x01\x04\x00\x00\x00\x01" + garbage)
            sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + CASE_DEADLINE_S
            try:
                while time.monotonic() < deadline:
                    if not sock.recv(65536):
                        return CLEAR, "closed the connection"
            except TimeoutError:
                return HANG, "kept a half-closed connection open"
            except OSError:
                return CLEAR, "reset the connection"
        return HANG, "kept a half-closed connection open"

    def stall(self, rng: random.Random) -> socket.socket:
        sock = _tcp(self.addr)
        sock.sendall(_H2_PREFACE[: rng.randint(1, len(_H2_PREFACE))])
        return sock

    def close(self) -> None:
        self.channel.close()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


class MasterTarget(GrpcTarget):
    """The job master (``dlrover-master``)."""

    name = "master"
    error_fields = ("refused", "error")

    def __init__(self, host: Host) -> None:
        from dlrover.proto import master_pb2

        super().__init__(host, master_pb2.DESCRIPTOR.services_by_name["Master"])
        self._pb = master_pb2

    def probe(self) -> tuple[str, str]:
        call = self._call("/dlrover.Master/GetJobStatus", b"", self.host.token)
        return grpc_outcome(call, self._pb.JobStatus, self.error_fields)

    def warm(self, pool: futures.Executor) -> None:
        """Key-value waits run on the master's thread pool: start some of its threads."""
        request = self._pb.KvGetRequest(key="warm", wait_s=0.3).SerializeToString()
        call = self._call("/dlrover.Master/KvGet", request, self.host.token)
        list(pool.map(lambda _: call(), range(8)))


class MasterHeartbeatTarget(MasterTarget):
    """The master's heartbeat server (``dlrover-master --heartbeat-port``): the master's
    service, of which it serves Heartbeat alone (any other method is a case too)."""

    name = "master-heartbeats"

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        # Heartbeat, most of all: what it serves; RegisterNode for one it must refuse.
        beat = [m for m in self.methods if m[0].endswith("/Heartbeat")]
        self.methods = beat * 4 + [m for m in self.methods if m[0].endswith("/RegisterNode")]

    def probe(self) -> tuple[str, str]:
        request = self._pb.HeartbeatRequest(
            node_id=str(self.host.where["node_id"]),
            incarnation=int(self.host.where["incarnation"]),
        )
        call = self._call("/dlrover.Master/Heartbeat", request.SerializeToString(), self.host.token)
        return grpc_outcome(call, self._pb.HeartbeatResponse, self.error_fields)

    def warm(self, pool: futures.Executor) -> None:
        """Its threads start with the first calls: the probes."""


class EmbeddingTarget(GrpcTarget):
    """An embedding server (``dlrover-ps``)."""

    name = "embedding"
    error_fields = ("error",)

    def __init__(self, host: Host) -> None:
        from dlrover.proto import embedding_pb2

        super().__init__(host, embedding_pb2.DESCRIPTOR.services_by_name["EmbeddingServer"])
        self._pb = embedding_pb2

    def probe(self) -> tuple[str, str]:
        ids = (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
        request = self._pb.LookupRequest(table="probe", ids=ids).SerializeToString()
        call = self._call(f"/{self.service.full_name}/Lookup", request, self.host.token)
        outcome, detail = grpc_outcome(call, self._pb.LookupResponse, self.error_fields)
        # A fuzzed SetMap may have moved the probe's ids away: a NOT_OWNER answer is an answer.
        return (ACCEPTED, detail) if outcome == CLEAR else (outcome, detail)


class LineTarget(Target):
    """A JSON-lines socket server: one request line, one reply line."""

    def connect(self) -> socket.socket:
        """A new connection to the server."""
        raise NotImplementedError

    def valid_doc(self, rng: random.Random) -> dict[str, Any]:
        """A plausible request."""
        raise NotImplementedError

    def exchange(self, line: bytes, then: Callable[[socket.socket], None] | None = None) -> Case:
        """Send ``line`` on a new connection and judge the reply."""

        def run() -> tuple[str, str]:
            with self.connect() as sock:
                try:
                    sock.sendall(line)
                except OSError:
                    return CLEAR, "closed the connection while it was sent"
                reply, closed = read_line(sock, CASE_DEADLINE_S)
                outcome = line_outcome(reply, closed)
                if outcome[0] in (UNCLEAR, HANG):  # what was sent, to reproduce it
                    outcome = (outcome[0], f"{outcome[1]} to {line[:160]!r}")
                if then is not None and outcome[0] == ACCEPTED:
                    then(sock)
                    outcome = line_outcome(*read_line(sock, CASE_DEADLINE_S))
                return outcome

        return run

    def case(self, rng: random.Random) -> tuple[str, Case]:
        roll = rng.random()
        if roll < 0.05:
            line = b"x" * OVERSIZED_LINE_BYTES + b"\n"
            return "oversized", self.exchange(line)
        if roll < 0.1:
            return "truncated_stream", self._truncated(rng)
        doc = self.valid_doc(rng)
        waits = [key for key in doc if "timeout" in key]
        if roll < 0.2 and waits:  # a wait no server should take on
            doc[rng.choice(waits)] = rng.choice(EXTREME_WAITS)
            return "extreme_wait", self.exchange(json.dumps(doc).encode() + b"\n")
        kind, line = mutate_doc(rng, doc)
        return kind, self.exchange(line)

    def _truncated(self, rng: random.Random) -> Case:
        line = json.dumps(self.valid_doc(rng)).encode()
        cut = line[: rng.randrange(len(line))]

        def run() -> tuple[str, str]:
            with self.connect() as sock:
                sock.sendall(cut)
                sock.shutdown(socket.SHUT_WR)
                return line_outcome(*read_line(sock, CASE_DEADLINE_S))

        return run

    def stall(self, rng: random.Random) -> socket.socket:
        sock = self.connect()
        sock.sendall(b'{"op": "he')
        return sock


class SaverTarget(LineTarget):
    """The checkpoint saver's unix socket (what a node's workers talk to)."""

    name = "saver"

    def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CASE_DEADLINE_S)
        sock.connect(self.host.where["path"])
        return sock

    def valid_doc(self, rng: random.Random) -> dict[str, Any]:
        slot, step = rng.randint(0, 3), rng.randint(0, 9)
        ckpt = str(Path(self.host.where["path"]).parent / "ckpt")
        spec = {
            "checkpoint_dir": ckpt,
            "slots": {"0": 0},
            "fmt": "plain",
            "node_rank": 0,
            "persist_nodes": 1,
            "keep_last": 2,
        }
        return rng.choice(
            [
                {"op": "allocate", "slot": slot, "nbytes": rng.choice([64, 8192])},
                {"op": "attach", "slot": slot, "step": step, "direct": False, "timeout": 0.2},
                {"op": "begin_copy", "slot": slot, "nbytes": 8192, "step": step, "timeout": 0.2},
                {"op": "copied", "slot": slot, "step": step, "spec": spec, "persist": False},
                {"op": "held"},
                {
                    "op": "load_step",
                    "slots": [slot],
                    "node_rank": 0,
                    "total_nodes": 1,
                    "round_id": rng.randint(0, 1000),
                    "timeout": 0.2,
                },
                {"op": "wait_persisted", "checkpoint_dir": ckpt, "step": step, "timeout_s": 0.1},
            ]
        )

    def probe(self) -> tuple[str, str]:
        return self.exchange(b'{"op": "held"}\n')()


class ReplicaTarget(LineTarget):
    """The flash-checkpoint replica port (peers push and read checkpoint images here)."""

    name = "replica"

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        self._stalled_pushes = 0

    def connect(self) -> socket.socket:
        return _tcp(self.host.where["addr"])

    def stall(self, rng: random.Random) -> socket.socket:
        """Half the time a push with the right token that stops in the middle of its image
        (each of its own replica slot, so that each is accepted)."""
        if rng.random() < 0.5:
            return super().stall(rng)
        self._stalled_pushes += 1
        doc = {"op": "put", "token": self.host.token, "source_node": 100, "nbytes": 8192}
        doc["slot"] = self._stalled_pushes
        sock = self.connect()
        sock.sendall(json.dumps(doc).encode() + b"\n")
        reply, _ = read_line(sock, CASE_DEADLINE_S)
        if reply is not None and json.loads(reply).get("ok"):
            sock.sendall(b"\0" * 100)  # and nothing more
        return sock

    def valid_doc(self, rng: random.Random) -> dict[str, Any]:
        token = self.host.token
        docs: list[dict[str, Any]] = [
            {"op": "list", "token": token},
            {"op": "get", "token": token, "key": "own/0", "step": rng.choice([4, 5])},
            {"op": "read", "token": token, "key": "own/0", "step": rng.choice([4, 5])},
            {
                "op": "put",
                "token": token,
                "source_node": rng.randint(0, 2),
                "slot": rng.randint(0, 2),
                "nbytes": rng.choice([5000, 8192]),
            },
        ]
        doc = rng.choice(docs)
        roll = rng.random()
        if roll < 0.15:
            doc["token"] = token + "x"
        elif roll < 0.3:
            del doc["token"]
        return doc

    def case(self, rng: random.Random) -> tuple[str, Case]:
        if rng.random() < 0.15:  # a push whose image breaks off
            doc = {"op": "put", "token": self.host.token, "source_node": 1, "slot": 0}
            doc["nbytes"] = 8192
            image = rng.randbytes(rng.randint(0, 9000))

            def send_part(sock: socket.socket) -> None:
                with contextlib.suppress(OSError):
                    sock.sendall(image)
                    sock.shutdown(socket.SHUT_WR)

            return "truncated_image", self.exchange(json.dumps(doc).encode() + b"\n", send_part)
        return super().case(rng)

    def probe(self) -> tuple[str, str]:
        line = json.dumps({"op": "list", "token": self.host.token}).encode() + b"\n"
        return self.exchange(line)()


class EmbeddingDataTarget(Target):
    """An embedding server's data port (Lookup, Push, Replicate as length-prefixed frames)."""

    name = "embedding-data"

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        from dlrover.embedding import dataport
        from dlrover.proto import embedding_pb2

        self._dp = dataport
        self._pb = embedding_pb2
        addr = host.where["addr"]
        self.addr = f"{addr.rpartition(':')[0]}:{host.where['data_port']}"

    def _frame(self, method: int, token: bytes, payload: bytes, length: int | None = None) -> bytes:
        size = len(payload) if length is None else length
        return self._dp.REQUEST.pack(method, len(token), size) + token + payload

    def _exchange(self, frame: bytes, shut: bool = False) -> Case:
        def run() -> tuple[str, str]:
            with _tcp(self.addr) as sock:
                try:
                    sock.sendall(frame)
                    if shut:
                        sock.shutdown(socket.SHUT_WR)
                except OSError:
                    return CLEAR, "closed the connection while it was sent"
                return self._judge(sock, frame)

        return run

    def _judge(self, sock: socket.socket, frame: bytes) -> tuple[str, str]:
        deadline = time.monotonic() + CASE_DEADLINE_S
        head = b""
        try:
            while len(head) < self._dp.REPLY.size:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                got = sock.recv(self._dp.REPLY.size - len(head))
                if not got:
                    return CLEAR, "closed the connection"
                head += got
            status, size = self._dp.REPLY.unpack(head)
            body = b""
            while len(body) < size:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                got = sock.recv(size - len(body))
                if not got:
                    return UNCLEAR, f"a reply cut short to {frame[:80]!r}"
                body += got
        except TimeoutError:
            return HANG, f"no reply within {CASE_DEADLINE_S:g}s to {frame[:80]!r}"
        except OSError:
            return CLEAR, "reset the connection"
        if status == self._dp.OK:
            return ACCEPTED, f"{size} bytes"
        if body:
            return CLEAR, body[:120].decode(errors="replace")
        return UNCLEAR, f"status {status} without a reason to {frame[:80]!r}"

    def case(self, rng: random.Random) -> tuple[str, Case]:
        token = self.host.token.encode()
        method, request = rng.choice(
            [
                (self._dp.LOOKUP, self._pb.LookupRequest),
                (self._dp.PUSH, self._pb.PushRequest),
                (self._dp.REPLICATE, self._pb.RowsMessage),
            ]
        )
        roll = rng.random()
        if roll < 0.1:
            return "random_bytes", self._exchange(rng.randbytes(rng.randint(0, 300)), True)
        if roll < 0.15:  # a length over the cap, and no payload behind it
            return "oversized", self._exchange(self._frame(method, token, b"", OVERSIZED_BYTES))
        if roll < 0.2:
            return "unknown_method", self._exchange(self._frame(rng.randint(4, 255), token, b""))
        if roll < 0.3:  # a frame whose payload breaks off
            frame = self._frame(method, token, rng.randbytes(rng.randint(0, 200)), 4096)
            return "truncated_stream", self._exchange(frame, True)
        kind, data = mutate_message(rng, random_message(rng, request))
        if roll < 0.4:
            kind, token = "wrong_token", token + b"x"
        elif roll < 0.45:
            kind, token = "no_token", b""
        return kind, self._exchange(self._frame(method, token, data))

    def probe(self) -> tuple[str, str]:
        ids = (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
        payload = self._pb.LookupRequest(table="probe", ids=ids).SerializeToString()
        outcome, detail = self._exchange(
            self._frame(self._dp.LOOKUP, self.host.token.encode(), payload)
        )()
        return outcome, detail

    def stall(self, rng: random.Random) -> socket.socket:
        sock = _tcp(self.addr)
        sock.sendall(
            self._frame(self._dp.LOOKUP, self.host.token.encode(), b"", 100)[: rng.randint(1, 12)]
        )
        return sock


TARGETS: dict[str, Callable[[Host], Target]] = {
    "master": MasterTarget,
    "master-heartbeats": MasterHeartbeatTarget,
    "embedding": EmbeddingTarget,
    "embedding-data": EmbeddingDataTarget,
    "saver": SaverTarget,
    "replica": ReplicaTarget,
}
