"""``logs/launcher.log``: a copy of what the launcher prints while it runs a controller, so
``python -m system.ctl logs`` can show it from another shell (and ``stacks``: what SIGURG makes
the launcher write, :func:`system.thread_stacks.copy_stacks_to`).

Everything still reaches the launcher's own stderr unchanged (the terminal, with its live
progress line). The file gets complete lines only, without terminal control sequences, and a
line redrawn in place (``\\r``, the live progress line) only in the form it was left in. A
``--detach`` controller's job writes its output to ``logs/controller.log`` already: no copy.

A stderr that stops taking output (a pipe whose reader has gone: ``2>&1 | head -1``; a full
disk under ``> out.log 2>&1``; none at all: ``2>&-``) must not end a trial its controller
runs, nor the clean-up after it: the first write that fails turns that stream off (its
descriptor then writes to ``/dev/null``), the log file goes on, and the trial with it.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import sys
import time
from typing import IO, Any

from system.thread_stacks import copy_stacks_to

ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07]*\x07|[@-Z\\-_])")
"""Terminal control sequences (CSI, OSC, and two-byte escapes)."""


class LineTee:
    """A text stream that writes to ``stream`` and appends complete, cleaned lines to ``log``
    (None: no copy); a ``stream`` that fails a write is written to no more (see the module).
    Every other attribute is ``stream``'s."""

    def __init__(self, stream: IO[str] | None, log: IO[str] | None) -> None:
        self.stream: IO[str] = stream if stream is not None else open(os.devnull, "w")
        self.log = log
        self.lost: str | None = None
        """Why ``stream`` takes no more output (None: it does)."""
        self._pending = ""

    def write(self, text: str) -> int:
        if self.lost is None:
            try:
                self.stream.write(text)
            except (OSError, ValueError) as e:
                self._lose(e)
        if self.log is None:
            return len(text)
        try:
            self._pending += ANSI.sub("", text)
            *lines, rest = self._pending.split("\n")
            self._pending = rest.rsplit("\r", 1)[-1]
            for line in lines:
                line = line.rsplit("\r", 1)[-1].rstrip()
                if line:
                    self.log.write(line + "\n")
            if lines:
                self.log.flush()
        except (OSError, ValueError):  # a full disk or a closed file must not stop the trial
            pass
        return len(text)

    def flush(self) -> None:
        if self.lost is None:
            try:
                self.stream.flush()
            except (OSError, ValueError) as e:
                self._lose(e)

    def _lose(self, e: BaseException) -> None:
        self.lost = f"{type(e).__name__}: {e}"
        try:  # what else writes to the descriptor (the interpreter's last flush, a dump of
            fd = self.stream.fileno()  # the stacks) must not fail either
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        except (OSError, ValueError, AttributeError):
            pass
        if self.log is not None:
            try:
                self.log.write(f"(standard error takes no more output: {self.lost}; this file "
                               "goes on)\n")
                self.log.flush()
            except (OSError, ValueError):
                pass

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self.stream, name)


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def run_header(command: str) -> str:
    """The line that opens one launcher's part of the log (the file is appended to by every
    launch of the trial): when, where and what ran."""
    when = time.strftime("%Y-%m-%d %H:%M:%S %z")
    return f"=== {when} on {socket.gethostname()}, pid {os.getpid()}: {command}"


def tee_stderr(logs_dir: str, command: str) -> None:
    """Copy this process's stderr (``print``, logging, tracebacks) to
    ``<logs_dir>/launcher.log`` after a :func:`run_header` naming ``command``, unless stderr
    already is ``<logs_dir>/controller.log``; the stacks SIGURG writes too. Either way, a
    stderr that fails a write is not written to again (see the module)."""
    log: IO[str] | None = None
    if not _same_file(2, os.path.join(logs_dir, "controller.log")):
        path = os.path.join(logs_dir, "launcher.log")
        try:
            log = open(path, "a", encoding="utf-8")
            log.write(("\n" if log.tell() else "") + run_header(command) + "\n")
            log.flush()
            copy_stacks_to(path)
        except OSError as e:
            log = None
            print(f"warning: no launcher.log ({e})", file=sys.stderr)
    old = sys.stderr
    sys.stderr = LineTee(old, log)  # type: ignore[assignment]
    for handler in logging.getLogger().handlers:  # basicConfig's handler holds the old stream
        if isinstance(handler, logging.StreamHandler) and handler.stream is old:
            handler.setStream(sys.stderr)
