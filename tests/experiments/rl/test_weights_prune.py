"""Disk weight sync keeps only the latest published copy of the model, and none at the end."""
import os

from experiments.rl.cluster import _prune


def test_only_the_kept_version_stays_and_nothing_else_is_touched(tmp_path):
    weights = tmp_path / "weights"
    for name in ["v1", "v7", "v8", "notes", "vx"]:  # v1: a resumed run's leftover
        (weights / name).mkdir(parents=True)
    _prune(str(weights), "v8")
    assert sorted(os.listdir(weights)) == ["notes", "v8", "vx"]
    _prune(str(weights), None)
    assert sorted(os.listdir(weights)) == ["notes", "vx"]  # (not ours: the directory stays)
    (weights / "notes").rmdir()
    (weights / "vx").rmdir()
    (weights / "v9").mkdir()
    _prune(str(weights), None)
    assert not weights.exists()
    _prune(str(tmp_path / "none"), None)  # never published
