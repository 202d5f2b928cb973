"""Which torch.distributed backend each layer of the run uses.

NCCL on CUDA builds and on ROCm builds (where torch's "nccl" backend is RCCL, `torch.version.hip` set),
gloo on CPU. Kept pure so it can be unit-tested and so the choice is made once, the same way, by the
controller's validation and by every worker.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from monarch_plugin.errors import BackendUnavailableError, ConfigError

__all__ = ["resolve_backend", "device_for_backend", "accelerator_kind"]


def accelerator_kind() -> str:
    """"rocm", "cuda" or "cpu": what the GPU stack of this torch build is and whether a device is visible."""
    if torch.cuda.is_available():
        return "rocm" if torch.version.hip else "cuda"
    return "cpu"


def resolve_backend(requested: str, *, accelerator: str | None = None) -> str:
    """Map "auto" to the fast backend for this machine and check that the backend exists in this build."""
    accelerator = accelerator or accelerator_kind()
    if requested == "auto":
        backend = "nccl" if accelerator in ("cuda", "rocm") else "gloo"
    elif requested in ("gloo", "nccl"):
        backend = requested
    else:
        raise ConfigError(f"unknown backend {requested!r}: choose 'auto', 'gloo' or 'nccl'")
    if backend == "nccl":
        if accelerator == "cpu":
            raise BackendUnavailableError(
                "backend 'nccl' needs a CUDA or ROCm GPU and none is visible: use 'gloo' or 'auto'"
            )
        if not dist.is_nccl_available():
            flavour = "RCCL (ROCm)" if accelerator == "rocm" else "NCCL"
            raise BackendUnavailableError(
                f"backend 'nccl' ({flavour}) is not built into this torch {torch.__version__}: "
                "install a CUDA/ROCm build of torch or choose 'gloo'"
            )
    elif not dist.is_gloo_available():
        raise BackendUnavailableError(
            f"backend 'gloo' is not built into this torch {torch.__version__}: choose 'nccl' or 'auto'"
        )
    return backend


def device_for_backend(backend: str, local_rank: int = 0) -> torch.device:
    """The device a backend's tensors live on: the replica's GPU for nccl, the CPU for gloo."""
    if backend == "nccl":
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")
