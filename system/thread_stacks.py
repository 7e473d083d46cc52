"""Where every thread of this process is: as text, what a worker logs before it exits because
its role did not stop (a hang that left no other trace); and on demand, :data:`STACKS_SIGNAL`
makes a worker write every thread's stack to its log and go on, as a JVM's thread dump does
(``python -m system.ctl stacks`` and the controller, before it stops a hung trial, send it)."""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import traceback

STACKS_SIGNAL = signal.SIGURG
"""The signal on which a process set up by :func:`dump_stacks_on_signal` writes its stacks.
SIGURG (out-of-band data on a socket that asked for it with ``F_SETOWN``: none here), because
its default is to be ignored: a process that has not set the handler up (still importing, a
worker's child of another program, a Slurm batch script) is not harmed by it, where SIGQUIT
or SIGUSR1 would end it. Slurm's ``scancel --signal=URG`` sends it to a job's tasks."""


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
    (the worker's log) and the process goes on. faulthandler writes from the signal handler
    itself, in C: a main thread stuck inside a call that never returns to the interpreter (a
    collective, a blocking socket) is shown as well. A child forked later inherits it; its
    file is descriptor 2, whatever is on it then (a spare's worker, forked, puts its own log
    there)."""
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def handles_stacks_signal(pid: int) -> bool:
    """Whether live process ``pid`` has a handler of its own for :data:`STACKS_SIGNAL`
    (``SigCgt`` in ``/proc/PID/status``): one still starting ignores the signal."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (STACKS_SIGNAL - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def ask_for_stacks(pid: int) -> bool:
    """:data:`STACKS_SIGNAL` to process ``pid`` alone (not its group) if it handles it;
    whether it was sent."""
    if not handles_stacks_signal(pid):
        return False
    try:
        os.kill(pid, STACKS_SIGNAL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


__all__ = ["STACKS_SIGNAL", "ask_for_stacks", "dump_stacks_on_signal", "handles_stacks_signal",
           "thread_stacks"]
