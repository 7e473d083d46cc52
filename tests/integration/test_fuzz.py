"""The fuzz and attack suite, short (the long one: ``tests/benchmarks/fuzz.py``): a fixed seed and
a small count per target, against a live ``smoke`` trial (frames, replays, floods), a live
OpenAI endpoint on a real vLLM engine, and the sbatch templates. Every target must end with 0
crashed, 0 wrongly accepted and every drop counted; the trial must then complete, its summary
counting exactly the drops the attacks caused.

What each attack is and how it is judged: ``tests/fuzzing/``. The attacks that existing tests
make one by one (``test_wire_attacks.py``, ``test_openai_http.py``, ``test_script_safety.py``)
are here drawn at random and in volume.
"""
from __future__ import annotations

import random
from typing import Iterator

import pytest

from tests.fuzzing import Budget, Tally
from tests.fuzzing.http import Endpoint, http_attack, serve
from tests.fuzzing.templates import template_attack
from tests.fuzzing.trial import LiveTrial, launch, stop
from tests.fuzzing.wire import ATTACKS, Attacker

SEED = 20261123
WIRE_COUNT = 40
"""Bad messages (connections, for the flood) per wire target."""
ATTACK_SECONDS = 20.0
"""The trial's window for the wire targets (they take well under half of it)."""


def _check(tally: Tally, at_least: int) -> None:
    assert tally.ok, "\n".join([tally.line(), *tally.notes])
    assert tally.tried >= at_least, "\n".join([tally.line(), *tally.notes])
    assert tally.crashed == tally.wrongly_accepted == tally.miscounted == 0


@pytest.fixture(scope="module")
def trial(tmp_path_factory) -> Iterator[LiveTrial]:
    t = launch(str(tmp_path_factory.mktemp("fuzz") / "runs"), "fuzz", ATTACK_SECONDS)
    yield t
    t.close()
    stop(t.proc)


@pytest.fixture(scope="module")
def attacker(trial) -> Iterator[Attacker]:
    a = Attacker(trial)
    yield a
    a.close()


@pytest.mark.parametrize("target", list(ATTACKS))
def test_wire_target(trial, attacker, target):
    tally = ATTACKS[target](trial, attacker, random.Random(f"{SEED}/{target}"),
                            Budget(count=WIRE_COUNT))
    _check(tally, WIRE_COUNT)
    assert tally.dropped_and_counted == tally.tried


def test_templates(tmp_path):
    tally = template_attack(str(tmp_path), random.Random(SEED), Budget(count=40))
    _check(tally, 40)
    assert tally.dropped_and_counted > 0 and tally.accepted > 0  # both outcomes were drawn


@pytest.fixture(scope="module")
def endpoint(vllm_tiny, tmp_path_factory) -> Iterator[Endpoint]:
    ep, close = serve(vllm_tiny, str(tmp_path_factory.mktemp("http-trial")))
    yield ep
    close()


@pytest.mark.slow
def test_http(endpoint):
    tally = http_attack(endpoint, random.Random(SEED), Budget(count=120))
    _check(tally, 120)
    assert tally.dropped_and_counted > tally.accepted > 0


def test_the_trial_completes_and_counted_every_drop(trial):
    """Runs last: the smoke trial, attacked above, completes, and the drops its workers and its
    stream report (the master's own RPC drops are not in its summary) are those the attacks
    caused."""
    code, summary = trial.finish(timeout=ATTACK_SECONDS + 120)
    assert code == 0 and summary.get("status") == "completed", summary
    caused = sum(n for name, n in trial.observed.items() if name != "master/0")
    assert caused > 0 and summary["results"]["dropped_messages"] == caused
