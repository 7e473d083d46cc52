"""Tasks: rewards, generated and file datasets."""
from __future__ import annotations

import json

import pytest

from experiments.rl.tasks import (TaskConfig, dataset, first_int_reward, last_int_reward,
                               load_prompts)
from system.errors import ConfigError


def test_rewards():
    assert first_int_reward("7", 7) == 1.0 and first_int_reward(" 7+", 7) == 1.0
    assert first_int_reward("78", 7) == 0.0 and first_int_reward("+7", 7) == 0.0
    assert last_int_reward("so 3 + 4 = 7.", 7) == 1.0
    assert last_int_reward("1,200 apples", 1200) == 1.0
    assert last_int_reward("no number", 3) == 0.0


def test_generated_and_file_datasets(tmp_path):
    cfg = TaskConfig(train_size=50, eval_size=10)
    train = dataset(cfg, "train")
    assert len(train) == 50 and all(eval(p["prompt"][:-1]) == p["answer"] for p in train)
    word = TaskConfig(name="word", max_operand=9, eval_size=8)
    tr, ev = dataset(word, "train"), dataset(word, "eval")
    assert {p["prompt"] for p in tr}.isdisjoint({p["prompt"] for p in ev})
    rows = [{"prompt": "1+1=", "answer": 2, "id": None}, {"prompt": "2+2=", "answer": 4, "id": 9}]
    with open(tmp_path / "p.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    for path in ("p.jsonl", "p.parquet"):
        got = load_prompts(str(tmp_path / path))
        assert [p["answer"] for p in got] == [2, 4] and got[1]["id"] == 9
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match=r"\.jsonl or \.parquet"):
        TaskConfig(train_path="x.csv")
