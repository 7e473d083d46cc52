"""End a finished worker process without the interpreter's own tear-down.

After ``atexit``, CPython tears down every module and collects the whole heap; with torch,
transformers and vLLM loaded that is about 1 CPU-second per process (and C++ destructors run
after it). A trial's five workers stop together, so on two cores the trial's stop took 3 s
longer than its workers' own work. :func:`exit_now` does what that tear-down does that anyone
can see, then leaves with ``os._exit``:

- waits for the threads that are not daemons, after the hooks that end them (as
  ``threading._shutdown`` does: an idle ``ThreadPoolExecutor``'s workers);
- runs the ``atexit`` handlers: ``weakref.finalize`` callbacks, multiprocessing's (which ends
  and joins child processes and runs its finalizers: vLLM's private directory is removed
  there), logging's;
- flushes every file object still open for writing (a buffer the tear-down would have flushed
  when it freed the object), and stdout and stderr.

What it skips is freeing memory the exit frees anyway.
"""
from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading


def exit_now(code: int) -> None:
    """Exit the process with ``code`` as described above (never returns)."""
    # what threading's own shutdown runs first: concurrent.futures' hook that wakes an
    # executor's idle workers (not daemons) so that they end; else the join below never would
    for hook in reversed(getattr(threading, "_threading_atexits", [])):
        hook()
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon and t.is_alive():
            t.join()
    try:
        atexit._run_exitfuncs()  # (each handler's exception is printed, the rest still run)
        flush_open_files()
    finally:
        os._exit(code)


def flush_open_files() -> None:
    """Flush every file object open for writing, standard streams included; one that fails to
    flush (a closed pipe, a full disk) is left, as the tear-down would leave it."""
    for f in (sys.stdout, sys.stderr):
        _flush(f)
    for obj in gc.get_objects():
        if issubclass(type(obj), io.IOBase):  # (not isinstance: a dead weak proxy raises)
            _flush(obj)


def _flush(f: object) -> None:
    try:
        if f is not None and not f.closed and f.writable():  # type: ignore[attr-defined]
            f.flush()  # type: ignore[attr-defined]
    except Exception:
        pass
