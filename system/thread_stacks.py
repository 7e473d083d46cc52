"""Where every thread of this process is, as text: what a worker logs before it exits because
its role did not stop (a hang that left no other trace)."""
from __future__ import annotations

import sys
import threading
import traceback


def thread_stacks() -> str:
    """Each live thread's name and current stack, innermost call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame)).rstrip()
        parts.append(f"thread {names.get(ident, '?')} ({ident}):\n{stack}")
    return "\n".join(parts)


__all__ = ["thread_stacks"]
