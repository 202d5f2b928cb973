"""`backend`: which torch.distributed backend each accelerator gets."""

from __future__ import annotations

import pytest

from monarch_plugin.backend import resolve_backend
from monarch_plugin.errors import BackendUnavailableError

pytestmark = pytest.mark.timeout(60)


def test_backend_choice_per_accelerator():
    assert resolve_backend("auto", accelerator="cpu") == "gloo"
    assert resolve_backend("gloo", accelerator="cpu") == "gloo"
    with pytest.raises(BackendUnavailableError, match="needs a CUDA or ROCm GPU"):
        resolve_backend("nccl", accelerator="cpu")
    import torch.distributed as dist

    if dist.is_nccl_available():
        assert resolve_backend("auto", accelerator="rocm") == "nccl"  # RCCL is torch's "nccl" on ROCm
    else:
        with pytest.raises(BackendUnavailableError, match="RCCL"):
            resolve_backend("auto", accelerator="rocm")
