"""``summary.json``'s record of a completed run: the master's figures, and its warnings said."""
from __future__ import annotations

import json
import time

from system.launch import build_config
from system.launcher.summary import TrialSummary


def test_a_completed_runs_warnings_are_printed_and_recorded(tmp_path, capsys):
    summary = TrialSummary(build_config("smoke", "t", []), time.time())
    summary.completed({"summary": {"evaluated": [4], "warnings": [
        "checkpoint /c/step_6 is unreadable (meta.json: gone): not evaluated"]}})
    assert capsys.readouterr().err == ("warning: checkpoint /c/step_6 is unreadable "
                                       "(meta.json: gone): not evaluated\n")
    assert summary.status == "completed" and summary.data["evaluated"] == [4]
    path = str(tmp_path / "summary.json")
    assert summary.finish(path, [], {}, {}, {})
    with open(path) as f:
        assert json.load(f)["warnings"] == [
            "checkpoint /c/step_6 is unreadable (meta.json: gone): not evaluated"]
    assert not summary.finish(str(tmp_path / "absent" / "summary.json"), [], {}, {}, {})
    assert "could not write" in capsys.readouterr().err
    summary.completed({"summary": {"evaluated": []}})  # none: nothing said
    summary.completed(["not", "a", "dict"])
    assert capsys.readouterr().err == ""
