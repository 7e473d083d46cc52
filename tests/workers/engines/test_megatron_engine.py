"""The megatron engine over real processes and gloo: tp, pp, tp x pp and dp layouts give the
log-probs, the training step and the exported Hugging Face weights of the one-process FSDP/torch
engine (some sequences at sampling temperatures of their own); its checkpoint restores the
same training; publishing boxes are cut from its own shards."""
from __future__ import annotations

import datetime
import json
import os
import queue

import pytest
import torch

pytest.importorskip("megatron.core")

from workers.engines.configs import MegatronConfig, TorchEngineConfig  # noqa: E402
from workers.engines.torch_engine import TorchEngine  # noqa: E402
from system.errors import ConfigError  # noqa: E402
from tests.helpers import end_rank, rank_context, save_tiny_qwen3  # noqa: E402

TOL = 2e-5


def _model(directory: str, kv_heads: int, tied: bool = False) -> str:
    """A tiny Qwen2 (vocab 100: megatron pads it to 128 x tp)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=100, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=kv_heads,
                      head_dim=64, max_position_embeddings=256, tie_word_embeddings=tied)
    Qwen2ForCausalLM(cfg).float().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    """A tiny Qwen3 (per-head q_norm/k_norm, random; one kv head: replicated at tp=2)."""
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("mg-qwen3")))


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory) -> str:
    return _model(str(tmp_path_factory.mktemp("mg-kv2")), kv_heads=2)


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory) -> str:
    return _model(str(tmp_path_factory.mktemp("mg-kv1")), kv_heads=1)


def _seqs(n: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 100, (int(torch.randint(5, 20, (1,), generator=g)),), generator=g)
            for _ in range(n)]


def _temps(seqs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Sampling temperatures of some sequences' last positions (the trainer's log-probs are
    taken at them; the rest at 1): every layout must place them as the torch engine does."""
    return [torch.linspace(0.5, 1.5, min(4, len(s) - 1)) if i % 3 else None
            for i, s in enumerate(seqs)]


def sft_loss(lps, idx):
    return -sum(lp.sum() for lp in lps)


def value_loss(values, idx):
    return sum(((v - 0.5) ** 2).sum() for v in values)


LOSSES = {"lm": sft_loss, "value": value_loss}


def _cfg(path: str, tp: int, pp: int, **kw) -> TorchEngineConfig:
    return TorchEngineConfig(model_path=path, lr=1e-3, max_tokens_per_microbatch=40,
                             backend="megatron", megatron=MegatronConfig(tp=tp, pp=pp), **kw)


def _worker(rank, world, port, path, tp, pp, ckpt, clip, steps, head, out):
    import torch.distributed as dist

    from workers.engines.megatron_engine import MegatronEngine

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    eng = MegatronEngine(_cfg(path, tp, pp, grad_clip=clip), world_size=world, head=head)
    loss = LOSSES[head]
    dp = world // (tp * pp)
    d, t, p = (rank // tp) % dp, rank % tp, rank // (tp * dp)
    lead = t == 0 and p == pp - 1
    seqs = _seqs()
    mine = seqs[d::dp]
    temps = _temps(seqs)[d::dp] if head == "lm" else None
    tokens = sum(len(s) - 1 for s in seqs)
    before = eng.logprobs(mine, temps)
    stats = [eng.train_step(mine, loss, tokens, temps) for _ in range(steps)]
    if ckpt:  # the second step runs on an engine rebuilt from the checkpoint
        eng.save(ckpt, rank)
        dist.barrier()
        eng = MegatronEngine(_cfg(ckpt, tp, pp, grad_clip=clip), world_size=world, head=head)
        eng.load_optimizer(ckpt, rank)
        assert eng.steps == steps
        stats.append(eng.train_step(mine, loss, tokens, temps))
    after = eng.logprobs(mine, temps)
    assert all(torch.equal(a, b) for a, b in zip(after, eng.logprobs(mine, temps)))
    state = eng.full_state_dict()
    if head == "value":  # a critic publishes nothing
        out.put(_result(rank, d, lead, stats, before, after, state))
        end_rank()
        return
    # publishing: the reshard planner's boxes of this rank, cut from its own shards, are
    # exactly those boxes of the exported weights
    from system.reshard.layout import TrainLayout
    from system.reshard.params import ModelShape, qwen2_specs, train_shard_boxes

    shape = ModelShape.from_hf(eng.hf_config)
    boxes = train_shard_boxes(qwen2_specs(shape), TrainLayout(dp=dp, tp=tp, pp=pp), rank,
                              shape.num_layers)
    sent = eng.publish_shards(boxes)
    assert sent.keys() == boxes.keys()
    for name, box in boxes.items():
        assert torch.equal(sent[name], state[name][tuple(slice(a, b) for a, b in box)]), name
    out.put(_result(rank, d, lead, stats, before, after, state))
    end_rank()


def _result(rank, d, lead, stats, before, after, state) -> dict:
    return {"rank": rank, "dp": d, "lead": lead, "loss": stats[0]["loss"],
            "grad_norms": [s["grad_norm"] for s in stats],
            "before": [x.numpy().copy() for x in before],
            "after": [x.numpy().copy() for x in after],
            "state": {k: v.numpy().copy() for k, v in state.items()} if rank == 0 else None}


def _run(path: str, world: int, tp: int, pp: int, ckpt: str = "", clip: float = 1.0,
         steps: int = 1, head: str = "lm") -> list[dict]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    ctx = rank_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker,
                         args=(r, world, store.port, path, tp, pp, ckpt, clip, steps, head, q))
             for r in range(world)]
    for p in procs:
        p.start()
    outs: list[dict] = []
    while len(outs) < world:  # a rank that dies fails the test at once, not at a timeout
        try:
            outs.append(q.get(timeout=2))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise AssertionError(f"a megatron rank failed (exit codes {dead})")
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return outs


def _reference(path: str, steps: int, clip: float = 1.0, head: str = "lm") -> dict:
    eng = TorchEngine(TorchEngineConfig(model_path=path, lr=1e-3, max_tokens_per_microbatch=40,
                                        grad_clip=clip), head=head)
    seqs = _seqs()
    temps = _temps(seqs) if head == "lm" else None
    tokens = sum(len(s) - 1 for s in seqs)
    before = eng.logprobs(seqs, temps)
    stats = [eng.train_step(seqs, LOSSES[head], tokens, temps) for _ in range(steps)]
    return {"before": before, "after": eng.logprobs(seqs, temps), "stats": stats[0],
            "grad_norms": [s["grad_norm"] for s in stats], "state": eng.full_state_dict()}


def _compare(outs: list[dict], ref: dict, world: int, tp: int, pp: int) -> None:
    dp = world // (tp * pp)
    seqs = _seqs()
    leads = [o for o in outs if o["lead"]]
    assert len(leads) == dp
    for key in ("before", "after"):
        for o in outs:  # every rank of a pipeline returns its data-parallel rank's results
            for j, lp in enumerate(o[key]):
                i = o["dp"] + j * dp
                assert len(lp) == len(seqs[i]) - 1
                worst = (torch.from_numpy(lp) - ref[key][i]).abs().max().item()
                assert worst < TOL, (key, o["rank"], i, worst)
    loss = sum(o["loss"] for o in leads)
    assert abs(loss - ref["stats"]["loss"]) < TOL * 10, (loss, ref["stats"]["loss"])
    for o in outs:  # every step's (the clipping's) gradient norm, on every rank
        assert len(o["grad_norms"]) == len(ref["grad_norms"])
        for got, want in zip(o["grad_norms"], ref["grad_norms"]):
            assert abs(got - want) < 1e-4 * want, (o["rank"], o["grad_norms"], ref["grad_norms"])
    state = next(o["state"] for o in outs if o["state"] is not None)
    # (a tied model's: the torch engine's state dict names the embedding as lm_head too)
    assert state.keys() <= ref["state"].keys() <= state.keys() | {"lm_head.weight"}
    worst = max((torch.from_numpy(state[k]) - ref["state"][k]).abs().max().item()
                for k in state)
    # AdamW's first steps move every weight by about lr (1e-3) whatever its gradient's size:
    # where a gradient is ~1e-8 (as small as eps) float noise in it shows in the update
    assert worst < 0.1 * 1e-3, (worst, sorted(
        ((torch.from_numpy(state[k]) - ref["state"][k]).abs().max().item(), k) for k in state)[-3:])


@pytest.mark.parametrize("world,tp,pp", [(2, 2, 1), (2, 1, 2), (4, 2, 2), (2, 1, 1)],
                         ids=["tp2", "pp2", "tp2xpp2", "dp2"])
def test_layouts_equal_the_torch_engine(gqa_dir, world, tp, pp):
    """Log-probs before and after one step, the step's loss and gradient norm, and the exported
    HF weights equal the one-process torch engine's."""
    _compare(_run(gqa_dir, world, tp, pp), _reference(gqa_dir, 1), world, tp, pp)


@pytest.mark.parametrize("world,tp,pp", [(2, 2, 1), (4, 2, 2)], ids=["tp2", "tp2xpp2"])
def test_a_qwen3_model_equals_the_torch_engine(qwen3_dir, world, tp, pp):
    """Qwen3's per-head q_norm/k_norm are megatron's q_layernorm/k_layernorm (replicated over
    tp): log-probs, the step, the exported weights and the published boxes as for Qwen2."""
    _compare(_run(qwen3_dir, world, tp, pp), _reference(qwen3_dir, 1), world, tp, pp)


def test_replicated_kv_heads_train_as_one(mqa_dir):
    """One kv head at tp=2: each tp rank holds a copy, their gradients are summed, the gradient
    norm counts the head once (as at tp=1), and the export (first copy) equals the torch
    engine's weights. Six steps with clipping active at every one of them: a norm that counted
    both copies (about 13% too large here) would clip differently and the weights would part
    by ~2e-4 (log-probs by ~2e-3)."""
    clip, steps = 1.0, 6
    outs = _run(mqa_dir, 2, 2, 1, clip=clip, steps=steps)
    ref = _reference(mqa_dir, steps, clip=clip)
    assert min(ref["grad_norms"]) > 1.5 * clip, ref["grad_norms"]  # every step clips
    _compare(outs, ref, 2, 2, 1)


def test_checkpoint_roundtrip_continues_training(gqa_dir, tmp_path):
    """tp2 x dp2: a step, a checkpoint (HF weights + each rank's optimizer shard), an engine
    rebuilt from it, a second step: equal to two uninterrupted torch steps."""
    outs = _run(gqa_dir, 4, 2, 1, ckpt=str(tmp_path / "ckpt"))
    ref = _reference(gqa_dir, 2)
    assert os.path.isfile(tmp_path / "ckpt" / "model.safetensors")
    _compare(outs, ref, 4, 2, 1)
    # the export is what save_pretrained writes: no source path or default noise, and the
    # model's generation defaults (vLLM reads them when it serves the checkpoint)
    with open(tmp_path / "ckpt" / "config.json") as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "qwen2" and cfg["num_key_value_heads"] == 2
    assert "_name_or_path" not in cfg and "id2label" not in cfg, sorted(cfg)
    with open(os.path.join(gqa_dir, "generation_config.json")) as f, \
            open(tmp_path / "ckpt" / "generation_config.json") as g:
        assert json.load(f) == json.load(g)


@pytest.fixture(scope="module")
def critic_dir(gqa_dir, tmp_path_factory) -> str:
    """The FSDP/torch engine's critic of the GQA model (HF ``Qwen2ForTokenClassification``, one
    label), its value head's bias moved off zero so that loading it counts."""
    eng = TorchEngine(TorchEngineConfig(model_path=gqa_dir), head="value")
    with torch.no_grad():
        eng.model.score.bias.fill_(0.3)
    directory = str(tmp_path_factory.mktemp("mg-critic"))
    eng.save(directory, 0)
    return directory


def test_a_critic_equals_the_torch_engines_and_resumes_from_its_checkpoint(critic_dir,
                                                                          tmp_path):
    """tp2 x pp2 critic from the FSDP engine's critic checkpoint: its values before and after a
    step, a checkpoint, an engine rebuilt from it and a second step equal two torch steps; the
    checkpoint is the FSDP engine's format (it loads there, to the same values)."""
    ckpt = str(tmp_path / "ckpt")
    outs = _run(critic_dir, 4, 2, 2, ckpt=ckpt, head="value")
    ref = _reference(critic_dir, 2, head="value")
    assert abs(float(ref["before"][0][0])) > 0.1  # (the bias: 0.3, not megatron's zero)
    _compare(outs, ref, 4, 2, 2)
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["Qwen2ForTokenClassification"], cfg["architectures"]
    assert cfg["id2label"] == {"0": "LABEL_0"}
    assert not os.path.exists(os.path.join(ckpt, "generation_config.json"))
    back = TorchEngine(TorchEngineConfig(model_path=ckpt), head="value")  # (after one step)
    for got, want in zip(back.logprobs(_seqs()), _reference(critic_dir, 1, head="value")["after"]):
        assert (got - want).abs().max().item() < TOL


def test_a_critic_checkpoint_without_a_bias_starts_it_at_zero(critic_dir, tmp_path):
    """A value head saved without its bias loads as the torch engine loads it (bias 0)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "nobias")
    shutil.copytree(critic_dir, path)
    state = load_file(os.path.join(path, "model.safetensors"))
    del state["score.bias"]
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _compare(_run(path, 2, 2, 1, head="value"), _reference(path, 1, head="value"), 2, 2, 1)


def test_a_critic_from_a_causal_lm_keeps_its_own_value_head(gqa_dir):
    """From an LM checkpoint (no value head) the critic's head keeps megatron's initialisation
    (tp rank 0's column), and it trains."""
    outs = _run(gqa_dir, 2, 2, 1, head="value")
    state = next(o["state"] for o in outs if o["state"] is not None)
    assert "lm_head.weight" not in state and state["score.weight"].shape == (1, 128)
    assert (state["score.weight"] != 0).all() and state["score.bias"].shape == (1,)
    lead = next(o for o in outs if o["lead"])
    assert any((a != b).any() for a, b in zip(lead["before"], lead["after"]))


def test_config_refuses_impossible_splits():
    cfg = TorchEngineConfig(backend="megatron", megatron=MegatronConfig(tp=2, pp=2))
    with pytest.raises(ConfigError, match="does not divide model.count=6"):
        cfg.check_layout(6)
    with pytest.raises(ConfigError, match="pp=2 does not divide the model's 3 layers"):
        cfg.check_layout(4, {"num_attention_heads": 2, "num_hidden_layers": 3})
    with pytest.raises(ConfigError, match="tp=2 does not divide the model's 3 attention heads"):
        cfg.check_layout(4, {"num_attention_heads": 3, "num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="use backend=megatron"):
        TorchEngineConfig(megatron=MegatronConfig(tp=2))
    with pytest.raises(ConfigError, match="backend='deepspeed'"):
        TorchEngineConfig(backend="deepspeed")
