"""The name-resolution key layout of one trial: every key lives under ``<exp>/<trial>/``."""
from __future__ import annotations


def trial_root(exp: str, trial: str) -> str:
    return f"{exp}/{trial}"


def worker_address(exp: str, trial: str, kind: str, index: int) -> str:
    """RPC address (``tcp://host:port``) a worker serves on."""
    return f"{exp}/{trial}/worker/{kind}/{index}"


def worker_addresses(exp: str, trial: str, kind: str | None = None) -> str:
    return f"{exp}/{trial}/worker" + (f"/{kind}" if kind else "")


def heartbeat(exp: str, trial: str, kind: str, index: int) -> str:
    """Kept alive with a TTL while the worker lives."""
    return f"{exp}/{trial}/heartbeat/{kind}/{index}"


def heartbeats(exp: str, trial: str, kind: str | None = None) -> str:
    return f"{exp}/{trial}/heartbeat" + (f"/{kind}" if kind else "")


def worker_error(exp: str, trial: str, kind: str, index: int) -> str:
    """JSON ``{"type", "message", "traceback"}`` written by a worker that failed."""
    return f"{exp}/{trial}/error/{kind}/{index}"


def worker_errors(exp: str, trial: str) -> str:
    return f"{exp}/{trial}/error"


def worker_of(key: str) -> str:
    """``kind/index`` of a per-worker key (``.../error/model/1`` -> ``model/1``)."""
    return "/".join(key.split("/")[-2:])


def stream(exp: str, trial: str, name: str) -> str:
    """Address of a PULL endpoint (e.g. the master's trajectory stream)."""
    return f"{exp}/{trial}/stream/{name}"


def streams(exp: str, trial: str) -> str:
    return f"{exp}/{trial}/stream"


def stores(exp: str, trial: str) -> str:
    return f"{exp}/{trial}/store"


def store(exp: str, trial: str, group: str) -> str:
    """``host:port`` of the TCPStore that rendezvous a torch.distributed group."""
    return f"{exp}/{trial}/store/{group}"


def http_addresses(exp: str, trial: str) -> str:
    return f"{exp}/{trial}/http"


def http_address(exp: str, trial: str, index: int) -> str:
    """``http://host:port`` of generation server ``index``'s OpenAI-compatible endpoint."""
    return f"{http_addresses(exp, trial)}/{index}"


def controller(exp: str, trial: str) -> str:
    """The controller's liveness key (kept alive with a TTL while the controller runs)."""
    return f"{exp}/{trial}/controller"


def cancel(exp: str, trial: str) -> str:
    """Set by ``python -m system.ctl cancel``: the running controller stops the trial (and
    records it as cancelled) when it finds this key."""
    return f"{exp}/{trial}/cancel"


def progress(exp: str, trial: str) -> str:
    """JSON of the master's latest progress figures (what the controller shows and what a
    recovery reads: the last step trained before a failure)."""
    return f"{exp}/{trial}/progress"


def preempt(exp: str, trial: str, kind: str, index: int) -> str:
    """Set by a worker that holds training state when Slurm warns it of preemption (SIGUSR2);
    the master deletes it once a checkpoint is committed, and the worker then stops."""
    return f"{exp}/{trial}/preempt/{kind}/{index}"


def preempts(exp: str, trial: str) -> str:
    return f"{exp}/{trial}/preempt"


def alive(exp: str, trial: str, kind: str, index: int) -> str:
    """``host:pid:nonce`` of the worker's process, kept alive with a TTL by the worker's witness
    (:mod:`system.launcher.witness`, under Slurm) while that process lives, whether or not it
    heart-beats: the controller reads it for a silent worker whose job runs others too."""
    return f"{exp}/{trial}/alive/{kind}/{index}"


def stop_order(exp: str, trial: str, kind: str, index: int) -> str:
    """JSON ``{"incarnation": "host:pid:nonce", "grace": seconds}``, set by the controller to end a
    worker's process that shares its Slurm job with others (Slurm cannot stop one task of a
    step): the witness of that incarnation signals it, and deletes the order."""
    return f"{exp}/{trial}/stop/{kind}/{index}"
