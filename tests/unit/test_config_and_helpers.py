"""Pure helpers tested alone: config validation, backend choice, fault specs, sampler, heal planning.

Plus the CLI's bad-input paths, which must fail before anything is spawned.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from monarch_plugin import ConfigError, ElasticConfig, ElasticSampler, FaultSpec
from monarch_plugin.backend import resolve_backend
from monarch_plugin.config import cli_flag, field_docs, spell_fields
from monarch_plugin.procs.devices import plan_gpus
from monarch_plugin.errors import BackendUnavailableError
from monarch_plugin.sampler import share, shard_bounds, weight
from monarch_plugin.faults import parse_faults
from monarch_plugin.worker.heal import ASSUMED_BYTES_PER_S, HEAL_FLOOR_S, heal_bound_s, plan_heal, shares

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(replicas=2, min_replicas=3, max_replicas=2), "lower `min_replicas` or raise `max_replicas`"),
        (dict(replicas=0), "`replicas` must be a positive integer"),
        (dict(replicas=4, max_replicas=3), "must lie between"),
        (dict(backend="mpi"), "choose one of auto, gloo, nccl"),
        (dict(batch_policy="whatever"), "choose one of constant_global, constant_local"),
        (dict(scale_lr_with_replicas=True), "only applies to `batch_policy`='constant_local'"),
        (dict(collective_timeout_s=0), "positive number of seconds"),
        (dict(fault="explode:step=3"), "unknown fault mode"),
        (dict(fault="sigkill:replica=1"), "needs a step"),
        (dict(fault="sigkill:replica=1:step=3,boom:step=4"), "unknown fault mode 'boom'"),
    ],
)
def test_bad_config_names_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ElasticConfig(**kwargs)


_WRONG = {"int": "2", "float": "2.5", "str": 2, "bool": "yes", "list[str]": "tcp://10.0.0.2:26600",
          "dict[str, str]": {"OMP_NUM_THREADS": 1}}


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(ElasticConfig)])
def test_every_setting_of_the_wrong_type_is_refused_naming_it(name):
    kind = next(f.type for f in dataclasses.fields(ElasticConfig) if f.name == name).removesuffix(" | None")
    with pytest.raises(ConfigError, match=rf"^`{name}` must be ") as raised:
        ElasticConfig(**{name: _WRONG[kind]})
    assert raised.value.field == name


_FLOATS = [f.name for f in dataclasses.fields(ElasticConfig) if f.type == "float"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", _FLOATS)
def test_every_float_setting_refuses_nan_and_inf_naming_it(name, value):
    with pytest.raises(ConfigError, match=rf"^`{name}` must be a finite number, got {value!r}: ") as raised:
        ElasticConfig(**{name: value})
    assert raised.value.field == name
    assert len(_FLOATS) == 5  # a new float setting is covered here by its type, whatever its name


def test_monarch_run_refuses_a_nan_timeout_naming_its_flag(capsys):
    from monarch_plugin.cli import main

    assert main(["--collective-timeout", "nan", "x.py"]) == 2
    assert "--collective-timeout must be a finite number, got nan" in capsys.readouterr().err


@pytest.mark.parametrize("procs, batch, ok", [(1, 3, True), (2, 5, False), (2, 6, True)])
def test_elastic_loop_refuses_a_global_batch_that_leaves_a_proc_without_samples(tmp_path, monkeypatch, procs, batch,
                                                                                ok):
    import torch

    from monarch_plugin import ElasticLoop
    from monarch_plugin.worker import context

    config = ElasticConfig(replicas=3, procs_per_replica=procs, events_path=str(tmp_path / "ev.jsonl"))
    monkeypatch.setattr(context, "_current", context.WorkerContext(
        replica_id=0, local_rank=0, procs_per_replica=procs, initial=True, config=config, store_host="127.0.0.1",
        store_port=1))
    model = torch.nn.Linear(2, 1)

    def loop():
        return ElasticLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset_size=64,
                           global_batch_size=batch, max_steps=1)

    if ok:
        loop()
        return
    with pytest.raises(ValueError, match=r"global_batch_size 5 is smaller than max_replicas 3 x procs_per_replica 2: "
                                         r".*raise global_batch_size to 6 or more"):
        loop()


def test_a_config_error_names_its_field_in_each_front_ends_spelling():
    with pytest.raises(ConfigError) as raised:
        ElasticConfig(replicas=2, min_replicas=3, max_replicas=2)
    assert raised.value.field == "min_replicas"
    assert spell_fields(str(raised.value), cli_flag).startswith("--min-replicas (3) is larger than --max-replicas (2)")
    assert spell_fields("`backend`, `join_timeout_s` and `devices`", cli_flag) == (
        "--backend, --join-timeout and `devices`")  # not a runtime field: left as written


def test_monarch_run_takes_every_setting_with_its_docstring_and_default():
    from monarch_plugin.cli import build_parser, config_from_args

    parser = build_parser()
    assert config_from_args(parser.parse_args(["x.py"])) == ElasticConfig()
    text = " ".join(parser.format_help().split())
    for name, doc in field_docs().items():
        if name != "env":  # the workers' environment is the caller's own, as under torchrun
            assert cli_flag(name) in text and " ".join(doc.split()[:4]) in text, name
    ns = parser.parse_args(["--join-timeout", "12", "--backend", "gloo", "--batch-policy", "constant_local",
                            "--scale-lr-with-replicas", "train.py", "--lr", "3"])
    config = config_from_args(ns)
    assert (config.join_timeout_s, config.backend, config.scale_lr_with_replicas) == (12.0, "gloo", True)
    assert (ns.target, ns.args) == ("train.py", ["--lr", "3"])


def test_config_round_trips_through_the_worker_environment(monkeypatch):
    cfg = ElasticConfig(replicas=3, min_replicas=2, fault="sigkill:replica=1:step=4", env={"A": "1"})
    monkeypatch.setenv("MONARCH_PLUGIN_CONFIG", cfg.to_env()["MONARCH_PLUGIN_CONFIG"])
    assert ElasticConfig.from_env() == cfg


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


def test_each_replica_slot_sees_its_own_gpus():
    assert plan_gpus("cpu", 0, {}, slots=4, procs_per_replica=2) is None
    plan = plan_gpus("cuda", 8, {}, slots=3, procs_per_replica=2)
    assert [plan.env_for_slot(s) for s in range(3)] == [
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}, {"CUDA_VISIBLE_DEVICES": "4,5"}]
    # The controller's own narrowing is respected, on ROCm through the variable it was narrowed by.
    plan = plan_gpus("rocm", 3, {"HIP_VISIBLE_DEVICES": "5,6,7"}, slots=3, procs_per_replica=1)
    assert plan.env_for_slot(2) == {"HIP_VISIBLE_DEVICES": "7"}
    plan = plan_gpus("rocm", 2, {"CUDA_VISIBLE_DEVICES": "2,3"}, slots=2, procs_per_replica=1)
    assert plan.env_for_slot(1) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert plan_gpus("rocm", 2, {}, slots=2, procs_per_replica=1).env_for_slot(0) == {"HIP_VISIBLE_DEVICES": "0"}
    with pytest.raises(ConfigError, match=r"need 6 GPUs, but 4 are visible.*lower --replicas or --spares"):
        plan_gpus("cuda", 4, {}, slots=3, procs_per_replica=2)


def test_fault_spec_parsing():
    spec = FaultSpec.parse("sigkill:replica=1:step=20")
    assert (spec.mode, spec.replica, spec.step, spec.at) == ("sigkill", 1, 20, "step")
    assert spec.applies(1, 20) and not spec.applies(0, 20) and not spec.applies(1, 19)
    assert not spec.applies(1, 20, at="construct")
    assert FaultSpec.parse("raise:step=3").applies(7, 3)


def test_fault_points_and_lists():
    faults = parse_faults("sigkill:replica=1:step=5, stop:replica=3:at=construct,hang:replica=0:at=heal_donor:step=2")
    assert [(f.mode, f.replica, f.at, f.step) for f in faults] == [
        ("sigkill", 1, "step", 5), ("stop", 3, "construct", None), ("hang", 0, "heal_donor", 2)]
    construct, donor = faults[1], faults[2]
    assert construct.applies(3, 0, at="construct") and construct.applies(3, 99, at="construct")
    assert not construct.applies(3, 0, at="arrived") and not construct.applies(4, 0, at="construct")
    assert not donor.applies(0, 1, at="heal_donor") and donor.applies(0, 2, at="heal_donor")  # after step 2
    # Named replicas are hit even as replacements; unnamed faults only hit the replicas spawned at the start.
    assert construct.targets(3, initial=False) and not construct.targets(2, initial=True)
    unnamed = FaultSpec.parse("raise:step=3")
    assert unnamed.targets(0, initial=True) and not unnamed.targets(5, initial=False)
    one_proc = FaultSpec.parse("hang:replica=1:lane=1:step=5")
    assert one_proc.targets(1, initial=True, lane=1) and not one_proc.targets(1, initial=True, lane=0)
    assert parse_faults(None) == () and parse_faults("") == ()
    with pytest.raises(ConfigError, match="unknown fault point at='somewhere'.*choose one of step, arrived"):
        parse_faults("sigkill:replica=1:step=5,sigkill:at=somewhere")


def test_heal_bound_follows_the_state_size_and_the_measured_rate():
    assert heal_bound_s(1_000_000, None) == HEAL_FLOOR_S  # small state: the floor
    assert heal_bound_s(10**9, 1e9) == HEAL_FLOOR_S  # 1 GB at a measured 1 GB/s: 4 s, so the floor
    assert heal_bound_s(100 * 10**9, 1e9) == pytest.approx(400.0)  # a big state is not cut off at 60 s
    assert heal_bound_s(10**9, None) == pytest.approx(4 * 10**9 / ASSUMED_BYTES_PER_S)  # no rate measured yet


def test_shards_cover_the_batch_exactly():
    for n in range(0, 40):
        for world in range(1, 6):
            bounds = [shard_bounds(n, r, world) for r in range(world)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [e - s for s, e in bounds]
            assert max(sizes) - min(sizes) <= 1


def test_sampler_never_skips_or_repeats_across_resizes():
    sampler = ElasticSampler(100, shuffle=True, seed=3)
    seen: list[int] = []
    worlds = [3, 3, 2, 2, 4, 1, 3, 3, 3, 2, 2]
    for world in worlds:
        if sampler.epoch:
            break
        (batch,) = sampler.window(16)
        for rank in range(world):
            seen += share(batch, rank, world)
        assert sum(weight([batch], rank, world) for rank in range(world)) == pytest.approx(1.0)
        sampler.advance(16)
    assert sorted(seen) == list(range(100))


def test_a_window_of_micro_batches_stops_at_the_epoch_end_and_commits_whole():
    sampler = ElasticSampler(10, shuffle=False, drop_last=True)
    assert sampler.batches_per_epoch(3) == 3
    assert sampler.window(3, 2) == [[0, 1, 2], [3, 4, 5]]
    sampler.advance(3, 2)
    assert sampler.window(3, 2) == [[6, 7, 8]]  # the epoch's last whole micro-batch; sample 9 is dropped
    assert weight(sampler.window(3, 2), 0, 2) == pytest.approx(2 / 3)
    sampler.advance(3, 2)
    assert (sampler.epoch, sampler.cursor) == (1, 0)


def test_sampler_state_moves_the_cursor():
    a = ElasticSampler(50, seed=1)
    a.advance(8)
    a.advance(8)
    b = ElasticSampler(50, seed=1)
    b.load_state_dict(a.state_dict())
    assert b.window(8, 2) == a.window(8, 2)
    with pytest.raises(ValueError, match="same dataset"):
        ElasticSampler(49).load_state_dict(a.state_dict())


def test_heal_plan_picks_donors_at_the_newest_step():
    held = [True] * 4
    assert plan_heal([5, 5], [False, False], held[:2]) is None
    plan = plan_heal([5, 5, -1], [False, False, True], [True, True, False])
    assert (plan.donors, plan.recipients, plan.step) == ((0,), (2,), 5)
    assert plan_heal([5, 5, -1], [False, False, True], [True, True, False], max_donors=2).donors == (0, 1)
    plan = plan_heal([4, 5, 5, 5], [False, False, False, True], [True, True, True, False], max_donors=2)
    assert (plan.donors, plan.recipients) == ((1, 2), (0, 3))  # never one that is behind: a survivor dropped a step
    plan = plan_heal([0, 0, 0], [True, True, True], held[:3], max_donors=2)  # first generation: rank 0 alone seeds
    assert (plan.donors, plan.recipients) == ((0,), (1, 2))


def test_only_a_holder_of_the_runs_state_ever_serves_a_heal():
    # A newcomer that joined alone once (its donor died mid-heal) is not fresh, and may even be ahead: still no donor.
    plan = plan_heal([3, 9], [False, False], [True, False], max_donors=2)
    assert (plan.donors, plan.recipients, plan.step) == ((0,), (1,), 3)
    # A late initial replica (fresh, at step 0) that is not a holder, beside the holders: a recipient.
    plan = plan_heal([0, 7, 7], [True, False, False], [False, True, True], max_donors=1)
    assert (plan.donors, plan.recipients) == ((1,), (0,))
    # The first generation seeds from its lowest-rank holder, not from rank 0.
    plan = plan_heal([0, 0, 0], [True, True, True], [False, True, True])
    assert (plan.donors, plan.recipients) == ((1,), (0, 2))
    with pytest.raises(RuntimeError, match="no member of this generation holds the run's trained state"):
        plan_heal([0, 12], [True, False], [False, False])


def test_shares_split_the_tensors_by_bytes_without_cutting_one():
    assert shares([10, 10, 10, 10], 1) == [range(0, 4)]
    assert shares([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert shares([40, 1, 1, 1, 37], 2) == [range(0, 1), range(1, 5)]  # the nearer boundary: 40 / 40
    assert shares([100, 1], 3) == [range(0, 0), range(0, 1), range(1, 2)]  # one tensor outweighs the rest: empty
    sizes = [4096 * 1024 * 4, 4096 * 4, 1024 * 4096 * 4, 1024 * 4, 8] * 3  # an MLP's weights and Adam's moments
    split = shares(sizes, 2)
    assert [i for run in split for i in run] == list(range(len(sizes)))  # every tensor once, in order
    halves = [sum(sizes[i] for i in run) for run in split]
    assert abs(halves[0] - halves[1]) <= max(sizes)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--replicas", "2", "--min-replicas", "3", "x.py"], "lower --min-replicas or raise --max-replicas"),
        (["--replicas", "0", "x.py"], "--replicas must be a positive integer"),
        (["--replicas", "2", "does_not_exist.py"], "training script 'does_not_exist.py' not found"),
        (["--replicas", "2", "-m", "no_such_module_here"], "module 'no_such_module_here' not found"),
        (["--replicas", "2", "--fault", "boom:step=1", "x.py"], "unknown fault mode"),
        (["--backend", "mpi", "x.py"], "invalid choice: 'mpi'"),
    ],
)
def test_cli_rejects_bad_input_before_spawning(tmp_path, monkeypatch, capsys, args, message):
    from monarch_plugin.cli import main

    (tmp_path / "x.py").write_text("print('never runs')\n")
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["--events", "ev.jsonl", *args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "ev.jsonl").exists()  # nothing was spawned, not even the store


def test_monarch_run_command_exits_2_naming_the_fix(tmp_path):
    """The installed entry point, as a user's shell runs it (the cases above call its `main` in this process)."""
    result = subprocess.run([sys.executable, "-m", "monarch_plugin.cli", "--replicas", "2", "missing.py"],
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2 and "training script 'missing.py' not found" in result.stderr


def test_recovery_report_says_why_a_replacement_never_trained():
    from monarch_plugin.report import format_recovery, recoveries

    events = [
        {"ts": 1.0, "event": "quorum", "gen": 0, "members": [0, 1]},
        {"ts": 2.0, "event": "death", "replica": 1, "detected_by": "pidfd", "gen": 0},
        {"ts": 2.0, "event": "quorum", "gen": 1, "members": [0]},
        {"ts": 2.1, "event": "first_commit", "replica": 0, "gen": 1, "step": 5},
        {"ts": 5.0, "event": "spawn", "replica": 2, "seconds": 2.5, "pids": [9]},
        {"ts": 5.5, "event": "quorum", "gen": 2, "members": [0, 2]},
    ]
    assert "the run ended before it trained" in format_recovery(recoveries(events)[0])
    died = events + [{"ts": 6.0, "event": "death", "replica": 2, "detected_by": "pidfd", "gen": 2}]
    text = format_recovery(recoveries(died)[0])
    assert "died before it trained" in text and "None" not in text


def test_recovery_report_of_a_restore_says_what_is_trained_again_never_no_step_lost():
    """The last holder (replica 0) dies serving replica 2's heal: the next generation restores step 10's checkpoint
    though the run had committed 14 steps."""
    from monarch_plugin.report import format_recovery, format_summary, recoveries

    events = [
        {"ts": 1.0, "event": "quorum", "gen": 0, "members": [0, 1], "action": "train"},
        {"ts": 2.0, "event": "death", "replica": 1, "detected_by": "pidfd", "gen": 0},
        {"ts": 2.0, "event": "quorum", "gen": 1, "members": [0], "action": "train"},
        {"ts": 2.1, "event": "first_commit", "replica": 0, "gen": 1, "step": 8},
        {"ts": 2.6, "event": "spawn", "replica": 2, "seconds": 0.5, "pids": [9]},
        {"ts": 2.7, "event": "quorum", "gen": 2, "members": [0, 2], "action": "train"},
        {"ts": 2.8, "event": "death", "replica": 0, "detected_by": "pidfd", "gen": 2},
        {"ts": 2.8, "event": "quorum", "gen": 3, "members": [2], "action": "restore", "checkpoint": "/c/s10.pt"},
        {"ts": 2.8, "event": "restore", "gen": 3, "members": [2], "path": "/c/s10.pt", "step": 10},
        {"ts": 2.9, "event": "restored", "replica": 2, "gen": 3, "step": 10, "newest_seen": 14},
        {"ts": 3.0, "event": "first_commit", "replica": 2, "gen": 3, "step": 10},
    ]
    second = recoveries(events)[1]
    assert (second.restored_step, second.redone_steps, second.restored_by) == (10, 4, [2])
    text = format_recovery(second)
    assert "no step lost" not in text
    assert "replicas [2] restored the checkpoint of step 10, and train again the 4 step(s)" in text
    assert any("restored step 10, 4 redone" in line for line in format_summary(events))


# A torchtitan run's events (`--monarch.fault sigkill:replica=0:step=3`, 2 replicas x 2 procs, `--training.steps 6`),
# trimmed to the fields the report reads: the writer (replica 0) dies, the survivor reaches step 6 alone and the run
# ends 5 s after replica 2 was spawned for it, before replica 2 could join a generation.
_WRITER_DEATH = """
{"ts": 552.631, "event": "spawn", "replica": 0, "initial": true, "seconds": 16.083}
{"ts": 554.008, "event": "spawn", "replica": 1, "initial": true, "seconds": 17.457}
{"ts": 588.56, "event": "quorum", "gen": 0, "members": [0, 1]}
{"ts": 588.759, "event": "heal", "gen": 0, "recipients": [1], "step": 0, "bytes": 14703208, "seconds": 0.1784}
{"ts": 588.76, "event": "heal", "gen": 0, "recipients": [1], "step": 0, "bytes": 14703214, "seconds": 0.1811}
{"ts": 590.6, "event": "first_commit", "replica": 1, "gen": 0, "step": 1}
{"ts": 590.607, "event": "first_commit", "replica": 0, "gen": 0, "step": 1}
{"ts": 590.732, "event": "first_commit", "replica": 1, "gen": 0, "step": 1}
{"ts": 591.083, "event": "first_commit", "replica": 0, "gen": 0, "step": 1}
{"ts": 593.165, "event": "fault_injected", "replica": 0, "step": 3}
{"ts": 593.166, "event": "fault_injected", "replica": 0, "step": 3}
{"ts": 593.354, "event": "death", "replica": 0, "detected_by": "pidfd (pid 19648 exited)", "gen": 0}
{"ts": 593.363, "event": "quorum", "gen": 1, "members": [1]}
{"ts": 594.639, "event": "dropped_step", "replica": 1, "step": 3, "gen": 0}
{"ts": 594.644, "event": "dropped_step", "replica": 1, "step": 3, "gen": 0}
{"ts": 597.069, "event": "first_commit", "replica": 1, "gen": 1, "step": 3}
{"ts": 597.072, "event": "first_commit", "replica": 1, "gen": 1, "step": 3}
{"ts": 603.266, "event": "spawn", "replica": 2, "initial": false, "seconds": 9.903}
{"ts": 608.36, "event": "finished", "replica": 1, "gen": 1}
{"ts": 608.36, "event": "run_end", "gen": 1, "members": [1]}
"""

# The same job with the survivor waiting for the regrow (`--probe.shrunk_steps 2`): replica 2 joins generation 2,
# is healed shard by shard from replica 1 (both shards at once: the heal is their sum), and both procs of each
# replica commit step 6 in it.
_WRITER_DEATH_REGROWN = """
{"ts": 31.552, "event": "spawn", "replica": 0, "initial": true, "seconds": 17.142}
{"ts": 31.797, "event": "spawn", "replica": 1, "initial": true, "seconds": 17.384}
{"ts": 51.839, "event": "quorum", "gen": 0, "members": [0, 1]}
{"ts": 54.585, "event": "first_commit", "replica": 0, "gen": 0, "step": 1}
{"ts": 54.589, "event": "first_commit", "replica": 1, "gen": 0, "step": 1}
{"ts": 56.182, "event": "fault_injected", "replica": 0, "step": 3}
{"ts": 56.405, "event": "death", "replica": 0, "detected_by": "pidfd (pid 15447 exited)", "gen": 0}
{"ts": 56.407, "event": "quorum", "gen": 1, "members": [1]}
{"ts": 57.471, "event": "dropped_step", "replica": 1, "step": 3, "gen": 0}
{"ts": 59.087, "event": "first_commit", "replica": 1, "gen": 1, "step": 3}
{"ts": 59.095, "event": "first_commit", "replica": 1, "gen": 1, "step": 3}
{"ts": 64.668, "event": "spawn", "replica": 2, "initial": false, "seconds": 8.261}
{"ts": 74.215, "event": "quorum", "gen": 2, "members": [1, 2]}
{"ts": 75.135, "event": "heal", "gen": 2, "recipients": [2], "step": 5, "bytes": 39365200, "seconds": 0.2847}
{"ts": 75.189, "event": "heal", "gen": 2, "recipients": [2], "step": 5, "bytes": 39365202, "seconds": 0.3408}
{"ts": 76.402, "event": "first_commit", "replica": 1, "gen": 2, "step": 6}
{"ts": 76.408, "event": "first_commit", "replica": 1, "gen": 2, "step": 6}
{"ts": 76.88, "event": "first_commit", "replica": 2, "gen": 2, "step": 6}
{"ts": 77.045, "event": "first_commit", "replica": 2, "gen": 2, "step": 6}
"""


def test_recovery_report_of_a_writer_death_names_the_replacement_whether_or_not_it_joined():
    from monarch_plugin.report import format_recovery, recoveries

    [rec] = recoveries([json.loads(line) for line in _WRITER_DEATH.splitlines() if line])
    assert (rec.survivors, rec.dropped_steps, rec.replacement, rec.replacement_joined) == ([1], [3], 2, False)
    assert format_recovery(rec).splitlines() == [
        "replica 0 died (noticed by pidfd (pid 19648 exited), 189 ms after the kill)",
        "  survivors [1] kept training: next committed step 3904 ms after the kill (dropped step [3])",
        "  replacement replica 2: spawned in 9903 ms, the run ended before it joined",
    ]
    [rec] = recoveries([json.loads(line) for line in _WRITER_DEATH_REGROWN.splitlines() if line])
    assert (rec.replacement, rec.replacement_joined, rec.participating_step) == (2, True, 6)
    assert format_recovery(rec).splitlines()[-1] == (
        "  replacement replica 2: spawned in 8261 ms, healed from a live peer in 341 ms (78.7 MB), training at step 6 "
        "20473 ms after spawn began")


def test_the_forkserver_loads_torch_and_its_optimizer_imports_and_only_frameworks_the_training_code_imports():
    from monarch_plugin.procs.forkserver import ALWAYS, preload_for

    assert preload_for(set()) == list(ALWAYS) == ["torch", "torch._dynamo"]
    assert preload_for({"lightning", "torch", "my_model", "os"}) == [*ALWAYS, "lightning"]
    assert preload_for({"torchtitan", "transformers"}) == [*ALWAYS, "transformers", "torchtitan.train"]


def test_a_targets_imports_are_read_from_its_source_not_run(tmp_path):
    from monarch_plugin.target import Target

    script = tmp_path / "train.py"
    script.write_text("import os, lightning.pytorch as pl\nfrom transformers import AutoModel\nfrom . import near\n"
                      "def main():\n    import torchtitan.train\nraise SystemExit('never run')\n")
    assert Target.script(str(script)).imports == ["lightning", "os", "torchtitan", "transformers"]
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    assert Target.script(str(broken)).imports == []
    assert "torch" in Target.function(_module_level_fn).imports  # this file's own imports
    assert Target.function(print).imports == []  # a builtin has no source


def _module_level_fn():
    import torch  # noqa: F401


def test_pidwatch_reports_a_death_whose_pidfd_is_numbered_past_select_s_limit():
    """A controller of a few hundred procs holds over 1,024 fds (a store connection per proc, their pidfds):
    select() refuses those, which ended the watch thread and every death notice with it."""
    import os
    import queue
    import resource
    import subprocess

    from monarch_plugin.procs.pidwatch import PidWatch

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this machine allows {hard} open files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    proc = subprocess.Popen(["sleep", "60"])
    deaths: queue.Queue = queue.Queue()
    watch = PidWatch(lambda replica, pid: deaths.put((replica, pid)))
    try:
        watch.watch(7, [proc.pid])
        assert max(watch._running) > 1024
        proc.kill()
        assert deaths.get(timeout=5) == (7, proc.pid)
    finally:
        watch.close()
        proc.kill()
        proc.wait()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
