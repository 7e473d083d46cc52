"""The torch training engine: log-probs, micro-batching, and FSDP2 (gloo) equivalence."""
from __future__ import annotations

import datetime

import torch

from workers.engines.torch_engine import (TorchEngine, TorchEngineConfig, microbatches,
                                          mixed_precision_policy, precision)
from tests.helpers import end_rank, rank_context


def _seqs(n: int = 6, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(torch.randint(5, 20, (1,), generator=g)),), generator=g)
            for _ in range(n)]


def _temps(seqs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Sampling temperatures of some sequences' last positions (divided in place in the
    logits, under FSDP2's hooks too)."""
    return [torch.linspace(0.5, 1.5, min(4, len(s) - 1)) if i % 3 else None
            for i, s in enumerate(seqs)]


def sft_loss(lps, idx):  # negative log-likelihood, summed over tokens
    return -sum(lp.sum() for lp in lps)


def test_microbatches_respect_the_budget():
    lengths = [10, 3, 7, 7, 1, 12]
    groups = microbatches(lengths, 20)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        assert max(lengths[i] for i in g) * len(g) <= 20 or len(g) == 1
    assert microbatches([50], 10) == [[0]]


def test_precision_is_mixed_only_for_bfloat16_on_cuda():
    """(master, publish, mixed): CPU trains in its dtype as is; CUDA bfloat16 (and auto) keeps
    float32 masters and AdamW state, computes in bfloat16 and publishes bfloat16."""
    f32, bf16 = torch.float32, torch.bfloat16
    assert precision("cpu", "auto") == (f32, f32, False)
    assert precision("cpu", "float32") == (f32, f32, False)
    assert precision("cpu", "bfloat16") == (bf16, bf16, False)
    assert precision("cuda", "auto") == (f32, bf16, True)
    assert precision("cuda", "bfloat16") == (f32, bf16, True)
    assert precision("cuda", "float32") == (f32, f32, False)


def test_fsdp_mixed_precision_policy_gathers_bf16_and_reduces_fp32():
    """The FSDP2 policy of a sharded engine: under mixed precision (CUDA bfloat16/auto) float32
    shards compute in bfloat16 and reduce gradients in float32; otherwise (CPU) as they are."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    for device, dtype in (("cuda", "auto"), ("cuda", "bfloat16")):
        master, _, mixed = precision(device, dtype)
        mp_ = MixedPrecisionPolicy(**mixed_precision_policy(mixed))
        assert (master, mp_.param_dtype, mp_.reduce_dtype) == \
            (torch.float32, torch.bfloat16, torch.float32)
    for device, dtype in (("cpu", "auto"), ("cpu", "bfloat16"), ("cuda", "float32")):
        mp_ = MixedPrecisionPolicy(**mixed_precision_policy(precision(device, dtype)[2]))
        assert mp_ == MixedPrecisionPolicy()


def _one_rank_fsdp(model_dir, port, out):
    """A one-rank FSDP2 engine (the sharded code path, as gpu_check runs it on one GPU)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    try:  # (the parent holds the store: a free port it picked, bound here later, could be taken)
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=False,
                              timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        torch.manual_seed(0)
        eng = TorchEngine(TorchEngineConfig(model_path=model_dir, lr=1e-3), fsdp=True)
        plain = TorchEngine(TorchEngineConfig(model_path=model_dir, lr=1e-3))
        seqs = _seqs()
        tokens = sum(len(s) - 1 for s in seqs)
        for e in (eng, plain):
            e.train_step(seqs, sft_loss, tokens)
        params = list(eng.model.parameters())
        state = [eng.optimizer.state[p]["exp_avg"] for p in params]
        shards, full = eng.local_shards(), plain.full_state_dict()
        out.put({"sharded": eng.sharded and not eng._autocast,
                 "dtensor_fp32": all(isinstance(p, DTensor) and p.dtype == torch.float32
                                     for p in params + state),
                 "same": max((shards[k] - full[k]).abs().max().item() for k in full),
                 "gathered": all(torch.equal(v, shards[k])
                                 for k, v in eng.gather_on_rank0().items())})
    except Exception as e:
        out.put({"error": f"{type(e).__name__}: {e}"})


def test_one_rank_fsdp_engine_trains_like_the_plain_one(tiny_model_dir):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    ctx = rank_context()
    q = ctx.Queue()
    p = ctx.Process(target=_one_rank_fsdp, args=(tiny_model_dir, store.port, q))
    p.start()
    res = q.get(timeout=300)
    p.join(timeout=60)
    assert "error" not in res, res
    assert res["sharded"] and res["dtensor_fp32"] and res["gathered"]
    assert res["same"] < 1e-6


def test_cpu_engine_is_float32_without_autocast(tiny_model_dir):
    eng = TorchEngine(TorchEngineConfig(model_path=tiny_model_dir))
    assert (eng.dtype, eng.master_dtype, eng.mixed) == (torch.float32, torch.float32, False)
    assert all(p.dtype == torch.float32 for p in eng.model.parameters())
    assert all(t.dtype == torch.float32 for t in eng.full_state_dict().values())


def test_logprobs_match_a_plain_forward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    eng = TorchEngine(TorchEngineConfig(model_path=tiny_model_dir, max_tokens_per_microbatch=40))
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    seqs = _seqs()
    for s, lp in zip(seqs, eng.logprobs(seqs)):
        with torch.no_grad():
            logits = ref(s[None]).logits[0]
        want = torch.log_softmax(logits[:-1], -1).gather(1, s[1:, None])[:, 0]
        assert torch.allclose(lp, want, atol=1e-5)


def test_a_critic_trains_on_the_values_it_computed(tiny_model_dir):
    """No dropout in training (a ``*ForTokenClassification`` head drops 10% of its input by
    default): the values a training step's loss sees are the ones ``logprobs`` computed, so
    the loss of a step equals the loss of those values."""
    eng = TorchEngine(TorchEngineConfig(model_path=tiny_model_dir, max_tokens_per_microbatch=40),
                      head="value")
    seqs = _seqs()
    values = eng.logprobs(seqs)
    seen: dict[int, torch.Tensor] = {}

    def loss(vals, idx):
        seen.update((i, v.detach()) for i, v in zip(idx, vals))
        return sum((v ** 2).sum() for v in vals)

    eng.train_step(seqs, loss, 1)
    assert sorted(seen) == list(range(len(seqs)))
    for i, v in enumerate(values):
        assert torch.allclose(seen[i], v, atol=1e-6), i


def test_training_lowers_the_loss(tiny_model_dir):
    eng = TorchEngine(TorchEngineConfig(model_path=tiny_model_dir, lr=1e-3))
    seqs = _seqs()
    tokens = sum(len(s) - 1 for s in seqs)
    first = eng.train_step(seqs, sft_loss, tokens)["loss"]
    for _ in range(10):
        last = eng.train_step(seqs, sft_loss, tokens)["loss"]
    assert last < first * 0.9


def _dp_worker(rank, port, model_dir, ckpt_dir, out):
    import torch.distributed as dist

    torch.manual_seed(0)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    cfg = TorchEngineConfig(model_path=model_dir, lr=1e-3, max_tokens_per_microbatch=30)
    eng = TorchEngine(cfg, world_size=2)
    seqs = _seqs()
    tokens = sum(len(s) - 1 for s in seqs)
    mine = seqs[rank::2]  # uneven token counts per rank on purpose
    temps = _temps(seqs)[rank::2]
    eng.train_step(mine, sft_loss, tokens, temps)
    # checkpoint round trip: the second step runs on an engine rebuilt from the checkpoint
    # (HF safetensors written by rank 0, each rank's sharded AdamW state restored); without
    # the optimizer state the second step differs by ~2e-3
    eng.save(ckpt_dir, rank)
    dist.barrier()
    orig, eng = eng, TorchEngine(TorchEngineConfig(model_path=ckpt_dir, lr=1e-3,
                                                   max_tokens_per_microbatch=30), world_size=2)
    eng.load_optimizer(ckpt_dir, rank)
    assert eng.steps == 1
    eng.train_step(mine, sft_loss, tokens, temps)
    sd = eng.full_state_dict()
    # the saved engine trains on (save leaves its sharded optimizer state alone), identically
    orig.train_step(mine, sft_loss, tokens, temps)
    assert all(torch.equal(t, sd[k]) for k, t in orig.full_state_dict().items())
    if rank == 0:  # numpy copies: torch tensors would travel as handles to this process
        out.put({k: v.numpy().copy() for k, v in sd.items()})
    end_rank()


def test_fsdp_two_ranks_equal_one_rank(tiny_model_dir, tmp_path):
    """Two data-parallel ranks splitting a batch take the same steps as one rank with all of it,
    also across a checkpoint (sharded optimizer state saved and restored) between the steps;
    some sequences at sampling temperatures of their own."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ctx = rank_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=_dp_worker, args=(r, store.port, tiny_model_dir, str(tmp_path), q))
             for r in range(2)]
    for p in procs:
        p.start()
    dp = {k: torch.from_numpy(v) for k, v in q.get(timeout=300).items()}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    eng = TorchEngine(TorchEngineConfig(model_path=tiny_model_dir, lr=1e-3,
                                        max_tokens_per_microbatch=30))
    seqs = _seqs()
    tokens = sum(len(s) - 1 for s in seqs)
    for _ in range(2):
        eng.train_step(seqs, sft_loss, tokens, _temps(seqs))
    single = eng.full_state_dict()
    assert single.keys() == dp.keys()
    worst = max((single[k] - dp[k]).abs().max().item() for k in single)
    assert worst < 1e-5, worst
