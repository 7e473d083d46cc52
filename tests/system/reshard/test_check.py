"""Resharding: the check itself (it catches wrong data) and its command, with processes."""
from __future__ import annotations

import subprocess
import sys

import pytest

from system.reshard.check import MODELS, run_check
from system.reshard.layout import GenLayout, TrainLayout
from tests.helpers import REPO

TINY = MODELS["tiny"]


def test_the_check_catches_wrong_data():
    bad, _ = run_check(TrainLayout(2, 2, 1), GenLayout(2, 1), TINY, threads=True, corrupt_rank=1)
    assert bad and all("max abs diff" in b for b in bad)


def test_an_unknown_start_method_is_refused_before_any_rank_starts():
    from system.errors import ConfigError

    with pytest.raises(ConfigError, match="start_method='fork': one of forkserver, spawn"):
        run_check(TrainLayout(1, 1, 1), GenLayout(1, 1), TINY, start_method="fork")


@pytest.mark.slow  # processes: about 45 s on a busy two-core machine
def test_check_command_with_processes():
    r = subprocess.run([sys.executable, "-m", "system.reshard", "check", "--src", "dp=2,tp=2,pp=1",
                        "--dst", "tp=2,replicas=2"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok:")
    r = subprocess.run([sys.executable, "-m", "system.reshard", "check", "--src", "tp=4",
                        "--dst", "tp=3"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "do not divide each other" in r.stderr
