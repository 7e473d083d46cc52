"""A trial continues only with the training layout its checkpoint is sharded by: another one is
refused in one line before anything is written or started."""
from __future__ import annotations

import os

import pytest

from experiments.rl.checkpoint import CheckpointDir
from experiments.rl.checkpoint_layout import (check_resume_critic, check_resume_layout, layout_of,
                                              saved_layout)
from system.errors import ConfigError
from tests.helpers import run_launch
from workers.engines.configs import MegatronConfig, TorchEngineConfig

MEGATRON_TP2 = layout_of(TorchEngineConfig(backend="megatron", megatron=MegatronConfig(tp=2)),
                            2)


def checkpoint(root: str, step: int, layout: dict | None, models: tuple[str, ...] = ()
               ) -> None:
    ck = CheckpointDir(root)
    with open(os.path.join(ck.staging(step), "state.json"), "w") as f:
        f.write("{}")
    for m in models:
        os.makedirs(os.path.join(ck.staging(step), m))
    ck.commit(step, {} if layout is None else {"layout": layout})


def test_layouts_and_what_a_resume_accepts(tmp_path):
    root = str(tmp_path / "checkpoints")
    assert saved_layout(root) is None and not os.path.exists(root)  # reading creates nothing
    check_resume_layout(root, MEGATRON_TP2)  # nothing to continue
    assert layout_of(TorchEngineConfig(), 3) == {"backend": "fsdp", "model_workers": 3,
                                                    "tp": 1, "pp": 1}
    checkpoint(root, 2, None)  # written before layouts were recorded: not judged
    check_resume_layout(root, layout_of(TorchEngineConfig(), 1))
    checkpoint(root, 4, MEGATRON_TP2)
    assert saved_layout(root) == (4, MEGATRON_TP2)
    check_resume_layout(root, dict(MEGATRON_TP2))
    for other in (layout_of(TorchEngineConfig(), 2),
                  {**MEGATRON_TP2, "tp": 1}, {**MEGATRON_TP2, "model_workers": 4}):
        with pytest.raises(ConfigError) as e:
            check_resume_layout(root, other)
        msg = str(e.value)
        assert msg.startswith("the latest checkpoint (step 4) was written by "
                              "rl.actor.backend=megatron, rl.actor.megatron.tp=2, pp=1 over "
                              "model.count=2; this run asks "), msg
        assert "\n" not in msg and f"rl.model_path={root}/step_4/actor" in msg


def test_a_launch_with_another_layout_is_refused_before_it_writes_anything(fileroot):
    trial_dir = os.path.join(fileroot, "arith-tiny", "lay")
    checkpoint(os.path.join(trial_dir, "checkpoints"), 6, MEGATRON_TP2)
    os.makedirs(os.path.join(trial_dir, "logs"))
    with open(os.path.join(trial_dir, "config.yaml"), "w") as f:
        f.write("# the trial's own\n")
    r = run_launch("exp=arith-tiny", "trial=lay", f"cluster.fileroot={fileroot}",
                   "rl.actor.backend=fsdp", "model.count=2", timeout=120)
    assert r.returncode == 2, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert "the latest checkpoint (step 6) was written by rl.actor.backend=megatron" in line
    assert "this run asks rl.actor.backend=fsdp over model.count=2" in line
    with open(os.path.join(trial_dir, "config.yaml")) as f:
        assert f.read() == "# the trial's own\n"
    # starting over is still possible, and so is the same layout (a dry run shows it)
    same = run_launch("exp=arith-tiny", "trial=lay", f"cluster.fileroot={fileroot}",
                      "rl.actor.backend=megatron", "rl.actor.megatron.tp=2", "model.count=2",
                      "--dry-run", timeout=120)
    assert same.returncode == 0, same.stderr


def test_ppo_resumes_only_a_checkpoint_with_a_critic(tmp_path):
    root = str(tmp_path / "checkpoints")
    check_resume_critic(root, "ppo")  # nothing to continue
    checkpoint(root, 3, None, ("actor",))  # grpo's
    check_resume_critic(root, "grpo")
    with pytest.raises(ConfigError) as e:
        check_resume_critic(root, "ppo")
    msg = str(e.value)
    assert msg.startswith("rl.algorithm=ppo: the latest checkpoint (step 3) has no critic")
    assert "\n" not in msg and f"rl.model_path={root}/step_3/actor" in msg
    checkpoint(root, 5, None, ("actor", "critic"))  # ppo's: either algorithm continues it
    check_resume_critic(root, "ppo")
    check_resume_critic(root, "grpo")


def test_a_ppo_launch_on_a_grpo_checkpoint_is_refused_before_it_starts(fileroot):
    trial_dir = os.path.join(fileroot, "arith-tiny", "alg")
    checkpoint(os.path.join(trial_dir, "checkpoints"), 4, layout_of(TorchEngineConfig(), 1),
               ("actor",))
    r = run_launch("exp=arith-tiny", "trial=alg", f"cluster.fileroot={fileroot}",
                   "rl.algorithm=ppo", timeout=120)
    assert r.returncode == 2, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert "has no critic to resume" in line and "rl.algorithm=grpo" in line


def test_a_trial_trained_to_its_end_already_starts_nothing(fileroot):
    """Relaunched with ``rl.total_steps`` at or below its latest checkpoint's step, a trial
    started every worker, trained nothing, rewrote config.yaml and exited 0 without a word."""
    from experiments.rl.checkpoint_layout import nothing_to_train
    from system.launch import build_config

    trial_dir = os.path.join(fileroot, "arith-tiny", "done")
    assert nothing_to_train(build_config("arith-tiny", "done", []), trial_dir) is None
    checkpoint(os.path.join(trial_dir, "checkpoints"), 20, layout_of(TorchEngineConfig(), 1))
    with open(os.path.join(trial_dir, "config.yaml"), "w") as f:
        f.write("# the trial's own\n")
    cfg = build_config("arith-tiny", "done", ["rl.total_steps=21"])
    assert nothing_to_train(cfg, trial_dir) is None  # a step is left: it runs
    r = run_launch("exp=arith-tiny", "trial=done", f"cluster.fileroot={fileroot}",
                   "rl.total_steps=10", timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "arith-tiny/done is trained to step 20 already (its latest checkpoint), "
        "rl.total_steps=10: nothing to train; raise rl.total_steps to train on, or start over "
        "with recover=off recover.overwrite=true")
    assert sorted(os.listdir(trial_dir)) == ["checkpoints", "config.yaml"]
    with open(os.path.join(trial_dir, "config.yaml")) as f:
        assert f.read() == "# the trial's own\n"


def test_a_trial_none_of_whose_checkpoints_reads_is_refused(fileroot):
    """It trained from the base model again and its first commit deleted every checkpoint."""
    trial_dir = os.path.join(fileroot, "arith-tiny", "torn")
    for step in (2, 4):
        checkpoint(os.path.join(trial_dir, "checkpoints"), step, layout_of(TorchEngineConfig(), 1))
    for step in (2, 4):
        with open(os.path.join(trial_dir, "checkpoints", f"step_{step}", "state.json"), "w") as f:
            f.write("{{")  # the size it was committed with, no longer JSON
    r = run_launch("exp=arith-tiny", "trial=torn", f"cluster.fileroot={fileroot}", timeout=120)
    assert r.returncode == 2, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert "none of the 2 checkpoint(s)" in line and "step_4: state.json: " in line
    assert "warning" not in r.stderr.lower()
    assert sorted(os.listdir(trial_dir)) == ["checkpoints"]
    assert sorted(os.listdir(os.path.join(trial_dir, "checkpoints"))) == [
        "latest", "step_2", "step_4"]


def test_a_trial_continues_only_from_the_model_it_was_trained_from(tmp_path):
    """With another rl.model_path the servers started from that model and the first weight
    sync failed, naming a parameter no spec maps (the model family looked unknown)."""
    import json

    from experiments.rl.checkpoint_layout import check_resume_model

    root = str(tmp_path / "checkpoints")
    check_resume_model(root, str(tmp_path / "base"))  # nothing to continue
    checkpoint(root, 4, layout_of(TorchEngineConfig(), 1), ("actor",))
    tiny = {"model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 2, "vocab_size": 24}
    with open(os.path.join(root, "step_4", "actor", "config.json"), "w") as f:
        json.dump(tiny, f)
    os.makedirs(tmp_path / "base")
    check_resume_model(root, str(tmp_path / "base"))  # the base's config unreadable: not judged
    (tmp_path / "base" / "config.json").write_text(json.dumps({**tiny, "dtype": "bfloat16"}))
    check_resume_model(root, str(tmp_path / "base"))  # the same model (another dtype)
    (tmp_path / "base" / "config.json").write_text(json.dumps(  # a default left out of one
        {k: v for k, v in tiny.items() if k != "num_hidden_layers"}))
    check_resume_model(root, str(tmp_path / "base"))
    (tmp_path / "base" / "config.json").write_text(json.dumps(
        {**tiny, "model_type": "llama", "hidden_size": 576}))
    with pytest.raises(ConfigError) as e:
        check_resume_model(root, str(tmp_path / "base"))
    msg = str(e.value)
    assert msg.startswith(f"the latest checkpoint (step 4) holds another model than "
                          f"rl.model_path={tmp_path / 'base'} (model_type qwen2 against llama, "
                          "hidden_size 128 against 576)") and "\n" not in msg
    assert msg.endswith(f"(rl.model_path={root}/step_4/actor)")
