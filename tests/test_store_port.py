"""The rank-0 worker's store port: kept from everyone else on the machine until that worker binds it.

Two jobs on one busy machine once drew the same port: the agent found it free, a moment later
another process took it, and the worker's TCPStore failed with EADDRINUSE (a restart spent)."""

from __future__ import annotations

import errno
import socket

import pytest

from dlrover.agent.agent import free_port


def test_no_one_else_is_given_the_port_but_the_store_binds_it() -> None:
    port = free_port()
    # Other processes asking the kernel for a free port are not given it...
    given = set()
    for _ in range(2000):
        with socket.socket() as other:
            other.bind(("", 0))
            given.add(other.getsockname()[1])
    assert port not in given
    # ...nor can one take it by number without SO_REUSEADDR...
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("", port))
    assert taken.value.errno == errno.EADDRINUSE
    # ...while the store's listener, which sets SO_REUSEADDR, binds it at once.
    with socket.socket() as store:
        store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        store.bind(("", port))
        store.listen(1)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            accepted, _ = store.accept()
            accepted.close()


def test_torch_stores_of_both_backends_listen_on_it() -> None:
    torch_distributed = pytest.importorskip("torch.distributed")
    for libuv in (True, False):
        port = free_port()
        store = torch_distributed.TCPStore("127.0.0.1", port, 1, True, use_libuv=libuv)
        store.set("k", "v")
        assert store.get("k") == b"v"
