"""Every live thread's stack as text, named; and written on SIGURG, in C, by a process that
goes on (and ignored by one that did not set that up)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time

from system.thread_stacks import (STACKS_SIGNAL, ask_for_stacks, handles_stacks_signal,
                                  thread_stacks)
from tests.helpers import REPO


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


def test_the_stacks_signal_writes_every_stack_and_the_process_goes_on():
    """A process set up by dump_stacks_on_signal writes each thread's stack on SIGURG (also
    one parked inside a call that never returns to the interpreter) and goes on; before that,
    it does not catch the signal (``system.ctl stacks`` names it) and ignores one sent."""
    code = textwrap.dedent("""
        import signal, sys, threading, time
        print("before", flush=True)
        input()
        from system.thread_stacks import dump_stacks_on_signal
        dump_stacks_on_signal()

        def parked_here():
            threading.Event().wait()

        threading.Thread(target=parked_here, name="parked", daemon=True).start()
        print("ready", flush=True)
        input()
        print("still here", flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "before\n"
        assert not handles_stacks_signal(p.pid) and not ask_for_stacks(p.pid)  # (not sent)
        os.kill(p.pid, STACKS_SIGNAL)  # sent anyway (scancel does): ignored
        time.sleep(0.2)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline() == "ready\n"
        assert handles_stacks_signal(p.pid) and ask_for_stacks(p.pid)
        dump: list[str] = []  # until the main thread's frame (the last one written)
        while not any(" in <module>" in line for line in dump):
            dump.append(p.stderr.readline())
            assert dump[-1], "".join(dump)
        out, err = p.communicate("\n", timeout=30)
        err = "".join(dump) + err
    finally:
        p.kill()
    assert p.returncode == 0 and out == "still here\n", (out, err)
    assert err.count("Current thread") == 1, err  # (the signal before the set-up: none)
    assert err.count("(most recent call first)") >= 2, err
    assert 'File "<string>", line 9 in parked_here' in err, err
    main = err[err.index("Current thread"):]  # (the one the handler ran on)
    assert re.search(r'File "<string>", line 1[23] in <module>', main), err  # print or input
    assert not handles_stacks_signal(p.pid)  # (gone)
