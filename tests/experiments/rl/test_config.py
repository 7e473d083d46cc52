"""The RL config's validation."""
from __future__ import annotations

import pytest

from experiments.rl.agents import AgentConfig
from experiments.rl.config import RLConfig
from system.errors import ConfigError


def test_rl_config_errors_name_the_field():
    # a section names its own fields; the override machinery adds where it is mounted
    with pytest.raises(ConfigError, match="^mode='fast'"):
        RLConfig(mode="fast")
    with pytest.raises(ConfigError, match="sync_interval"):
        RLConfig(sync_interval=3, max_head_offpolicyness=1)
    with pytest.raises(ConfigError, match="mode=sync trains on fresh samples only"):
        RLConfig(mode="sync", sync_interval=2, max_head_offpolicyness=1)  # (not what is asked)
    with pytest.raises(ConfigError, match="group_size"):
        RLConfig(group_size=1)
    assert RLConfig(mode="sync", max_head_offpolicyness=3).eta == 0


def test_a_model_directory_without_a_tokenizer_is_refused(tmp_path):
    import os

    from experiments.rl.config import resolve_model_path

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^rl.model_path='.*' has no tokenizer \(none of "
                                          r"tokenizer.json, .*copy the base model's"):
        resolve_model_path(RLConfig(model_path=str(tmp_path)), "arith-tiny")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert resolve_model_path(RLConfig(model_path=str(tmp_path)), "arith-tiny") == \
        os.path.abspath(tmp_path)


@pytest.mark.parametrize("model", ["arith-tiny", "smollm2-135m-instruct"])
def test_a_saved_tokenizer_loads_and_encodes_as_the_base_models(model, tmp_path):
    import os

    from experiments.rl.common import encode_prompt, load_tokenizer, save_tokenizer
    from system.paths import PROJECT_ROOT

    base = os.path.join(PROJECT_ROOT, ".models", model)
    if not os.path.isfile(os.path.join(base, "config.json")):
        pytest.skip("the models are created by scripts/setup.sh")
    tok = load_tokenizer(base)
    save_tokenizer(tok, str(tmp_path))  # what a checkpoint's actor/ gets beside the weights
    again = load_tokenizer(str(tmp_path))
    for chat in (False, True):
        assert encode_prompt(again, "12+30=", chat) == encode_prompt(tok, "12+30=", chat) != []
    assert again.eos_token_id == tok.eos_token_id


BAD_OVERRIDES = [  # (override, the start of its one-line error)
    ("rl.call_timeout=0", "rl.call_timeout=0.0 is not valid; valid: seconds > 0"),
    ("rl.call_timeout=1e10", "rl.call_timeout=1e10: must be a finite number of magnitude at "
                             "most 1e+09"),
    ("rl.startup_timeout=-1", "rl.startup_timeout=-1.0 is not valid; valid: seconds > 0"),
    ("rl.lease_timeout=0", "rl.lease_timeout=0.0 is not valid; valid: seconds > 0"),
    ("rl.weight_sync.timeout=0", "rl.weight_sync.timeout=0.0 is not valid; valid: seconds > 0"),
    ("rl.weight_sync.bucket_mb=0", "rl.weight_sync.bucket_mb must be >= 1"),
    ("rl.critic_lr=-1", "rl.critic_lr=-1.0 is not valid; valid: > 0"),
    ("rl.critic_lr=0", "rl.critic_lr=0.0 is not valid; valid: > 0"),
    ("rl.gamma=2", "rl.gamma=2.0 is not valid; valid: a number in [0, 1]"),
    ("rl.gamma=-1", "rl.gamma=-1.0 is not valid; valid: a number in [0, 1]"),
    ("rl.lam=-1", "rl.lam=-1.0 is not valid; valid: a number in [0, 1]"),
    ("rl.lam=1.5", "rl.lam=1.5 is not valid; valid: a number in [0, 1]"),
    ("rl.value_clip=-1", "rl.value_clip=-1.0 is not valid; valid: > 0"),
    ("rl.value_clip=0", "rl.value_clip=0.0 is not valid; valid: > 0"),
    ("rl.seed=-1", "rl.seed must be in [0, 2**32)"),
    ("rl.seed=4294967296", "rl.seed must be in [0, 2**32)"),
    ("rl.vllm.seed=-1", "rl.vllm.seed must be in [0, 2**32)"),
    ("rl.vllm.max_model_len=4", "rl.vllm.max_model_len must be >= 8"),
    # past the model's positions: vLLM refused it at every (recovered) start of the servers
    ("rl.vllm.max_model_len=300", "rl.vllm.max_model_len=300 is longer than the model's context "
                                  "(max_position_embeddings=256 in its config.json); valid: "
                                  "rl.vllm.max_model_len <= 256"),
    ("rl.vllm.tensor_parallel_size=0", "rl.vllm.tensor_parallel_size must be >= 1"),
    ("rl.agent.temperature=0", "rl.agent.temperature=0.0 is not valid for training rollouts"),
    ("rl.agent.temperature=-1", "rl.agent.temperature=-1.0 is not valid for training"),
    ("rl.agent.top_p=0", "rl.agent.top_p=0.0 is not valid; valid: a number in (0, 1]"),
    ("rl.agent.max_turns=0", "rl.agent.max_turns must be >= 1, got 0"),
    ("rl.agent.max_new_tokens=0", "rl.agent.max_new_tokens must be >= 1, got 0"),
    ("rl.agent.max_new_tokens=100000", "rl.agent.max_new_tokens=100000 leaves no room for a "
                                       "prompt in rl.vllm.max_model_len=128"),
    ("rl.agent.max_new_tokens=128", "rl.agent.max_new_tokens=128 leaves no room"),
    ("rl.task.eval_size=-1", "rl.task.eval_size must be >= 0, got -1"),
    ("rl.task.max_operand=0", "rl.task.max_operand must be >= 1, got 0"),
    # (the server checks in its own dtype; at the launch's, the smaller, bfloat16)
    ("rl.vllm.kv_cache_gib=0.00001", "rl.vllm.kv_cache_gib=1e-05 cannot hold the KV cache of "
                                     "one rl.vllm.max_model_len=128 sequence of this model "
                                     "(512 bytes a token in bfloat16 per rank"),
    ("rl.loss.clip_eps_high=-0.1", "rl.loss.clip_eps_high=-0.1 is not valid; valid: 0 "
                                   "(clip_eps) or > 0"),
    ("rl.loss.dual_clip=1", "rl.loss.dual_clip=1.0 is not valid; valid: 0 (off) or > 1"),
    ("rl.overlong.buffer=-1", "rl.overlong.buffer=-1 is not valid; valid: an integer >= 0"),
    ("rl.overlong.penalty=0.5", "rl.overlong.penalty=0.5 is read only with "
                                "rl.overlong.buffer > 0"),
    ("rl.eval_samples=0", "rl.eval_samples must be >= 1, got 0"),
    ("rl.eval_samples=4", "rl.eval_samples=4 needs rl.eval_temperature > 0 (greedy answers"),
    ("rl.eval_temperature=-1", "rl.eval_temperature=-1.0 is not valid; valid: 0 (greedy) or"),
    ("rl.overlong.buffer=5", "rl.overlong.buffer=5 is longer than the budget "
                             "rl.agent.max_new_tokens=4; valid: 0 to 4"),
    ("rl.overlong.penalty=-1", "rl.overlong.penalty=-1.0 is not valid; valid: a number >= 0"),
    ("rl.loss.aggregation=seq-mean", "rl.loss.aggregation='seq-mean' is not one of token-mean, "
                                     "seq-mean-token-mean, seq-mean-token-sum, "
                                     "seq-mean-token-sum-norm"),
]


@pytest.mark.parametrize("override, message", BAD_OVERRIDES)
def test_an_out_of_range_setting_is_one_line_naming_its_key(override, message, tmp_path,
                                                            capsys):
    from system.launch import build_config, main

    with pytest.raises(ConfigError) as e:
        build_config("arith-tiny", "t", [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    code = main(["exp=arith-tiny", "trial=t", f"cluster.fileroot={tmp_path}", override,
                 "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and err == f"error: {e.value}\n"
    assert not (tmp_path / "arith-tiny").exists()  # refused before anything is written


def test_the_ranges_take_their_bounds_and_a_budget_that_leaves_room():
    from system.launch import build_config

    cfg = build_config("arith-tiny", "t", [
        "rl.gamma=0", "rl.lam=1", "rl.agent.temperature=0.01", "rl.agent.max_new_tokens=127",
        "rl.seed=0", "rl.vllm.seed=4294967295", "rl.call_timeout=1e9"])
    assert (cfg.rl.gamma, cfg.rl.lam, cfg.rl.agent.max_new_tokens) == (0, 1, 127)
    # an agent function asks for its own max_tokens: rl.agent.max_new_tokens is not read
    build_config("arith-tiny", "t", ["rl.agent.kind=openai", "rl.agent.function=calculator",
                                     "generation.http=true", "rl.agent.max_new_tokens=500"])
    # (RLConfig on its own names the keys it compares in full: it is the rl section)
    with pytest.raises(ConfigError, match=r"^rl\.agent\.max_new_tokens=512 .*valid: "
                                          r"rl\.agent\.max_new_tokens < rl\.vllm\.max_model_len"):
        RLConfig(agent=AgentConfig(max_new_tokens=512))


def _trial(*overrides: str, gpus: str = "none"):
    from system.launch import build_config

    return build_config("arith-tiny", "t", [f"scheduler.local.gpus={gpus}", *overrides])


def test_tensor_parallelism_on_cpu_needs_a_numa_node_per_rank():
    """vLLM's CPU backend binds each tensor-parallel rank to a NUMA node of its own (with its
    default VLLM_CPU_OMP_THREADS_BIND=auto): with fewer, every generation server failed an
    assertion at start and was recovered three times. The launcher refuses it (exit 1)."""
    tp2 = _trial("rl.vllm.tensor_parallel_size=2")
    with pytest.raises(ConfigError, match=r"^rl\.vllm\.tensor_parallel_size=2 cannot run on this "
                                          r"machine's CPUs: .*may use 1 NUMA node \(0\); valid: "
                                          r"rl\.vllm\.tensor_parallel_size <= 1 on this machine"):
        tp2.check_machine({}, nodes=[0])
    tp2.check_machine({}, nodes=[0, 1])
    tp2.check_machine({"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, nodes=[0])  # bound by hand
    _trial().check_machine({}, nodes=[0])
    # on GPUs it counts GPUs (placement checks those); Slurm's nodes are not this machine
    _trial("rl.vllm.tensor_parallel_size=2", gpus="0,1").check_machine({}, nodes=[0])
    _trial("rl.vllm.tensor_parallel_size=2", "scheduler=slurm").check_machine({}, nodes=[0])


def test_a_local_trials_model_must_be_a_model_directory_here(tmp_path):
    """A missing ``rl.model_path`` was found by the model worker, after the trial directory was
    written and every worker started; a local launch now refuses it (exit 1). Slurm's nodes
    may see other files, and an evaluation reads the trial's checkpoints: not checked here."""
    missing = str(tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"^rl\.model_path='.*absent' is not a model directory"):
        _trial(f"rl.model_path={missing}").check_machine({}, nodes=[0])
    _trial(f"rl.model_path={missing}", "scheduler=slurm").check_machine({}, nodes=[0])
    _trial(f"rl.model_path={missing}", "mode=eval").check_machine({}, nodes=[0])


def test_a_local_trials_prompt_files_are_read_at_launch(tmp_path):
    """A missing, malformed or empty ``rl.task.train_path`` (or ``eval_path``) passed the
    launch and failed the master about 10 s later, every worker started; a local launch reads
    them as the master will and refuses them (exit 1). Slurm's nodes may see other files."""
    good, bad, empty = (tmp_path / n for n in ("good.jsonl", "bad.jsonl", "empty.jsonl"))
    good.write_text('{"prompt": "1+1=", "answer": 2}\n')
    bad.write_text('{"prompt": 1\n')
    empty.write_text("")
    _trial(f"rl.task.train_path={good}", f"rl.task.eval_path={good}").check_machine({}, [0])
    for key in ("train_path", "eval_path"):
        for path, words in ((tmp_path / "absent.jsonl", "does not exist on"),
                            (bad, "line 1 is not JSON"), (empty, "holds no prompts")):
            with pytest.raises(ConfigError, match=rf"^rl\.task\.{key}='{path}':? {words}"):
                _trial(f"rl.task.{key}={path}").check_machine({}, nodes=[0])
            _trial(f"rl.task.{key}={path}", "scheduler=slurm").check_machine({}, nodes=[0])
    # an evaluation reads the held-out file (the training file is not its business)
    with pytest.raises(ConfigError, match=r"^rl\.task\.eval_path=.* holds no prompts"):
        _trial(f"rl.task.eval_path={empty}", "mode=eval").check_machine({}, nodes=[0])
    _trial(f"rl.task.train_path={empty}", "mode=eval").check_machine({}, nodes=[0])


def test_a_context_past_the_models_positions_is_left_to_vllm_where_it_may_be_valid():
    from experiments.rl.config import check_model_len

    plain = {"max_position_embeddings": 256}
    with pytest.raises(ConfigError, match="rl.vllm.max_model_len=300 is longer"):
        check_model_len(300, plain, {})
    check_model_len(256, plain, {})
    check_model_len(300, None, {})
    check_model_len(300, {**plain, "rope_scaling": {"type": "yarn", "factor": 4}}, {})
    # transformers 5 writes rope_parameters (its rope_type "default" does not scale)
    check_model_len(300, {**plain, "rope_parameters": {"rope_type": "yarn", "factor": 4}}, {})
    with pytest.raises(ConfigError):
        check_model_len(300, {**plain, "rope_parameters": {"rope_type": "default"}}, {})
    check_model_len(300, plain, {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})  # vLLM's own override


@pytest.mark.parametrize("overrides, message", [
    (["rl.group_std_norm=false", "rl.algorithm=ppo"], "rl.group_std_norm=false needs "
                                                       "rl.algorithm=grpo"),
    (["rl.ppo_minibatches=0"], "rl.ppo_minibatches=0 is not valid; valid: 1 to "
                               "rl.batch_size=16"),
    (["rl.ppo_minibatches=17"], "rl.ppo_minibatches=17 is not valid"),
    (["rl.max_filtered_batches=-1"], "rl.max_filtered_batches must be >= 0"),
    # the default async loss: its ratio is 1 with one optimizer step a batch
    (["rl.loss.clip_eps_high=0.28"], "rl.loss.clip_eps_high acts on ratios away from 1"),
    (["rl.loss.dual_clip=3", "rl.loss.proximal=recompute"], "rl.loss.dual_clip acts on"),
    (["rl.ppo_minibatches=4"], "rl.ppo_minibatches=4 needs rl.loss.proximal=recompute"),
])
def test_objective_settings_that_cannot_act_are_refused(overrides, message):
    from system.launch import build_config

    with pytest.raises(ConfigError) as e:
        build_config("arith-tiny", "t", overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_the_clips_act_with_mini_batches_or_against_the_behaviour_policy():
    from system.launch import build_config

    for overrides in (["rl.ppo_minibatches=4", "rl.loss.proximal=recompute"],
                      ["rl.loss.proximal=off"], ["rl.decoupled_loss=false"], ["rl.mode=sync"],
                      ["rl.mode=sync", "rl.ppo_minibatches=2"]):
        build_config("arith-tiny", "t", ["rl.loss.clip_eps_high=0.28", "rl.loss.dual_clip=3",
                                         *overrides])


def test_dynamic_sampling_is_grpos():
    from system.launch import build_config

    with pytest.raises(ConfigError) as e:
        build_config("arith-tiny", "t", ["rl.dynamic_sampling=true", "rl.algorithm=ppo"])
    assert str(e.value).startswith("rl.dynamic_sampling=true needs rl.algorithm=grpo")
    cfg = build_config("arith-tiny", "t", ["rl.dynamic_sampling=true",
                                           "rl.loss.aggregation=seq-mean-token-sum-norm"])
    assert cfg.rl.dynamic_sampling and cfg.rl.loss.aggregation == "seq-mean-token-sum-norm"
