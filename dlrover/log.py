"""How every DLRover process logs: to stderr at DLROVER_LOG_LEVEL, each line tagged with the
process's part (``[dlrover-run]``, ``[dlrover]``, the Ray master actor's)."""

from __future__ import annotations

import logging
import os
import sys

from dlrover.constants import ENV_LOG_LEVEL

__all__ = ["setup_logging"]


def setup_logging(name: str) -> None:
    """Log to stderr at DLROVER_LOG_LEVEL (default INFO), each line tagged ``[name]``; gRPC's own
    loggers only from WARNING."""
    level = os.environ.get(ENV_LOG_LEVEL, "INFO").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format=f"[{name}] %(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    # gRPC's own loggers are noisy at INFO.
    logging.getLogger("grpc").setLevel(logging.WARNING)
