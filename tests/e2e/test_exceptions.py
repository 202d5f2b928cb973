"""An exception in one replica is that replica's failure, as a death is; the same exception at the same step in two
replicas is the code's own, and stops the run with a checkpoint that resumes exactly.

Real Monarch procs and real gloo groups under `monarch-run`; the exceptions are the opt-in faults (`raise`, `oom`)
fired by the training code's own forward and backward passes (`at=forward`, `at=backward`), and the processes that
raised stay alive until the controller ends them.
"""

from __future__ import annotations

import json

import pytest

from support.procs import alive
from support.runs import WORKLOADS
from monarch_plugin.worker import dcp_io

pytestmark = pytest.mark.timeout(240)

SAMPLES, BATCH, EPOCHS = 240, 24, 3  # 10 steps an epoch
STEPS = EPOCHS * SAMPLES // BATCH
LOOP = ("--samples", str(SAMPLES), "--batch", str(BATCH), "--epochs", str(EPOCHS), "--step-sleep", "0.05")


def _steps(run) -> list[dict]:
    path = run.out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _every_sample_once(steps: list[dict]) -> None:
    assert [r["step"] for r in steps] == list(range(STEPS))
    for epoch in range(EPOCHS):
        assert sorted(i for r in steps if r["epoch"] == epoch for i in r["batch"]) == list(range(SAMPLES)), epoch


def _no_orphans(run) -> None:
    for pids in run.pids().values():
        assert not any(alive(p) for p in pids), run.pids()


def test_an_exception_mid_backward_replaces_the_replica_and_the_run_finishes_identical_every_sample_once(elastic_run):
    run = elastic_run()
    run.start("--replicas", "3", "--fault", "raise:replica=1:step=6:at=backward", script=WORKLOADS / "logged_loop.py",
              script_args=(*LOOP, "--out", str(run.out)))
    assert run.wait(timeout=180) == 0, run.output

    [raised] = run.events("raised")
    assert (raised["replica"], raised["step"], raised["type"]) == (1, 6, "monarch_plugin.faults.InjectedFault")
    assert raised["error"] == "InjectedFault: injected fault raise at the backward of step 6"
    assert raised["runtime"] == "" and raised["held"] == 6  # raised inside backward: the state is still step 6's
    [death] = run.events("death")
    assert (death["replica"], death["detected_by"]) == (1, "raised InjectedFault at step 6")
    assert [q["members"] for q in run.events("quorum")] == [[0, 1, 2], [0, 2], [0, 2, 3]]
    assert {d["step"] for d in run.events("dropped_step")} == {6}
    assert run.output.count("Traceback (most recent call last)") == 1  # printed once, by the controller
    assert "replica 1 raised InjectedFault at step 6 (noticed" in run.output  # monarch-run's recovery summary
    _every_sample_once(_steps(run))
    results = run.results()
    assert set(results) == {0, 2, 3} and {r["step"] for r in results.values()} == {STEPS}
    assert len({r["checksum"] for r in results.values()}) == 1
    assert not run.events("give_up")
    _no_orphans(run)


def test_one_proc_of_a_replica_raising_mid_forward_takes_its_whole_replica_out_while_its_sibling_is_stuck(
        elastic_run):
    """Its sibling waits in their replica's own all-reduce for a proc that left: the replica's actor call would
    never return, so the proc that raised tells the controller through the store, and both procs are ended."""
    run = elastic_run()
    run.start("--replicas", "2", "--procs-per-replica", "2", "--fault", "raise:replica=1:lane=1:step=5:at=forward",
              script=WORKLOADS / "two_procs_per_replica.py", script_args=(str(run.out), "24"))
    assert run.wait(timeout=180) == 0, run.output
    [raised] = run.events("raised")
    assert (raised["replica"], raised["lane"], raised["step"]) == (1, 1, 5)
    assert [d["replica"] for d in run.events("death")] == [1]
    results = [json.loads(p.read_text()) for p in run.out.glob("result-*.json")]
    assert sorted((r["replica"], r["local_rank"]) for r in results) == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert {r["checksum"] for r in results} == {results[0]["checksum"]} and {r["step"] for r in results} == {24}
    _no_orphans(run)


def test_the_same_exception_at_the_same_step_in_both_replicas_stops_with_a_checkpoint_that_resumes_exactly(
        elastic_run):
    """Both raise in step 6's backward: the first is replaced, the second raising the same there is the code's bug. No
    replica is left training, so the one that raised last writes the give-up checkpoint from the state it held since
    step 6 began (its BatchNorm statistics, which the step's forward had moved, put back); the run resumed from it
    ends exactly as a run that never failed."""
    loop = (*LOOP, "--batchnorm")
    clean = elastic_run()
    clean.start("--replicas", "2", script=WORKLOADS / "logged_loop.py", script_args=(*loop, "--out", str(clean.out)))
    stopped = elastic_run()
    stopped.start("--replicas", "2", "--fault", "raise:step=6:at=backward", script=WORKLOADS / "logged_loop.py",
                  script_args=(*loop, "--out", str(stopped.out)))
    assert clean.wait(timeout=180) == 0, clean.output
    assert stopped.wait(timeout=180) == 1, stopped.output

    assert "the training code raised at step 6 in replica" in stopped.output and "and again in replica" in stopped.output
    assert stopped.output.count("--- replica 0 traceback ---") >= 1 and "--- replica 1 traceback ---" in stopped.output
    [give_up] = stopped.events("give_up")
    path = give_up["checkpoint"]
    assert path and path.endswith("step00000006") and f"checkpoint written to {path}" in stopped.output
    assert dcp_io.load({"loop": {"step": -1}}, path, None)["loop"]["step"] == 6  # named for the step it holds
    assert {j["replica"] for j in stopped.events("join")} == {0, 1}  # no replacement joined
    _no_orphans(stopped)

    resumed = elastic_run()
    resumed.start("--replicas", "2", "--resume", path, script=WORKLOADS / "logged_loop.py",
                  script_args=(*loop, "--out", str(resumed.out)))
    assert resumed.wait(timeout=180) == 0, resumed.output
    assert [r["step"] for r in _steps(resumed)] == list(range(6, STEPS))
    assert _steps(resumed) == _steps(clean)[6:]
    assert {r["checksum"] for r in resumed.results().values()} == {clean.results()[0]["checksum"]}


def test_out_of_memory_the_survivors_wait_for_the_replacement_instead_of_training_on_larger_shares(elastic_run):
    """Under the constant global batch two replicas would each take half of it where the one that ran out of memory
    took a third: the run waits for the replacement (a generation that trains nothing) and trains on three again."""
    run = elastic_run()
    run.start("--replicas", "3", "--fault", "oom:replica=1:step=6", script=WORKLOADS / "logged_loop.py",
              script_args=(*LOOP, "--out", str(run.out)))
    assert run.wait(timeout=180) == 0, run.output
    [raised] = run.events("raised")
    assert raised["oom"] and raised["type"] == "torch.OutOfMemoryError"
    plans = [(q["members"], q["action"]) for q in run.events("quorum")]
    assert plans == [([0, 1, 2], "train"), ([0, 2], "wait"), ([0, 2, 3], "train")], plans
    assert "waiting for replacements" in run.events("quorum")[1]["reason"]
    assert {e["replica"] for e in run.events("wait")} == {0, 2}
    steps = _steps(run)
    assert {r["replicas"] for r in steps} == {3}  # never a step on larger shares
    _every_sample_once(steps)
    results = run.results()
    assert set(results) == {0, 2, 3} and len({r["checksum"] for r in results.values()}) == 1
    _no_orphans(run)
