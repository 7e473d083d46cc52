"""Fuzz and attack suite, long: randomized hostile input against a live ``smoke`` trial (frames,
replays, floods), the sbatch templates and a live OpenAI endpoint on a real vLLM engine.

    .venv/bin/python tests/benchmarks/fuzz.py                        # 10 s per target
    .venv/bin/python tests/benchmarks/fuzz.py --seconds 30 --seed 7
    .venv/bin/python tests/benchmarks/fuzz.py --count 500 --seconds 0 --no-http

Prints one line per target, ``target: tried N, dropped_and_counted N, crashed N,
wrongly_accepted N, accepted N, miscounted N`` (``accepted``: inputs that were valid after all
and were served or delivered verbatim; ``miscounted``: refused but not accounted as they should
be; what went wrong, indented below), then ``trial_dropped_messages`` (what the trial's summary
counted, and what the attacks caused) and ``trial_completed: 1`` when the attacked trial still
completed. Exit code 1 if anything crashed, was wrongly accepted or miscounted, or the trial
did not complete. Targets and how each is judged: ``tests/fuzzing/``.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the report, not vLLM's start-up log

from tests.fuzzing import Budget, Tally  # noqa: E402
from tests.fuzzing.templates import template_attack  # noqa: E402
from tests.fuzzing.trial import LiveTrial, launch, stop  # noqa: E402
from tests.fuzzing.wire import ATTACKS, Attacker  # noqa: E402


def _report(tally: Tally) -> bool:
    print(tally.line(), flush=True)
    for note in tally.notes:
        print(f"  {note}", flush=True)
    return tally.ok


def _wire(trial: LiveTrial, args: argparse.Namespace, share: float) -> bool:
    attacker = Attacker(trial)
    ok = True
    try:
        for name, attack in ATTACKS.items():
            rng = random.Random(f"{args.seed}/{name}")
            ok &= _report(attack(trial, attacker, rng, Budget(args.count, share)))
    finally:
        attacker.close()
    return ok


def _http(root: str, args: argparse.Namespace, budget: Budget) -> bool:
    try:
        from tests.fuzzing.http import http_attack, serve
        from tests.helpers import save_tiny_model, tiny_llm

        llm = tiny_llm(save_tiny_model(os.path.join(root, "tiny-qwen2")))
    except ImportError as e:
        print(f"http: skipped ({e})", flush=True)
        return True
    os.makedirs(os.path.join(root, "http-trial"))
    endpoint, close = serve(llm, os.path.join(root, "http-trial"))
    try:
        return _report(http_attack(endpoint, random.Random(args.seed), budget))
    finally:
        close()
        llm.llm_engine.engine_core.shutdown()


def _completed(trial: LiveTrial, timeout: float) -> bool:
    code, summary = trial.finish(timeout)
    counted = summary.get("results", {}).get("dropped_messages")
    caused = sum(n for name, n in trial.observed.items() if name != "master/0")
    print(f"trial_dropped_messages: {counted} (caused {caused})")
    completed = code == 0 and summary.get("status") == "completed"
    print(f"trial_completed: {int(completed)}", flush=True)
    return completed and counted == caused


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0,
                   help="at most this long per target (0: no time bound)")
    p.add_argument("--count", type=int, default=0,
                   help="at most this many inputs per target (0: no count bound)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-http", action="store_true", help="skip the vLLM endpoint")
    args = p.parse_args()
    if args.seconds <= 0 and args.count <= 0:
        p.error("give --seconds or --count")
    # wire targets share the trial's window: with a count only, give each a generous one
    share = args.seconds if args.seconds > 0 else max(10.0, args.count * 0.05)
    root = tempfile.mkdtemp(prefix="rlsys-fuzz-")
    t0 = time.monotonic()
    trial = launch(os.path.join(root, "runs"), "fuzz", share * len(ATTACKS) + 5)
    try:
        ok = _wire(trial, args, share)
        budget = Budget(args.count, args.seconds)
        ok &= _report(template_attack(os.path.join(root, "templates"), random.Random(args.seed),
                                      budget))
        if not args.no_http:
            ok &= _http(root, args, budget)
        ok &= _completed(trial, timeout=share * len(ATTACKS) + 180)
    finally:
        trial.close()
        stop(trial.proc)  # only if something above failed before it completed
    print(f"seconds: {time.monotonic() - t0:.0f}")
    if ok:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"kept for a look: {root}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
