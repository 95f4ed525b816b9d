"""build_master: a setting that cannot be used is a clear error, and leaves nothing bound."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import pytest

from dlrover.master.assembly import MasterSettings, build_master
from dlrover.master.server import MasterServerError
from dlrover.master.tensorboard import TensorBoardError
from dlrover.master.web import WebError
from tests.conftest import free_port


def _loop_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "dlrover-master-grpc")


def _settings(port: int, **kwargs: object) -> MasterSettings:
    return MasterSettings("asm", "tok", host="127.0.0.1", port=port, **kwargs)  # type: ignore[arg-type]


def test_a_taken_metrics_port_is_its_own_error_and_frees_the_grpc_port() -> None:
    """Not a MasterServerError (dlrover-run reads that as "another node hosts the master"): the
    message says the port is taken and how to choose another; the gRPC server it had bound is
    stopped, its port free and its loop thread gone."""
    assert not issubclass(WebError, MasterServerError)
    port = free_port()
    threads = _loop_threads()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        with pytest.raises(WebError) as raised:
            build_master(_settings(port, metrics_port=taken))
    assert str(raised.value) == (
        f"cannot serve metrics on 127.0.0.1:{taken}: the port is taken; pick another "
        "--metrics-port (0: a free one, -1: none)"
    )
    assert _loop_threads() == threads
    again = build_master(_settings(port, metrics_port=None))  # the gRPC port is free again
    again.stop(0.0)


def test_an_unwritable_tensorboard_dir_fails_before_anything_listens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The exporter is built before the servers: no node can register with a master that is
    about to stop, and neither port stays bound."""
    caplog.set_level(logging.INFO, logger="dlrover.master.server")
    (tmp_path / "file").write_text("")
    port, metrics_port = free_port(), free_port()
    threads = _loop_threads()
    with pytest.raises(TensorBoardError, match="give a writable --tensorboard-dir"):
        build_master(
            _settings(
                port, metrics_port=metrics_port, tensorboard_dir=str(tmp_path / "file" / "tb")
            )
        )
    assert "listening on" not in caplog.text
    assert _loop_threads() == threads
    again = build_master(_settings(port, metrics_port=metrics_port))  # both ports are free
    again.stop(0.0)
