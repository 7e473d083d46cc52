"""ctl's printing, for a reader that may go away: ``status ... | head -1`` closes the pipe after
one line. As for other command-line tools, that is no error: the rest of the output is dropped
without a message, and the command still ends with its documented exit code (``status``: the
trial's state; ``cancel`` goes on stopping the trial)."""
from __future__ import annotations

import os
import sys
from typing import TextIO


def silence(stream: TextIO) -> None:
    """Point ``stream``'s descriptor at ``/dev/null``: what it still buffers (flushed at exit)
    and whatever is written to it later are dropped, not another broken pipe."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, stream.fileno())
    finally:
        os.close(null)


def say(text: str, stream: TextIO | None = None) -> None:
    """Print ``text`` (and a newline) to ``stream`` (default stdout) at once; once its reader
    has gone, nothing more reaches it."""
    stream = sys.stdout if stream is None else stream
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        silence(stream)

