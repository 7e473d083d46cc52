"""What a command-line entry point (``system.launch``, ``system.ctl``) does first, before its
imports:

- descriptors 0-2 it was started without (``2>&-``) are opened on ``/dev/null``: otherwise the
  first file it opens (the trial's lock) takes the number, and what is written to standard
  error (a dump of the stacks) lands in that file;
- a Ctrl-C while it still imports its modules is one line and exit code 130, not a traceback
  through the import machinery (it has done nothing yet that needs undoing). ``main()`` then
  gives SIGINT back to Python's default (``KeyboardInterrupt``), which it handles itself."""
from __future__ import annotations

import os
import signal
from typing import Any

INTERRUPTED = 130
"""The shell's exit code of a command ended by SIGINT (128 + 2)."""


def std_fds_open() -> None:
    """Each of descriptors 0, 1 and 2 that is closed is opened on ``/dev/null``."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def _interrupted_while_importing(_signum: int, _frame: Any) -> None:
    os.write(2, b"interrupted\n")
    os._exit(INTERRUPTED)


def quiet_while_importing() -> None:
    """Call first thing (before the imports) where the entry point runs as ``__main__``; a
    SIGINT the process was started ignoring (a background job of a script) stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_importing)


def main_begins() -> None:
    """SIGINT raises ``KeyboardInterrupt`` again, if :func:`quiet_while_importing` took it."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_importing:
        signal.signal(signal.SIGINT, signal.default_int_handler)


__all__ = ["INTERRUPTED", "main_begins", "quiet_while_importing", "std_fds_open"]
