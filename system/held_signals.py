"""Hold the stop signals (Ctrl-C, SIGTERM, SIGHUP) pending while a step that must not be cut in
half runs: a ``sbatch`` whose job id would otherwise be lost (the job queued, nobody to cancel
it). The signal is delivered, and acted on as usual, as soon as the step ends."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def held_signals(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Block ``signals`` in this thread for the block's duration (only the main thread runs
    Python's signal handlers; elsewhere nothing changes). A child started meanwhile inherits
    the mask: a terminal's Ctrl-C does not kill it either, so it finishes what it was doing
    (bound it with a timeout)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
