"""What every RL role needs: its validated ``rl`` section, the model, tokenizer and prompts."""
from __future__ import annotations

import os
from typing import Any

from experiments.rl.config import RLConfig, resolve_model_path
from experiments.rl.reward_watch import RewardWatch
from experiments.rl.tasks import Prompt, dataset, get_task
from experiments.rl.tokenizer import load_tokenizer
from system.errors import ConfigError
from system.files import fsync_path
from workers.base import Worker
from workers.schema import Trajectory

def rl_config(worker: Worker) -> RLConfig:
    """The ``rl`` section the controller sent, as a validated :class:`RLConfig`."""
    return rl_section(worker.config["experiment"])


def rl_section(section: Any) -> RLConfig:
    """An ``rl`` config section (a mapping, or an OmegaConf node) as a validated
    :class:`RLConfig`."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RLConfig), section))


def model_path(worker: Worker, rl: RLConfig) -> str:
    return experiment_model_path(worker.boot.experiment, rl)


def experiment_model_path(experiment: str, rl: RLConfig) -> str:
    return resolve_model_path(rl, experiment)


def save_tokenizer(tok: Any, directory: str) -> None:
    """Write ``tok``'s files (and chat template) into the model directory ``directory``, each
    fsynced: a checkpoint's actor then loads with ``AutoTokenizer`` and serves as
    ``rl.model_path`` of a new trial."""
    for path in tok.save_pretrained(directory):
        if os.path.isfile(path):
            fsync_path(path)


def encode_prompt(tok: Any, text: str, chat: bool) -> list[int]:
    if chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # BatchEncoding
    ids = tok.encode(text, add_special_tokens=False)
    return ([tok.bos_token_id] if tok.bos_token_id is not None else []) + list(ids)


def eval_prompts(rl: RLConfig, tok: Any) -> list[tuple[Prompt, list[int]]]:
    """The held-out prompts with their token ids. A prompt too long for the servers' context
    with ``rl.agent.max_new_tokens`` more is a ConfigError naming where it comes from and its
    id (a training prompt is skipped instead: an evaluation without it would measure another
    set); it stopped the first evaluation with the server's words alone. (An agent function
    sets its own request sizes: not checked here.)"""
    task = get_task(rl.task)
    out = [(p, encode_prompt(tok, p["prompt"], task.chat)) for p in dataset(rl.task, "eval")]
    room = rl.vllm.max_model_len - rl.agent.max_new_tokens
    long = next(((p, ids) for p, ids in out if len(ids) > room), None)
    if long is not None and rl.agent.kind != "openai":
        source = (f"rl.task.eval_path={rl.task.eval_path!r}" if rl.task.eval_path else
                  f"rl.task.name={rl.task.name!r}")
        raise ConfigError(f"{source}: held-out prompt id {long[0]['id']} ({len(long[1])} "
                          f"tokens) + rl.agent.max_new_tokens ({rl.agent.max_new_tokens}) "
                          f"exceeds rl.vllm.max_model_len={rl.vllm.max_model_len}; valid: "
                          f"held-out prompts of at most {room} tokens, or a larger "
                          "rl.vllm.max_model_len")
    return out


def reward_watch(worker: Worker, timeout: float) -> RewardWatch:
    """The deadline on ``worker``'s reward calls (``rl.task.reward_timeout``): a call past it
    fails the worker at once, with a ConfigError naming the function (not recovered)."""
    return RewardWatch(timeout, lambda message: worker.fail_now(ConfigError(message)))


def group_version(trajs: list[Trajectory], fallback: int) -> int:
    """The oldest weight version that produced a policy token of the group."""
    vs = [int(t["versions"][t["mask"] == 1].min()) for t in trajs
          if len(t["versions"]) and (t["mask"] == 1).any()]
    return min(vs) if vs else fallback


__all__ = ["encode_prompt", "eval_prompts", "experiment_model_path",
           "group_version", "load_tokenizer", "model_path", "reward_watch", "rl_config",
           "rl_section"]
