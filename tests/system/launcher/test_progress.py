"""The launcher's progress line off a terminal: printed at most every few seconds, and never
after the line that says the trial stops."""
from __future__ import annotations

from system.launcher.progress import Progress


def test_no_progress_line_after_the_stop_is_said(capsys):
    """``interrupted: stopping every worker`` was followed by one more progress line saying
    ``state running`` (the display's last line, printed at its close)."""
    p = Progress("smoke/t1", plain_every=3600)
    p.update(step="1/10", state="running")  # printed: the first
    p.update(step="2/10", state="running")  # held back (every hour)
    p.say("\ninterrupted: stopping every worker")
    p.close()  # (the controller's cleanup): nothing more
    p.update(step="3/10", state="running")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln]
    assert lines == ["smoke/t1 | step 1/10 | state running",
                     "smoke/t1 | step 2/10 | state running",
                     "interrupted: stopping every worker"], lines
