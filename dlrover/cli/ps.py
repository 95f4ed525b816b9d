"""`dlrover-ps`: one embedding server, a process of its own (see docs/embedding.md)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence

from dlrover import constants as c
from dlrover.cli.common import setup_logging
from dlrover.constants import ENV_PS_ADDR
from dlrover.coordination import PS_ADDRESS

logger = logging.getLogger("dlrover.ps")


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
    p.add_argument(
        "--advertise",
        default="",
        metavar="HOST",
        help="The host others reach this server at (default: --host, or this machine's address "
        "when --host is 0.0.0.0).",
    )
    return p


def _advertised(address: str, host: str, advertise: str) -> str:
    port = address.rpartition(":")[2]
    if advertise:
        return f"{advertise}:{port}"
    if host in ("0.0.0.0", "::", ""):
        return f"{socket.gethostbyname(socket.gethostname())}:{port}"
    return address


def _register(address: str, token: str) -> str | None:
    """Tell the master that launched this server (``$DLROVER_MASTER_ADDR``, node
    ``$DLROVER_NODE_NAME``) where it listens; an error message, or None."""
    master, node = os.environ.get(c.ENV_MASTER_ADDR, ""), os.environ.get(c.ENV_NODE_NAME, "")
    if not master or not node:
        return None  # started by hand: the user passes the address on
    from dlrover.client.master_client import MasterClient, MasterClientError

    client = MasterClient(master, token)
    try:
        client.wait_ready(30)
        PS_ADDRESS.put(client, address, node)
    except MasterClientError as e:
        return f"cannot register with the job's master at {master}: {e}"
    finally:
        client.close()
    logger.info("registered as %s with the master at %s", node, master)
    return None


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
    try:
        from dlrover.embedding.server import EmbeddingServer
    except ImportError as e:  # numpy is the one dependency beyond the base install
        print(f"dlrover-ps: {e}: pip install 'dlrover[ps]'", file=sys.stderr)
        return 2

    try:
        server = EmbeddingServer(token, args.host, args.port, args.threads).start()
    except ValueError as e:
        print(f"dlrover-ps: --threads {args.threads}: {e}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as e:
        print(f"dlrover-ps: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    address = _advertised(server.address, args.host, args.advertise)
    print(f"{ENV_PS_ADDR}={address}", flush=True)
    if args.write_env:
        tmp = args.write_env + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{ENV_PS_ADDR}={address}\n")
        os.replace(tmp, args.write_env)
    refused = _register(address, token)
    if refused:
        print(f"dlrover-ps: {refused}", file=sys.stderr)
        server.stop(0.5)
        return 1
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
