"""Durable checkpoints alone: which checkpoint is the newest complete one, pruning that never loses it, the run's
what reading unpickles, the writer thread.

The e2e half (a lane's write failing then the controller SIGKILLed, two runs on one directory, a resume on another
shape) is in tests/e2e/test_checkpoints.py.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import time

import pytest
import torch
from torch import nn

from monarch_plugin import ConfigError, ElasticConfig, ElasticLoop
from monarch_plugin.storage.checkpoint import DIGESTS, clean_stale, damage, newest, newest_written, prune, step_path
from monarch_plugin.worker.checkpoint_writer import CheckpointWriter
from monarch_plugin.worker import dcp_io
from monarch_plugin.worker.dcp_io import read_metadata, save

pytestmark = pytest.mark.timeout(60)


def _write(directory, step: int, complete: bool = True) -> str:
    path = step_path(str(directory), step)
    save({"w": torch.full((3,), float(step)), "loop": {"step": step}}, path, None)
    if not complete:  # what a write cut off before DCP's coordinator wrote the metadata leaves
        os.remove(os.path.join(path, ".metadata"))
    return path


def test_only_a_checkpoint_whose_metadata_is_in_place_is_taken(tmp_path):
    assert newest(str(tmp_path / "missing")) is None and newest(str(tmp_path)) is None
    _write(tmp_path, 5)
    ten = _write(tmp_path, 10)
    _write(tmp_path, 15, complete=False)
    assert newest(str(tmp_path)) == ten
    assert newest_written([ten, step_path(str(tmp_path), 15), step_path(str(tmp_path), 5)]) == ten
    assert newest_written([step_path(str(tmp_path), 15)]) is None and newest_written([]) is None


def test_pruning_keeps_the_newest_complete_checkpoints_and_never_the_newest_complete_one(tmp_path):
    for step in (2, 4, 6):
        _write(tmp_path, step)
    _write(tmp_path, 8, complete=False)  # a lane's write failed: its replica's other lane wrote, no metadata
    assert prune(str(tmp_path), keep=1) == [step_path(str(tmp_path), 2), step_path(str(tmp_path), 4)]
    assert newest(str(tmp_path)) == step_path(str(tmp_path), 6)  # step 8 never replaced it
    assert sorted(os.listdir(tmp_path)) == ["step00000006", "step00000008"]  # 8 may still be being written
    _write(tmp_path, 10)
    assert prune(str(tmp_path), keep=1) == [step_path(str(tmp_path), 6), step_path(str(tmp_path), 8)]


def test_stale_writes_are_cleaned_when_a_run_takes_the_directory(tmp_path):
    _write(tmp_path, 4)
    _write(tmp_path, 6, complete=False)
    (tmp_path / "model.pt.tmp1234").write_bytes(b"half a file")
    (tmp_path / "notes.txt").write_text("not ours")
    assert sorted(map(os.path.basename, clean_stale(str(tmp_path)))) == ["model.pt.tmp1234", "step00000006"]
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "step00000004"]


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_reading_a_checkpoint_runs_no_code_from_it(tmp_path):
    path = _write(tmp_path, 2)
    assert "w" in read_metadata(path).state_dict_metadata
    with open(os.path.join(path, ".metadata"), "wb") as f:  # a forged index
        pickle.dump(_Boom(), f)
    with pytest.raises(ValueError, match="names posix.system"):
        read_metadata(path)
    forged = step_path(str(tmp_path), 4)  # a forged non-tensor item: DCP stores those as pickles
    state = _loop(2).checkpoint_state()
    state["loop"]["step"] = _Boom()
    save(state, forged, None)
    with pytest.raises(ValueError, match="holds an object that loading would run code for .*posix.system"):
        _loop(2).resume(forged)


def test_the_writer_keeps_every_nth_step_from_a_copy_taken_at_the_step_and_prunes_after(tmp_path, monkeypatch):
    emitted = []
    writer = CheckpointWriter(str(tmp_path), every_steps=5, every_s=0, coordinator=True, keep=1, bound_s=60,
                              emit=lambda kind, **fields: emitted.append((kind, fields)))
    assert [s for s in range(1, 12) if writer.due(s)] == [5, 10]
    assert [s for s in range(4, 25, 4) if writer.due(s, 4)] == [8, 12, 16, 20]  # a sync's round of 4: the first past each
    weights = torch.zeros(3)
    writer.write(5, {"w": weights}, None)
    weights += 1  # the training step goes on while the copy is written
    writer.wait()
    assert torch.equal(_read_w(str(tmp_path / "step00000005")), torch.zeros(3))
    disk = threading.Event()  # a slow disk: the write of step 10 goes on until it is set
    real_save = dcp_io.save
    monkeypatch.setattr(dcp_io, "save", lambda *a: (disk.wait(30), real_save(*a)))
    writer.write(10, {"w": weights}, None)
    assert writer.busy()  # ElasticLoop skips a write due now (`checkpoint_skipped`) rather than wait
    disk.set()
    writer.wait()
    assert not writer.busy() and os.listdir(tmp_path) == ["step00000010"]
    assert [kind for kind, _ in emitted] == ["checkpoint", "checkpoint", "checkpoint_pruned"]
    assert emitted[0][1]["step"] == 5 and emitted[0][1]["periodic"]


def _read_w(path: str) -> torch.Tensor:
    return dcp_io.load({"w": torch.empty(3)}, path, None)["w"]


def test_a_failed_write_is_reported_and_training_goes_on(tmp_path):
    (tmp_path / "file").write_text("")
    emitted = []
    writer = CheckpointWriter(str(tmp_path / "file"), every_steps=1, every_s=0, coordinator=True, bound_s=60,
                              emit=lambda kind, **fields: emitted.append(kind))
    writer.write(1, {"w": torch.zeros(1)}, None)
    writer.wait()
    assert emitted == ["checkpoint_failed"]


def test_a_write_that_hangs_is_given_up_on_and_nothing_is_written_over_it(tmp_path):
    """A filesystem that stopped answering (a hung NFS mount) holds a write forever: here the file it opens is a FIFO
    nobody reads, whose open blocks as such a mount's does. The loop's wait for it ends at its bound, saying so."""
    os.makedirs(tmp_path / "step00000001")
    os.mkfifo(tmp_path / "step00000001" / "__0_0.distcp")
    emitted = []
    writer = CheckpointWriter(str(tmp_path), every_steps=1, every_s=0, coordinator=True, bound_s=0.5,
                              emit=lambda kind, **fields: emitted.append((kind, fields)))
    writer.write(1, {"w": torch.zeros(1)}, None)
    started = time.monotonic()
    writer.wait()
    assert 0.5 <= time.monotonic() - started < 5
    [(kind, fields)] = emitted
    assert kind == "checkpoint_failed" and fields["step"] == 1 and "did not finish in 0.5 s" in fields["error"]
    writer.write(2, {"w": torch.zeros(1)}, None)  # still busy: not started over the hung one
    assert writer.busy() and not os.path.exists(tmp_path / "step00000002")
    loop = _loop(4)
    loop._checkpoints = writer  # a stop's write and a restore's load would run on the group the hung write holds
    for attempt, what in ((lambda: loop._write_checkpoint(1), "write the stop's checkpoint"),
                          (lambda: loop._restore(str(tmp_path / "step00000001")), "restore a checkpoint")):
        with pytest.raises(RuntimeError, match=f"cannot {what}: this proc's periodic checkpoint write has not "
                                               "finished"):
            attempt()
    with open(tmp_path / "step00000001" / "__0_0.distcp", "rb") as fifo:  # the mount answers again
        fifo.read()
    for _ in range(20):
        writer.wait()
    assert not writer.busy()


@pytest.mark.parametrize("kwargs, message", [
    (dict(checkpoint_steps=-1), "`checkpoint_steps` must be 0 or more"),
    (dict(checkpoint_interval_s=-1.0), "`checkpoint_interval_s` must be 0 or more seconds"),
    (dict(checkpoint_interval_s=30.0, procs_per_replica=2), "use `checkpoint_steps`"),
    (dict(resume="/nonexistent/step00000005"), "is not a complete checkpoint"),
])
def test_bad_checkpoint_settings_name_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ElasticConfig(**kwargs)


def _loop(width: int, momentum: float = 0.9) -> ElasticLoop:
    model = nn.Linear(width, 2)
    return ElasticLoop(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum), dataset_size=8,
                       global_batch_size=4, max_steps=2)


def test_a_checkpoint_round_trips_and_one_of_another_model_is_refused_naming_the_fix(tmp_path, monkeypatch):
    first = _loop(4)
    first.model(torch.randn(3, 4)).sum().backward()
    first.optimizer.step()
    first.step, first.sampler.cursor = 7, 4
    path = step_path(str(tmp_path), 7)
    save(first.checkpoint_state(), path, None)
    torch.manual_seed(123)
    expected = torch.rand(2)
    second = _loop(4)
    assert second.resume(path) and second.step == 7 and second.sampler.cursor == 4
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), second.model.parameters()))
    momentum = [s["momentum_buffer"] for s in second.optimizer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(momentum, [s["momentum_buffer"] for s in first.optimizer.state.values()]))
    assert not torch.equal(torch.rand(2), expected)  # the generators are those the checkpoint held
    with pytest.raises(ValueError, match=r"is not of this model and optimizer .* drop `resume`"):
        _loop(5).resume(path)
    monkeypatch.chdir(tmp_path)
    assert not _loop(4).resume("auto")  # "auto": none in ./checkpoints, beside ./monarch_events.jsonl


def test_an_fsspec_url_is_written_found_pruned_and_resumed_as_a_local_path_is():
    pytest.importorskip("fsspec")
    directory = "memory://monarch-plugin-test/ckpt"
    first = _loop(4)
    for step in (2, 4, 6):
        first.step = step
        save(first.checkpoint_state(), step_path(directory, step), None)
    assert newest(directory) == f"{directory}/step00000006"
    assert prune(directory, keep=1) == [f"{directory}/step00000002", f"{directory}/step00000004"]
    second = _loop(4)
    assert second.resume(newest(directory)) and second.step == 6
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), second.model.parameters()))
    assert ElasticConfig(resume=newest(directory)).resume == f"{directory}/step00000006"  # not a local path: found on load


def _largest(path: str) -> str:
    return max((os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp")), key=os.path.getsize)


def test_a_damaged_checkpoint_is_named_so_and_auto_passes_over_it_for_the_newest_intact_one(tmp_path, caplog):
    """DCP has no checksum: a file cut short fails its load as "another model", a bit flipped loads without a word.
    The digests written with each checkpoint tell both, naming the file."""
    paths = {}
    for step in (2, 4, 6, 8):
        loop = _loop(4)
        loop.step = step
        paths[step] = step_path(str(tmp_path), step)
        save(loop.checkpoint_state(), paths[step], None)
    digests = json.loads((tmp_path / "step00000008" / DIGESTS).read_text())
    name = os.path.basename(_largest(paths[8]))
    assert digests["algorithm"] == "sha256" and set(digests["files"]) == {name}
    assert digests["files"][name]["bytes"] == os.path.getsize(_largest(paths[8]))
    assert all(damage(p) is None for p in paths.values())

    with open(_largest(paths[8]), "r+b") as f:  # a low bit flipped in each of four bytes: bit rot, a bad DMA
        for at in (100, 200, 300, 400):
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 1]))
    size = os.path.getsize(_largest(paths[6]))
    os.truncate(_largest(paths[6]), size // 2)  # cut short: a failing disk, a half-synced shared filesystem
    os.remove(_largest(paths[4]))
    assert damage(paths[8]).startswith(f"{name} changed since it was written (its SHA-256 is not the one written")
    assert damage(paths[6]) == f"{name} is cut short: {size // 2} of the {size} bytes written"
    assert damage(paths[4]) == f"{name} is missing"
    skipped = []
    assert newest(str(tmp_path), skipped=lambda p, why: skipped.append(p)) == paths[2]
    assert skipped == [paths[8], paths[6], paths[4]]
    assert newest_written(list(paths.values())[1:]) is None  # what a run wrote, none of it intact
    # Mid-run, the controller checks sizes only (reading the whole checkpoint would hold up its decisions): the
    # flipped bits pass, a file cut short or missing does not.
    assert newest_written(list(paths.values())[1:], hashed=False) == paths[8]
    assert damage(paths[6], hashed=False) == f"{name} is cut short: {size // 2} of the {size} bytes written"

    with pytest.raises(ValueError, match=r"step00000008 is damaged: .* changed since it was written.*'auto' for the "
                                         "newest intact one"):
        _loop(4).resume(paths[8])
    with caplog.at_level("WARNING", logger="monarch_plugin"):
        resumed = _loop(4)
        resumed.config.checkpoint_dir = str(tmp_path)
        assert resumed.resume("auto") and resumed.step == 2
    assert [r.getMessage().split(":")[0] for r in caplog.records if r.name == "monarch_plugin"] == [
        f"the checkpoint {p} is damaged" for p in skipped]
    record = tmp_path / "step00000002" / DIGESTS
    intact = record.read_text()
    record.write_text(json.dumps({"algorithm": "sha256", "files": {name: {"bytes": size}}}))  # torn, or forged
    assert damage(paths[2]).startswith(f"its {DIGESTS} cannot be read (KeyError")
    data = _largest(paths[2])
    os.remove(data)
    os.mkdir(data)  # of the size written, but it cannot be read as a file: the read fails, and nothing escapes
    entry = json.loads(intact)
    entry["files"][name]["bytes"] = os.path.getsize(data)
    record.write_text(json.dumps(entry))
    assert damage(paths[2]).startswith(f"{name} cannot be read (IsADirectoryError")
    os.remove(record)  # written before digests were: nothing to check it by
    assert damage(paths[2]) is None
