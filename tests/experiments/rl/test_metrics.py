"""The metrics log survives a crash mid-write."""
from __future__ import annotations

import json
import logging

from experiments.rl.metrics import MetricsLog, read_rows


def _write(path, text: str) -> None:
    path.write_text(text)


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, caplog):
    p = tmp_path / "metrics.jsonl"
    _write(p, json.dumps({"step": 0}) + "\n" + json.dumps({"step": 1, "r": 0.5}) + "\n"
           + '{"step": 2, "rew')
    with caplog.at_level(logging.WARNING, logger="rl-metrics"):
        assert read_rows(str(p)) == [{"step": 0}, {"step": 1, "r": 0.5}]
    assert any("line 3" in r.getMessage() for r in caplog.records)


def test_resume_with_a_torn_metrics_file_keeps_the_good_rows(tmp_path):
    p = tmp_path / "metrics.jsonl"
    _write(p, "".join(json.dumps({"step": s}) + "\n" for s in range(4)) + '{"step": 4, "x"')
    m = MetricsLog(str(tmp_path), resume=True)
    m.truncate(2)  # a resume from the checkpoint at step 2
    m.log(3, reward=1.0)
    m.close()
    assert [r["step"] for r in read_rows(str(p))] == [0, 1, 2, 3]
    assert p.read_text().endswith('"reward": 1.0}\n')
