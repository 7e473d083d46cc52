"""Relative paths that workers read are made absolute by the launcher, against its own working
directory: config.yaml holds absolute paths, so every worker (local, or a Slurm job started in
scheduler.slurm.workdir) reads the same file."""
from __future__ import annotations

import os
import subprocess
import sys

import yaml

from system.launch import absolute_argv, absolute_paths, build_config
from tests.helpers import REPO


def test_build_config_makes_worker_read_paths_absolute(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.chdir(data)
    cfg = build_config("arith-tiny", "t", ["rl.task.train_path=train.jsonl",
                                           "rl.task.eval_path=../held/eval.parquet",
                                           "rl.model_path=models/m",
                                           "name_resolve.file_root=nr",
                                           "cluster.fileroot=runs"])
    assert cfg.rl.task.train_path == str(data / "train.jsonl")
    assert cfg.rl.task.eval_path == str(tmp_path / "held" / "eval.parquet")
    assert cfg.rl.model_path == str(data / "models" / "m")
    assert cfg.name_resolve.file_root == str(data / "nr")
    assert cfg.cluster.fileroot == "runs"  # the launcher's own: made absolute where it is used
    # empty stays empty (the task's own prompts, the experiment's model)
    cfg = build_config("arith-tiny", "t", [])
    assert cfg.rl.task.train_path == cfg.rl.task.eval_path == cfg.rl.model_path == ""
    smoke = build_config("smoke", "t", ["name_resolve.file_root=x"])  # no rl section
    assert smoke.name_resolve.file_root == str(data / "x") and not hasattr(smoke, "rl")


def test_absolute_paths_keep_absolute_ones_and_expand_home(monkeypatch):
    monkeypatch.setenv("HOME", "/home/u")
    cfg = build_config("arith-tiny", "t", ["rl.task.train_path=/d/t.jsonl",
                                           "rl.task.eval_path=~/e.jsonl"])
    assert absolute_paths(cfg, "/elsewhere") == {"rl.task.train_path": "/d/t.jsonl",
                                                 "rl.task.eval_path": "/home/u/e.jsonl"}


def test_a_detached_controller_gets_the_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["exp=arith-tiny", "trial=t", "rl.task.train_path=train.jsonl", "rollout.count=1"]
    cfg = build_config("arith-tiny", "t", argv[2:])
    got = absolute_argv(argv, cfg)
    assert got == ["exp=arith-tiny", "trial=t", "rollout.count=1",
                   f"rl.task.train_path={tmp_path / 'train.jsonl'}",
                   f"cluster.fileroot={tmp_path / 'runs'}"]  # (the default ./runs, here)


def test_the_written_config_holds_absolute_paths(tmp_path):
    """A dry run from the data directory prints (and writes) config.yaml as workers read it."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"prompt": "1+1=", "answer": 2}\n')
    r = subprocess.run([sys.executable, "-m", "system.launch", "exp=arith-tiny", "trial=rel",
                        f"cluster.fileroot={tmp_path / 'runs'}", "rl.task.train_path=train.jsonl",
                        "--dry-run"], cwd=data, capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr
    saved = yaml.safe_load(open(tmp_path / "runs" / "arith-tiny" / "rel" / "config.yaml"))
    assert saved["rl"]["task"]["train_path"] == str(data / "train.jsonl")
