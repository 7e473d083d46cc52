"""Where every thread of this process is: as text, what a worker logs before it exits because
its role did not stop (a hang that left no other trace); and on demand, :data:`STACKS_SIGNAL`
(SIGQUIT, as a JVM's thread dump) makes a worker write every thread's stack to its log and go
on (``python -m system.ctl stacks`` sends it to a trial's workers)."""
from __future__ import annotations

import faulthandler
import signal
import sys
import threading
import traceback

STACKS_SIGNAL = signal.SIGQUIT
"""The signal on which a process set up by :func:`dump_stacks_on_signal` writes its stacks."""


def thread_stacks() -> str:
    """Each live thread's name and current stack, innermost call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame)).rstrip()
        parts.append(f"thread {names.get(ident, '?')} ({ident}):\n{stack}")
    return "\n".join(parts)


def dump_stacks_on_signal() -> None:
    """From now on :data:`STACKS_SIGNAL` writes every thread's Python stack to standard error
    (the worker's log) and the process goes on, instead of dumping core. faulthandler writes
    from the signal handler itself, in C: a main thread stuck inside a call that never returns
    to the interpreter (a collective, a blocking socket) is shown as well. A child forked later
    inherits it; its file is descriptor 2, whatever is on it then (a spare's worker, forked,
    puts its own log there)."""
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


__all__ = ["STACKS_SIGNAL", "dump_stacks_on_signal", "thread_stacks"]
