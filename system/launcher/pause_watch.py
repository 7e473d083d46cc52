"""Noticing that this process was stopped (SIGSTOP, a suspended machine): a thread that ticks
every :data:`TICK` seconds of ``CLOCK_BOOTTIME`` (which, unlike ``CLOCK_MONOTONIC``, goes on
while the machine sleeps). A tick that comes much later than due is a pause of the whole
process, wherever its main thread was at the time; :meth:`PauseWatch.take` reports the longest
since it was last asked."""
from __future__ import annotations

import threading
import time

TICK = 0.5
"""Seconds between the thread's ticks."""


def boottime() -> float:
    """Seconds of ``CLOCK_BOOTTIME`` (suspend included), else of the monotonic clock."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock) if clock is not None else time.monotonic()


class PauseWatch:
    """The longest pause of this process (seconds beyond a tick's due time)."""

    def __init__(self, clock=boottime) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last = clock()
        self._longest = 0.0
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="pause-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(TICK):
            self._tick()

    def _tick(self) -> float:
        """Note the time; the lateness it found (the lock is taken)."""
        with self._lock:
            now = self._clock()
            late = max(0.0, now - self._last - TICK)
            self._longest = max(self._longest, late)
            self._last = now
            return late

    def take(self) -> float:
        """The longest pause since the last call (a pause that just ended, before the thread
        ticked again, included), and forget it."""
        self._tick()
        with self._lock:
            longest, self._longest = self._longest, 0.0
            return longest

    def close(self) -> None:
        self._stop.set()
