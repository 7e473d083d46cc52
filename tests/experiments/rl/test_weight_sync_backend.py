"""The master picks each replica group's weight-sync backend from what the workers report
about their devices (EngineInfo, EngineStats): those reports cross the wire as they are."""
from __future__ import annotations

import pytest

from experiments.rl.cluster import group_ranks
from system.reshard.backend import CPU, choose_backend
from system.wire import Channel, Codec, Header, new_secret
from workers.schema import EngineInfo, EngineStats

GPU_A = "GPU-6f1c2a4e-0000-0000-0000-00000000000a"
GPU_B = "GPU-6f1c2a4e-0000-0000-0000-00000000000b"


def wire(payload):
    codec = Codec(new_secret())
    header = Header(Channel.REPLY, b"s" * 16, 1, b"r" * 16, 1)
    frames = [bytes(f) for f in codec.encode(payload, header)]
    return codec.decode(frames, lambda h: None).payload


def test_reports_round_trip_and_pick_the_backend():
    infos: list[EngineInfo] = [{"dtype": "bfloat16", "device": GPU_A, "sharded": True}]
    stats: EngineStats = {"version": 3, "load": 0, "http": None, "devices": [GPU_A]}
    got_infos, got_stats = wire(infos), wire(stats)
    assert got_infos == infos and got_stats == stats
    ranks = group_ranks([i["device"] for i in got_infos], got_stats["devices"], 0, 1)
    assert [(r.name, r.device) for r in ranks] == [("model-0", GPU_A),
                                                     ("generation-0 tp0", GPU_A)]
    choice = choose_backend(ranks)
    assert choice.backend == "gloo" and choice.fallback
    assert choice.line("weight sync with generation server 0") == (
        f"weight sync with generation server 0: gloo (model-0 and generation-0 tp0 share GPU "
        f"{GPU_A}); NCCL refuses two ranks on one GPU")


def test_each_replica_is_judged_on_its_own_ranks():
    models = [GPU_A]
    # replica 0 shares the trainer's GPU, replica 1 has its own: gloo for one, NCCL for the other
    assert choose_backend(group_ranks(models, [GPU_A], 0, 1)).backend == "gloo"
    assert choose_backend(group_ranks(models, [GPU_B], 1, 1)).backend == "nccl"
    # on the CPU (this machine) everything is gloo, without a fallback line
    cpu = choose_backend(group_ranks([CPU, CPU], [CPU, CPU], 0, 2))
    assert cpu.backend == "gloo" and not cpu.fallback


def test_a_server_that_names_no_devices_is_gloo_and_a_wrong_count_is_refused():
    ranks = group_ranks([GPU_A], [], 2, 2)
    assert [r.name for r in ranks] == ["model-0", "generation-2 tp0", "generation-2 tp1"]
    assert choose_backend(ranks).backend == "gloo"
    with pytest.raises(ValueError, match="reports 1 devices for tensor_parallel_size=2"):
        group_ranks([GPU_A], [GPU_B], 0, 2)


def test_a_server_that_misreports_its_devices_is_left_out_of_the_weight_updates(caplog):
    """On the master's join (at start or when a server comes back): one server that names
    the wrong number of devices is refused with a line in the log, the master goes on."""
    import dataclasses as dc
    import logging

    from experiments.rl.cluster import Cluster
    from system.reshard.layout import GenLayout, TrainLayout
    from system.reshard.params import ModelShape
    from system.reshard.spec import WeightSyncSpec

    @dc.dataclass
    class Named:  # what join reads of a generation server before it calls it
        name: str

    class Peers:
        def address(self, name: str) -> str:
            return f"tcp://{name}"

    cluster = Cluster.__new__(Cluster)
    cluster.peers, cluster.models, cluster._joined = Peers(), [], {}
    cluster.gens = {0: Named("generation/0")}
    cluster._model_devices, cluster._gen_devices = [GPU_A], {0: [GPU_A, GPU_B, GPU_B]}
    shape = ModelShape(vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=1,
                       num_heads=2, num_kv_heads=2, head_dim=4)
    cluster._spec = WeightSyncSpec(src=TrainLayout(), dst=GenLayout(tp=2, replicas=1),
                                   shape=shape, dtype="float32", backend="gloo", mode="fast",
                                   bucket_bytes=1 << 20, timeout=5)
    with caplog.at_level(logging.WARNING):
        assert cluster.join([0]) == set()
    assert "generation server 0 cannot join the weight updates: generation server 0 " \
           "reports 3 devices for tensor_parallel_size=2" in caplog.text
