"""`dlrover-ps`: one embedding server, a process of its own (see docs/embedding.md)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from dlrover import constants as c
from dlrover.cli.common import setup_logging

logger = logging.getLogger("dlrover.ps")

ENV_PS_ADDR = "DLROVER_PS_ADDR"
"""What ``--write-env`` writes: the address the server listens on."""


def build_parser() -> argparse.ArgumentParser:
    """The ``dlrover-ps`` command line."""
    p = argparse.ArgumentParser(
        prog="dlrover-ps",
        description="Run one DLRover embedding server: sparse tables for ElasticEmbedding, "
        "partitioned over the job's servers by virtual buckets. Prints its address.",
    )
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (default loopback).")
    p.add_argument("--port", type=int, default=0, help="Port; 0 picks a free one (default).")
    p.add_argument(
        "--token",
        default=None,
        help=f"The job token every call must carry (default: ${c.ENV_JOB_TOKEN}).",
    )
    p.add_argument(
        "--write-env",
        default="",
        metavar="FILE",
        help=f"Write {ENV_PS_ADDR}=host:port to FILE once listening (atomically).",
    )
    p.add_argument("--threads", type=int, default=8, help="Request threads (default 8).")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT; exit 2 on bad arguments, 1 if the port cannot be bound."""
    args = build_parser().parse_args(argv)
    setup_logging("dlrover-ps")
    token = args.token if args.token is not None else os.environ.get(c.ENV_JOB_TOKEN, "")
    if not token:
        print(
            f"dlrover-ps: no job token: pass --token or set {c.ENV_JOB_TOKEN} (the token the "
            "job's master printed)",
            file=sys.stderr,
        )
        return 2
    from dlrover.embedding.server import EmbeddingServer

    try:
        server = EmbeddingServer(token, args.host, args.port, args.threads).start()
    except (OSError, RuntimeError) as e:
        print(f"dlrover-ps: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    print(f"{ENV_PS_ADDR}={server.address}", flush=True)
    if args.write_env:
        tmp = args.write_env + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{ENV_PS_ADDR}={server.address}\n")
        os.replace(tmp, args.write_env)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    server.stop(2.0)
    logger.info("embedding server on %s stopped", server.address)
    return 0


if __name__ == "__main__":
    sys.exit(main())
