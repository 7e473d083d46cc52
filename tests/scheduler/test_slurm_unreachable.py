"""A Slurm whose controller cannot be reached (down, restarting): the launch says so in one
line naming slurmctld, not that the trial's groups "can never run" (which would send the user
off to change resources that are fine)."""
from __future__ import annotations

import os
import shutil

import pytest

from slurm.testcluster.cluster import SlurmTestCluster
from tests.helpers import read_summary, run_launch
from tests.scheduler.test_slurm_e2e import SLURM

pytestmark = pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch installed")


@pytest.fixture
def dead_slurm(tmp_path) -> dict[str, str]:
    """A real slurm.conf whose slurmctld is not running (none is started), and real sbatch."""
    cluster = SlurmTestCluster(str(tmp_path / "slurm"))
    cluster._write_files()
    with open(cluster.conf_path, "a") as f:
        f.write("\nMessageTimeout=1\n")  # sbatch gives up at once instead of retrying
    return cluster.env


def error_line(stderr: str) -> str:
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    return line


def test_an_unreachable_controller_is_named_not_the_groups_resources(dead_slurm, tmp_path):
    root = str(tmp_path / "runs")
    r = run_launch("exp=smoke", "trial=down", f"cluster.fileroot={root}", *SLURM,
                   env=dead_slurm, timeout=120)
    assert r.returncode == 1, r.stderr
    line = error_line(r.stderr)
    assert "Slurm's controller cannot be reached" in line and "slurmctld" in line, line
    assert "Unable to contact slurm controller" in line, line
    assert "can never run" not in line and "scheduler.slurm." not in line, line
    assert read_summary(root, "smoke", "down")["status"] == "failed"


def test_detach_names_the_controller_job_and_the_unreachable_slurmctld(dead_slurm, tmp_path):
    root = str(tmp_path / "runs")
    r = run_launch("exp=smoke", "trial=down", f"cluster.fileroot={root}", *SLURM, "--detach",
                   env=dead_slurm, timeout=120)
    assert r.returncode == 1, r.stderr
    line = error_line(r.stderr)
    assert "could not reach Slurm's controller to submit the trial's controller" in line, line
    assert "master group" not in line, line
    assert os.path.isfile(os.path.join(root, "smoke", "down", "jobs", "controller.sbatch"))
