"""docs/streaming.md's "Try it", run as written against the real broker binary (CI's extras
stage installs noida-db and confluent-kafka)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.docs.blocks import Shell, doc_block, marker_id, user_dir, user_env, wait_for
from tests.kafka_broker import kafka_missing

pytestmark = [
    pytest.mark.extras,
    pytest.mark.skipif(bool(kafka_missing()), reason=kafka_missing() or "ready"),
]


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return False
    except OSError:
        return True


def test_try_it(tmp_path: Path) -> None:
    """Substituted: the broker's port 9092 becomes a free one (a CI machine may have a broker, or
    another test's), and /tmp/ the test's directory (a second run must not resume from the
    first's checkpoint). Promised: the topic is created, the job prints step 200/200, its
    checkpoint is at step 200, and `kill $BROKER` stops the broker itself."""
    block = doc_block(marker_id(__file__, "test_try_it"))
    port = free_port()
    text = block.text.replace("9092", str(port)).replace("/tmp/", f"{tmp_path}/")
    shell = Shell(text, user_dir(tmp_path), user_env(tmp_path), tmp_path / "shell.log")
    try:
        code = shell.wait(timeout=240)
        out = shell.output()
        assert code == 0, out[-4000:]
        assert "step 200/200 loss" in out, out[-4000:]
        assert (tmp_path / "kafka-ckpt" / "latest").read_text().strip() == "200"
        wait_for("the broker to stop", lambda: refused(port), timeout=30)
    finally:
        shell.close()
