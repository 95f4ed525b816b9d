"""Fixtures of the embedding server tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dlrover.embedding.server import EmbeddingServer

TOKEN = "tok"
"""The job token of `server`."""


@pytest.fixture
def server() -> Iterator[EmbeddingServer]:
    """One embedding server (gRPC on port 0, job token TOKEN), stopped after the test."""
    started = EmbeddingServer(TOKEN).start()
    try:
        yield started
    finally:
        started.stop(0.1)
