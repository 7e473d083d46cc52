"""Which collective backend a group of ranks can use, from the physical devices they are on.

NCCL refuses a communicator with two ranks on one GPU ("Duplicate GPU detected"), and it needs
every rank on a GPU. Workers that share a GPU (``scheduler.local.share_gpus=true`` on a one-GPU
machine puts the trainer and vLLM on the same device) therefore sync weights over gloo, which
broadcasts CUDA tensors by staging them through host memory (the resharding executor uses
broadcast only). Each rank names its device by a physical identity (:func:`device_identity`:
the CUDA device UUID), never by its index: every worker sees its own ``CUDA_VISIBLE_DEVICES``
slice, where ``cuda:0`` is a different GPU in each. The decision itself (:func:`choose_backend`)
is pure: it takes those identities as plain strings.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # torch is imported by the ranks that ask for their device's identity
    import torch

CPU = "cpu"
"""The identity of a rank that computes on the CPU."""


@dataclasses.dataclass(frozen=True)
class RankDevice:
    """One rank of a group: who it is (``model-0``, ``generation-1 tp0``) and its device's
    physical identity (:data:`CPU`, or a GPU's ``GPU-<uuid>``)."""

    name: str
    device: str

    def __post_init__(self) -> None:
        if not self.name or not self.device:
            raise ValueError(f"RankDevice needs a name and a device, got {self!r}")

    @property
    def on_gpu(self) -> bool:
        return self.device != CPU


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """The backend of a group, and why it is not NCCL (empty when it is)."""

    backend: str
    reason: str = ""
    rule: str = ""
    """The constraint behind a fallback (e.g. NCCL refuses two ranks on one GPU)."""
    fallback: bool = False
    """Gloo although ranks are on GPUs (slower than NCCL there): worth one line in the log."""

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {self.backend!r} is not gloo or nccl")

    def line(self, what: str = "weight sync") -> str:
        """One line for the log, e.g. ``weight sync: gloo (model-0 and generation-0 tp0 share
        GPU GPU-1a2b); NCCL refuses two ranks on one GPU``."""
        return (f"{what}: {self.backend}" + (f" ({self.reason})" if self.reason else "")
                + (f"; {self.rule}" if self.rule else ""))


def shared_devices(ranks: Sequence[RankDevice]) -> dict[str, list[str]]:
    """GPU identity -> the names of the ranks on it, for every GPU that holds more than one
    rank (in the ranks' order)."""
    on: dict[str, list[str]] = {}
    for r in ranks:
        if r.on_gpu:
            on.setdefault(r.device, []).append(r.name)
    return {dev: names for dev, names in on.items() if len(names) > 1}


def sharing(ranks: Sequence[RankDevice]) -> str:
    """``a and b share GPU X; c and d share GPU Y`` for the GPUs that hold more than one rank
    (empty when none does)."""
    return "; ".join(f"{and_list(names)} share GPU {dev}"
                     for dev, names in shared_devices(ranks).items())


def choose_backend(ranks: Sequence[RankDevice]) -> BackendChoice:
    """NCCL only when every rank is on a GPU and no two ranks share one; gloo otherwise, with
    the reason (a rank on the CPU while others are on GPUs, or the ranks sharing a GPU)."""
    if not ranks:
        raise ValueError("choose_backend needs at least one rank")
    on_cpu = [r.name for r in ranks if not r.on_gpu]
    if len(on_cpu) == len(ranks):
        return BackendChoice("gloo", "every rank is on the CPU")
    if on_cpu:
        on_gpu = [r.name for r in ranks if r.on_gpu]
        return BackendChoice("gloo", f"{and_list(on_cpu)} on the CPU, {and_list(on_gpu)} on a "
                             "GPU", "NCCL needs every rank on a GPU", fallback=True)
    shared = sharing(ranks)
    if shared:
        return BackendChoice("gloo", shared, "NCCL refuses two ranks on one GPU", fallback=True)
    return BackendChoice("nccl")


def and_list(names: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"


def device_identity(device: "torch.device | str") -> str:
    """The physical identity of ``device``: :data:`CPU` for the CPU; for a CUDA device its UUID
    as ``GPU-<uuid>`` (the form ``nvidia-smi -L`` prints), else its PCI address. The same GPU
    gives the same identity in every process, whatever its ``CUDA_VISIBLE_DEVICES``."""
    import torch

    d = torch.device(device)
    if d.type != "cuda":
        return CPU
    props = torch.cuda.get_device_properties(d)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    domain, bus, dev = (getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device"))
    if bus is None:
        raise RuntimeError(f"{d}: torch gives neither its UUID nor its PCI address")
    return f"PCI-{int(domain or 0):04x}:{int(bus):02x}:{int(dev or 0):02x}"
