"""Whom ``ctl cancel`` signals when the controller has not stopped by itself in time."""
from __future__ import annotations

import time

from system.ctl import cancel
from system.ctl.trial_state import TrialView
from system.paths import TrialPaths


def _view(tmp_path, holder: dict, controller: dict) -> TrialView:
    record = {"controller": controller}
    return TrialView(TrialPaths(str(tmp_path)), "e", "t", "running", record,  # type: ignore
                     None, holder, None)


def test_a_launcher_elsewhere_inside_an_allocation_is_named_not_cancelled(tmp_path, capsys):
    """A launcher run inside the user's own Slurm job (``salloc``, a wrapper script) records
    that job in the trial's lock; ``cancel`` ran ``scancel`` on it: the user's allocation, and
    everything else in it. Now only a --detach controller's own job is cancelled."""
    holder = {"pid": 4242, "host": "another-node", "slurm_job": "77"}
    cancel._signal_controller(_view(tmp_path, holder, {"pid": 4242, "slurm_job": ""}),
                              time.monotonic())
    out = capsys.readouterr().out
    assert "(the controller's job)" not in out, out
    assert ("cannot signal the controller (pid 4242 on 'another-node'); it runs inside Slurm "
            "job 77, which `scancel 77` would end with everything else in it") in out, out
