"""SignalRelay: a signal is acted on in the relay's thread, so acting may take a lock that
the interrupted main thread holds (a Python handler doing the same would wait for itself)."""
from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO

# The main thread holds the stop event's lock when SIGTERM comes (as Event.wait does between
# two polls); acting on it sets that event. In the handler itself this hangs forever.
SCRIPT = """
import os, signal, sys, threading, time
from system.signal_relay import SignalRelay

stop = threading.Event()
got = []
def on_signal(sig):
    got.append((sig.name, threading.current_thread().name))
    stop.set()

if sys.argv[1] == "relay":
    SignalRelay((signal.SIGTERM, signal.SIGUSR2), on_signal).install()
else:
    signal.signal(signal.SIGTERM, lambda n, f: on_signal(signal.Signals(n)))
with stop._cond:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)
assert stop.wait(10), "never stopped"
os.kill(os.getpid(), signal.SIGUSR2)
deadline = time.monotonic() + 10
while len(got) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
print(got)
"""


def _run(mode: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_a_signal_is_acted_on_in_the_relay_thread_while_main_holds_the_lock():
    out = _run("relay", 30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[('SIGTERM', 'signals'), ('SIGUSR2', 'signals')]"


def test_the_same_in_a_plain_handler_hangs():
    """What the relay is for: the plain handler waits for the lock its own thread holds."""
    try:
        out = _run("plain", 3)
    except subprocess.TimeoutExpired:
        return
    raise AssertionError(f"a plain handler did not hang: {out}")
