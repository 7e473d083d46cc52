"""``mode=eval``: the root key's validation, what it starts, where its files go, and that it
leaves the evaluated trial's files alone (no "has checkpoints" refusal, nothing deleted)."""
from __future__ import annotations

import os

import pytest

from system.errors import ConfigError
from system.launch import build_config, main
from system.launcher.help import help_text
from system.launcher.config import RunMode
from system.launcher.trial_dir import prepare_trial
from system.paths import TrialPaths


def _cfg(root, *overrides: str):
    return build_config("arith-tiny", "t", [f"cluster.fileroot={root}", *overrides])


def test_mode_is_validated_and_documented():
    with pytest.raises(ConfigError, match=r"mode='bad'.*\['train', 'eval'\]"):
        build_config("arith-tiny", "t", ["mode=bad"])
    with pytest.raises(ConfigError, match=r"mode='eval' is not valid for experiment smoke.*"
                                          r"valid: \['train'\]"):
        build_config("smoke", "t", ["mode=eval"])
    assert build_config("arith-tiny", "t", []).mode == RunMode.TRAIN
    assert "  mode = 'train'  (one of: train, eval)" in help_text("arith-tiny")


def test_eval_starts_the_master_and_generation_servers_only_and_is_not_recovered(tmp_path):
    cfg = _cfg(tmp_path, "mode=eval", "generation.count=2")
    assert cfg.worker_counts() == {"master": 1, "model": 0, "generation": 2, "rollout": 0}
    assert cfg.recovery() is None
    assert [d.count for d in cfg.gpu_demands()] == [0, 2]
    train = _cfg(tmp_path, "generation.count=2")
    assert train.worker_counts()["model"] >= 1 and train.recovery() is not None


def _launch(root, *args: str) -> int:
    return main(["exp=arith-tiny", "trial=t", f"cluster.fileroot={root}", "mode=eval", *args])


def test_eval_of_a_missing_or_checkpointless_trial_is_one_line_and_creates_nothing(
        tmp_path, capsys):
    assert _launch(tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err and "mode=eval" in err
    assert not os.path.exists(tmp_path / "arith-tiny")
    os.makedirs(tmp_path / "arith-tiny" / "t" / "checkpoints" / "step_3.tmp")  # not committed
    assert _launch(tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has no checkpoint" in err
    assert os.listdir(tmp_path / "arith-tiny" / "t") == ["checkpoints"]


def test_eval_leaves_a_finished_trial_alone_and_writes_under_eval(tmp_path):
    trained = _cfg(tmp_path, "rl.task.eval_size=5")
    paths = TrialPaths.of(str(tmp_path), "arith-tiny", "t")
    prepare_trial(trained, "arith-tiny", "trained: yes\n").lock.release()
    os.makedirs(os.path.join(paths.checkpoints, "step_4"))
    with open(paths.config, "w") as f:  # what the training wrote (resolved)
        from omegaconf import OmegaConf

        f.write(OmegaConf.to_yaml(OmegaConf.structured(trained)))
    before = {n: open(os.path.join(paths.root, n), "rb").read()
              for n in ("config.yaml", "secret", "bootstrap.json")}
    # recover=off with overwrite would delete the checkpoints of a training run: not here
    cfg = _cfg(tmp_path, "mode=eval", "recover=off", "recover.overwrite=true")
    assert cfg.rl.task.eval_size == 5  # the trial's own config is the base
    assert _cfg(tmp_path, "mode=eval", "rl.task.eval_size=7").rl.task.eval_size == 7
    prepared = prepare_trial(cfg, "arith-tiny", "eval: yes\n")
    try:
        assert prepared.paths.root == os.path.join(paths.root, "eval")
        assert os.path.isdir(os.path.join(paths.checkpoints, "step_4"))
        assert {n: open(os.path.join(paths.root, n), "rb").read() for n in before} == before
        from system.bootstrap import Bootstrap

        boot = Bootstrap.read(prepared.paths.bootstrap)
        assert (boot.mode, boot.evaluated_dir, boot.trial_dir) == \
            ("eval", paths.root, prepared.paths.root)
        # the trial's own lock is held: no training (or second evaluation) meanwhile
        from system.errors import TrialLocked

        with pytest.raises(TrialLocked):
            prepare_trial(_cfg(tmp_path), "arith-tiny", "x\n")
    finally:
        prepared.lock.release()


def test_a_config_saved_by_an_older_version_loads():
    """A trial trained before a section moved (``rl.metrics`` -> ``metrics``) or a setting was
    removed still evaluates: moved sections follow, removed settings are dropped and named."""
    from omegaconf import OmegaConf

    from experiments.catalog import get_experiment
    from system.launcher.eval_mode import fit_saved

    cfg = get_experiment("arith-tiny").make_config()
    cfg.exp, cfg.trial = "arith-tiny", "t"
    schema = OmegaConf.structured(cfg)
    old = OmegaConf.create(OmegaConf.to_container(schema))
    del old["metrics"]
    old.rl.metrics = {"wandb": "offline", "wandb_project": "p", "wandb_entity": ""}
    old.rl.retired = 3
    old.rl.vllm.gone = {"a": 1}
    old.scheduler.slurm.model.env = {"KEEP": "1"}  # a free mapping keeps its keys
    assert sorted(fit_saved(old, schema)) == ["rl.metrics", "rl.retired", "rl.vllm.gone"]
    loaded = OmegaConf.to_object(OmegaConf.merge(schema, old))
    assert loaded.metrics.wandb == "offline" and loaded.metrics.wandb_project == "p"
    assert loaded.scheduler.slurm.model.env == {"KEEP": "1"}


def test_a_trial_saved_with_overwrite_beside_recover_auto_still_evaluates(tmp_path):
    """``recover.overwrite=true`` without ``recover=off`` is refused since; trials saved so
    before (it continued them, silently) must still evaluate."""
    import os

    from omegaconf import OmegaConf

    from experiments.catalog import get_experiment
    from system.launcher.eval_mode import trained_base

    root = str(tmp_path / "runs")
    trained = os.path.join(root, "arith-tiny", "t")
    os.makedirs(trained)
    saved = OmegaConf.structured(_cfg(root))
    OmegaConf.update(saved, "recover.overwrite", True)  # beside recover.type=auto
    OmegaConf.update(saved, "rl.total_steps", 12)
    OmegaConf.save(saved, os.path.join(trained, "config.yaml"))
    defaults = get_experiment("arith-tiny").make_config()
    cfg = trained_base(_cfg(root, "mode=eval"), defaults, lambda base: base)
    assert cfg.rl.total_steps == 12 and cfg.recover.overwrite is False
