"""The HTTP server's reaper thread: cuts connections whose request is late, and closes answered
ones gently.

- A handler has its connection watched (:meth:`Reaper.watch`) until the whole request is in; past the
  deadline the reaper shuts the connection's reading side, so the handler's blocked read returns
  at once (a per-read socket timeout alone lets a client that sends one byte every few seconds
  hold a thread forever).
- A connection answered before its input was read (a refusal, ``413``, ``429``) is handed to
  :meth:`Reaper.linger`: its sending side is shut and what the client still sends is read and
  dropped for up to :data:`LINGER_SECONDS`, so the client reads the answer instead of a reset.
"""
from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time

log = logging.getLogger("openai-http")

TICK = 0.1
"""Seconds between the reaper's rounds."""
LINGER_SECONDS = 2.0
"""How long an answered connection is drained before it is closed."""
MAX_LINGERING = 256
"""Connections drained at once; beyond, an answered connection is closed at once."""
DRAIN_BYTES = 8 << 20
"""Most bytes drained from one connection per round (a client's 32 MiB body takes a few)."""
ROUND_BYTES = 32 << 20
"""Most bytes drained per round from all connections together."""


@dataclasses.dataclass(eq=False)
class Deadline:
    """One connection's deadline; ``expired`` once the reaper cut it."""

    conn: socket.socket
    at: float
    expired: bool = False


class Reaper:
    """One thread per server (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: set[Deadline] = set()
        self._lingering: dict[socket.socket, float] = {}
        self._stop = threading.Event()
        self._buffer = bytearray(256 << 10)  # drained bytes land here (only the reaper reads)
        self.cut = 0
        """Connections cut at their deadline so far."""
        self._thread = threading.Thread(target=self._run, name="openai-http-reaper", daemon=True)
        self._thread.start()

    def watch(self, conn: socket.socket, seconds: float) -> Deadline:
        d = Deadline(conn, time.monotonic() + seconds)
        with self._lock:
            self._watched.add(d)
        return d

    def unwatch(self, d: Deadline) -> None:
        with self._lock:
            self._watched.discard(d)

    def linger(self, sock: socket.socket) -> None:
        """Take over closing ``sock`` (see the module's docstring)."""
        try:
            sock.setblocking(False)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        with self._lock:
            if len(self._lingering) < MAX_LINGERING:
                self._lingering[sock] = time.monotonic() + LINGER_SECONDS
                return
        sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            socks, self._lingering = list(self._lingering), {}
        for sock in socks:
            sock.close()

    def _run(self) -> None:
        while not self._stop.wait(TICK):
            try:
                self._expire(time.monotonic())
                self._drain(time.monotonic())
            except Exception:  # never let the reaper die: it is what bounds the pool's time
                log.exception("HTTP reaper round failed")

    def _expire(self, now: float) -> None:
        with self._lock:
            late = [d for d in self._watched if d.at <= now]
            self._watched.difference_update(late)
        for d in late:
            d.expired = True
            self.cut += 1
            try:
                d.conn.shutdown(socket.SHUT_RD)  # the handler's read returns b"" now
            except OSError:
                pass

    def _drain(self, now: float) -> None:
        with self._lock:
            socks = list(self._lingering.items())
        budget, done = ROUND_BYTES, []
        for sock, until in socks:
            closed, got = _drain_one(sock, self._buffer, min(budget, DRAIN_BYTES))
            budget -= got
            if closed or until <= now:
                done.append(sock)
        with self._lock:
            for sock in done:
                self._lingering.pop(sock, None)
        for sock in done:
            sock.close()


def _drain_one(sock: socket.socket, buffer: bytearray, limit: int) -> tuple[bool, int]:
    """Read and drop up to ``limit`` bytes of what has arrived: (whether the client closed or
    the socket failed, bytes read)."""
    got = 0
    try:
        while got < limit:
            n = sock.recv_into(buffer)
            if n == 0:
                return True, got
            got += n
    except (BlockingIOError, InterruptedError):
        return False, got
    except OSError:
        return True, got
    return False, got
