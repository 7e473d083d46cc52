from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from system.held_signals import held_signals


def test_a_stop_signal_waits_for_the_held_step_then_acts():
    done = []
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with pytest.raises(KeyboardInterrupt):
        with held_signals():
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during sbatch, say
            # a child started now inherits the mask: the terminal's Ctrl-C spares it too
            r = subprocess.run([sys.executable, "-c", "import os, signal; "
                                "os.kill(os.getpid(), signal.SIGINT); print('finished')"],
                               capture_output=True, text=True, timeout=60)
            done.append(r.stdout.strip())
    assert done == ["finished"]  # the step ran to its end; the interrupt came after it
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before  # the mask restored
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_delivered_to_another_thread_is_held_too():
    """The launcher has other threads (its pause watch, the name service's keep-alive): the
    kernel may hand the signal to one of them, and Python runs the handler in the main thread
    at once, in the middle of the held step."""
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    recorded = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with held_signals():
                # the step (a sbatch) is under way when the signal comes, from another thread
                # (a timer could fire after the step on a loaded machine)
                sent = threading.Event()
                threading.Thread(target=lambda: (os.kill(os.getpid(), signal.SIGINT),
                                                 sent.set()), daemon=True).start()
                assert sent.wait(30)
                time.sleep(0.1)
                recorded.append("job id")
        assert recorded == ["job id"]
    finally:
        stop.set()
