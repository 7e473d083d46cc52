"""Act on signals in a thread of their own, not in the interrupted main thread.

A Python signal handler runs in the main thread between two bytecodes, wherever that thread
is: inside ``Event.wait`` holding the event's (non-reentrant) lock, inside a logging call,
inside a lock of a library. A handler that takes any of those locks (``Event.set``, a
logger, a name-resolution client) then waits for itself forever: the process neither stops
nor answers. So the handler installed here only notes the signal and writes its number into a
pipe (``os.write``: no Python lock); a daemon thread reads the pipe and calls ``on_signal``
there, where taking locks is safe.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, Callable

log = logging.getLogger("signals")


class SignalRelay:
    """Relay ``signals`` to ``on_signal``, called in the relay's thread in the order they
    came. Install with :meth:`install` (main thread only)."""

    def __init__(self, signals: tuple[signal.Signals, ...],
                 on_signal: Callable[[signal.Signals], None]) -> None:
        self.signals = signals
        self.on_signal = on_signal
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # a full pipe drops a signal, never blocks
        self._thread = threading.Thread(target=self._relay, name="signals", daemon=True)

    def install(self) -> None:
        self._thread.start()
        for sig in self.signals:
            signal.signal(sig, self._note)

    def _note(self, signum: int, _frame: Any) -> None:
        try:
            os.write(self._write, bytes((signum,)))
        except OSError:  # (a full pipe: thousands of signals unread; one more changes nothing)
            pass

    def _relay(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                try:
                    self.on_signal(signal.Signals(signum))
                except Exception:
                    log.exception("handling %s failed", signal.Signals(signum).name)
