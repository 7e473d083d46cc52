"""The live one-line progress display of the launching terminal.

On a terminal it is a rich ``Live`` line redrawn in place; elsewhere (CI logs, pipes) the same
line is printed at most every ``plain_every`` seconds.
"""
from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    def __init__(self, title: str, enabled: bool = True, plain_every: float = 5.0) -> None:
        self.title = title
        self.enabled = enabled
        self.plain_every = plain_every
        self._live: Any = None
        self._last_plain = 0.0
        self._line = ""
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.live import Live

            self._live = Live("", console=Console(stderr=True), refresh_per_second=8,
                              transient=False)
            self._live.start()

    def update(self, **fields: Any) -> None:
        parts = [self.title] + [f"{k} {v}" for k, v in fields.items() if v not in (None, "")]
        self._line = " | ".join(parts)
        if not self.enabled:
            return
        if self._live is not None:
            self._live.update(self._line)
        elif time.monotonic() - self._last_plain >= self.plain_every:
            self._last_plain = time.monotonic()
            print(self._line, file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the display, its last line shown (once: later calls do nothing)."""
        if self._live is not None:
            self._live.stop()
            self._live = None
        elif self.enabled and self._line:
            print(self._line, file=sys.stderr, flush=True)
        self.enabled, self._line = False, ""

    def say(self, text: str) -> None:
        """Print ``text`` below the display, which ends first: no progress line (a stale
        ``state running``) is printed after it."""
        self.close()
        print(text, file=sys.stderr, flush=True)
