"""Operate trials from any shell: list, inspect, cancel, read logs, show workers' stacks.

    python -m system.ctl ls [--fileroot DIR | cluster.fileroot=DIR]
    python -m system.ctl status exp=smoke trial=t1 [cluster.fileroot=DIR] [--json]
    python -m system.ctl cancel exp=smoke trial=t1 [cluster.fileroot=DIR] [--grace S]
    python -m system.ctl logs exp=smoke trial=t1 [rollout:1] [-f] [-n LINES]
    python -m system.ctl stacks exp=smoke trial=t1 [cluster.fileroot=DIR]

A trial is named as for the launcher (``exp=``, ``trial=``, ``cluster.fileroot=``; other
``key=value`` words are checked and ignored). Everything is read from the trial directory
(``status.json``, ``summary.json``, its lock and logs) and the trial's name resolution; nothing
needs the process that launched it.

``status`` exit codes: 0 live (pending, starting, running, stopping), 1 failed, 2 usage error or
no such trial, 3 completed, 4 interrupted, 5 cancelled, 6 lost (the controller died without
recording an end), 7 unknown (never ran). ``cancel``: 0 once nothing of the trial is left, 1 if
something is. ``stacks``: 0 once a worker or the controller was asked, 1 if none could be.
``ls`` and ``logs``: 0, or 2 for a usage error. Output whose reader has gone (``| head -1``) is
dropped without a message; the exit code stays the same.
"""
from __future__ import annotations

from system.cli_entry import INTERRUPTED, main_begins, quiet_while_importing, std_fds_open

if __name__ == "__main__":
    std_fds_open()  # (2>&-: see system.cli_entry)
    quiet_while_importing()  # (a Ctrl-C while the imports below run: one line, no traceback)

import argparse
import os
import sys

from system.ctl import cancel, logs, ls, output, stacks, status
from system.ctl.args import split_words, trial_paths
from system.errors import ConfigError, RLSystemError
from system.launcher.config import ExperimentConfig

TRIAL_HELP = "exp=NAME trial=T [cluster.fileroot=DIR] (as given to system.launch)"


def _lines(text: str) -> int:
    """``-n``: a count of lines, 0 or more."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of lines (0 or more)")
    return n


def _seconds(text: str) -> float:
    """``--grace``: seconds, 0 or more."""
    try:
        s = float(text)
    except ValueError:
        s = -1.0
    if not 0 <= s < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return s


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m system.ctl", description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_ls = sub.add_parser("ls", help="every trial under a file root: state, step, age, scheduler")
    p_ls.add_argument("--fileroot", default=None,
                      help="the trials' cluster.fileroot (default: "
                           f"{ExperimentConfig().cluster.fileroot})")
    p_ls.add_argument("words", nargs="*", metavar="cluster.fileroot=DIR",
                      help="the same, as the launcher and the other commands take it")
    p_st = sub.add_parser("status", help="one trial: jobs, live workers, progress, last error, "
                                         "logs; exit 0 while it is live")
    p_st.add_argument("words", nargs="+", metavar="KEY=VALUE", help=TRIAL_HELP)
    p_st.add_argument("--json", action="store_true", help="print the status as JSON")
    p_ca = sub.add_parser("cancel", help="stop every job and process of a trial (within 30 s)")
    p_ca.add_argument("words", nargs="+", metavar="KEY=VALUE", help=TRIAL_HELP)
    p_ca.add_argument("--grace", type=_seconds, default=cancel.GRACE,
                      help="seconds the controller gets to stop the trial itself before "
                           "cancel stops what is left (default: %(default)s)")
    p_lo = sub.add_parser("logs", help="print or follow a worker's log (KIND:INDEX), or the "
                                       "controller's")
    p_lo.add_argument("words", nargs="+", metavar="KEY=VALUE|KIND:INDEX",
                      help=TRIAL_HELP + ", then optionally a worker such as rollout:1")
    p_lo.add_argument("-f", "--follow", action="store_true",
                      help="follow the log until the trial ends (or Ctrl-C)")
    p_lo.add_argument("-n", "--lines", type=_lines, default=None,
                      help="only the last LINES lines (default: all; 20 with -f)")
    p_sk = sub.add_parser("stacks", help="every live worker, and the controller, writes its "
                                         "threads' stacks to its log (SIGURG; it goes on): "
                                         "print them")
    p_sk.add_argument("words", nargs="+", metavar="KEY=VALUE", help=TRIAL_HELP)
    return p


def ls_fileroot(flag: str | None, words: list[str]) -> str:
    """The file root ``ls`` lists: ``--fileroot DIR`` or the word ``cluster.fileroot=DIR``
    (one of them; ConfigError naming anything else), else the launcher's default."""
    roots = [w.partition("=")[2] for w in words if w.partition("=")[0] == "cluster.fileroot"]
    other = [w for w in words if w.partition("=")[0] != "cluster.fileroot"]
    if other:
        raise ConfigError(f"unexpected argument(s) {other}: ls takes only --fileroot DIR or "
                          "cluster.fileroot=DIR")
    if len(roots) + (flag is not None) > 1:
        raise ConfigError("give the file root once: --fileroot DIR or cluster.fileroot=DIR")
    if "" in roots or flag == "":
        raise ConfigError("the file root is empty: give --fileroot DIR or cluster.fileroot=DIR")
    given = flag if flag is not None else roots[0] if roots else None
    if given is None:
        return ExperimentConfig().cluster.fileroot  # (absent until a trial runs: no trials)
    given = os.path.expanduser(given)  # (as the launcher does: a shell leaves key=~/x be)
    if not os.path.isdir(given):  # a typo must not read as a root without trials
        raise ConfigError(f"the file root {given} is not a directory"
                          + ("" if os.path.exists(given) else " (it does not exist)"))
    return given


def dispatch(args: argparse.Namespace) -> int:
    if args.command == "ls":
        return ls.run(ls_fileroot(args.fileroot, args.words))
    keys, rest = split_words(args.words)
    if args.command == "logs" and len(rest) > 1:
        raise ConfigError(f"logs shows one worker's log at a time (KIND:INDEX), got {rest}")
    if rest and args.command != "logs":
        raise ConfigError(f"unexpected argument(s) {rest}: give {TRIAL_HELP}")
    paths = trial_paths(keys)
    if args.command == "status":
        return status.run(paths, args.json)
    if args.command == "cancel":
        return cancel.run(paths, args.grace)
    if args.command == "stacks":
        return stacks.run(paths)
    lines = args.lines if args.lines is not None or not args.follow else 20
    return logs.run(paths, logs.worker_name(rest[0]) if rest else None, args.follow, lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed; ``--help`` prints and exits 0, also to a reader that has gone."""
    try:
        try:
            return parser().parse_args(argv)
        finally:
            sys.stdout.flush()  # --help's text, before its SystemExit
    except BrokenPipeError:
        output.silence(sys.stdout)
        raise SystemExit(0) from None


def main(argv: list[str] | None = None) -> int:
    main_begins()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return dispatch(args)
    except KeyboardInterrupt:  # (cancel says what its request still does)
        output.say("interrupted", sys.stderr)
        return INTERRUPTED
    except ConfigError as e:
        output.say(f"error: {e}", sys.stderr)
        return 2
    except (RLSystemError, OSError) as e:
        output.say(f"error: {e}", sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
