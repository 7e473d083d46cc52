"""RL benchmarks, each measured side by side with its baseline in one run.

    .venv/bin/python tests/benchmarks/rl.py            # or: make bench
    .venv/bin/python tests/benchmarks/rl.py --only generation,train

Prints ``name: value`` lines:
- generation_ratio: generated tokens/s through our serving path (a rollout-worker process ->
  authenticated RPC -> the generation server's engine loop -> vLLM, with per-token log-probs and
  versions) / raw ``vllm.LLM.generate`` on the same engine, prompts and sampling (target >= 0.85)
- seeded_ratio: raw vLLM tokens/s with a sampling seed per request (as the RL loop's training
  rollouts send) / without (one shared random stream); same engine and prompts
- train_ratio: tokens/s of our train step (the torch engine, dp=1, the GRPO/PPO actor loss) / a
  plain single-process transformers + AdamW loop with the same loss on the same batches
  (target >= 0.85)
- async_speedup: training samples/s of arith-tiny in async mode / sync mode (same steps, same
  config otherwise, both with the local scheduler's default CPU sets: training and generation
  on disjoint cores; loop time, engine start-up excluded; target >= 1.5)
- cpu_sets_speedup: samples/s of the default async run with CPU sets / without
  (``scheduler.local.cpus.mode=off``), and each one's training-reward gain per loop minute
- objectives (not in the default ``--only``): arith-tiny's default async GRPO against four
  optimizer steps a batch (``grpo4``: ``rl.ppo_minibatches=4 rl.loss.proximal=recompute``),
  DAPO's settings on those (``rl.dynamic_sampling=true rl.loss.clip_eps_high=0.28``) and Dr.
  GRPO's (``rl.group_std_norm=false rl.loss.aggregation=seq-mean-token-sum-norm``), DAPO's soft
  overlong punishment alone (``overlong``: ``rl.overlong.buffer=2`` of arith-tiny's 4 tokens)
  and sampling at temperature 1.5 (``hot``: the tempered policy trained), same steps
  and seeds: each one's gain in ``rollout_reward`` (every arriving group's mean reward, filtered or
  not; the training reward of a filtered batch is not comparable: dynamic sampling leaves out
  the groups all right or all wrong), last 10 steps against the first 10, its held-out greedy
  accuracy gain (arith-tiny holds out 6 problems: coarse), loop time, and groups generated
  per group trained; ``--seeds`` runs each with several ``rl.seed``
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from system.wire import new_secret  # noqa: E402

MODEL = os.path.join(REPO, ".models", "arith-tiny")
BIG = os.path.join(REPO, ".models", "smollm2-135m-instruct")
SECRET = new_secret()


# --- generation --------------------------------------------------------------------------------

def _rollout_client(address: str, secret: bytes, prompts: list, n: int, max_tokens: int,
                    go: mp.Event, q: mp.Queue) -> None:
    """A rollout worker's side: all its generate calls in flight on one RPC client."""
    from system.rpc import RpcClient
    from system.wire import Codec

    c = RpcClient(Codec(secret), address, 600)
    sampling = {"max_tokens": max_tokens, "ignore_eos": True}
    go.wait()
    t0 = time.time()
    ids = [c.submit("generate", prompt=p, n=n, sampling=sampling) for p in prompts]
    tokens = sum(len(s["tokens"]) for i in ids for s in c.result(i))
    q.put((tokens, t0, time.time()))
    c.close()


def generation(rounds: int = 3) -> dict[str, float]:
    from concurrent.futures import Future

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from system.rpc import RpcServer
    from system.wire import Codec
    from workers.engines.vllm_build import WEIGHT_SYNC_EXTENSION
    from workers.engines.vllm_config import LOGPROBS_MODE
    from workers.engines.vllm_server import GenerationEngine, Sampling, VllmConfig
    from workers.engines.vllm_tmp import engine_temp_dir

    with engine_temp_dir():  # (vLLM's sockets: not left in /tmp)
        llm = LLM(model=MODEL, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  gpu_memory_utilization=0.2, max_model_len=128, seed=0,
                  logprobs_mode=LOGPROBS_MODE, worker_extension_cls=WEIGHT_SYNC_EXTENSION)
    prompts = [[1] + [3 + (i * 7 + k) % 10 for k in range(5)] for i in range(64)]
    n, max_tokens = 4, 48
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                            detokenize=False)
    engine = GenerationEngine.from_llm(llm, VllmConfig(max_model_len=128), eos_token_id=2)

    def handler(prompt: list, n: int, sampling: dict) -> Future:
        return engine.submit(prompt, n, Sampling(**sampling))

    server = RpcServer(Codec(SECRET), "127.0.0.1", {"generate": handler})
    stop = threading.Event()
    serve = threading.Thread(target=server.serve_forever, args=(stop,), daemon=True)
    serve.start()

    seeded = [SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                             detokenize=False, seed=1000 * i) for i in range(len(prompts))]

    def raw(per_prompt: list | None = None) -> float:
        """``per_prompt``: a seed of its own per request, as the RL loop's rollouts send."""
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            per_prompt or params, use_tqdm=False)
        return sum(len(o.token_ids) for r in outs for o in r.outputs) / (time.perf_counter() - t0)

    ctx = mp.get_context("spawn")

    def ours(clients: int = 2) -> float:
        """Two rollout-worker processes (spawned and connected before the clock starts)."""
        q: mp.Queue = ctx.Queue()
        go = ctx.Event()
        share = [prompts[i::clients] for i in range(clients)]
        ps = [ctx.Process(target=_rollout_client, args=(server.address, SECRET, s, n,
                                                        max_tokens, go, q)) for s in share]
        for p in ps:
            p.start()
        time.sleep(3.0)  # imports and connect
        go.set()
        got = [q.get(timeout=600) for _ in ps]
        for p in ps:
            p.join()
        return sum(t for t, _, _ in got) / (max(e for _, _, e in got) - min(s for _, s, _ in got))

    raw()  # warm-up (first batch compiles / allocates)
    ours()
    r_raw, r_ours = [], []
    for _ in range(rounds):  # interleaved
        r_raw.append(raw())
        r_ours.append(ours())
    r_plain, r_seeded = [], []
    for _ in range(2 * rounds):  # (apart: in the loop above it changed the others' figures)
        r_plain.append(raw())
        r_seeded.append(raw(seeded))
    stop.set()
    serve.join()
    server.close()
    engine.close()
    llm.llm_engine.engine_core.shutdown()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"generation_ratio": med(r_ours) / med(r_raw),
            "generation_tokens_per_s_ours": med(r_ours),
            "generation_tokens_per_s_raw_vllm": med(r_raw),
            "seeded_ratio": med(r_seeded) / med(r_plain)}


# --- training ----------------------------------------------------------------------------------

def train(steps: int = 5) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from experiments.rl.algorithms.objectives import ActorLossConfig, actor_loss
    from experiments.rl.algorithms.ppo import ppo_policy_loss
    from workers.engines.torch_engine import TorchEngine, TorchEngineConfig

    path = BIG if os.path.isdir(BIG) else MODEL
    g = torch.Generator().manual_seed(0)
    vocab = 1000 if path == BIG else 20
    batches = []
    for _ in range(steps + 1):
        batch = []
        for _ in range(16):
            plen, clen = 24, int(torch.randint(16, 72, (1,), generator=g))
            toks = torch.randint(3, vocab, (plen + clen,), generator=g)
            batch.append({"tokens": toks.numpy(), "prompt_len": plen,
                          "mask": torch.ones(clen).numpy(),
                          "old_logp": (-torch.rand(clen, generator=g) * 3).numpy(),
                          "adv": torch.randn(clen, generator=g).numpy()})
        batches.append(batch)
    n_tokens = [sum(len(b["tokens"]) for b in batch) for batch in batches]
    loss_cfg = ActorLossConfig()
    lr = 1e-6

    def ours() -> float:
        eng = TorchEngine(TorchEngineConfig(model_path=path, lr=lr,
                                            max_tokens_per_microbatch=4096))
        t = 0.0
        for i, batch in enumerate(batches):
            seqs = [torch.as_tensor(b["tokens"], dtype=torch.long) for b in batch]
            gt = int(sum(b["mask"].sum() for b in batch))
            t0 = time.perf_counter()
            eng.train_step(seqs, actor_loss(batch, loss_cfg, {}), gt)
            if i:  # the first step warms up
                t += time.perf_counter() - t0
        return sum(n_tokens[1:]) / t

    def plain() -> float:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        t = 0.0
        for i, batch in enumerate(batches):
            t0 = time.perf_counter()
            L = max(len(b["tokens"]) for b in batch)
            ids = torch.zeros(len(batch), L, dtype=torch.long)
            att = torch.zeros(len(batch), L, dtype=torch.long)
            for k, b in enumerate(batch):
                ids[k, :len(b["tokens"])] = torch.as_tensor(b["tokens"])
                att[k, :len(b["tokens"])] = 1
            model.train()
            opt.zero_grad()
            logits = model(input_ids=ids, attention_mask=att).logits.float()
            lp = torch.gather(F.log_softmax(logits[:, :-1], -1), 2, ids[:, 1:, None])[..., 0]
            logp = torch.cat([lp[k, b["prompt_len"] - 1:len(b["tokens"]) - 1]
                              for k, b in enumerate(batch)])
            cat = lambda key: torch.cat([torch.as_tensor(b[key]) for b in batch])  # noqa: E731
            loss, _ = ppo_policy_loss(logp, cat("old_logp"), cat("adv"), cat("mask"))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if i:
                t += time.perf_counter() - t0
        return sum(n_tokens[1:]) / t

    r_plain, r_ours = [], []
    for _ in range(2):  # interleaved
        r_plain.append(plain())
        r_ours.append(ours())
    return {"train_ratio": max(r_ours) / max(r_plain), "train_tokens_per_s_ours": max(r_ours),
            "train_tokens_per_s_plain": max(r_plain),
            "train_model": os.path.basename(path)}


# --- async vs sync -----------------------------------------------------------------------------

def _loop_run(root: str, name: str, steps: int, *overrides: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "system.launch", "exp=arith-tiny",
                        f"trial=bench-{name}", f"cluster.fileroot={root}",
                        f"rl.total_steps={steps}", "rl.eval_interval=0",
                        "controller.progress=false", *overrides], cwd=REPO, capture_output=True,
                       text=True, timeout=1200)
    if r.returncode:
        raise RuntimeError(f"{name} run failed:\n{r.stderr[-2000:]}")
    with open(os.path.join(root, "arith-tiny", f"bench-{name}", "summary.json")) as f:
        return json.load(f)


def async_vs_sync(steps: int = 40) -> dict[str, float]:
    """Sync against async with the local scheduler's default CPU sets (training and generation
    on disjoint cores), and async without CPU sets (every worker on every core: the default
    before the sets), in one invocation."""
    out = {}
    with tempfile.TemporaryDirectory() as root:
        for name, overrides in (("sync", ["rl.mode=sync"]), ("async", ["rl.mode=async"]),
                                ("async-unbound", ["rl.mode=async",
                                                   "scheduler.local.cpus.mode=off"])):
            out[name] = _loop_run(root, name, steps, *overrides)

    def gain_per_min(s: dict) -> float:
        return (s["reward_last3"] - s["reward_first3"]) / (s["loop_seconds"] / 60)
    return {"async_speedup": out["async"]["samples_per_s"] / out["sync"]["samples_per_s"],
            "samples_per_s_async": out["async"]["samples_per_s"],
            "samples_per_s_sync": out["sync"]["samples_per_s"],
            "max_staleness_async": out["async"]["max_staleness_used"],
            "cpu_sets_speedup": (out["async"]["samples_per_s"]
                                 / out["async-unbound"]["samples_per_s"]),
            "samples_per_s_async_unbound": out["async-unbound"]["samples_per_s"],
            "reward_gain_per_min_async": gain_per_min(out["async"]),
            "reward_gain_per_min_async_unbound": gain_per_min(out["async-unbound"])}


MINIBATCHES = ["rl.ppo_minibatches=4", "rl.loss.proximal=recompute"]
OBJECTIVES = {"grpo": [],
              "grpo4": MINIBATCHES,
              "dapo": [*MINIBATCHES, "rl.dynamic_sampling=true", "rl.loss.clip_eps_high=0.28"],
              "drgrpo": ["rl.group_std_norm=false",
                         "rl.loss.aggregation=seq-mean-token-sum-norm"],
              "overlong": ["rl.overlong.buffer=2"],
              "hot": ["rl.agent.temperature=1.5"]}


def objectives(seeds: str = "1", steps: int = 160, batch: int = 16) -> dict[str, float]:
    """Each policy objective of :data:`OBJECTIVES` on arith-tiny, per seed, runs alternated."""
    rows: dict[str, list[dict]] = {name: [] for name in OBJECTIVES}
    with tempfile.TemporaryDirectory() as root:
        for seed in seeds.split(","):
            for name, overrides in OBJECTIVES.items():
                trial = f"{name}-{seed}"
                s = _loop_run(root, trial, steps, f"rl.seed={seed}", f"rl.batch_size={batch}",
                              *overrides)  # (evaluated before and after)
                with open(os.path.join(root, "arith-tiny", f"bench-{trial}",
                                       "metrics.jsonl")) as f:
                    steps_rows = [r for r in map(json.loads, f) if r.get("step", 0) > 0]
                rollout = [r["rollout_reward"] for r in steps_rows
                           if r.get("rollout_reward") is not None]
                rows[name].append({**s, "filtered": steps_rows[-1].get("filtered_groups", 0),
                                   "rollout_gain": (sum(rollout[-10:]) / len(rollout[-10:])
                                                    - sum(rollout[:10]) / len(rollout[:10]))})
    out: dict[str, float] = {}
    for name, runs in rows.items():
        gains = [r["rollout_gain"] for r in runs]
        out[f"rollout_gain_{name}"] = sum(gains) / len(gains)
        out[f"rollout_gains_{name}"] = " / ".join(f"{g:.3f}" for g in gains)  # type: ignore
        evals = [r["eval_accuracy_after"] - r["eval_accuracy_before"] for r in runs]
        out[f"eval_gains_{name}"] = " / ".join(f"{g:.3f}" for g in evals)  # type: ignore
        out[f"loop_seconds_{name}"] = sum(r["loop_seconds"] for r in runs) / len(runs)
        out[f"rollout_gain_per_min_{name}"] = out[f"rollout_gain_{name}"] / (
            out[f"loop_seconds_{name}"] / 60)
        out[f"groups_per_trained_{name}"] = sum(
            1 + r["filtered"] / (steps * batch) for r in runs) / len(runs)
    for name in OBJECTIVES:
        if name != "grpo":
            out[f"rollout_gain_ratio_{name}"] = (out[f"rollout_gain_{name}"]
                                                 / max(out["rollout_gain_grpo"], 1e-9))
            out[f"loop_time_ratio_{name}"] = (out[f"loop_seconds_{name}"]
                                              / out["loop_seconds_grpo"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", default="generation,train,async")
    p.add_argument("--seeds", default="1", help="objectives: rl.seed of each run, e.g. 1,2,3")
    args = p.parse_args()
    parts = {"generation": generation, "train": train, "async": async_vs_sync,
             "objectives": lambda: objectives(args.seeds)}
    for name in args.only.split(","):
        for k, v in parts[name]().items():
            print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}", flush=True)


if __name__ == "__main__":
    main()
