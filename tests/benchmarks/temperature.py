"""What sampling at a temperature other than 1 costs, now that both sides are corrected, each
measured side by side with its baseline in one run.

    .venv/bin/python tests/benchmarks/temperature.py

Prints ``name: value`` lines:
- processed_logprobs_ratio: raw ``vllm.LLM.generate`` tokens/s (arith-tiny, 64 prompts x 4
  samples, temperature 0.7, a log-prob per token) with ``logprobs_mode=processed_logprobs``
  (the sampled distribution's log-probs, what the generation servers use) / vLLM's default
  ``raw_logprobs``; an engine per mode, built in turn, rounds alternated
- tempered_train_ratio: tokens/s of the torch engine's training step with every completion
  token at temperature 0.7 (the logits divided before the log-softmax) / at 1 (no division);
  same engine, batches and loss, steps alternated
"""
from __future__ import annotations

import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

MODEL = os.path.join(REPO, ".models", "arith-tiny")
BIG = os.path.join(REPO, ".models", "smollm2-135m-instruct")
TEMPERATURE = 0.7


def _generate_rate(mode: str, rounds: int) -> list[float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from workers.engines.vllm_tmp import engine_temp_dir

    with engine_temp_dir():
        llm = LLM(model=MODEL, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  gpu_memory_utilization=0.2, max_model_len=128, seed=0, logprobs_mode=mode)
    prompts = [TokensPrompt(prompt_token_ids=[1] + [3 + (i * 7 + k) % 10 for k in range(5)])
               for i in range(64)]
    params = SamplingParams(n=4, max_tokens=48, ignore_eos=True, logprobs=0, detokenize=False,
                            temperature=TEMPERATURE)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        rates.append(sum(len(o.token_ids) for r in outs for o in r.outputs)
                     / (time.perf_counter() - t0))
    llm.llm_engine.engine_core.shutdown()
    del llm
    return rates


def generation(rounds: int = 3, builds: int = 2) -> dict[str, float]:
    got: dict[str, list[float]] = {"raw_logprobs": [], "processed_logprobs": []}
    for _ in range(builds):  # (an engine per mode, in turn: a machine's drift hits both)
        for mode in got:
            got[mode] += _generate_rate(mode, rounds)
    med = {m: sorted(r)[len(r) // 2] for m, r in got.items()}
    return {"processed_logprobs_ratio": med["processed_logprobs"] / med["raw_logprobs"],
            "tokens_per_s_processed": med["processed_logprobs"],
            "tokens_per_s_raw": med["raw_logprobs"]}


def train(steps: int = 6) -> dict[str, float]:
    import torch

    from experiments.rl.algorithms.objectives import ActorLossConfig, actor_loss
    from workers.engines.torch_engine import TorchEngine, TorchEngineConfig

    path = BIG if os.path.isdir(BIG) else MODEL
    vocab = 1000 if path == BIG else 20
    g = torch.Generator().manual_seed(0)
    batch = []
    for _ in range(16):
        plen, clen = 24, int(torch.randint(16, 72, (1,), generator=g))
        batch.append({"tokens": torch.randint(3, vocab, (plen + clen,), generator=g).numpy(),
                      "prompt_len": plen, "mask": torch.ones(clen).numpy(),
                      "old_logp": (-torch.rand(clen, generator=g) * 3).numpy(),
                      "adv": torch.randn(clen, generator=g).numpy()})
    seqs = [torch.as_tensor(b["tokens"], dtype=torch.long) for b in batch]
    hot = [torch.full((len(b["mask"]),), TEMPERATURE) for b in batch]
    tokens = sum(len(s) for s in seqs)
    gt = int(sum(b["mask"].sum() for b in batch))
    eng = TorchEngine(TorchEngineConfig(model_path=path, lr=1e-7, max_tokens_per_microbatch=4096))
    eng.train_step(seqs, actor_loss(batch, ActorLossConfig(), {}), gt)  # warm-up
    t = {"plain": 0.0, "tempered": 0.0}
    for _ in range(steps):  # alternated
        for name, temps in (("plain", None), ("tempered", hot)):
            t0 = time.perf_counter()
            eng.train_step(seqs, actor_loss(batch, ActorLossConfig(), {}), gt, temps)
            t[name] += time.perf_counter() - t0
    return {"tempered_train_ratio": t["plain"] / t["tempered"],
            "train_tokens_per_s_tempered": steps * tokens / t["tempered"],
            "train_tokens_per_s_plain": steps * tokens / t["plain"]}


def main() -> None:
    for part in (generation, train):
        for k, v in part().items():
            print(f"{k}: {v:.3f}", flush=True)


if __name__ == "__main__":
    main()
