"""A model worker's part of a checkpoint over two real gloo ranks: every file digested by
exactly one rank; a rank whose write fails raises, and the other is not left in a collective."""
from __future__ import annotations

import datetime
import os
import queue
import time

from system.digests import file_digest
from tests.helpers import rank_context


class _GatheringEngine:
    """An engine's save as the real ones do it: a collective (the gather to rank 0), then
    rank 0 writes the model (here: ``model.bin``, failing where a directory is in the way)."""

    def save(self, directory: str, rank: int) -> None:
        import torch
        import torch.distributed as dist

        t = torch.ones(4)
        dist.all_reduce(t)
        if rank == 0:
            with open(os.path.join(directory, "model.bin"), "wb") as f:
                f.write(t.numpy().tobytes())


def _rank(rank: int, port: int, directory: str, engines: int, out) -> None:
    import torch
    import torch.distributed as dist

    from tests.helpers import end_rank
    from workers.model_checkpoint import save_checkpoint

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    parts = {k: _GatheringEngine() for k in ("actor", "critic")[:engines]}
    try:
        out.put((rank, "saved", save_checkpoint(parts, directory, rank, 2, "cpu")))
    except Exception as e:  # noqa: BLE001 - what the model worker reports to the master
        out.put((rank, "raised", str(e)))
    t = torch.ones(1)
    dist.all_reduce(t)  # the next collective (a train step's): both ranks are there
    out.put((rank, "next collective", float(t.item())))
    end_rank()


def _run(directory: str, engines: int = 0) -> dict[int, list]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ctx = rank_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, store.port, directory, engines, q))
             for r in range(2)]
    for p in procs:
        p.start()
    got: dict[int, list] = {0: [], 1: []}
    deadline = time.monotonic() + 120
    try:
        while sum(len(v) for v in got.values()) < 4:
            assert time.monotonic() < deadline, f"the ranks hang (a collective?); so far {got}"
            try:
                rank, *what = q.get(timeout=2)
                got[rank].append(what)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"a rank failed (exit codes {dead}); so far {got}"
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return got


def test_two_ranks_digest_every_file_once(tmp_path):
    got = _run(str(tmp_path))
    (_, saved0), (_, saved1) = got[0][0], got[1][0]
    assert saved0["rank"] == 0 and saved1["rank"] == 1
    assert not set(saved0["digests"]) & set(saved1["digests"])
    both = {**saved0["digests"], **saved1["digests"]}
    assert both == {n: file_digest(os.path.join(tmp_path, n))
                    for n in ("rng.model0.pt", "rng.model1.pt")}
    assert got[0][1] == got[1][1] == ["next collective", 2.0]


def test_a_rank_whose_write_fails_raises_and_the_other_goes_on(tmp_path):
    os.makedirs(tmp_path / "rng.model1.pt")  # rank 1 cannot write its file
    got = _run(str(tmp_path))
    assert got[1][0][0] == "raised" and "Is a directory" in got[1][0][1], got
    assert got[0][0] == ["saved", {"rank": 0, "digests": {}}]  # nothing digested for a commit
    assert got[0][1] == got[1][1] == ["next collective", 2.0]  # that will not come


def test_a_failed_engine_save_stops_every_rank_before_the_next_engine_s_collective(tmp_path):
    """Rank 0 fails to write the actor after its gather; rank 1 must not go on into the
    critic's gather (which rank 0 never joins), nor rank 0 wait there for it."""
    os.makedirs(tmp_path / "actor" / "model.bin")
    got = _run(str(tmp_path), engines=2)
    assert got[0][0][0] == "raised" and "Is a directory" in got[0][0][1], got
    assert got[1][0] == ["saved", {"rank": 1, "digests": {}}]
    assert got[0][1] == got[1][1] == ["next collective", 2.0]
    assert not os.path.exists(tmp_path / "critic")  # neither rank started the critic
