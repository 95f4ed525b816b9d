"""Command-line entry points; nothing imports this package, it only wires parts together."""

import os

# gRPC's fork handlers only log noise when the agent forks workers while its threads use gRPC.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
