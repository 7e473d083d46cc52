"""Every live thread's stack as text, named."""
from __future__ import annotations

import threading

from system.thread_stacks import thread_stacks


def test_every_thread_is_named_with_where_it_waits():
    release = threading.Event()

    def parked_here() -> None:
        release.wait()

    t = threading.Thread(target=parked_here, name="parked")
    t.start()
    try:
        text = thread_stacks()
    finally:
        release.set()
        t.join()
    assert "thread parked (" in text and "in parked_here\n    release.wait()" in text, text
    assert f"thread {threading.current_thread().name} (" in text
    assert "in test_every_thread_is_named_with_where_it_waits" in text
