"""`MonarchFSDPStrategy`: FSDP inside each replica, elastic data parallel across replicas.

A replica is `procs_per_replica` procs that shard one copy of the model with FSDP2 (`fully_shard`) over their
own gloo/NCCL group; replicas are what the runtime adds and removes. So the unit of failure is a replica: when
one of its procs dies, its shards are gone with it, the controller kills its siblings, the other replicas drop
the step in flight and go on, and a whole new replica is spawned. Each new proc heals from the proc holding the
same shard in a live replica (the runtime's cross-replica groups pair procs by local rank), so no proc ever
holds more than its shard.

With `tensor_parallel_size` > 1 a replica is a 2-D mesh, `("data_parallel", "tensor_parallel")`, the shape of
Lightning's `ModelParallelStrategy`: the LightningModule's `configure_model` reads it as `self.device_mesh` and
applies its TP plan over `"tensor_parallel"` and FSDP over `"data_parallel"`; the procs of one TP group read the
same samples. A heal checks each shard's mesh dimensions and placements against the donor's before moving it.

Everything else is `MonarchStrategy`'s: the step transaction, the redo of an interrupted window, the global
cursor, checkpoints by one writer. What differs: FSDP assigns its sharded gradients after its own
reduce-scatter (no autograd hook fires), so the cross-replica reduction runs when backward returns; the
LightningModule's steps run through its forward (Lightning's forward redirection) so FSDP's hooks gather the
parameters; and checkpoints hold full, unsharded state, so they load into any layout, `strategy="ddp"` included.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

import monarch_plugin.integrations.lightning._lightning_hooks as _hooks
from monarch_plugin.integrations.lightning.strategy import MonarchStrategy
from monarch_plugin.worker.dtensors import is_dtensor

__all__ = ["MonarchFSDPStrategy"]


class MonarchFSDPStrategy(MonarchStrategy):
    """Elastic FSDP: ``Trainer(devices=N)`` procs as ``N // procs_per_replica`` FSDP replicas; survives dead workers.

    Args:
        procs_per_replica: procs that shard one copy of the model. A replica lives or dies whole.
        auto_wrap_policy: module classes that each become their own FSDP unit (e.g. ``{TransformerBlock}``), as
            in Lightning's ``FSDPStrategy``; the LightningModule itself is always the root unit.
        reshard_after_forward: free gathered parameters after forward and gather again in backward (FSDP's
            ZeRO-3 behaviour); False keeps them until backward (ZeRO-2, more memory, less communication).
        tensor_parallel_size: procs of a replica that split each layer (tensor parallelism), as in Lightning's
            ``ModelParallelStrategy``; it divides ``procs_per_replica``. Above 1 the replica's procs form the
            mesh ``("data_parallel", "tensor_parallel")`` that ``configure_model`` parallelizes the model over.
        **kwargs: everything `MonarchStrategy` takes (``min_replicas``, ``fault``, ``events_path``, ...);
            ``min_replicas`` and ``max_replicas`` count replicas, not procs.
    """

    strategy_name = "monarch_fsdp"

    def __init__(
        self,
        procs_per_replica: int = 2,
        auto_wrap_policy: Optional[Iterable[type[torch.nn.Module]]] = None,
        reshard_after_forward: bool = True,
        tensor_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(procs_per_replica, int) or procs_per_replica < 1:
            raise MisconfigurationException(
                f"MonarchFSDPStrategy(procs_per_replica={procs_per_replica!r}): give a positive number of procs"
            )
        tp = tensor_parallel_size
        if not isinstance(tp, int) or tp < 1 or procs_per_replica % tp:
            raise MisconfigurationException(
                f"MonarchFSDPStrategy(tensor_parallel_size={tensor_parallel_size!r}) must divide procs_per_replica="
                f"{procs_per_replica}: a replica's procs are its data-parallel x tensor-parallel mesh"
            )
        self.procs_per_replica = procs_per_replica
        self.tensor_parallel_size = tensor_parallel_size
        self.auto_wrap_policy = frozenset(auto_wrap_policy or ())
        self.reshard_after_forward = reshard_after_forward
        self.device_mesh = None
        """This replica's own procs, which shard the model; set in each replica when `fit` sets up."""

    # -- inside a replica -----------------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.tensor_parallel_size > 1 and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            from torch.distributed.device_mesh import init_device_mesh

            tp = self.tensor_parallel_size
            self.device_mesh = init_device_mesh(self.root_device.type, (self._ctx.procs_per_replica // tp, tp),
                                                mesh_dim_names=("data_parallel", "tensor_parallel"))
            self.lightning_module._device_mesh = self.device_mesh  # configure_model's `self.device_mesh`

    @override
    def setup(self, trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING and self._ctx is not None:
            self._shard(self.lightning_module)  # before the optimizers exist: they must hold the shards
        super().setup(trainer)

    def _data_parallel(self) -> tuple[int, int]:
        tp = self.tensor_parallel_size
        return self._ctx.local_rank // tp, self._ctx.procs_per_replica // tp

    def _shard(self, module: torch.nn.Module) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.tensor_parallel_size > 1:
            if not any(is_dtensor(p) for p in module.parameters()):
                raise MisconfigurationException(
                    f"MonarchFSDPStrategy(tensor_parallel_size={self.tensor_parallel_size}) leaves parallelizing "
                    "the model to the LightningModule, as Lightning's ModelParallelStrategy does: in "
                    "configure_model, apply your TP plan over self.device_mesh['tensor_parallel'] "
                    "(parallelize_module) and FSDP over self.device_mesh['data_parallel'] (fully_shard)"
                )
            return
        self.device_mesh = init_device_mesh(self.root_device.type, (self._ctx.procs_per_replica,))
        if isinstance(module, FSDPModule):
            return  # sharded by the user (in configure_model)
        for sub in list(module.modules())[1:]:
            if type(sub) in self.auto_wrap_policy:
                fully_shard(sub, mesh=self.device_mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(module, mesh=self.device_mesh, reshard_after_forward=self.reshard_after_forward)

    _overlap = False  # FSDP assigns its sharded gradients after its own reduce-scatter: reduced in `backward`

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """FSDP has reduce-scattered within the replica when backward returns; reduce across replicas now, so
        clipping and `on_before_optimizer_step` see the global gradient, as under DDP."""
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._tx is not None:
            self._tx.reducer.backward_done()
        return out

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        args = self._elastic_batch(args)
        with self.precision_plugin.train_step_context():
            return self._through_forward("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._through_forward("validation_step", *args, **kwargs)

    def _through_forward(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a step method as the root module's forward, so FSDP gathers the parameters around it."""
        module = self.lightning_module
        if self.device_mesh is None:
            return getattr(module, method)(*args, **kwargs)
        return self._forward_redirection(module, module, method, *args, **kwargs)

    # -- state: full tensors in and out ------------------------------------------------------------------------

    @override
    def full_state_dict(self) -> dict:
        """Gathered on every proc of the replica (a collective); held by its first proc, empty elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.device_mesh is None:
            return super().full_state_dict()
        return get_model_state_dict(self.lightning_module,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.full_state_dict()

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if self.device_mesh is None:
            return super().optimizer_state(optimizer)
        return get_optimizer_state_dict(self.lightning_module, _hooks.unwrap_optimizer(optimizer),
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a checkpoint's full tensors load into the shards, which exist only after setup

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.lightning_module, checkpoint["state_dict"],
                             options=StateDictOptions(full_state_dict=True, strict=strict))

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        # Not strict: an optimizer keeps no state for some parameters (SGD without momentum), legitimately.
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            set_optimizer_state_dict(self.lightning_module, optimizer, state,
                                     options=StateDictOptions(full_state_dict=True, strict=False))
