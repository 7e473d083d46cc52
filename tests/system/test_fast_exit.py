"""exit_now: a finished worker leaves without the interpreter's tear-down, but with everything
that tear-down does that anyone can see (real processes)."""
from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO

SCRIPT = """
import atexit, sys, threading, time, weakref
from system.fast_exit import exit_now

class Gone:
    pass

gone = Gone()
proxy = weakref.proxy(gone)  # a dead weak proxy on the heap: isinstance() on it raises
del gone
out = open(sys.argv[1], "w")
out.write("written, never flushed by the script;")

def late():
    time.sleep(0.3)
    out.write(" by a thread that is not a daemon;")

threading.Thread(target=late).start()
atexit.register(lambda: out.write(" at exit"))
print("on stdout, buffered", end="")
exit_now(7)
"""


def test_exit_now_joins_threads_runs_atexit_flushes_files_and_keeps_the_code(tmp_path):
    target = tmp_path / "out.txt"
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(target)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 7, r.stderr
    assert r.stdout == "on stdout, buffered" and r.stderr == ""
    assert target.read_text() == ("written, never flushed by the script; by a thread that is "
                                  "not a daemon; at exit")


def test_exit_now_ends_an_executor_the_main_thread_left_open():
    """A ThreadPoolExecutor made in the main thread and never shut down: its idle workers
    (not daemons) wait for work until threading's exit hook wakes them; exit_now joined them
    without running it, and the worker never exited (SIGTERM could not end it either)."""
    code = ("from concurrent.futures import ThreadPoolExecutor\n"
            "from system.fast_exit import exit_now\n"
            "pool = ThreadPoolExecutor(2)\n"
            "assert pool.submit(lambda: 41 + 1).result() == 42\n"
            "exit_now(5)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=30)
    assert r.returncode == 5
