"""The master's view of the megatron layout: which dp part each model worker gets, whose
results stand for each dp rank, and the config checks naming rl.actor.megatron.*."""
from __future__ import annotations

import dataclasses
import os

import pytest

from experiments.rl.cluster import train_layout
from experiments.rl.config import RLConfig, RLExperimentConfig
from system.errors import ConfigError
from system.paths import PROJECT_ROOT
from workers.engines.configs import MegatronConfig, TorchEngineConfig


def _actor(tp: int, pp: int) -> TorchEngineConfig:
    return TorchEngineConfig(backend="megatron", megatron=MegatronConfig(tp=tp, pp=pp))


def test_fsdp_is_data_parallel_over_every_worker():
    assert train_layout(TorchEngineConfig(), 3).world_size == 3
    assert train_layout(TorchEngineConfig(), 3).dp == 3


def test_megatron_ranks_follow_megatron_order():
    lay = train_layout(_actor(2, 2), 8)  # dp = 2
    assert (lay.dp, lay.tp, lay.pp) == (2, 2, 2)
    # tp fastest, then dp, then pp: ranks 0,1 | 2,3 are dp 0 | 1 on stage 0
    assert [lay.coord(r).dp for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    leads = [lay.rank(dp=d, tp=0, pp=1) for d in range(2)]
    assert leads == [4, 6]  # the last stage's tp rank 0 of each dp group


def test_experiment_config_refuses_a_split_naming_the_key(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 3}')
    with pytest.raises(ConfigError, match=r"rl.actor.megatron.tp x rl.actor.megatron.pp"):
        RLExperimentConfig(rl=RLConfig(actor=_actor(2, 2)))  # model.count defaults to 2
    with pytest.raises(ConfigError, match=r"rl.actor.megatron.pp=2 does not divide the "
                       r"model's 3 layers"):
        RLExperimentConfig(rl=RLConfig(actor=_actor(1, 2), model_path=str(tmp_path)))
    RLConfig(actor=_actor(1, 1), algorithm="ppo")  # (the critic is megatron's too)
    # the experiment's own model when rl.model_path is empty: checked at launch (arith-tiny:
    # 2 heads, 2 layers), not once every worker started
    if os.path.isfile(os.path.join(PROJECT_ROOT, ".models", "arith-tiny", "config.json")):
        with pytest.raises(ConfigError, match=r"rl.actor.megatron.tp=4 does not divide the "
                           r"model's 2 attention heads"):
            RLExperimentConfig(exp="arith-tiny", model=dataclasses.replace(
                RLExperimentConfig().model, count=4), rl=RLConfig(actor=_actor(4, 1)))
    (tmp_path / "config.json").write_text(
        '{"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, '
        '"intermediate_size": 6}')
    with pytest.raises(ConfigError, match=r"rl.actor.megatron.tp=4 does not divide the "
                       r"model's intermediate_size 6"):
        RLExperimentConfig(model=dataclasses.replace(RLExperimentConfig().model, count=4),
                           rl=RLConfig(actor=_actor(4, 1), model_path=str(tmp_path)))
