from __future__ import annotations

import os
import signal
import subprocess
import sys

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
