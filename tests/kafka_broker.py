"""A real Kafka-protocol broker for tests: noida-db's binary (``pip install noida-db==0.2.3``),
started on a free port of loopback with its own data directory, stopped by its PID."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.conftest import free_port


def kafka_missing() -> str:
    """Why Kafka tests cannot run here, or "" when they can."""
    if importlib.util.find_spec("confluent_kafka") is None:
        return "confluent-kafka is not installed (pip install 'dlrover[kafka]')"
    if importlib.util.find_spec("noida_db") is None:
        return "the test broker is not installed (pip install noida-db==0.2.3)"
    return ""


class KafkaBroker:
    """One broker process; ``bootstrap`` is its address. ``stop()`` kills it (SIGKILL loses its
    last writes, as the broker's docs say), ``stop(graceful=True)`` keeps them."""

    def __init__(self, directory: Path) -> None:
        spec = importlib.util.find_spec("noida_db")
        assert spec is not None and spec.origin is not None
        self.binary = str(Path(spec.origin).parent / "noida-db")
        self.directory = directory
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self, timeout_s: float = 30.0) -> None:
        """Run the broker (the binary itself: the console script is a wrapper with another
        PID) and wait until its port accepts connections."""
        self.log = open(self.directory / "broker.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [self.binary, "start", "--only", "kafka", "--host", "127.0.0.1",
             "--kafka-port", str(self.port), "--data-dir", str(self.directory / "data")],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the test broker exited {self.proc.returncode}: "
                    f"{(self.directory / 'broker.log').read_text()[-2000:]}"
                )
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the broker did not listen within {timeout_s}s") from None
                time.sleep(0.05)  # nothing to wait on but the port

    def stop(self, graceful: bool = False) -> None:
        """Stop the broker and wait for it: SIGKILL (it loses its last writes), or SIGTERM with
        ``graceful`` (it keeps them; ``start()`` brings it back with its data)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM if graceful else signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()

    def create_topic(self, topic: str, partitions: int) -> None:
        """Create ``topic`` with ``partitions`` partitions (waits for the broker's answer)."""
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for future in admin.create_topics([NewTopic(topic, num_partitions=partitions)]).values():
            future.result(10)

    def produce(self, topic: str, records: list[tuple[int, bytes]]) -> None:
        """Write ``(partition, value)`` records and wait until the broker has them all."""
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": self.bootstrap})
        for partition, value in records:
            producer.produce(topic, value=value, partition=partition)
        assert producer.flush(10) == 0, "the broker did not take every record within 10 s"
