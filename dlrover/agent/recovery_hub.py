"""The agent's end of in-process recovery: which workers opted in, and what they are told.

Serves ``DLROVER_RECOVERY_SOCKET`` (channel: `dlrover.recovery_channel`). A wrapped worker
connects and says `Hello`; a connection that ends is a worker that is gone. The agent asks
`opted_in` before it keeps survivors instead of restarting them, `abort`s them, waits until
they are `parked` (their collectives released), and hands each the next round.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Collection, Mapping

from dlrover.json_messages import MessageError
from dlrover.recovery_channel import (
    Abort,
    Hello,
    NewRound,
    Parked,
    decode_worker_message,
    encode_message,
)

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5.0
"""A worker that does not take a message within this long is treated as gone."""


class _Link:
    """One worker's connection."""

    def __init__(self, conn: socket.socket, hello: Hello) -> None:
        self.conn = conn
        self.local_rank = hello.local_rank
        self.pid = hello.pid
        self.shrink = hello.shrink
        self.parked: str | None = None
        """Why the worker left its training function, once it said `Parked`."""
        self.asked = False
        """The agent sent `Abort` since the last round: a park is an answer, not news."""


class RecoveryHub:
    """The workers of this node that recover in-process, by local rank."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._cond = threading.Condition()
        self._links: dict[int, _Link] = {}
        self._closed = False
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        os.chmod(path, 0o600)
        self._server.listen(64)
        self._thread = threading.Thread(target=self._accept, name="recovery-hub", daemon=True)
        self._thread.start()

    # --- what the agent asks ---------------------------------------------------------------
    def opted_in(self, pids: Mapping[int, int]) -> bool:
        """Whether every worker in ``pids`` (local rank -> pid) said `Hello` and is connected."""
        with self._cond:
            return bool(pids) and all(
                (link := self._links.get(lr)) is not None and link.pid == pid
                for lr, pid in pids.items()
            )

    def shrink(self, local_ranks: Collection[int]) -> bool:
        """Whether these workers go on without a failed local rank (all said so in `Hello`)."""
        with self._cond:
            links = [self._links.get(lr) for lr in local_ranks]
        return bool(links) and all(link is not None and link.shrink for link in links)

    def parked_unasked(self) -> dict[int, str]:
        """Local rank -> why, of the workers that left their training function by themselves
        (a collective failed and no `Abort` came within their confirm time)."""
        with self._cond:
            return {
                lr: link.parked
                for lr, link in self._links.items()
                if link.parked is not None and not link.asked
            }

    def abort(self, local_ranks: Collection[int], reason: str, at_step_end: bool = False) -> None:
        """Tell these workers to leave their training function (those not parked yet); with
        ``at_step_end`` once their current step is done."""
        with self._cond:
            links = [self._links[lr] for lr in local_ranks if lr in self._links]
            for link in links:
                link.asked = True
        for link in links:
            if link.parked is None:
                self._send(link, encode_message(Abort(reason, at_step_end)))

    def wait_parked(self, local_ranks: Collection[int], timeout: float) -> set[int]:
        """Wait up to ``timeout`` s until these workers are parked; the ones that are (a worker
        that is gone counts as not parked)."""
        deadline = time.monotonic() + timeout

        def parked() -> set[int]:
            return {
                lr
                for lr in local_ranks
                if (link := self._links.get(lr)) is not None and link.parked is not None
            }

        with self._cond:
            while True:
                done = parked()
                left = deadline - time.monotonic()
                if len(done) == len(local_ranks) or left <= 0:
                    return done
                self._cond.wait(left)

    def send_round(self, local_rank: int, rdzv_round: int, env: dict[str, str]) -> bool:
        """Hand a parked worker its next round; False if it is gone."""
        with self._cond:
            link = self._links.get(local_rank)
            if link is None:
                return False
            link.parked, link.asked = None, False
        return self._send(link, encode_message(NewRound(rdzv_round, env)))

    def close(self) -> None:
        """Drop every link and the socket (the workers' links end)."""
        with self._cond:
            self._closed = True
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            _close(link.conn)
        _close(self._server)
        try:
            os.unlink(self.path)
        except OSError:
            pass

    # --- connections -----------------------------------------------------------------------
    def _send(self, link: _Link, line: bytes) -> bool:
        try:
            link.conn.sendall(line)
            return True
        except OSError as e:
            logger.warning("worker at local rank %d is gone (%s)", link.local_rank, e)
            self._drop(link)
            return False

    def _drop(self, link: _Link) -> None:
        with self._cond:
            if self._links.get(link.local_rank) is link:
                del self._links[link.local_rank]
            self._cond.notify_all()
        _close(link.conn)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            # Reads wait for the worker (blocking); a send gives up after SEND_TIMEOUT_S.
            conn.setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S), 0)
            )
            threading.Thread(
                target=self._serve, args=(conn,), name="recovery-link", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        link: _Link | None = None
        reader = conn.makefile("rb")
        try:
            for line in reader:
                message = decode_worker_message(line)
                with self._cond:
                    if self._closed:
                        return
                    if isinstance(message, Hello):
                        link = _Link(conn, message)
                        self._links[message.local_rank] = link
                        logger.info(
                            "local rank %d (pid %d) recovers in-process", link.local_rank, link.pid
                        )
                    elif isinstance(message, Parked) and link is not None:
                        link.parked = message.error or "parked"
                    self._cond.notify_all()
        except (OSError, MessageError) as e:
            logger.warning("recovery link of a worker ended: %s", e)
        finally:
            if link is not None:
                self._drop(link)
            else:
                _close(conn)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
