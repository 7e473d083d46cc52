"""RL post-training experiments: ``arith-tiny`` (the default run) and ``smollm2-arith``.

Roles: model workers host the torch engines (actor; reference when ``rl.loss.kl_coef > 0``;
critic for PPO); generation servers host vLLM plus an OpenAI-compatible endpoint; rollout
workers take prompts from the master, run the agent against the server the master picked, score
the samples and stream the groups back; the master runs the loop in :mod:`experiments.rl_loop`.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from experiments.agents import GenRequest, make_agent
from experiments.registry import register
from experiments.rl_config import RLConfig, RLExperimentConfig, resolve_model_path
from experiments.tasks import dataset, get_task
from system import names
from workers.engines.configs import TorchEngineConfig

log = logging.getLogger("rl")

ROLES = {"master": "experiments.rl_loop:master_role", "model": "experiments.rl:model_role",
         "generation": "experiments.rl:generation_role", "rollout": "experiments.rl:rollout_role"}
DEFAULT_MODEL = {"arith-tiny": "arith-tiny", "smollm2-arith": "smollm2-135m-instruct"}


@register("arith-tiny", roles=ROLES, section="rl")
def arith_tiny() -> RLExperimentConfig:
    """GRPO, asynchronous, on one-digit sums with a tiny random-init Qwen2 (learns in minutes on
    2 cores)."""
    cfg = RLExperimentConfig()
    cfg.model.count, cfg.generation.count, cfg.rollout.count = 1, 1, 2
    cfg.rl.vllm.max_model_len = 128
    return cfg


@register("smollm2-arith", roles=ROLES, section="rl")
def smollm2_arith() -> RLExperimentConfig:
    """GRPO on arithmetic word problems with SmolLM2-135M-Instruct; held-out accuracy before and
    after."""
    cfg = RLExperimentConfig()
    cfg.model.count, cfg.generation.count, cfg.rollout.count = 1, 1, 2
    rl = cfg.rl
    # sized for a 2-core CPU (a 135M-parameter train step on ~1.5k tokens takes ~15 s there);
    # on GPUs raise total_steps, batch_size and max_new_tokens
    rl.total_steps, rl.batch_size, rl.group_size = 8, 4, 4
    rl.eval_interval = 4
    rl.actor = TorchEngineConfig(lr=2e-6, max_tokens_per_microbatch=2048)
    rl.task.name, rl.task.max_operand, rl.task.eval_size = "word", 20, 32
    rl.agent.max_new_tokens = 32
    rl.vllm.max_model_len = 512
    rl.tasks_per_request = 2
    return cfg


def rl_config(worker: Any) -> RLConfig:
    """The ``rl`` section the controller sent, as a validated :class:`RLConfig`."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RLConfig),
                                               worker.config["experiment"]))


def model_path(worker: Any, rl: RLConfig) -> str:
    return resolve_model_path(rl, DEFAULT_MODEL.get(worker.boot.experiment, "arith-tiny"))


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def encode_prompt(tok: Any, text: str, chat: bool) -> list[int]:
    if chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # BatchEncoding
    ids = tok.encode(text, add_special_tokens=False)
    return ([tok.bos_token_id] if tok.bos_token_id is not None else []) + list(ids)


# --- model workers -----------------------------------------------------------------------------

def model_role(worker: Any) -> dict[str, Any]:
    import dataclasses
    import os

    from workers.engines.torch_engine import TorchEngine

    rl = rl_config(worker)
    path = model_path(worker, rl)
    resume_dir = _resume_dir(worker)
    worker.init_default_group()
    actor_path = os.path.join(resume_dir, "actor") if resume_dir else path
    actor = TorchEngine(dataclasses.replace(rl.actor, model_path=actor_path), worker.device,
                        worker.world_size)
    engines = {"actor": actor}
    if rl.loss.kl_coef > 0:
        engines["ref"] = TorchEngine(dataclasses.replace(rl.actor, model_path=path),
                                     worker.device, worker.world_size, trainable=False)
    if rl.algorithm == "ppo":
        critic_path = os.path.join(resume_dir, "critic") if resume_dir else path
        engines["critic"] = TorchEngine(
            dataclasses.replace(rl.actor, model_path=critic_path, lr=rl.critic_lr),
            worker.device, worker.world_size, head="value")
    if resume_dir:
        for which, eng in engines.items():
            if which != "ref":
                eng.load_optimizer(os.path.join(resume_dir, which), worker.index)
    worker.engines = engines
    worker.engine_info = {"dtype": str(actor.dtype).replace("torch.", ""),
                          "backend": "nccl" if worker.device.startswith("cuda") else "gloo"}
    worker.wait_stop()
    return {"engines": sorted(engines), "steps": actor.steps}


def _resume_dir(worker: Any) -> str | None:
    import os

    from system.checkpoint import CheckpointDir

    if worker.config.get("recover") != "resume":
        return None
    ckpt = CheckpointDir(os.path.join(worker.boot.trial_dir, "checkpoints"))
    step = ckpt.latest()
    return ckpt.path(step) if step is not None else None


# --- generation servers ------------------------------------------------------------------------

def generation_role(worker: Any) -> dict[str, Any]:
    from workers.openai_http import OpenAIEndpoint

    rl = rl_config(worker)
    path = model_path(worker, rl)
    tok = load_tokenizer(path)
    engine = worker.open_engine(path, rl.vllm, tok.eos_token_id)
    worker.http = OpenAIEndpoint(engine, tok, worker.boot.experiment, worker.host)
    worker.name_resolve.add(names.trial_root(worker.exp, worker.trial) + f"/http/{worker.index}",
                            worker.http.address, replace=True)
    try:
        worker.wait_stop()
    finally:
        worker.http.close()
        engine.close()
    return {"requests": worker.requests, "engine": dict(engine.stats), "version": engine.version}


# --- rollout workers ---------------------------------------------------------------------------

def run_episodes(episodes: list[tuple[Any, int]], clients: dict[int, Any],
                 timeout: float) -> list[list[dict]]:
    """Drive episodes (``(generator, server)``) together: every round submits each live
    episode's request to its server, then feeds back the samples. Returns each episode's
    trajectories."""
    results: list[list[dict] | None] = [None] * len(episodes)
    pending: dict[int, GenRequest] = {}
    for i, (ep, _) in enumerate(episodes):
        pending[i] = next(ep)
    while pending:
        ids = {i: clients[episodes[i][1]].submit_generate(r.prompt, r.n, r.sampling)
               for i, r in pending.items()}
        nxt: dict[int, GenRequest] = {}
        for i, rid in ids.items():
            samples = clients[episodes[i][1]].rpc.result(rid, timeout)
            try:
                nxt[i] = episodes[i][0].send(samples)
            except StopIteration as stop:
                results[i] = stop.value
        pending = nxt
    return results  # type: ignore[return-value]


def score(trajs: list[dict], tok: Any, answer: Any, reward_fn: Any) -> None:
    """Reward each trajectory on its final answer: the policy's last turn (after the last tool
    output; for a single-turn agent, the whole completion)."""
    for t in trajs:
        comp = t["tokens"][t["prompt_len"]:]
        tool = np.nonzero(t["mask"] == 0)[0]
        final = comp[tool[-1] + 1:] if len(tool) else comp
        t["reward"] = float(reward_fn(tok.decode([int(x) for x in final],
                                                 skip_special_tokens=True), answer))


def rollout_role(worker: Any) -> dict[str, Any]:
    from workers.generation import GenerationClient

    rl = rl_config(worker)
    path = model_path(worker, rl)
    tok = load_tokenizer(path)
    task = get_task(rl.task)
    prompts = {p["id"]: p for p in dataset(rl.task, "train")}
    agent = make_agent(rl.agent, tok)
    master_addr = worker.name_resolve.wait(
        names.worker_address(worker.exp, worker.trial, "master", 0), 60)
    master = worker.client(master_addr, 30.0)
    pusher = worker.trajectory_stream()
    gens: dict[int, Any] = {}
    done = groups = failed = 0
    encoded: dict[int, list[int]] = {}
    try:
        while not worker.stopping:
            if not worker.wait_unpaused():
                break
            reply = master.call("next_task", worker=worker.index, max_tasks=rl.tasks_per_request)
            if reply.get("done"):
                done = 1
                break
            if "wait" in reply:
                time.sleep(float(reply["wait"]))
                continue
            tasks = reply["tasks"]
            for t in tasks:
                if t["server"] not in gens:
                    addr = worker.name_resolve.wait(names.worker_address(
                        worker.exp, worker.trial, "generation", t["server"]), 60)
                    gens[t["server"]] = GenerationClient(worker.client(addr, rl.call_timeout),
                                                         f"generation/{t['server']}")
            episodes, owner = [], []
            for k, t in enumerate(tasks):
                p = prompts[t["prompt_id"]]
                if p["id"] not in encoded:
                    encoded[p["id"]] = encode_prompt(tok, p["prompt"], task.chat)
                for ep in agent.episodes(encoded[p["id"]], rl.group_size):
                    episodes.append((ep, t["server"]))
                    owner.append(k)
            try:
                results = run_episodes(episodes, gens, rl.call_timeout)
                error = ""
            except Exception as e:  # a server failed or was cut off: give the tasks back
                log.exception("rollout failed")
                results, error = [], f"{type(e).__name__}: {e}"
                # look the servers up again next time: one requeued by Slurm registers anew
                for server in {t["server"] for t in tasks}:
                    gens.pop(server).close()
            for k, t in enumerate(tasks):
                trajs = [tr for i, r in enumerate(results) if owner[i] == k for tr in r]
                if not error:
                    score(trajs, tok, prompts[t["prompt_id"]]["answer"], task.reward)
                msg = {"seq": t["seq"], "prompt_id": t["prompt_id"], "worker": worker.index,
                       "server": t["server"], "trajs": trajs, "failed": bool(error),
                       "error": error}
                if not _push(worker, pusher, msg):
                    break
                groups += 1
                failed += bool(error)
    finally:
        master.close()
        for c in gens.values():
            c.close()
        pusher.close(linger=0.5)
    return {"groups": groups, "failed": failed, "finished": bool(done)}


def _push(worker: Any, pusher: Any, msg: dict) -> bool:
    """Push, retrying while the master's queue is full; gives up once the worker is stopping."""
    from system.errors import RpcTimeout

    while True:
        try:
            pusher.send(msg, timeout=1.0)
            return True
        except RpcTimeout:
            if worker.stopping:
                return False


def eval_prompts(rl: RLConfig, tok: Any) -> list[tuple[dict, list[int]]]:
    task = get_task(rl.task)
    return [(p, encode_prompt(tok, p["prompt"], task.chat)) for p in dataset(rl.task, "eval")]


def group_version(trajs: list[dict], fallback: int) -> int:
    """The oldest weight version that produced a policy token of the group."""
    vs = [int(t["versions"][t["mask"] == 1].min()) for t in trajs
          if len(t["versions"]) and (t["mask"] == 1).any()]
    return min(vs) if vs else fallback

