"""A deadline on reward functions: one that never returns (a verifier called without a
time-out, a sandbox that hangs) stalled the trial for ever, silently: its rollout worker kept
heart-beating, its leases ran out and were handed out again to the next call that hung.

The reward still runs in the caller's thread (a reward that times itself out with
``signal.alarm``, as math verifiers do, needs the main thread), and a call in Python cannot be
interrupted: a watchdog thread notices the call running past ``rl.task.reward_timeout`` and
calls ``expired(message)``, which in a worker reports the failure (a ConfigError: a restart
would hang again) and ends the process."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

PERIOD = 0.5
"""Seconds between two looks of the watchdog."""


class RewardWatch:
    """Watches one call at a time (``watching``); ``timeout`` 0 watches nothing."""

    def __init__(self, timeout: float, expired: Callable[[str], None],
                 period: float = PERIOD) -> None:
        self.timeout, self.period = timeout, period
        self._expired = expired
        self._lock = threading.Lock()
        self._current: tuple[float, str] | None = None  # (deadline, what runs)
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """Around one call of the reward function ``what`` (its name and input)."""
        if self.timeout <= 0:
            yield
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="reward-watch",
                                                daemon=True)
                self._thread.start()
            self._current = (time.monotonic() + self.timeout, what)
        try:
            yield
        finally:
            with self._lock:
                self._current = None

    def _run(self) -> None:
        while True:
            time.sleep(self.period)
            with self._lock:
                current = self._current
            if current is not None and time.monotonic() > current[0]:
                self._expired(f"{current[1]} did not return within {self.timeout:g}s "
                              "(rl.task.reward_timeout); valid: a reward function that "
                              "returns (one that calls a service: with a time-out of its own), "
                              "or a larger rl.task.reward_timeout")
                return
