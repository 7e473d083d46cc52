"""``logs/launcher.log``: a copy of what the launcher prints while it runs a controller, so
``python -m system.ctl logs`` can show it from another shell (and ``stacks``: what SIGURG makes
the launcher write, :func:`system.thread_stacks.copy_stacks_to`).

Everything still reaches the launcher's own stderr unchanged (the terminal, with its live
progress line). The file gets complete lines only, without terminal control sequences, and a
line redrawn in place (``\\r``, the live progress line) only in the form it was left in. A
``--detach`` controller's job writes its output to ``logs/controller.log`` already: no copy.
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
    """A text stream that writes to ``stream`` and appends complete, cleaned lines to
    ``log``; every other attribute is ``stream``'s."""

    def __init__(self, stream: IO[str], log: IO[str]) -> None:
        self.stream = stream
        self.log = log
        self._pending = ""

    def write(self, text: str) -> int:
        n = self.stream.write(text)
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
        return n

    def flush(self) -> None:
        self.stream.flush()

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
    already is ``<logs_dir>/controller.log``; the stacks SIGURG writes too."""
    if _same_file(2, os.path.join(logs_dir, "controller.log")):
        return
    path = os.path.join(logs_dir, "launcher.log")
    try:
        log = open(path, "a", encoding="utf-8")
        log.write(("\n" if log.tell() else "") + run_header(command) + "\n")
        log.flush()
    except OSError as e:
        print(f"warning: no launcher.log ({e})", file=sys.stderr)
        return
    old = sys.stderr
    sys.stderr = LineTee(old, log)  # type: ignore[assignment]
    for handler in logging.getLogger().handlers:  # basicConfig's handler holds the old stream
        if isinstance(handler, logging.StreamHandler) and handler.stream is old:
            handler.setStream(sys.stderr)
    copy_stacks_to(path)
