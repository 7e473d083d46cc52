"""Hold the stop signals (Ctrl-C, SIGTERM, SIGHUP, and SIGUSR2: Slurm's time-limit warning)
while a step that must not be cut in half runs: a ``sbatch`` whose job id would otherwise be
lost (the job queued, nobody to cancel it).
A signal that came meanwhile is acted on, with the handler that was in place, as soon as the
step ends."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)


@contextlib.contextmanager
def held_signals(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """For the block's duration, ``signals`` only get noted: their Python handlers (which run
    in the main thread, whichever thread the kernel picked) are replaced, and the main thread
    blocks them, so a child it starts meanwhile inherits the mask (a terminal's Ctrl-C does
    not kill it either: bound it with a timeout). Afterwards each noted signal is raised again
    under the restored handler. Nothing changes outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []

    def note(signum: int, _frame: Any) -> None:
        noted.append(signum)

    handlers = {s: signal.signal(s, note) for s in signals}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        pending = set(signals) & signal.sigpending()  # (sent to this thread, or to the process
        while pending:                                #  while every other thread blocks them)
            got = signal.sigtimedwait(pending, 0)
            if got is None:
                break
            noted.append(got.si_signo)
            pending.discard(signal.Signals(got.si_signo))
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, h in handlers.items():
            signal.signal(s, h)
        for s in dict.fromkeys(noted):  # once each, in the order they came
            signal.raise_signal(s)
