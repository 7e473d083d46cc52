"""Start a trial.

    python -m system.launch exp=smoke trial=t1                      # run it
    python -m system.launch exp=smoke trial=t1 rollout.count=8     # with overrides
    python -m system.launch exp=smoke trial=t1 --dry-run           # show what would run
    python -m system.launch --help                                 # experiments and keys

Parses the overrides into the experiment's validated config, writes the trial directory
(``<cluster.fileroot>/<exp>/<trial>/``) and runs the controller. Exit code 0 only when the
master reports completion.
"""
from __future__ import annotations

import logging
import shlex
import signal
import sys

from omegaconf import OmegaConf

from experiments.registry import all_experiments, get_experiment
from system.config import ExperimentConfig
from system.controller import Controller, worker_specs
from system.errors import ConfigError, RLSystemError
from system.name_resolve import make_name_resolve
from system.overrides import apply_overrides, describe_config, parse_cli
from system.trial import prepare_trial
from system.wire import Codec


def help_text(exp: str = "") -> str:
    lines = [__doc__.strip().splitlines()[0], "",
             "usage: python -m system.launch exp=NAME trial=T [key=value ...] [--dry-run] [--help]",
             "", "experiments:"]
    lines += [f"  {e.name:<12} {e.doc.splitlines()[0] if e.doc else ''}"
              for e in all_experiments().values()]
    cfg = get_experiment(exp).make_config() if exp else ExperimentConfig()
    lines += ["", f"keys{' of ' + exp if exp else ''} (dotted, e.g. rollout.count=8):"]
    lines += describe_config(cfg, depth=1)
    return "\n".join(lines)


def build_config(exp: str, trial: str, overrides: list[str]) -> ExperimentConfig:
    base = get_experiment(exp).make_config()
    base.exp, base.trial = exp, trial
    return apply_overrides(base, overrides)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_cli(argv)
        if args.help:
            print(help_text(args.exp))
            return 0
        cfg = build_config(args.exp, args.trial, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    experiment = get_experiment(args.exp)
    paths, secret = prepare_trial(cfg, experiment.name, OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    if args.dry_run:
        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        for group in worker_specs(cfg, paths).values():
            for w in group:
                print(f"# {w.name} -> {w.log_path}\n{shlex.join(w.argv)}")
        print(f"dry run: nothing started; trial directory {paths.root}", file=sys.stderr)
        return 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops like Ctrl-C
    try:
        from scheduler.registry import make_scheduler

        controller = Controller(cfg, experiment, paths, make_scheduler(cfg),
                                make_name_resolve(cfg.name_resolve, _nr_root(cfg)),
                                Codec(secret, cfg.rpc.max_message_bytes))
    except RLSystemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return controller.run()


def _nr_root(cfg: ExperimentConfig) -> str:
    import os

    return cfg.name_resolve.file_root or os.path.join(os.path.abspath(cfg.cluster.fileroot),
                                                      ".name_resolve")


if __name__ == "__main__":
    sys.exit(main())
