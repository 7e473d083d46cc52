"""Tasks: rewards, generated and file datasets, held-out splits, plugins."""
from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from experiments.rl.prompt_files import load_prompts, parse_fields
from experiments.rl.rewards import first_int_reward, last_int_reward, math_reward, to_number
from experiments.rl.synthetic import arith_problems
from experiments.rl.tasks import TaskConfig, dataset, get_task
from system.errors import ConfigError
from tests.experiments.rl.plugin_site import install_example_plugin


def test_rewards():
    assert first_int_reward("7", 7) == 1.0 and first_int_reward(" 7+", 7) == 1.0
    assert first_int_reward("78", 7) == 0.0 and first_int_reward("+7", 7) == 0.0
    assert last_int_reward("so 3 + 4 = 7.", 7) == 1.0
    assert last_int_reward("1,200 apples", 1200) == 1.0
    assert last_int_reward("no number", 3) == 0.0
    assert first_int_reward("7", "7") == 1.0 and first_int_reward("7", 7.0) == 1.0


def test_int_rewards_refuse_answers_that_are_not_integers():
    """``2.5`` was read as 2 (``int(2.5)``), and ``"3.0"`` failed mid-run."""
    for reward in (first_int_reward, last_int_reward):
        for answer in (2.5, "3.0", "two", True, None):
            with pytest.raises(ValueError, match="is not an integer"):
                reward("2", answer)


@pytest.mark.parametrize("completion", ["0" * 5000, "1e10000000", "1e50000000", "9" * 4400,
                                        "1e000000000020000000", "1E+0000000000000050000000"])
def test_rewards_of_numbers_no_one_would_answer_are_0_at_once(completion):
    """A degenerate completion: Python refuses an integer of over 4300 digits (the reward
    raised, which stops the trial) and ``Fraction("1e50000000")`` ran for minutes."""
    t0 = time.perf_counter()
    for reward in (first_int_reward, last_int_reward, math_reward):
        assert reward(completion, 0) == 0.0 and reward(f"so {completion}", 1000) == 0.0
    assert math_reward(completion, "1e3") == 0.0
    assert time.perf_counter() - t0 < 10  # (not a timing: a hang's guard; it takes ms)
    assert math_reward("\\boxed{1e400}", "1e400") == 1.0  # (the largest exponent read)
    assert math_reward("\\boxed{1e401}", "1e401") == 1.0  # (beyond it: the same text)


@pytest.mark.parametrize("completion, answer, want", [
    ("so the total is 1,000.", 1000, 1.0),
    ("1000.0 apples", "1,000", 1.0),
    ("x = 3/4.", "0.75", 1.0),
    ("first 2, then \\boxed{\\frac{3}{4}} and 9", 0.75, 1.0),  # boxed wins over the last number
    ("\\boxed{\\dfrac{6}{8}}", "3/4", 1.0),
    ("\\boxed{50\\%}", "0.5", 1.0),
    ("\\boxed{1e3}", "1000", 1.0),
    ("it is -2", -2, 1.0),
    ("\\boxed{x + 1}", "x+1", 1.0),                 # not numbers: compared as text
    ("\\boxed{x + 2}", "x+1", 0.0),
    ("7 then 8", 7, 0.0),
    ("no number", 3, 0.0),
    ("\\boxed{1/0}", 0, 0.0),
])
def test_math_reward(completion, answer, want):
    assert math_reward(completion, answer) == want


def test_numbers():
    assert to_number("1,234.5") == to_number("2469/2") and to_number("(1)/(4)") == 0.25
    assert to_number("1,2,3") is None and to_number("abc") is None and to_number("") is None


@pytest.mark.parametrize("name, ops, top", [("arith", "+", 4), ("arith", "+-*", 6),
                                           ("word", "+", 9)])
def test_held_out_problems_are_never_training_problems(name, ops, top):
    cfg = TaskConfig(name=name, ops=ops, max_operand=top, train_size=3000, eval_size=64)
    train, held = dataset(cfg, "train"), dataset(cfg, "eval")
    assert held and {p["prompt"] for p in train}.isdisjoint({p["prompt"] for p in held})
    assert len({p["prompt"] for p in held}) == len(held) <= 64  # each held-out problem once
    if name == "arith":  # training draws cover every problem that is not held out
        assert len({p["prompt"] for p in train}) + len(held) == len(arith_problems(cfg))
        assert all(p["answer"] == eval(p["prompt"][:-1]) for p in train + held)
    assert [p["id"] for p in held] == list(range(len(held)))
    assert dataset(cfg, "eval") == held and dataset(cfg, "train") == train  # deterministic


def test_arith_tiny_held_out_split():
    cfg = TaskConfig(train_size=50, eval_size=8)  # arith-tiny in the integration tests
    held = dataset(cfg, "eval")
    assert len(held) == 6  # a quarter of the 25 sums
    assert {p["prompt"] for p in dataset(cfg, "train")}.isdisjoint(p["prompt"] for p in held)
    assert dataset(TaskConfig(eval_size=0), "eval") == []


def _rows():
    return [{"question": "1+1=", "solution": "2", "id": None},
            {"question": "2+2=", "solution": "4", "id": 9}]


def test_file_datasets_with_a_field_mapping(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(tmp_path / "p.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _rows())
    pq.write_table(pa.Table.from_pylist(_rows()), tmp_path / "p.parquet")
    for path in ("p.jsonl", "p.parquet"):
        got = load_prompts(str(tmp_path / path), "prompt:question, answer:solution")
        assert got == [{"id": 0, "prompt": "1+1=", "answer": "2"},
                       {"id": 9, "prompt": "2+2=", "answer": "4"}]
    with pytest.raises(ConfigError, match=r"lacks the column\(s\) \['prompt', 'answer'\]"):
        load_prompts(str(tmp_path / "p.jsonl"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match=r"\.jsonl or \.parquet"):
        TaskConfig(train_path="x.csv")
    for bad in ("prompt", "question:prompt", "prompt:"):
        with pytest.raises(ConfigError, match="FIELD:COLUMN"):
            TaskConfig(fields=bad)
    assert parse_fields("id:row") == {"prompt": "prompt", "answer": "answer", "id": "row"}
    cfg = TaskConfig(train_path=str(tmp_path / "p.parquet"), fields="prompt:question,"
                     "answer:solution", reward="math")
    assert [p["answer"] for p in dataset(cfg, "train")] == ["2", "4"]
    assert dataset(cfg, "eval")  # no eval_path: arith's own held-out prompts
    assert get_task(cfg).reward("= 4.0", "4") == 1.0


def test_saved_hugging_face_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    one = datasets.Dataset.from_list(_rows())
    one.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": one, "test": one.select([1])}).save_to_disk(
        str(tmp_path / "dict"))
    fields = "prompt:question,answer:solution"
    assert [p["prompt"] for p in load_prompts(str(tmp_path / "one"), fields)] == ["1+1=", "2+2="]
    cfg = TaskConfig(train_path=str(tmp_path / "dict"), eval_path=str(tmp_path / "dict"),
                     fields=fields)
    assert len(dataset(cfg, "train")) == 2
    assert dataset(cfg, "eval") == [{"id": 9, "prompt": "2+2=", "answer": "4"}]
    with pytest.raises(ConfigError, match=r"not 'validation'"):
        load_prompts(str(tmp_path / "dict"), fields, "validation")
    with pytest.raises(ConfigError, match="save_to_disk"):
        load_prompts(str(tmp_path), fields)


def test_unknown_tasks_and_rewards_are_refused_before_any_import():
    for name in ("os:system", "experiments.rl.synthetic:arith_task", "nope"):
        with pytest.raises(ConfigError, match=r"name=.*slurm_rl\.tasks.*valid: \['arith'"):
            TaskConfig(name=name)
    with pytest.raises(ConfigError, match=r"reward='subprocess:run'.*\['first_int', "
                                          r"'last_int', 'math'"):
        TaskConfig(reward="subprocess:run")
    with pytest.raises(ConfigError, match="takes none"):
        TaskConfig(options={"max_operand": "3"})


def test_a_plugin_task_and_reward_from_an_installed_package(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(install_example_plugin(str(tmp_path)))
    for name in ("paren", "paren_task:make_task"):
        cfg = TaskConfig(name=name, options={"max_operand": "2"}, train_size=40, eval_size=4)
        task = get_task(cfg)
        train, held = dataset(cfg, "train"), dataset(cfg, "eval")
        assert task.name == "paren" and len(train) == 40 and len(held) == 4
        assert {p["prompt"] for p in train}.isdisjoint(p["prompt"] for p in held)
        assert all(eval(p["prompt"][:-1]) == p["answer"] for p in train + held)
        assert task.reward(f"{held[0]['answer']} ", held[0]["answer"]) == 1.0
    strict = get_task(TaskConfig(name="paren", reward="exact"))
    assert strict.reward(" 6 ", 6) == 1.0 and strict.reward("6+", 6) == 0.0
    with pytest.raises(ConfigError, match=r"^rl\.task\.name='paren': the factory "
                                          r"paren_task\.make_task raised ValueError: .*"
                                          r"max_operand=12"):
        get_task(TaskConfig(name="paren", options={"max_operand": "12"}))


def _registered(name, factory):
    """A TaskConfig naming ``factory``, registered as a task (as if a plugin declared it)."""
    from experiments.rl import tasks

    tasks.TASKS[name] = factory
    cfg = TaskConfig()
    object.__setattr__(cfg, "name", name)  # (TaskConfig checks names against entry points)
    return cfg


def test_a_task_factory_that_raises_is_a_config_error_naming_it():
    """A factory runs in the master and in every rollout worker and must be deterministic:
    what it raises a restart raises again (it was recovered 4 times, then a traceback)."""
    from experiments.rl import tasks

    def bad_factory(cfg):
        raise ValueError("broken\nsecond line")

    def bad_prompts(split):
        raise KeyError(split)

    try:
        with pytest.raises(ConfigError, match=r"^rl\.task\.name='bad': the factory "
                                              r".*test_tasks\.test_a_task_factory_that_raises_"
                                              r"is_a_config_error_naming_it\.<locals>\."
                                              r"bad_factory raised ValueError: broken; valid: "
                                              r"a task that builds") as e:
            get_task(_registered("bad", bad_factory))
        assert "\n" not in str(e.value) and isinstance(e.value.__cause__, ValueError)
        cfg = _registered("bad_split", lambda cfg: tasks.Task("b", bad_prompts,
                                                              tasks.REWARDS["math"]))
        with pytest.raises(ConfigError, match=r"^rl\.task\.name='bad_split': its "
                                              r"prompts\('eval'\) raised KeyError: 'eval'"):
            dataset(cfg, "eval")
        with pytest.raises(ConfigError, match=r"^rl\.task\.name='leaves': the factory .* "
                                              r"raised ExitCalled: it called sys\.exit\(3\)"):
            get_task(_registered("leaves", lambda cfg: sys.exit(3)))  # (ended the worker)
        with pytest.raises(ConfigError, match=r"^rl\.task\.name='wrong': the factory "
                                              r"returned int, not"):
            get_task(_registered("wrong", lambda cfg: 3))
        # malformed prompts are named before any worker meets them (they crashed rollout
        # workers with a traceback, and every recovery again)
        cases = (([{"id": 0, "prompt": [1, 5], "answer": 6}], "[1, 5]"),
                 ([{"id": 0, "prompt": "1+1="}], "'1+1='"), ("not a list", "not a list"),
                 ([3], "3"))
        for n, (prompts, shown) in enumerate(cases):
            cfg = _registered(f"malformed{n}", lambda cfg, p=prompts: tasks.Task(
                "m", lambda split: p, tasks.REWARDS["math"]))
            with pytest.raises(ConfigError, match=rf"^rl\.task\.name='malformed{n}': its "
                                                  r"prompts\('train'\) gave .*"
                                                  + re.escape(shown)):
                dataset(cfg, "train")
    finally:
        for name in ("bad", "bad_split", "wrong", *(f"malformed{n}" for n in range(4))):
            tasks.TASKS.pop(name, None)


@pytest.mark.parametrize("pid", [1 << 64, "7", 1.0, True])
def test_a_task_whose_prompt_ids_the_wire_cannot_carry_is_refused(pid):
    """Tasks name their prompts by id: an id beyond 64 bits could not be sent, and every lease
    of it failed, for ever."""
    from experiments.rl import tasks

    prompts = [{"id": 0, "prompt": "1+1=", "answer": 2}, {"id": pid, "prompt": "x", "answer": 1}]
    try:
        cfg = _registered(f"wide{type(pid).__name__}", lambda cfg: tasks.Task("w", lambda split: prompts,
                                                                 tasks.REWARDS["math"]))
        with pytest.raises(ConfigError, match=rf"^rl\.task\.name='wide.*': train prompt id "
                                              rf"{re.escape(repr(pid))} is not a 64-bit integer"):
            dataset(cfg, "train")
    finally:
        tasks.TASKS.pop(f"wide{type(pid).__name__}", None)


def _jsonl(tmp_path, name, lines, mode="w"):
    path = tmp_path / name
    with open(path, mode) as f:
        f.write(lines)
    return str(path)


GOOD = '{"prompt": "1+1=", "answer": 2}\n'


@pytest.mark.parametrize("text, words", [
    (GOOD * 3 + '{"prompt": "2+2=" "answer": 4}\n',  # malformed line 4
     ["line 4", "not JSON", "one JSON object per line"]),
    (GOOD + "\n" + "5\n",  # blank lines count: line 3
     ["line 3", "5 (int)", "not a JSON object"]),
    (GOOD + '{"prompt": "x", "answer": 1, "id": "x0"}\n',
     ["line 2", "id 'x0'", "not a 64-bit integer", "rl.task.fields=id:COL"]),
    (GOOD + '{"prompt": "x", "answer": 1, "id": 1.5}\n', ["line 2", "id 1.5", "not a 64-bit integer"]),
    (GOOD + '{"prompt": "x", "answer": 1, "id": true}\n', ["line 2", "not a 64-bit integer"]),
    # beyond what msgpack carries: the rollout workers' leases failed for ever, the trial hung
    (GOOD + '{"prompt": "x", "answer": 1, "id": 100000000000000000000}\n',
     ["line 2", "id 100000000000000000000", "not a 64-bit integer", "2**63-1"]),
    (GOOD + '{"prompt": "x", "answer": 1, "id": "-9223372036854775809"}\n',
     ["line 2", "not a 64-bit integer"]),
    (GOOD + '{"prompt": "x", "answer": 2.5}\n',  # arith's reward: first_int
     ["prompt id 1", "the answer 2.5 is not an integer", "first_int", "rl.task.reward=math"]),
    (GOOD + '{"prompt": "x", "answer": "3.0"}\n', ["prompt id 1", "'3.0' is not an integer"]),
    (GOOD + '{"prompt": ["x"], "answer": 1}\n', ["line 2", "'prompt'", "list", "a string"]),
    (GOOD + '{"prompt": "x", "answer": null}\n', ["line 2", "'answer'", "null"]),
    ('{"prompt": "a", "answer": 1, "id": 3}\n{"prompt": "b", "answer": 1, "id": 3}\n',
     ["line 2", "id 3", "line 1", "unique"]),
    (GOOD + '{"question": "x", "answer": 1}\n', ["line 2", "lacks the column(s) ['prompt']"]),
])
def test_bad_jsonl_lines_are_config_errors_naming_key_file_and_line(tmp_path, text, words):
    path = _jsonl(tmp_path, "train.jsonl", text)
    cfg = TaskConfig(train_path=path)
    with pytest.raises(ConfigError) as e:
        dataset(cfg, "train")
    msg = str(e.value)
    assert msg.startswith(f"rl.task.train_path={path!r}") and "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
    cfg = TaskConfig(eval_path=path)
    with pytest.raises(ConfigError, match=r"^rl\.task\.eval_path="):
        dataset(cfg, "eval")


def test_non_utf8_and_bom_jsonl(tmp_path):
    path = _jsonl(tmp_path, "t.jsonl", GOOD.encode() + b'{"prompt": "caf\xe9", "answer": 1}\n',
                  "wb")
    with pytest.raises(ConfigError, match=r"train_path=.*t\.jsonl.*line 2.*not UTF-8.*valid"):
        dataset(TaskConfig(train_path=path), "train")
    bom = _jsonl(tmp_path, "bom.jsonl", b"\xef\xbb\xbf" + GOOD.encode(), "wb")
    assert dataset(TaskConfig(train_path=bom), "train") == [{"id": 0, "prompt": "1+1=",
                                                             "answer": 2}]


def test_integer_ids_of_any_spelling_are_kept(tmp_path):
    path = _jsonl(tmp_path, "t.jsonl", '{"prompt": "a", "answer": 1, "id": "7"}\n'
                  '{"prompt": "b", "answer": 1, "id": 8.0}\n'
                  '{"prompt": "c", "answer": 1, "id": "-9223372036854775808"}\n'
                  '{"prompt": "d", "answer": 1, "id": 9223372036854775807}\n')
    assert [p["id"] for p in dataset(TaskConfig(train_path=path), "train")] == [
        7, 8, -(1 << 63), (1 << 63) - 1]


def test_an_empty_training_set_names_its_file_or_task(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = _jsonl(tmp_path, "empty.jsonl", "\n\n")
    with pytest.raises(ConfigError, match=rf"^rl\.task\.train_path={empty!r} holds no prompts"):
        dataset(TaskConfig(train_path=empty), "train")
    # an empty held-out file named is a mistake too: it trained with no evaluation, silently
    with pytest.raises(ConfigError, match=rf"^rl\.task\.eval_path={empty!r} holds no prompts"):
        dataset(TaskConfig(eval_path=empty), "eval")
    zero = str(tmp_path / "zero.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()),
                             "answer": pa.array([], pa.string())}), zero)
    with pytest.raises(ConfigError, match=r"train_path=.*zero\.parquet.* holds no prompts"):
        dataset(TaskConfig(train_path=zero), "train")
    from experiments.rl import tasks

    tasks.TASKS["nothing"] = lambda cfg: tasks.Task("nothing", lambda split: [],
                                                    tasks.REWARDS["math"])
    try:
        cfg = TaskConfig()
        object.__setattr__(cfg, "name", "nothing")  # (a plugin that yields no prompts)
        with pytest.raises(ConfigError, match=r"rl\.task\.name='nothing'.*no training prompts"):
            dataset(cfg, "train")
    finally:
        del tasks.TASKS["nothing"]


def test_bad_parquet_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    junk = _jsonl(tmp_path, "junk.parquet", "not parquet at all")
    with pytest.raises(ConfigError, match=r"^rl\.task\.train_path=.*junk\.parquet.*not a "
                                          r"readable parquet file.*valid"):
        dataset(TaskConfig(train_path=junk), "train")
    typed = str(tmp_path / "typed.parquet")
    pq.write_table(pa.table({"prompt": [[1, 2]], "answer": ["1"], "id": [1.5]}), typed)
    with pytest.raises(ConfigError, match=r"typed\.parquet.*row 0.*'prompt'.*list"):
        dataset(TaskConfig(train_path=typed), "train")
    ids = str(tmp_path / "ids.parquet")
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"], "id": ["0", "x1"]}),
                   ids)
    with pytest.raises(ConfigError, match=r"ids\.parquet.*row 1.*id 'x1'.*not a 64-bit integer"):
        dataset(TaskConfig(train_path=ids), "train")


def test_bad_saved_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    one = datasets.Dataset.from_list(_rows())
    one.select([]).save_to_disk(str(tmp_path / "empty"))
    cfg = TaskConfig(train_path=str(tmp_path / "empty"), fields="prompt:question,answer:solution")
    with pytest.raises(ConfigError, match=r"^rl\.task\.train_path=.*empty.*holds no prompts"):
        dataset(cfg, "train")
    one.save_to_disk(str(tmp_path / "broken"))
    for name in os.listdir(tmp_path / "broken"):
        if name.endswith(".arrow"):
            (tmp_path / "broken" / name).write_text("junk")
    cfg = TaskConfig(train_path=str(tmp_path / "broken"), fields="prompt:question,answer:solution")
    with pytest.raises(ConfigError, match=r"^rl\.task\.train_path=.*broken.*save_to_disk"):
        dataset(cfg, "train")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match=r"^rl\.task\.eval_path=.*plain.*save_to_disk"):
        dataset(TaskConfig(eval_path=str(tmp_path / "plain")), "eval")
    datasets.DatasetDict({"train": one.select([]), "test": one}).save_to_disk(
        str(tmp_path / "dict"))
    cfg = TaskConfig(train_path=str(tmp_path / "dict"), fields="prompt:question,answer:solution")
    with pytest.raises(ConfigError, match=r"^rl\.task\.train_path=.*dict.*holds no prompts"):
        dataset(cfg, "train")


def test_a_file_without_a_known_suffix_is_refused_when_read(tmp_path):
    path = _jsonl(tmp_path, "train", GOOD)
    with pytest.raises(ConfigError, match=r"train_path=.*is a file.*\.jsonl or \.parquet"):
        dataset(TaskConfig(train_path=path), "train")


def test_a_held_out_prompt_too_long_is_named_with_its_file_and_id(tmp_path):
    """A held-out prompt that cannot fit the servers' context stopped the first evaluation with
    the server's words alone (no file, no id; under mode=eval, a traceback)."""
    from experiments.rl.agents import AgentConfig
    from experiments.rl.common import eval_prompts
    from experiments.rl.config import RLConfig
    from tests.helpers import CharTok
    from workers.engines.vllm_config import VllmConfig

    tok = CharTok()
    tok.bos_token_id = 1
    rows = [{"id": 7, "prompt": "1+1=", "answer": 2}, {"id": 9, "prompt": "1+" * 70 + "1=",
                                                        "answer": 71}]
    path = _jsonl(tmp_path, "eval.jsonl", "\n".join(json.dumps(r) for r in rows))
    rl = RLConfig(task=TaskConfig(eval_path=path), agent=AgentConfig(max_new_tokens=4),
                  vllm=VllmConfig(max_model_len=128))
    with pytest.raises(ConfigError, match=rf"^rl\.task\.eval_path={re.escape(repr(path))}: "
                                          r"held-out prompt id 9 \(143 tokens\) \+ "
                                          r"rl\.agent\.max_new_tokens \(4\) exceeds "
                                          r"rl\.vllm\.max_model_len="):
        eval_prompts(rl, tok)
    path = _jsonl(tmp_path, "short.jsonl", json.dumps(rows[0]))
    rl = RLConfig(task=TaskConfig(eval_path=path), agent=AgentConfig(max_new_tokens=4),
                  vllm=VllmConfig(max_model_len=128))
    assert [ids for _, ids in eval_prompts(rl, tok)] == [[1] + tok.encode("1+1=")]
