"""Where every thread of this process is: as text, what a worker logs before it exits because
its role did not stop (a hang that left no other trace); and on demand, :data:`STACKS_SIGNAL`
makes a worker write every thread's stack to its log and go on, as a JVM's thread dump does
(``python -m system.ctl stacks`` and the controller, before it stops a hung trial, send it).

The signal is taken by a thread of its own (``sigwait``; it is blocked in every other thread),
which reads the stacks under the interpreter lock (``sys._current_frames``): a main thread
stuck in a call that never returns to the interpreter (a collective, a socket) is shown at the
frame that made the call. Not faulthandler's dump, which reads the other threads' frames from
the signal handler without that lock: a CI run saw it crash a busy vLLM server (SIGSEGV in
``dump_frame``). The one process it cannot show is one where a thread never releases that lock.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import traceback

STACKS_SIGNAL = signal.SIGURG
"""The signal on which a process set up by :func:`dump_stacks_on_signal` writes its stacks.
SIGURG (out-of-band data on a socket that asked for it with ``F_SETOWN``: none here), because
its default is to be ignored: a process that has not set it up (still importing, a worker's
child of another program, a Slurm batch script) is not harmed by it, where SIGQUIT or SIGUSR1
would end it. Slurm's ``scancel --signal=URG`` sends it to a job's tasks."""

SCANCEL_STACKS = f"--signal={STACKS_SIGNAL.name[3:]}"
"""``scancel``'s option that sends :data:`STACKS_SIGNAL` to a job's tasks."""

STACKS_HEADER = "every thread's stack, on request"
"""The first line of what :data:`STACKS_SIGNAL` writes (then :func:`thread_stacks`)."""

_listening = 0  # the pid whose thread waits for the signal (a forked child must start its own)
_copies: list[str] = []  # files that get the stacks too


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
    (the worker's log, descriptor 2 whatever is on it then) and the process goes on. Call it
    in the main thread before any other thread starts (threads made later, by any library,
    inherit the signal blocked), and again in a child forked later (threads do not survive a
    fork; the blocked signal does)."""
    global _listening
    if _listening == os.getpid():
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {STACKS_SIGNAL})
    _listening = os.getpid()
    threading.Thread(target=_write_stacks_on_signal, name="stacks", daemon=True).start()


def copy_stacks_to(path: str) -> None:
    """Append what :data:`STACKS_SIGNAL` writes to file ``path`` too (the launcher's standard
    error is a terminal; its ``launcher.log`` is where ``python -m system.ctl stacks`` reads)."""
    if path not in _copies:
        _copies.append(path)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _write_stacks_on_signal() -> None:
    while True:
        signal.sigwait({STACKS_SIGNAL})
        # (no Python lock: a stuck thread may hold the logging's or stderr's)
        data = f"{STACKS_HEADER}:\n{thread_stacks()}\n".encode(errors="replace")
        try:
            _write_all(2, data)
        except OSError:
            pass
        for path in list(_copies):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                _write_all(fd, data)
            except OSError:
                pass
            finally:
                os.close(fd)


def handles_stacks_signal(pid: int) -> bool:
    """Whether live process ``pid`` waits for :data:`STACKS_SIGNAL` (blocked in its main
    thread: ``SigBlk`` in ``/proc/PID/status``); one still starting ignores the signal."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigBlk:"):
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


__all__ = ["SCANCEL_STACKS", "STACKS_HEADER", "STACKS_SIGNAL", "ask_for_stacks",
           "copy_stacks_to", "dump_stacks_on_signal", "handles_stacks_signal", "thread_stacks"]
