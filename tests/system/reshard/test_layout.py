"""Resharding layouts: training (dp, tp, pp) and generation (tp, replicas) ranks, and parsing."""
from __future__ import annotations

import pytest

from system.reshard.layout import (GenLayout, LayoutError, TrainLayout, fsdp_rows, parse_gen_layout,
                             parse_train_layout)


def test_layouts():
    t = TrainLayout(dp=2, tp=2, pp=2)
    assert t.world_size == 8
    assert [t.rank(c.dp, c.tp, c.pp) for c in map(t.coord, range(8))] == list(range(8))
    assert t.coord(5) == t.coord(t.rank(dp=0, tp=1, pp=1))
    g = GenLayout(tp=2, replicas=3)
    assert g.coord(5) == (2, 1) and g.rank(2, 1) == 5
    with pytest.raises(LayoutError, match="tp=0"):
        TrainLayout(tp=0)
    assert parse_train_layout("dp=2,tp=2") == TrainLayout(2, 2, 1)
    assert parse_gen_layout("tp=2,replicas=2") == GenLayout(2, 2)
    with pytest.raises(LayoutError, match="ep=2"):
        parse_train_layout("dp=2,ep=2")


@pytest.mark.parametrize("n, dp", [(128, 2), (128, 3), (7, 3), (4, 5), (1, 2), (64, 7)])
def test_fsdp_rows_are_torch_chunk(n, dp):
    """FSDP2 shards dim 0 as torch.chunk does (the last ranks' chunks shorter or empty)."""
    import torch

    chunks = torch.arange(n).chunk(dp)
    for r in range(dp):
        a, b = fsdp_rows(0, n, dp, r)
        want = chunks[r].tolist() if r < len(chunks) else []
        assert list(range(a, b)) == want
    assert fsdp_rows(10, 17, 3, 1) == (13, 16)


def test_fsdp_layout_parses_and_prints():
    t = parse_train_layout("dp=3,fsdp=1")
    assert t == TrainLayout(dp=3, fsdp=True) and str(t) == "dp=3,tp=1,pp=1,fsdp=1"
    assert parse_train_layout("dp=2,fsdp=0") == TrainLayout(dp=2)
    with pytest.raises(LayoutError, match="fsdp=2"):
        parse_train_layout("dp=2,fsdp=2")
