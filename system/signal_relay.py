"""Act on signals in a thread of their own, not in the interrupted main thread.

A Python signal handler runs in the main thread between two bytecodes, wherever that thread
is: inside ``Event.wait`` holding the event's (non-reentrant) lock, inside a logging call,
inside a lock of a library. A handler that takes any of those locks (``Event.set``, a
logger, a name-resolution client) then waits for itself forever: the process neither stops
nor answers. So the handler installed here only notes the signal and writes its number into a
pipe (``os.write``: no Python lock); a daemon thread reads the pipe and calls ``on_signal``
there, where taking locks is safe.

And a Python handler runs only once the main thread is back in Python: one in a long call of C
(a gloo collective waiting for a peer, a call of a native library) hears of Slurm's warning
only when that call returns, perhaps after the job was killed. So the signal's number is also
written by the interpreter's own C handler, the moment the signal comes
(:func:`signal.set_wakeup_fd`, on a second pipe), and the thread acts on that. The Python
handler's note then only tells the thread that it already acted; it acts on the note itself
where the wakeup pipe said nothing (another part of the process took the wakeup fd for its own).
"""
from __future__ import annotations

import logging
import os
import select
import signal
import threading
from typing import Any, Callable

log = logging.getLogger("signals")


class SignalRelay:
    """Relay ``signals`` to ``on_signal``, called in the relay's thread in the order they
    came, once each. Install with :meth:`install` (main thread only)."""

    def __init__(self, signals: tuple[signal.Signals, ...],
                 on_signal: Callable[[signal.Signals], None]) -> None:
        self.signals = signals
        self.on_signal = on_signal
        self._read, self._write = os.pipe()  # the Python handler's notes
        self._wake_read, self._wake_write = os.pipe()  # the C handler's, at once
        for fd in (self._write, self._wake_write):
            os.set_blocking(fd, False)  # a full pipe drops a signal, never blocks
        self._early: set[int] = set()
        """Signals acted on from the wakeup pipe whose Python handler's note is yet to come (a
        second wakeup byte meanwhile is the same signal again, which Python runs its handler
        for once: not acted on twice)."""
        self._before: dict[int, Any] = {}  # what install() replaced
        self._thread = threading.Thread(target=self._relay, name="signals", daemon=True)

    def install(self) -> None:
        self._thread.start()
        for sig in self.signals:
            self._before[sig] = signal.signal(sig, self._note)
        signal.set_wakeup_fd(self._wake_write, warn_on_full_buffer=False)
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        """In a child forked from this process (vLLM's engine core, forked by
        multiprocessing on a GPU): its signals are its own; neither pipe, both inherited, may
        carry them to this process's relay thread (the worker would act on the child's
        SIGTERM as its own). Each relayed signal gets back what it had before :meth:`install`,
        but SIGUSR2: Slurm's warning reaches every process of the job, and is this process's to
        act on (it stops its children), not a kill of the child (its default)."""
        try:
            theirs = signal.set_wakeup_fd(-1)
            if theirs != self._wake_write:  # (another part's own: put back)
                signal.set_wakeup_fd(theirs)
        except (ValueError, OSError) as e:  # (theirs closed since, say)
            log.debug("the forked child's wakeup fd: %s", e)
        for sig in self.signals:
            try:
                if signal.getsignal(sig) == self._note:
                    before = self._before.get(sig)  # (None: not set from Python)
                    signal.signal(sig, _ignore_warning if sig == signal.SIGUSR2
                                  else signal.SIG_DFL if before is None else before)
            except (ValueError, OSError, TypeError) as e:
                log.debug("the forked child's %s handler: %s", signal.Signals(sig).name, e)

    def _note(self, signum: int, _frame: Any) -> None:
        try:
            os.write(self._write, bytes((signum,)))
        except OSError:  # (a full pipe: thousands of signals unread; one more changes nothing)
            pass

    def _relay(self) -> None:
        poll = select.poll()  # (not select(): a worker's fds may be numbered past 1024)
        poll.register(self._wake_read, select.POLLIN)
        poll.register(self._read, select.POLLIN)
        while True:
            try:
                ready = {fd for fd, _ in poll.poll()}
                # the wakeup pipe first: its byte is written before the same signal's note
                woke = os.read(self._wake_read, 64) if self._wake_read in ready else b""
                noted = os.read(self._read, 64) if self._read in ready else None
            except InterruptedError:
                continue
            except Exception:  # noqa: BLE001 - said, not silent: no signal is relayed after
                log.exception("the signal relay stopped")
                return
            if noted == b"":
                return
            for signum in woke:
                if signum in self.signals and signum not in self._early:
                    self._early.add(signum)
                    self._act(signum)
            for signum in noted or b"":
                if signum in self._early:
                    self._early.discard(signum)  # (acted on already, from the wakeup pipe)
                else:
                    self._act(signum)

    def _act(self, signum: int) -> None:
        try:
            self.on_signal(signal.Signals(signum))
        except Exception:
            log.exception("handling %s failed", signal.Signals(signum).name)


def _ignore_warning(_signum: int, _frame: Any) -> None:
    """SIGUSR2 in a forked child: the parent acts on Slurm's warning (a Python handler, not
    ``SIG_IGN``, which an ``exec`` would keep)."""
