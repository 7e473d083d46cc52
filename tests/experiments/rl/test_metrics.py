"""The metrics log survives a crash mid-write."""
from __future__ import annotations

import json
import logging

from experiments.rl.metrics import MetricsLog, read_rows
from system.errors import ConfigError


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


def test_wandb_is_off_by_default_and_validated(tmp_path):
    import pytest

    from experiments.rl.metrics import MetricsConfig

    m = MetricsLog(str(tmp_path))
    m.log(1, reward=0.5)
    m.close()
    assert not (tmp_path / "wandb").exists()
    for bad in ({"wandb": "yes"}, {"wandb_project": ""}, {"wandb_project": "a/b"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            MetricsConfig(**bad)


def test_wandb_offline_writes_a_run_with_the_metrics_under_the_trial(tmp_path, monkeypatch):
    """Offline: nothing is sent (no network here); the run directory holds every logged row."""
    import glob

    import pytest

    pytest.importorskip("wandb")
    from experiments.rl.metrics import MetricsConfig
    from tests.experiments.rl.wandb_records import history, run_info, wait_closed

    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    m = MetricsLog(str(tmp_path), cfg=MetricsConfig(wandb="offline"), name="arith-tiny/t1")
    for step in (1, 2, 3):
        m.log(step, reward=step / 10, **({"eval_accuracy": 0.5} if step == 3 else {}),
              note="not a number")
    m.close()
    (run,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    wait_closed(run)
    rows = history(run)
    assert [(r["step"], r["reward"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert rows[2]["eval_accuracy"] == 0.5 and "note" not in rows[0]
    assert run_info(run) == {"name": "arith-tiny/t1", "project": "slurm-rl",
                             "group": "arith-tiny"}


def _tb_scalars(trial_dir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(trial_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_follows_the_log_on_resume_and_start_over(tmp_path):
    m = MetricsLog(str(tmp_path))
    for s in range(1, 6):
        m.log(s, reward=float(s), loss=float("nan"))
    m.close()
    rows = [json.loads(line, parse_constant=lambda c: 1 / 0)  # NaN is written as null
            for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 1, "reward": 1.0, "loss": None}
    m = MetricsLog(str(tmp_path), resume=True)
    m.truncate(2)  # resumed from step 2: steps 3-5 are redone
    m.log(3, reward=30.0)
    m.close()
    assert _tb_scalars(tmp_path, "reward") == [(1, 1.0), (2, 2.0), (3, 30.0)]
    m = MetricsLog(str(tmp_path))  # started over: nothing of the last run
    m.truncate(0)
    m.log(1, reward=7.0)
    m.close()
    assert _tb_scalars(tmp_path, "reward") == [(1, 7.0)]


def test_wandb_online_without_a_key_is_a_config_error(tmp_path, monkeypatch):
    """W&B refuses an online run with no API key (no network is needed to find out): one line
    naming metrics.wandb, a ConfigError (not recovered: a restart cannot change it). Before,
    the master raised UsageError, was restarted three times, and a traceback ended the trial."""
    import pytest

    pytest.importorskip("wandb")
    from experiments.rl.metrics import MetricsConfig

    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # (no ~/.netrc with a key)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with pytest.raises(ConfigError, match=r"^metrics.wandb=online: W&B refused the run "
                                          r"\(UsageError: .*metrics.wandb=offline$"):
        MetricsLog(str(tmp_path), cfg=MetricsConfig(wandb="online"), name="arith-tiny/t1")
