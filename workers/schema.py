"""Every payload that crosses a process boundary to or from a worker, in one place.

Control plane (controller <-> every worker): :class:`WorkerSetup`, :class:`ConfigureReply`,
:class:`PingReply`, :class:`WorkerReport`. RL plane (master, rollout workers, model workers,
generation servers): tasks handed out by the master, samples from generation servers,
trajectories and groups streamed to the master, training items and statistics. Arrays are numpy
on the wire (:mod:`system.wire` carries them as zero-copy frames).
"""
from __future__ import annotations

from typing import Any, NotRequired, TypedDict

import numpy as np

try:  # Python 3.11+: NotRequired in typing
    from typing import NotRequired
except ImportError:  # pragma: no cover
    from typing_extensions import NotRequired


# --- control plane ------------------------------------------------------------------------------

class WorkerSetup(TypedDict):
    """What ``configure`` sends a worker."""

    worker: dict[str, Any]
    """The worker kind's own config section (e.g. ``model``), as plain values."""
    experiment: dict[str, Any]
    """The experiment's section (e.g. ``rl``), as plain values."""
    counts: dict[str, int]
    """Workers per kind."""
    recover: str
    """``off`` or ``resume``."""
    metrics: NotRequired[dict[str, Any]]
    """The root ``metrics`` section (where a master logs training metrics), as plain values."""


class ConfigureReply(TypedDict):
    restart: int
    """The worker's incarnation (its job's restart count)."""


class PingReply(TypedDict):
    kind: str
    index: int
    local_rank: int
    state: str
    restart: int
    pid: int
    host: str
    uptime: float
    drops: dict[str, int]
    served: int
    unsent: int
    """Replies this worker could not deliver (their caller was gone or not reading)."""
    progress: dict[str, Any]


class WorkerReport(TypedDict):
    kind: str
    index: int
    state: str
    restart: int
    result: dict[str, Any]
    drops: dict[str, int]
    requests: NotRequired[int]
    """Generation servers: requests served."""
    engine: NotRequired[dict[str, Any]]
    """Generation servers: the engine's counters and weight version."""


# --- RL plane: master <-> rollout workers --------------------------------------------------------

class Task(TypedDict):
    """One prompt handed to a rollout worker."""

    seq: int
    """Admission ticket; the group that answers it carries the same ``seq``."""
    version: int
    """Weight version when admitted."""
    prompt_id: int
    epoch: int
    server: int
    """Generation server to use (all ``n`` samples go to one server)."""
    worker: int


class TaskReply(TypedDict, total=False):
    """The master's answer to ``next_task``: exactly one key is set."""

    tasks: list[Task]
    wait: float
    """Admission is closed: ask again after this many seconds."""
    done: bool
    """Training is over."""


# --- RL plane: generation servers ---------------------------------------------------------------

class SamplingParams(TypedDict, total=False):
    max_tokens: int
    temperature: float
    top_p: float
    stop_token_ids: list[int]
    ignore_eos: bool
    top_logprobs: int
    seed: int | None


class Sample(TypedDict):
    """One generated sample; every token is tagged with the weight version that produced it."""

    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    segments: list[list[int]]
    """``[version, count]`` runs."""
    finish: str


class SessionTurn(TypedDict):
    """One choice of one request an agent made in a session on the OpenAI endpoint."""

    prompt: np.ndarray
    """The prompt's token ids (int32), as the engine received them."""
    tokens: np.ndarray
    """The completion's token ids (int32): what the policy sampled, up to and including the
    token that completed a stop string."""
    logprobs: np.ndarray
    """float32, one per completion token."""
    versions: np.ndarray
    """int32: the weight version that produced each completion token."""
    finish: str
    temperature: float
    """The temperature its log-probs are at (vLLM's processed log-probs): the request's, at
    least 0.01 (vLLM's lowest); 1 for a greedy request (temperature 0)."""


class SessionRecord(TypedDict):
    """What ``take_sessions`` returns per session asked for (the session is then dropped)."""

    session: str
    found: bool
    """False: the server holds no such session (it made no request, expired or was taken)."""
    turns: list[SessionTurn]
    """In the order the requests were made, then by choice index."""
    pending: int
    """Choices still running when it was taken (they will not be recorded)."""


class EngineStats(TypedDict, total=False):
    version: int
    load: int
    http: str | None
    devices: list[str]
    """The physical identity of each vLLM worker's device, by tensor-parallel rank (``cpu`` or
    ``GPU-<uuid>``; see :func:`system.reshard.backend.device_identity`)."""


# --- RL plane: trajectories streamed to the master ---------------------------------------------

class Trajectory(TypedDict):
    """A whole episode: prompt, then completion tokens (policy tokens have ``mask`` 1, tool or
    environment tokens 0); ``logprobs`` and ``versions`` cover the completion."""

    tokens: np.ndarray
    prompt_len: int
    mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish: str
    temps: NotRequired[np.ndarray]
    """float32, one per completion token: the temperature it was sampled at, which its
    log-prob describes (tool tokens: 1). Absent: all 1."""
    reward: NotRequired[float]
    session: NotRequired[int]
    """Which agent session of its group produced it (OpenAI-API agents: one session may give
    several trajectories); GRPO normalises rewards over sessions. Absent: its own session."""


class GroupMessage(TypedDict):
    """The ``n`` trajectories of one task, streamed by a rollout worker to the master."""

    seq: int
    prompt_id: int
    worker: int
    server: int
    trajs: list[Trajectory]
    failed: bool
    error: str
    unservable: bool
    """The group failed because a generation server refused its request for good (a
    ``ConfigError``: the prompt does not fit the context, ``rl.vllm.max_model_len``): the master
    skips its prompt instead of handing it out again."""
    agent_error: bool
    """The group failed in the agent function (``rl.agent.kind=openai``): it raised, returned
    no finite number, made no request or ran past ``rl.call_timeout``; the master counts these
    (:mod:`experiments.rl.agent_failures`)."""


# --- RL plane: master <-> model workers ---------------------------------------------------------

class TrainItem(TypedDict):
    """One sequence of a training batch; arrays cover the completion tokens."""

    tokens: np.ndarray
    prompt_len: int
    mask: np.ndarray
    old_logp: np.ndarray
    temps: NotRequired[np.ndarray]
    """The completion tokens' sampling temperatures: the trainer's log-probs are taken at
    them (absent: 1)."""
    adv: NotRequired[np.ndarray]
    prox_logp: NotRequired[np.ndarray]
    ref_logp: NotRequired[np.ndarray]
    loss_weight: NotRequired[np.ndarray]
    old_values: NotRequired[np.ndarray]
    returns: NotRequired[np.ndarray]


class TrainStats(TypedDict, total=False):
    """What one rank's train step returns. ``*_sum`` figures and ``tokens`` add up over ranks;
    ``loss`` is each rank's share of the global token mean."""

    loss: float
    grad_norm: float
    seconds: float
    train_tokens: float
    tokens: float
    clip_fraction_sum: float
    behav_weight_mean_sum: float
    dual_clip_fraction_sum: float
    logp_mismatch_sum: float
    kl_sum: float
    value_loss_sum: float


class EngineInfo(TypedDict):
    """The actor's publish dtype and device (for the weight-sync spec)."""

    dtype: str
    device: str
    """The physical identity of the worker's device (:func:`system.reshard.backend.
    device_identity`: ``cpu`` or ``GPU-<uuid>``): the master picks the weight-sync backend
    from every rank's (NCCL refuses two ranks on one GPU)."""
    sharded: bool
    """Whether the actor's ranks hold FSDP2 dim-0 shards (the training layout's ``fsdp``)."""
    shape: dict[str, int | bool]
    """The actor's model shape as built (:meth:`system.reshard.params.ModelShape.to_dict`): the
    master plans the weight sync from it, and needs no transformers (nor torch) of its own."""


class Saved(TypedDict):
    """What a model worker's ``save`` wrote: its rank, and the content digests of its share of
    the checkpoint's files (relative path -> ``crc32:...``; :mod:`system.digests`)."""

    rank: int
    digests: dict[str, str]


class WeightsSent(TypedDict):
    seconds: float
    bytes_sent: int
    failed: dict[str, str]
    """Replica -> why its transfer failed (it is left out until it joins again)."""
