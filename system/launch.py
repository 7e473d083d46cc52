"""Start a trial.

    python -m system.launch exp=smoke trial=t1                      # run it
    python -m system.launch exp=smoke trial=t1 rollout.count=8     # with overrides
    python -m system.launch exp=smoke trial=t1 --dry-run           # show what would run
    python -m system.launch exp=smoke trial=t1 scheduler=slurm --test-only   # sbatch --test-only
    python -m system.launch exp=smoke trial=t1 scheduler=slurm --detach      # controller as a job
    python -m system.launch --help                                 # experiments and keys

Parses the overrides into the experiment's validated config, writes the trial directory
(``<cluster.fileroot>/<exp>/<trial>/``) and runs the controller. Exit code 0 only when the
master reports completion.
"""
from __future__ import annotations

import logging
import signal
import sys

from omegaconf import OmegaConf

from experiments.catalog import all_experiments, get_experiment
from scheduler.registry import make_scheduler
from system.launcher.config import ExperimentConfig
from system.launcher.controller import Controller
from system.errors import ConfigError, RLSystemError
from system.name_resolve import make_name_resolve
from system.launcher.overrides import apply_overrides, describe_config, parse_cli
from system.launcher.submit import detach, dry_run
from system.launcher.trial_dir import name_resolve_root, prepare_trial
from system.wire import Codec


def help_text(exp: str = "") -> str:
    lines = [__doc__.strip().splitlines()[0], "",
             "usage: python -m system.launch exp=NAME trial=T [key=value ...] [--dry-run] "
             "[--test-only] [--detach] [--help]",
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


EXTRA_FLAGS = ("--detach", "--test-only")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_cli(argv, EXTRA_FLAGS)
        if args.help:
            print(help_text(args.exp))
            return 0
        cfg = build_config(args.exp, args.trial, args.overrides)
        if args.flags and cfg.scheduler.type.value != "slurm":
            raise ConfigError(f"{' and '.join(args.flags)} need scheduler=slurm")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    experiment = get_experiment(args.exp)
    resolved = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    paths, secret = prepare_trial(cfg, experiment.name, resolved)
    try:
        scheduler = make_scheduler(cfg.scheduler, cfg.exp, cfg.trial, paths.root)
        if args.dry_run or "--test-only" in args.flags:
            return dry_run(cfg, paths, scheduler, resolved, "--test-only" in args.flags)
        if "--detach" in args.flags:
            return detach(cfg, paths, scheduler, [a for a in argv if a != "--detach"])
        controller = Controller(cfg, experiment, paths, scheduler,
                                make_name_resolve(cfg.name_resolve, name_resolve_root(cfg)),
                                Codec(secret, cfg.rpc.max_message_bytes))
    except RLSystemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops like Ctrl-C
    return controller.run()


if __name__ == "__main__":
    sys.exit(main())
