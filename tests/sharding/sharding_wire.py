"""A JSON-lines socket transport for tests: lets worker processes reach an in-process master."""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from dlrover.sharding import (
    DatasetProgress,
    DatasetSpec,
    FetchResult,
    InProcessTransport,
    Position,
    RegisterResult,
    ReportResult,
    ShardId,
)


def _serve(transport: InProcessTransport, method: str, args: dict[str, Any]) -> Any:
    if method == "register_dataset":
        return asdict(transport.register_dataset(DatasetSpec.from_dict(args["spec"])))
    if method == "fetch_shards":
        return transport.fetch_shards(
            args["dataset"], args["worker_id"], args["max_count"]
        ).to_dict()
    if method == "report_done":
        ids = [ShardId.from_list(i) for i in args["shard_ids"]]
        return asdict(transport.report_done(args["dataset"], args["worker_id"], ids))
    if method == "report_progress":
        shard_id = ShardId.from_list(args["shard_id"])
        return transport.report_progress(
            args["dataset"], args["worker_id"], shard_id, args["consumed"]
        )
    if method == "renew_leases":
        return transport.renew_leases(args["dataset"], args["worker_id"])
    if method == "get_position":
        return transport.get_position(args["dataset"]).to_dict()
    if method == "restore_position":
        return transport.restore_position(Position.from_dict(args["position"]), args["token"])
    if method == "dataset_progress":
        return asdict(transport.dataset_progress(args["dataset"]))
    raise ValueError(f"unknown method {method!r}")


class JsonLineServer:
    """Serves one InProcessTransport on 127.0.0.1, one JSON request per line."""

    def __init__(self, transport: InProcessTransport) -> None:
        outer = transport

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    request = json.loads(line)
                    try:
                        reply = {"ok": _serve(outer, request["method"], request["args"])}
                    except Exception as error:  # the client re-raises it as a ShardingError
                        reply = {"error": f"{type(error).__name__}: {error}"}
                    self.wfile.write(json.dumps(reply).encode() + b"\n")
                    self.wfile.flush()

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        self.address = f"{host!s}:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class JsonLineTransport:
    """ShardingTransport over JSON lines; one connection, one request at a time."""

    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        host, port = address.rsplit(":", 1)
        self._socket = socket.create_connection((host, int(port)), timeout=timeout_s)
        self._reader = self._socket.makefile("rb")
        self._lock = threading.Lock()

    def _call(self, method: str, **args: Any) -> Any:
        from dlrover.sharding import ShardingError

        with self._lock:
            self._socket.sendall(json.dumps({"method": method, "args": args}).encode() + b"\n")
            reply = json.loads(self._reader.readline())
        if "error" in reply:
            raise ShardingError(f"master refused {method}: {reply['error']}")
        return reply["ok"]

    def register_dataset(self, spec: DatasetSpec) -> RegisterResult:
        return RegisterResult(**self._call("register_dataset", spec=spec.to_dict()))

    def fetch_shards(self, dataset: str, worker_id: str, max_count: int) -> FetchResult:
        reply = self._call(
            "fetch_shards", dataset=dataset, worker_id=worker_id, max_count=max_count
        )
        return FetchResult.from_dict(reply)

    def report_done(
        self, dataset: str, worker_id: str, shard_ids: Sequence[ShardId]
    ) -> ReportResult:
        ids = [i.to_list() for i in shard_ids]
        return ReportResult(
            **self._call("report_done", dataset=dataset, worker_id=worker_id, shard_ids=ids)
        )

    def report_progress(
        self, dataset: str, worker_id: str, shard_id: ShardId, consumed: int
    ) -> bool:
        return bool(
            self._call(
                "report_progress",
                dataset=dataset,
                worker_id=worker_id,
                shard_id=shard_id.to_list(),
                consumed=consumed,
            )
        )

    def renew_leases(self, dataset: str, worker_id: str) -> int:
        return int(self._call("renew_leases", dataset=dataset, worker_id=worker_id))

    def get_position(self, dataset: str) -> Position:
        return Position.from_dict(self._call("get_position", dataset=dataset))

    def restore_position(self, position: Position, token: str | None) -> bool:
        return bool(self._call("restore_position", position=position.to_dict(), token=token))

    def dataset_progress(self, dataset: str) -> DatasetProgress:
        return DatasetProgress(**self._call("dataset_progress", dataset=dataset))
