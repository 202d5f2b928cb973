"""The HF front end's parts that need no replicas, on a real `Trainer`: each refusal of the Trainer's arguments in
HF's own words, the training loader it builds around the runtime's sampler and cuts by the live group, HF's resume
position as the sampler's cursor, and the checkpoint it names for a run that stops."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch.utils.data import Dataset  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from monarch_plugin import ElasticConfig  # noqa: E402
from monarch_plugin.integrations.hf import MonarchElasticCallback  # noqa: E402
from monarch_plugin.integrations.hf.callback import _HealState  # noqa: E402
from monarch_plugin.worker import context  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Numbers(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.tensor([float(i)]), "labels": torch.tensor([float(i)])}


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}


@pytest.fixture
def replica(monkeypatch, tmp_path):
    """Make this process replica 0 of a run with these settings, as `monarch-run` starts it."""

    def start(replicas: int = 2, procs: int = 1, **settings) -> None:
        config = ElasticConfig(replicas=replicas, procs_per_replica=procs, events_path=str(tmp_path / "ev.jsonl"),
                               **settings)
        monkeypatch.setattr(context, "_current", context.WorkerContext(
            replica_id=0, local_rank=0, procs_per_replica=procs, initial=True, config=config,
            store_host="127.0.0.1", store_port=1))

    return start


def _trainer(tmp_path, callback: MonarchElasticCallback, samples: int = 12, **args) -> Trainer:
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, **args)
    return Trainer(model=Regression(), args=args, train_dataset=Numbers(samples), callbacks=[callback])


def test_under_plain_python_the_callback_is_inactive(tmp_path):
    callback = MonarchElasticCallback()
    _trainer(tmp_path, callback)
    assert not callback.active and callback.num_replicas == 1 and callback.is_main_replica


@pytest.mark.parametrize("settings, args, message", [
    ({"max_replicas": 5}, {}, r"per_device_train_batch_size=2 x 2 replica\(s\) is a global batch of 4 samples, which "
                              r"cannot be split over up to 5 replicas: raise per_device_train_batch_size"),
    ({"batch_policy": "constant_local"}, {}, r"--batch-policy: ElasticLoop's own settings.* drop the flags"),
    ({"sync_every": 20}, {}, r"--sync-every: ElasticLoop's own settings.*semi-synchronous training is ElasticLoop's "
     r"only, for now\): drop the flags"),
    ({"procs": 2}, {}, r"one process per replica, got --procs-per-replica 2: drop the flag"),
    ({}, {"auto_find_batch_size": True}, r"auto_find_batch_size=True is not supported by MonarchElasticCallback \(it "
                                         r"changes the global batch mid-run\): remove it"),
    ({}, {"train_sampling_strategy": "group_by_length"}, r"use 'random' or 'sequential'"),
])
def test_arguments_the_elastic_step_cannot_honour_are_refused_when_the_trainer_is_built(tmp_path, replica, settings,
                                                                                       args, message):
    replica(**settings)
    with pytest.raises(ValueError, match=message):
        _trainer(tmp_path, MonarchElasticCallback(), **args)


def test_a_last_batch_too_short_for_every_replica_is_refused_naming_dataloader_drop_last(tmp_path, replica):
    replica(max_replicas=3)  # 10 samples in global batches of 4 leave 2 for up to 3 replicas
    trainer = _trainer(tmp_path, MonarchElasticCallback(), samples=10)
    with pytest.raises(ValueError, match=r"over 10 samples each epoch ends with a batch of 2, which cannot be split "
                                         r"over up to 3 replicas: .* TrainingArguments\(dataloader_drop_last=True\)"):
        trainer.get_train_dataloader()
    _trainer(tmp_path, MonarchElasticCallback(), samples=10, dataloader_drop_last=True).get_train_dataloader()


def test_the_training_loader_hands_each_replica_its_share_of_each_global_batch_for_the_live_group(tmp_path, replica):
    replica()
    callbacks = [MonarchElasticCallback(), MonarchElasticCallback()]
    loaders = [_trainer(tmp_path, c, seed=3).get_train_dataloader() for c in callbacks]
    for rank, callback in enumerate(callbacks):
        callback._tx = types.SimpleNamespace(rank=rank, world=2)  # the generation this replica is in
    epoch = [list(loader.batch_sampler) for loader in loaders]  # 3 global batches of 4: 2 samples each
    assert [len(share) for shares in epoch for share in shares] == [2] * 6
    together = [i for j in range(3) for shares in epoch for i in shares[j]]
    assert sorted(together) == list(range(12)) and together != list(range(12))  # one permutation, each once
    callbacks[0]._tx = types.SimpleNamespace(rank=0, world=1)  # its peer died: the survivor trains whole batches
    assert [len(share) for share in loaders[0].batch_sampler] == [4, 4, 4]


def test_hfs_resume_position_is_the_samplers_cursor_after_the_committed_steps(tmp_path, replica):
    replica()
    callback = MonarchElasticCallback()
    # 10 samples in global batches of 4: 3 micro-batches an epoch, the last of 2; 2 steps an epoch, the last of 1.
    _trainer(tmp_path, callback, samples=10, gradient_accumulation_steps=2).get_train_dataloader()
    assert [(c["epoch"], c["cursor"]) for c in map(callback._cursor_at, range(5))] == [
        (0, 0), (0, 8), (1, 0), (1, 8), (2, 0)]


def test_a_run_that_stops_names_the_newest_checkpoint_of_output_dir(tmp_path, replica):
    replica()
    callback = MonarchElasticCallback()
    _trainer(tmp_path, callback)
    assert callback._newest_checkpoint() is None
    for step in (5, 12, 9):
        (tmp_path / "out" / f"checkpoint-{step}").mkdir(parents=True)
    assert callback._newest_checkpoint() == str(tmp_path / "out" / "checkpoint-12")


def test_the_heal_state_counts_the_callbacks_committed_steps(tmp_path, replica):
    replica()
    callback = MonarchElasticCallback()
    _trainer(tmp_path, callback)
    state = _HealState(callback)
    callback._step = 7
    assert state.step == 7
    state.step = 9  # a heal handed this replica the donor's steps
    assert callback._step == 9
