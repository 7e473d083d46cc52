"""Every live thread's stack as text, named; and written on SIGURG by a process that goes on
(and ignored by one that did not set that up)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

from system.thread_stacks import (STACKS_HEADER, STACKS_SIGNAL, ask_for_stacks,
                                  handles_stacks_signal, thread_stacks)
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


def _unblocked() -> None:
    """(In the child: a blocked signal is inherited, from a test process that has it blocked.)"""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {STACKS_SIGNAL})


def test_the_stacks_signal_writes_every_stack_and_the_process_goes_on():
    """A process set up by dump_stacks_on_signal writes each thread's stack on SIGURG (the
    main thread parked in a call that has not returned to the interpreter too) and goes on;
    before that, it does not wait for the signal (``system.ctl stacks`` names it) and ignores
    one sent. A forked child, set up again, answers for itself."""
    code = textwrap.dedent("""
        import os, signal, sys, threading, time
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
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_unblocked)
    try:
        assert p.stdout.readline() == "before\n"
        assert not handles_stacks_signal(p.pid) and not ask_for_stacks(p.pid)  # (not sent)
        os.kill(p.pid, STACKS_SIGNAL)  # sent anyway (scancel does): ignored
        time.sleep(0.2)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline() == "ready\n"
        assert handles_stacks_signal(p.pid) and ask_for_stacks(p.pid)
        # (written at once, in one piece: once its first line is read, all of it is there)
        assert p.stderr.readline() == f"{STACKS_HEADER}:\n"
        p.stdin.write("\n")
        p.stdin.close()
        out, err = p.stdout.read(), p.stderr.read()  # (to the end: it exits)
        p.wait(30)
    finally:
        p.kill()
    assert p.returncode == 0 and out == "still here\n", (out, err)
    assert STACKS_HEADER not in err, err  # one dump: the signal before the set-up wrote none
    assert 'thread parked (' in err and 'File "<string>", line 9, in parked_here' in err, err
    main = err[err.index("thread MainThread ("):]
    assert re.match(r'[^\n]*\n  File "<string>", line 1[23], in <module>', main), err
    assert not handles_stacks_signal(p.pid)  # (gone)


def test_a_forked_child_set_up_again_writes_its_own_stacks():
    """Threads do not survive a fork: the child (a spare's worker) starts its own listener."""
    code = textwrap.dedent("""
        import os, sys, time
        from system.thread_stacks import dump_stacks_on_signal
        dump_stacks_on_signal()
        pid = os.fork()
        if pid == 0:
            dump_stacks_on_signal()
            print(os.getpid(), flush=True)
            time.sleep(30)
            os._exit(0)
        time.sleep(30)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(p.stdout.readline())
        assert ask_for_stacks(child)
        assert p.stderr.readline() == f"{STACKS_HEADER}:\n"
        assert p.stderr.readline().startswith("thread ")
    finally:
        os.killpg(p.pid, 9)
        p.communicate()


def test_the_stacks_are_copied_to_a_named_file_too(tmp_path):
    """A launcher's stderr is a terminal: its dump goes to ``launcher.log`` as well, appended
    after what the file holds; a file that cannot be opened costs only that copy."""
    log = tmp_path / "launcher.log"
    log.write_text("earlier\n")
    code = textwrap.dedent(f"""
        import sys
        from system.thread_stacks import copy_stacks_to, dump_stacks_on_signal
        dump_stacks_on_signal()
        copy_stacks_to({str(tmp_path / "gone" / "x.log")!r})
        copy_stacks_to({str(log)!r})
        print("ready", flush=True)
        sys.stdin.read()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_unblocked)
    try:
        assert p.stdout.readline() == "ready\n"
        assert ask_for_stacks(p.pid)
        assert p.stderr.readline() == f"{STACKS_HEADER}:\n"  # (stderr is written first)
        deadline = time.time() + 10
        while "in <module>" not in log.read_text() and time.time() < deadline:
            time.sleep(0.05)
        p.stdin.close()
        assert p.wait(30) == 0
    finally:
        p.kill()
    text = log.read_text()
    assert text.startswith(f"earlier\n{STACKS_HEADER}:\nthread "), text
    assert text.count(STACKS_HEADER) == 1, text  # (the main thread: at its print, or after)
    assert re.search(r'thread MainThread \(\d+\):\n  File "<string>", line [78], in <module>\n',
                     text), text
