"""Durable checkpoint files alone: atomic writes, which checkpoint is the newest complete one, the writer thread.

The e2e half (a controller SIGKILLed, `--resume auto` on another replica count) is in test_failure_policies.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from monarch_plugin import ConfigError, ElasticConfig
from monarch_plugin.checkpoint import CheckpointWriter, file_name, lane_file, newest, newest_written, save

pytestmark = pytest.mark.timeout(60)


def test_only_a_checkpoint_with_every_lane_in_place_is_taken_and_a_torn_write_never(tmp_path):
    for step, lanes in ((5, (0, 1)), (10, (0, 1)), (15, (0,))):  # step 15: lane 1 never got written
        for lane in lanes:
            save({"step": step, "lane": lane}, str(tmp_path / file_name(step, lane, 2)))
    (tmp_path / f"{file_name(20, 0, 2)}.tmp123").write_bytes(b"half a checkpoint")  # a crash mid-write
    (tmp_path / f"{file_name(20, 1, 2)}.tmp123").write_bytes(b"half a checkpoint")
    found = newest(str(tmp_path), lanes=2)
    assert found == str(tmp_path / "step00000010-local0-of2.pt")
    assert torch.load(lane_file(found, 1))["lane"] == 1 and torch.load(found)["step"] == 10
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p and "step00000005" in p]  # renamed into place


def test_a_run_restores_only_a_checkpoint_it_recorded_writing_whole_and_still_on_disk(tmp_path):
    recorded = []
    for step, lanes in ((5, (0, 1)), (10, (0, 1)), (15, (0,))):  # step 15: lane 1 never got written
        for lane in lanes:
            recorded.append(str(tmp_path / file_name(step, lane, 2)))
            save({"step": step}, recorded[-1])
    save({"step": 20}, str(tmp_path / file_name(20, 0, 2)))  # another run's, in the same directory
    save({"step": 20}, str(tmp_path / file_name(20, 1, 2)))
    assert newest_written(recorded, lanes=2) == str(tmp_path / file_name(10, 0, 2))
    os.remove(tmp_path / file_name(10, 1, 2))  # pruned since
    assert newest_written(recorded, lanes=2) == str(tmp_path / file_name(5, 0, 2))
    assert newest_written(recorded, lanes=1) is None and newest_written([], lanes=2) is None


def test_no_checkpoint_yet_and_checkpoints_of_another_replica_size(tmp_path):
    assert newest(str(tmp_path / "missing"), lanes=1) is None
    assert newest(str(tmp_path), lanes=1) is None
    save({}, str(tmp_path / file_name(5, 0, 1)))
    with pytest.raises(ConfigError, match=r"replicas of \[1\] proc\(s\), and this run's have 2: resume with "
                                          r"`procs_per_replica` 1"):
        newest(str(tmp_path), lanes=2)
    with pytest.raises(ConfigError, match="is not a checkpoint file of this runtime"):
        lane_file(str(tmp_path / "model.pt"), 0)


def test_the_writer_keeps_every_nth_step_from_a_copy_taken_at_the_step(tmp_path):
    emitted = []
    writer = CheckpointWriter(str(tmp_path), every_steps=5, every_s=0, lane=0, lanes=1,
                              emit=lambda kind, **fields: emitted.append((kind, fields)))
    assert [s for s in range(1, 12) if writer.due(s)] == [5, 10]
    weights = torch.zeros(3)
    writer.write(5, {"w": weights, "step": 5})
    weights += 1  # the training step goes on while the copy is written
    writer.wait()
    assert torch.equal(torch.load(tmp_path / file_name(5, 0, 1))["w"], torch.zeros(3))
    assert emitted[0][0] == "checkpoint" and emitted[0][1]["step"] == 5 and emitted[0][1]["periodic"]


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    writer = CheckpointWriter(str(tmp_path), every_steps=5, every_s=0, lane=1, lanes=2, emit=lambda *a, **k: None,
                              keep=2)
    save({}, str(tmp_path / file_name(5, 0, 2)))  # another proc's shard: that proc prunes its own
    for step in (5, 10, 15):
        writer.write(step, {"step": step})
    writer.wait()
    assert sorted(os.listdir(tmp_path)) == [file_name(5, 0, 2), file_name(10, 1, 2), file_name(15, 1, 2)]


def test_a_failed_write_is_reported_and_training_goes_on(tmp_path):
    (tmp_path / "file").write_text("")
    emitted = []
    writer = CheckpointWriter(str(tmp_path / "file"), every_steps=1, every_s=0, lane=0, lanes=1,
                              emit=lambda kind, **fields: emitted.append(kind))
    writer.write(1, {"w": torch.zeros(1)})
    writer.wait()
    assert emitted == ["checkpoint_failed"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(checkpoint_steps=-1), "`checkpoint_steps` must be 0 or more"),
    (dict(checkpoint_interval_s=-1.0), "`checkpoint_interval_s` must be 0 or more seconds"),
    (dict(checkpoint_interval_s=30.0, procs_per_replica=2), "use `checkpoint_steps`"),
    (dict(resume="/nonexistent/step00000005-local0-of1.pt"), "no checkpoint file"),
])
def test_bad_checkpoint_settings_name_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ElasticConfig(**kwargs)


def test_a_checkpoint_of_another_model_is_refused_naming_the_fix(tmp_path, monkeypatch):
    from torch import nn

    from monarch_plugin import ElasticLoop

    def loop(width: int) -> ElasticLoop:
        model = nn.Linear(width, 2)
        return ElasticLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset_size=8, global_batch_size=4,
                           max_steps=2)

    path = str(tmp_path / file_name(2, 0, 1))
    save(loop(4).state_dict(), path)
    with pytest.raises(ValueError, match=r"is not of this model and optimizer .*size mismatch for weight.* drop "
                                         r"`resume`"):
        loop(5).resume(path)
    monkeypatch.chdir(tmp_path)
    assert loop(4).resume(path) and not loop(4).resume("auto")  # "auto": none in ./monarch_checkpoints
