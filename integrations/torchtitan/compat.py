"""What torchtitan 0.3.0 needs to train on a CPU-only torch 2.13 build, kept in one place.

torchtitan 0.3.0 is written for accelerators; on a CPU-only torch 2.13 its debug model does not get past
`Trainer.__init__`. Each gap below is bridged at runtime from inside this integration (nothing in
site-packages is edited), only when no accelerator is present, and each names the versions it was found
with so it can be dropped when they move on. `apply()` is idempotent and runs before the torchtitan Trainer
is built, in every worker and in the plain (non-elastic) run alike.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

__all__ = ["apply", "force_sum_reduction", "on_cpu", "require_triton"]

_applied = False


def on_cpu() -> bool:
    """No accelerator torch could train on: the workarounds apply."""
    from torch._utils import _get_available_device_type

    return _get_available_device_type() is None


def require_triton() -> None:
    """torchtitan 0.3.0's `Trainer` imports `distributed.minimal_async_ep`, whose kernels `import triton` at
    module level, so without triton torchtitan cannot be imported at all, and on a CPU-only machine nothing
    pulls triton in. The `torchtitan` extra therefore depends on triton (the wheel imports fine without a GPU);
    this check, run when this package is imported, turns a missing triton into the fix rather than a
    traceback from deep inside torchtitan. (`python -m torchtitan.train` imports torchtitan's Trainer before
    any config module, so there only the dependency helps.)"""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        raise ImportError(
            "torchtitan 0.3.0 imports triton even on CPU (torchtitan/distributed/minimal_async_ep/kernels.py): "
            "pip install triton (it comes with monarch-plugin[torchtitan])"
        )


def apply() -> None:
    global _applied
    if _applied or not on_cpu():
        return
    _device_type_cpu()
    _set_timeout_shim()
    _flex_attention_by_sdpa()
    _applied = True


class _CpuDeviceModule:
    """The slice of the `torch.cuda` API torchtitan 0.3.0 calls on its device module, for the CPU.

    `torch.cpu` (torch 2.13) has `set_device`, `synchronize` and `device_count`, but not the memory and
    properties calls torchtitan's metrics make (`get_device_name`, `get_device_properties`, `memory_stats`,
    `reset_peak_memory_stats`, `empty_cache`). Memory is reported as the process's peak resident set."""

    set_device = staticmethod(torch.cpu.set_device)
    synchronize = staticmethod(torch.cpu.synchronize)

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return platform.processor() or platform.machine() or "cpu"

    @staticmethod
    def get_device_properties(device=None) -> SimpleNamespace:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return SimpleNamespace(name=_CpuDeviceModule.get_device_name(), total_memory=total)

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


def _device_type_cpu() -> None:
    """torchtitan 0.3.0 `tools/utils.py` falls back to device type "cuda" when torch finds no accelerator, so
    `Trainer.__init__` calls `torch.cuda.set_device` and dies on a CPU-only torch 2.13. Point it at "cpu" and a
    CPU device module, in `tools/utils.py` and in every torchtitan module that imported the two names by value
    before this ran (metrics, parallel dims, distributed utils, the profiler)."""
    from torchtitan.tools import utils

    stale = (utils.device_type, utils.device_module)
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and module is not None:
            if getattr(module, "device_type", None) == stale[0]:
                module.device_type = "cpu"
            if getattr(module, "device_module", None) is stale[1]:
                module.device_module = _CpuDeviceModule


def _set_timeout_shim() -> None:
    """torchtitan 0.3.0 lowers every process group's timeout after the first step with
    `torch.distributed.set_timeout(timeout, group)`, a function torch 2.13 does not have (the method
    `ProcessGroup.set_timeout` does the same). Provide the function only where torch lacks it."""
    if hasattr(dist, "set_timeout"):
        return

    def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
        (group or dist.distributed_c10d._get_default_group()).set_timeout(timeout)

    dist.set_timeout = set_timeout


def _flex_attention_by_sdpa() -> None:
    """torchtitan 0.3.0's language models only offer FlexAttention (or varlen, CUDA only), and torch 2.13
    refuses FlexAttention's backward on CPU, compiled or eager ("FlexAttention does not support backward on
    CPU"). Run the same attention as `scaled_dot_product_attention` with the block mask expanded to a dense
    boolean mask (`create_mask` over the mask's own `mask_mod`, so document boundaries are kept): exact, and
    cheap at the sequence lengths a CPU trains.

    The block mask is then only a carrier for its `mask_mod`, so it is built eagerly: torchtitan builds it
    with `torch.compile(create_block_mask)`, which on CPU costs an Inductor C++ compile in every new process
    (a replacement replica's first step) and again whenever the per-proc batch changes shape (it does, with
    the number of live replicas). Context parallelism shards its inputs with a block mask of its own, through
    torch's own compiled `create_block_mask` (`_context_parallel._attention`), which is built eagerly too: that
    compile made a CP replica's first step take 17 s instead of 1.4 s on 2 cores, a replacement's included."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common import attention

    attention.FlexAttention._compiled_flex_attn = _flex_attention_by_sdpa_impl
    attention._compiled_create_block_mask = create_block_mask
    cp_attention._compiled_create_block_mask = create_block_mask  # torch compiles it only while it is None
    _determinism_keeps_sdpa()


def _determinism_keeps_sdpa() -> None:
    """torchtitan 0.3.0's `set_determinism` (`--debug.deterministic`, run inside `Trainer.__init__`) installs its
    own `FlexAttention._compiled_flex_attn` (a fresh `torch.compile(flex_attention)`), replacing the stand-in
    above, so the first backward dies with "FlexAttention does not support backward on CPU". Let it set its
    flags and seeds, then put the stand-in back: SDPA's CPU kernels are deterministic, and the stand-in is
    never compiled, so there is no autotuning for torchtitan's replacement to switch off."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common import attention

    set_determinism = dist_utils.set_determinism

    def set_determinism_keeping_sdpa(*args, **kwargs):
        set_determinism(*args, **kwargs)
        attention.FlexAttention._compiled_flex_attn = _flex_attention_by_sdpa_impl

    dist_utils.set_determinism = set_determinism_keeping_sdpa


def _flex_attention_by_sdpa_impl(query, key, value, *, score_mod=None, block_mask=None, scale=None,
                                 enable_gqa=False, return_aux=None, kernel_options=None):
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None or (return_aux is not None and any(return_aux)):
        raise ValueError(
            "monarch_plugin's CPU FlexAttention stand-in (torch 2.13 has no FlexAttention backward on CPU) "
            "covers mask_mod attention only, not score_mod or auxiliary outputs: use a model without them "
            "on CPU"
        )
    mask = None
    if block_mask is not None:
        batch = block_mask.shape[0] if block_mask.shape[0] == query.shape[0] else 1
        mask = create_mask(block_mask.mask_mod, batch, 1, query.shape[-2], key.shape[-2], device=query.device)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                           enable_gqa=enable_gqa)
    return out, AuxOutput()


def force_sum_reduction(model: torch.nn.Module) -> None:
    """torchtitan 0.3.0 sets every FSDP module's gradient divide factor to 1 (it normalises the loss by the
    global token count itself); torch 2.13's FSDP2 then reduce-scatters with `ReduceOp.PREMUL_SUM(1.0)`,
    which gloo does not implement. Ask FSDP for a plain SUM instead: with a factor of 1 it is the same sum."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
