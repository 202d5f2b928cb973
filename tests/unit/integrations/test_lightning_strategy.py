"""The Lightning strategy's parts that need no replicas, on a real `Trainer` and `LightningModule`: what it says in
the controller, the refusal of a batch size that leaves a device without samples in Lightning's words, the training
loader it builds around the runtime's sampler and cuts by the live group, the windows Lightning's epoch plan makes,
and the state a checkpoint and a heal carry."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from monarch_plugin import ElasticConfig  # noqa: E402
from monarch_plugin.integrations.lightning import MonarchStrategy  # noqa: E402
from monarch_plugin.integrations.lightning.strategy import _HealState  # noqa: E402
from monarch_plugin.worker import context  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_in_the_controller_the_strategy_is_rank_zero_of_its_own_world_and_cannot_train_itself():
    strategy = MonarchStrategy()
    assert strategy.is_global_zero and strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    with pytest.raises(RuntimeError, match=r"call trainer.fit\(...\) from your script"):
        strategy.setup_environment()


def _fitting(tmp_path, replicas: int = 2, accumulate: int = 1, planned: int = 100, **settings) -> MonarchStrategy:
    """A strategy as `fit` holds it inside replica 0 of a run with these settings, at the start of its training data,
    in a generation of two replicas; Lightning plans `planned` batches an epoch."""
    strategy = MonarchStrategy()
    trainer = pl.Trainer(accelerator="cpu", devices=replicas, strategy=strategy, accumulate_grad_batches=accumulate,
                         logger=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    strategy.connect(BoringModel())
    strategy.lightning_module.trainer = trainer
    trainer.training = True
    trainer.fit_loop.max_batches = planned
    config = ElasticConfig(replicas=replicas, events_path=str(tmp_path / "ev.jsonl"), **settings)
    strategy._ctx = context.WorkerContext(replica_id=0, local_rank=0, procs_per_replica=1, initial=True, config=config,
                                          store_host="127.0.0.1", store_port=1)
    strategy._tx = types.SimpleNamespace(rank=0, world=2)  # the generation this replica is in
    return strategy


def test_a_batch_size_that_leaves_a_device_without_samples_is_refused_naming_drop_last(tmp_path):
    strategy = _fitting(tmp_path, max_replicas=3)  # 10 samples in global batches of 4 leave 2 for up to 3 replicas
    with pytest.raises(MisconfigurationException, match=(
            r"a global batch of 4 \(batch_size 2 x 2 data-parallel devices\) over 10 samples leaves some of up to 3 "
            r"devices without a sample in a step: raise batch_size, or pass drop_last=True to the training DataLoader")):
        strategy.process_dataloader(DataLoader(range(10), batch_size=2))
    strategy.process_dataloader(DataLoader(range(10), batch_size=2, drop_last=True))


def test_the_training_loader_hands_this_replica_its_share_of_each_global_batch_for_the_live_group(tmp_path):
    strategy = _fitting(tmp_path)
    loader = strategy.process_dataloader(DataLoader(range(12), batch_size=2))
    assert [len(batch) for batch in loader] == [2, 2, 2]
    strategy._tx = types.SimpleNamespace(rank=0, world=1)  # its peer died: the survivor trains whole batches
    assert [len(batch) for batch in loader] == [4, 4, 4]
    assert loader.state_dict() == {"sampler": strategy._sampler.state_dict(), "step": 0}


def test_a_window_is_accumulate_grad_batches_micro_batches_and_never_crosses_the_epoch_lightning_plans(tmp_path):
    strategy = _fitting(tmp_path, accumulate=2, planned=5)  # limit_train_batches=5, say: 5 of the data's 6
    strategy.process_dataloader(DataLoader(range(24), batch_size=2))
    windows = []
    while strategy._sampler.epoch == 0:
        window = strategy._window.batches()
        windows.append(len(window))
        strategy._sampler.advance(4, len(window))
        if sum(windows) == 5:  # Lightning ends the epoch here; the next starts a new permutation
            strategy._sampler.set_epoch(1)
    assert windows == [2, 2, 1]
    assert strategy._window.weight() == 0.5 and len(strategy._window.share(0)) == 2


def test_the_heal_state_counts_the_strategys_committed_steps(tmp_path):
    strategy = _fitting(tmp_path)
    state = _HealState(strategy)
    strategy._step = 7
    assert state.step == 7
    state.step = 9  # a heal handed this replica the donor's steps
    assert strategy._step == 9
