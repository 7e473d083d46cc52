"""What a job script may contain: every value the sbatch templates render goes through one of
:data:`FILTERS`, which quote it (for bash, or for sbatch's ``#SBATCH`` parser) or check it
against a strict pattern; the template environment refuses any other value (:func:`finalize`).

No filter lets a control character through: a newline would end an ``#SBATCH`` or shell line
and start another, whatever the quoting.
"""
from __future__ import annotations

import re
import shlex
from typing import Sequence

from system.checks import check_line
from system.errors import ConfigError


class Safe(str):
    """Text already quoted or checked for a job script (what every filter returns)."""


_SBATCH_BLANKED = re.compile(r"hetjob|packjob", re.IGNORECASE)


def check_sbatch_text(key: str, value: object) -> None:
    """``value`` can be written on an ``#SBATCH`` line: one line, and neither ``hetjob`` nor
    ``packjob`` (sbatch blanks those words out of a directive line wherever they are)."""
    check_line(key, value)
    assert isinstance(value, str)
    found = _SBATCH_BLANKED.search(value)
    if found:
        raise ConfigError(f"{key}={value!r} contains {found.group(0)!r}, which sbatch removes "
                          "from #SBATCH lines; valid: text without 'hetjob' or 'packjob'")


def sbatch_quote(value: object) -> Safe:
    """A value for an ``#SBATCH`` line: double-quoted, ``\\`` and ``"`` escaped (sbatch's own
    directive parser understands that, and a quoted ``#`` does not start a comment)."""
    s = str(value)
    check_sbatch_text("an #SBATCH value", s)
    return Safe('"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"')


def shell_quote(value: object) -> Safe:
    """One bash word, single-quoted where needed (``$(...)``, backticks, ``;`` stay text)."""
    s = str(value)
    check_line("a word of a job script", s)
    return Safe(shlex.quote(s))


def shell_join(argv: Sequence[str]) -> Safe:
    """A command line: every argument quoted (:func:`shell_quote`)."""
    if isinstance(argv, str):
        raise ConfigError(f"{argv!r}: a command to quote must be a list of arguments")
    return Safe(" ".join(shell_quote(a) for a in argv))


def split_words(key: str, text: str) -> list[str]:
    """``text`` split like a shell would (quotes group words); ConfigError naming ``key``."""
    check_line(key, text)
    try:
        return shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"{key}={text!r} is not a list of shell words ({e}); valid: words "
                          "separated by spaces, quoted like in a shell") from None


def shell_words(text: str) -> Safe:
    """Arguments given as one string (``apptainer_args``): split, then each word quoted, so
    ``$(...)`` or ``;`` in them is an argument, never a command."""
    return shell_join(split_words("a list of shell words", text))


PATH_REFUSED = "backslashes and without '%' before a digit"


def slurm_path_problem(path: str) -> str | None:
    """Why Slurm would not write a log at ``path`` given as an ``--output`` pattern with its
    ``%`` doubled, or None: a backslash (Slurm drops it, and then expands no pattern, ``%j``
    and ``%t`` included), or a ``%`` before a digit (srun's parser reads ``%%5t`` as a padded
    task rank and loses the 5)."""
    if "\\" in path:
        return "a backslash, which Slurm removes from --output paths"
    if re.search(r"%\d", path):
        return "a '%' before a digit, which srun reads as a padded %-pattern"
    return None


def number(value: object) -> Safe:
    """An ``int`` (never a ``bool`` or a string that looks like one)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{value!r} is rendered as a number in a job script but is not an int")
    return Safe(str(value))


_JOB_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]*")


def name(value: object) -> Safe:
    """An experiment, trial, kind or job name (letters, digits, ``_ . : -``), written bare in
    comments and messages of the script."""
    s = str(value)
    if not _JOB_NAME_RE.fullmatch(s):
        raise ConfigError(f"{s!r} is not a valid name in a job script; valid: a letter or "
                          "digit, then letters, digits, '_', '.', ':' or '-'")
    return Safe(s)


_TOKEN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9:\-]*")


def token(value: object) -> Safe:
    """A short bare value such as ``64G`` or ``2-00:00:00`` (checked by its config as well)."""
    s = str(value)
    if not _TOKEN_RE.fullmatch(s):
        raise ConfigError(f"{s!r} is not a valid bare #SBATCH value; valid: letters, digits, "
                          "':' and '-'")
    return Safe(s)


ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENV_VALID = "a letter or '_', then letters, digits or '_'"


def env_name(value: object) -> Safe:
    """The name of an exported variable."""
    s = str(value)
    if not ENV_RE.fullmatch(s):
        raise ConfigError(f"env: {s!r} is not a valid variable name; valid: {ENV_VALID}")
    return Safe(s)


def setup_line(value: object) -> Safe:
    """A ``setup`` line: shell code the operator wrote on purpose (module loads, a venv), so
    it is written as is; it must be one line."""
    s = str(value)
    check_line("a setup line", s)
    return Safe(s)


_BY_GROUP_KEY = ("nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "mem",
                 "partition", "account", "qos", "time", "exclusive", "constraint", "nodelist",
                 "exclude")
"""Options the launcher writes from ``scheduler.slurm.<group>.<key>`` (``-`` -> ``_``)."""
_BY_SLURM_KEY = {"signal": "scheduler.slurm.signal_seconds",
                 "requeue": "scheduler.slurm.requeue", "no-requeue": "scheduler.slurm.requeue"}
_FIXED = ("job-name", "output", "error", "input", "open-mode", "ntasks", "array")
"""Options the launcher fixes: the job names and log paths the controller watches, one task
per worker, one job per group."""
_NO_JOB_ID = {"wait": "sbatch would not return until the job ends",
              "hold": "the job would wait, held, for ever",
              "test-only": "sbatch would submit nothing"}
"""Options that keep ``sbatch --parsable SCRIPT`` from submitting the job and printing its id
at once, or the job from starting, with why (their short forms ``-W`` and ``-H`` are refused
as every short option is). Seen on Slurm 22.05: on an ``#SBATCH`` line, ``--quiet``,
``--parsable``, ``--help``, ``--usage`` and ``--version`` change nothing of this."""
_ELSEWHERE = {"clusters": "the job would be queued on another cluster, where the controller's "
                          "squeue and scancel do not look: it would be lost, and left running"}
"""Options that put the job where the controller cannot follow it (short form ``-M``)."""
NOT_EXTRA = (*_BY_GROUP_KEY, *_BY_SLURM_KEY, *_FIXED, *_NO_JOB_ID, *_ELSEWHERE)
_EXACT = ("gpus",)
"""Real sbatch options that are prefixes of one in :data:`NOT_EXTRA` (sbatch, like getopt,
takes any unambiguous prefix of an option: ``--out=x`` is ``--output=x``)."""
_OPTION_RE = re.compile(r"--([a-z][a-z0-9-]*)(?:=(.+))?")
OPTION_VALID = "'--option' or '--option=value', without '#SBATCH' (e.g. --reservation=rl)"


def _owner(option: str) -> str:
    if option in _BY_GROUP_KEY:
        return f"set it with scheduler.slurm.<group>.{option.replace('-', '_')}"
    if option in _BY_SLURM_KEY:
        return f"set it with {_BY_SLURM_KEY[option]}"
    if option in _NO_JOB_ID:
        return _NO_JOB_ID[option]
    if option in _ELSEWHERE:
        return _ELSEWHERE[option]
    return "the launcher sets it for the job names and log paths the controller watches"


def parse_sbatch_option(key: str, line: object) -> tuple[str, str | None]:
    """``(option, value or None)`` of one ``extra_sbatch`` entry; ConfigError naming ``key``
    for anything but one long option, or for an option the launcher sets itself."""
    check_sbatch_text(key, line)
    assert isinstance(line, str)
    m = _OPTION_RE.fullmatch(line)
    if m is None:
        raise ConfigError(f"{key}={line!r} is not one sbatch option; valid: {OPTION_VALID}")
    option, value = m.group(1), m.group(2)
    taken = [] if option in _EXACT else [o for o in NOT_EXTRA if o.startswith(option)]
    if taken:
        raise ConfigError(f"{key}={line!r}: --{taken[0]} is not valid in extra_sbatch "
                          f"({_owner(taken[0])}); extra_sbatch takes any option but "
                          f"{', '.join('--' + o for o in NOT_EXTRA)}")
    return option, value


def sbatch_option(line: object) -> Safe:
    """An ``extra_sbatch`` entry for its ``#SBATCH`` line: the option, its value quoted."""
    option, value = parse_sbatch_option("extra_sbatch", line)
    return Safe(f"--{option}" if value is None else f"--{option}={sbatch_quote(value)}")


FILTERS = {"sq": sbatch_quote, "shq": shell_quote, "shjoin": shell_join, "shwords": shell_words,
           "num": number, "name": name, "token": token, "envname": env_name,
           "setup": setup_line, "sbatch_opt": sbatch_option}
"""The template filters; every ``{{ ... }}`` of a template ends in one of them."""


def finalize(value: object) -> object:
    """The template environment's ``finalize``: only a filter's result may be written."""
    if not isinstance(value, Safe):
        raise ConfigError(f"a job script template writes the value {value!r} as it is; every "
                          f"{{{{ ... }}}} must end in one of the filters {', '.join(FILTERS)}")
    return value
