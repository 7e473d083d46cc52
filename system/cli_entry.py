"""Ctrl-C while a command-line entry point (``system.launch``, ``system.ctl``) still imports
its modules: one line and exit code 130, not a traceback through the import machinery (it has
done nothing yet that needs undoing). ``main()`` then gives SIGINT back to Python's default
(``KeyboardInterrupt``), which it handles itself."""
from __future__ import annotations

import os
import signal
from typing import Any

INTERRUPTED = 130
"""The shell's exit code of a command ended by SIGINT (128 + 2)."""


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


__all__ = ["INTERRUPTED", "main_begins", "quiet_while_importing"]
