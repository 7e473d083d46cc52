"""Publishing from the real shards: model-worker ranks (real FSDP2 torch engines, one process
each, gloo) send their own dim-0 chunks through the planner into generation ranks holding vLLM's
layout (fused ``qkv_proj``/``gate_up_proj``, tp shards); every received tensor equals the
trainer's full weights bit for bit. No rank gathers the model; the disk path's gather lands on
rank 0 only."""
from __future__ import annotations

import datetime
import threading
from typing import Callable

import pytest
import torch

from system.name_resolve import FileNameResolve
from system.rendezvous import host_store, join_store
from system.reshard.layout import GenLayout, LayoutError, TrainLayout
from system.reshard.params import ModelShape, UnmappedWeightError
from system.reshard.spec import WeightSyncSpec
from system.wire import new_secret
from tests.helpers import rank_context, save_tiny_model, save_tiny_qwen3
from workers.publish import source_boxes

SEQS = [[1, 5, 9, 17, 33, 65, 3], [7, 11, 100, 2, 44], [3, 4, 5, 6, 7, 8, 9, 10]]


def _loss(lps, idx):
    return -sum(lp.sum() for lp in lps)


def _trainer(rank: int, dp: int, model_dir: str, port: int, sync: tuple[dict, str, str],
             steps: int, out) -> None:
    """One model-worker rank: train ``steps`` steps, then publish its own shards; rank 0 reports the full
    weights (the reference) and what ``gather_on_rank0`` gave."""
    import torch.distributed as dist

    from workers.engines.torch_engine import TorchEngine, TorchEngineConfig
    from workers.publish import send_shards

    try:
        torch.set_num_threads(1)
        if dp > 1:
            store = dist.TCPStore("127.0.0.1", port, dp, is_master=False,
                                  timeout=datetime.timedelta(seconds=120))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=dp)
        eng = TorchEngine(TorchEngineConfig(model_path=model_dir, lr=1e-2), world_size=dp)
        for _ in range(steps):
            eng.train_step([torch.tensor(s) for s in SEQS[rank::dp]], _loss, 20)
        spec, address, prefix = WeightSyncSpec.from_wire(sync[0]), sync[1], sync[2]
        boxes = source_boxes(spec, rank, eng.local_shards())
        shards = eng.local_shards()
        held = sum(t.numel() for t in shards.values())
        executor = spec.executor(rank, join_store(address, spec.world_size, 120, prefix))
        sent = send_shards(executor, eng, boxes)
        full = eng.full_state_dict()  # the test's reference only (collective)
        on0 = eng.gather_on_rank0()
        report = {"rank": rank, "sent": sent, "held": held,
                  "total": sum(t.numel() for t in full.values()), "on0": len(on0)}
        if rank == 0:  # numpy copies: torch tensors would travel as handles to this process
            report["full"] = {k: v.numpy().copy() for k, v in full.items()}
            report["gather_equal"] = all(torch.equal(on0[k], full[k]) for k in full)
        out.put(report)
    except Exception as e:  # report, do not hang the test
        out.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def _receive(spec: WeightSyncSpec, rank: int, address: str, prefix: str,
             got: dict[int, dict[str, torch.Tensor]]) -> None:
    _, tp = spec.dst.coord(rank - spec.src.world_size)
    local = {p.name: torch.full(p.shape, float("nan")) for p in spec.dst_params(tp)}
    spec.executor(rank, join_store(address, spec.world_size, 120, prefix)).run(dst=local)
    got[rank] = local


def publish(model_dir: str, dp: int, dst: GenLayout, tmp_path,
            receive: Callable[[WeightSyncSpec, str, str], None] | None = None, steps: int = 1
            ) -> tuple[WeightSyncSpec, list, dict]:
    """Spawn ``dp`` trainer ranks (``steps`` train steps each), receive on threads of this process (or run ``receive(spec,
    store address, prefix)`` in one: a real vLLM engine); (spec, trainer reports, what each
    generation rank received)."""
    from transformers import AutoConfig

    spec = WeightSyncSpec(TrainLayout(dp=dp, fsdp=dp > 1), dst,
                          ModelShape.from_hf(AutoConfig.from_pretrained(model_dir)), "float32",
                          "gloo", "fast", 16 << 10, 120)
    nr = FileNameResolve(str(tmp_path / "nr"), secret=new_secret())
    prefix = "publish-test"
    keep = host_store(nr, "t/store", "127.0.0.1", spec.world_size, 120, prefix)
    address = nr.get("t/store")
    default = torch.distributed.TCPStore("127.0.0.1", 0, dp, is_master=True,
                                         wait_for_workers=False)
    ctx = rank_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_trainer, args=(r, dp, model_dir, default.port,
                                                (spec.to_wire(), address, prefix), steps,
                                                out))
             for r in range(dp)]
    for p in procs:
        p.start()
    got: dict[int, dict[str, torch.Tensor]] = {}
    threads = [threading.Thread(target=_receive, args=(spec, r, address, prefix, got),
                                daemon=True) for r in range(dp, spec.world_size)] \
        if receive is None else [threading.Thread(target=receive, args=(spec, address, prefix),
                                                  daemon=True)]
    for t in threads:
        t.start()
    reports = sorted((out.get(timeout=300) for _ in range(dp)), key=lambda r: r["rank"])
    for t in threads:
        t.join(timeout=60)
    for p in procs:
        p.join(timeout=60)
    del keep
    errors = [r["error"] for r in reports if "error" in r]
    assert not errors, errors
    return spec, reports, got


def _check(spec: WeightSyncSpec, reports: list, got: dict) -> None:
    full = {k: torch.from_numpy(v) for k, v in reports[0]["full"].items()}
    assert len(got) == spec.dst.world_size
    for rank, local in got.items():
        _, tp = spec.dst.coord(rank - spec.src.world_size)
        for p in spec.dst_params(tp):
            want = torch.cat([full[pc.source][tuple(slice(a, b) for a, b in pc.box)]
                              for pc in p.pieces])
            assert torch.equal(local[p.name], want), f"generation rank {rank} {p.name}"
    dp = spec.src.dp
    for r in reports:  # each rank holds (about) 1/dp of the model and nobody else's
        assert r["held"] <= r["total"] / dp + r["total"] * 0.01
    assert reports[0]["gather_equal"] and [r["on0"] for r in reports][1:] == [0] * (dp - 1)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("qwen2")))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("qwen3")))


@pytest.mark.parametrize("dp, dst", [(1, GenLayout(1, 1)), (2, GenLayout(1, 1)),
                                     (2, GenLayout(2, 1)), (3, GenLayout(2, 2))])
def test_fsdp_ranks_publish_their_own_shards_bit_exact(qwen2_dir, tmp_path, dp, dst):
    """dp=3 shards the tiny model's 128-row tensors unevenly (43, 43, 42 rows)."""
    _check(*publish(qwen2_dir, dp, dst, tmp_path))


def test_qwen3_publishes_its_qk_norms(qwen3_dir, tmp_path):
    spec, reports, got = publish(qwen3_dir, 2, GenLayout(2, 1), tmp_path)
    assert "model.layers.1.self_attn.k_norm.weight" in got[spec.src.world_size]
    _check(spec, reports, got)


def test_unmapped_or_misshapen_weights_are_refused_naming_them(qwen2_dir):
    from transformers import AutoConfig

    shape = ModelShape.from_hf(AutoConfig.from_pretrained(qwen2_dir))
    spec = WeightSyncSpec(TrainLayout(dp=2, fsdp=True), GenLayout(1, 1), shape, "float32",
                          "gloo", "fast", 1 << 20, 60)
    boxes = spec.src_boxes(1)
    shards = {n: torch.zeros([b - a for a, b in box]) for n, box in boxes.items()}
    assert source_boxes(spec, 1, shards) == boxes
    with pytest.raises(UnmappedWeightError,
                       match=r"^the actor has weight 'model.layers.0.self_attn.q_norm.weight'"):
        source_boxes(spec, 1, {**shards, "model.layers.0.self_attn.q_norm.weight": torch.ones(64)})
    whole = {**shards, "model.norm.weight": torch.zeros(shape.hidden_size)}
    with pytest.raises(LayoutError, match=r"rank 1 holds model.norm.weight as \(128,\), the "
                                          r"plan for dp=2,tp=1,pp=1,fsdp=1 expects \(64,\)"):
        source_boxes(spec, 1, whole)
