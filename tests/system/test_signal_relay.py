"""SignalRelay: a signal is acted on in the relay's thread, so acting may take a lock that
the interrupted main thread holds (a Python handler doing the same would wait for itself)."""
from __future__ import annotations

import signal
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


# The main thread is in one long call of C that releases the GIL (as a gloo collective waiting
# for a peer does) when SIGUSR2 comes; prints how long after the signal it was acted on, and
# how long after it the call returned.
IN_C = """
import hashlib, os, signal, sys, threading, time
from system.signal_relay import SignalRelay

acted = []
SignalRelay((signal.SIGUSR2,), lambda sig: acted.append(time.monotonic())).install()
if sys.argv[1] == "taken":  # another part of the process takes the wakeup fd for its own
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
t0 = time.monotonic()
threading.Timer(0.3, os.kill, args=(os.getpid(), signal.SIGUSR2)).start()
hashlib.pbkdf2_hmac("sha256", b"x", b"salt", 20_000_000)  # seconds in C, no Python
returned = time.monotonic()
time.sleep(0.5)
print(len(acted), acted[0] - t0 if acted else None, returned - t0)
"""


def test_a_signal_is_acted_on_while_the_main_thread_is_in_a_long_call_of_c():
    """Slurm's warning must be acted on (the requeue marked, the checkpoint asked for) while the
    main thread is still in C; a Python handler alone runs only once the call returns."""
    out = subprocess.run([sys.executable, "-c", IN_C, "own"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    count, acted, returned = out.stdout.split()
    assert float(returned) > 1.5, out.stdout  # (the call really outlasted the signal)
    assert count == "1" and float(acted) < 1.2, out.stdout  # once, at once


def test_the_python_handler_acts_where_the_wakeup_fd_was_taken():
    out = subprocess.run([sys.executable, "-c", IN_C, "taken"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    count, acted, returned = out.stdout.split()
    assert count == "1" and float(acted) >= float(returned) - 0.05, out.stdout  # once, late


# A child forked after the relay is installed (vLLM forks its engine core on a GPU) inherits
# both pipes and the wakeup fd: its signals must stay its own. One child takes SIGTERM with a
# handler of its own and outlives Slurm's warning (SIGUSR2: its parent's to act on); the other
# has SIGTERM's disposition from before the relay (the default): it ends by it.
FORKED = """
import os, signal, sys, time
from system.signal_relay import SignalRelay

acted = []
SignalRelay((signal.SIGTERM, signal.SIGUSR2), lambda sig: acted.append(sig.name)).install()
codes = []
for own in (True, False):
    pid = os.fork()
    if pid == 0:
        if own:
            signal.signal(signal.SIGTERM, lambda n, f: None)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)
        os._exit(7)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
time.sleep(0.5)
os.kill(os.getpid(), signal.SIGTERM)  # (the relay still acts on this process's own)
time.sleep(0.5)
print(codes, acted)
"""


def test_a_forked_childs_signals_are_its_own():
    out = subprocess.run([sys.executable, "-c", FORKED], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[7, {-signal.SIGTERM}] ['SIGTERM']", out.stdout


# A worker raises its fd limit and may hold over 1024 fds before it installs the relay.
HIGH_FDS = """
import os, resource, signal, time
from system.signal_relay import SignalRelay

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
acted = []
relay = SignalRelay((signal.SIGTERM,), lambda sig: acted.append(sig.name))
relay.install()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print(min(relay._read, relay._wake_read) > 1024, acted)
"""


def test_the_relay_works_with_fds_numbered_past_1024():
    out = subprocess.run([sys.executable, "-c", HIGH_FDS], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True ['SIGTERM']", out.stdout
