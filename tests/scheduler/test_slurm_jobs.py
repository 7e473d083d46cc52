"""Reading scancel's answers (pure)."""
from __future__ import annotations

from scheduler.slurm_jobs import _only_gone


def test_a_scancel_of_jobs_already_gone_is_no_failure():
    gone = "scancel: error: Kill job error on job id 5: Invalid job id specified\n"
    ending = "scancel: error: Kill job error on job id 6: Job/step already completing or completed\n"
    assert _only_gone(gone) and _only_gone(gone * 2) and _only_gone(gone + ending)
    assert not _only_gone("")  # failed without a word: worth a warning
    assert not _only_gone(gone + "scancel: error: Unable to contact slurm controller\n")
    assert not _only_gone("scancel: error: Access/permission denied for job 7\n")
