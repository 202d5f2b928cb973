"""`controller`: what `ElasticController` decides, through its `launch` seam, without a Monarch mesh.

The replicas are `simulated`'s: the real protocol over the controller's real store, each with a real proc that
the controller watches by pidfd and that these tests SIGKILL from outside. What a real replica does besides the
protocol (torch groups, heals, training) is tested end to end under tests/e2e.
"""

from __future__ import annotations

import re
import threading

import pytest
from support.simulated import Fleet, wait_for

from monarch_plugin.config import ElasticConfig
from monarch_plugin.controller import ElasticController
from monarch_plugin.errors import ElasticRunAborted, ReplicaCodeError
from monarch_plugin.events import read_events
from monarch_plugin.target import Target

pytestmark = pytest.mark.timeout(120)


class _Run:
    """One controller over simulated replicas; `drive(run)` acts on it from a thread while the controller runs,
    and the replicas finish together when it returns."""

    def __init__(self, tmp_path, never_ready: tuple[int, ...] = (), **settings):
        self.events_path = str(tmp_path / "events.jsonl")
        settings = {"join_timeout_s": 60, **settings}
        self.config = ElasticConfig(forkserver=False, restart_backoff_s=0.2, events_path=self.events_path,
                                    checkpoint_dir=str(tmp_path / "ckpt"), **settings)
        self.config.env.update(MONARCH_PLUGIN_EVENTS=self.events_path, MONARCH_PLUGIN_JOIN_TIMEOUT_S="60")
        self.fleet = Fleet(1, 0.02, never_ready)
        self.error: BaseException | None = None

    def events(self, kind: str) -> list[dict]:
        return [e for e in read_events(self.events_path) if e["event"] == kind]

    def wait(self, what: str, predicate, timeout: float = 60):
        return wait_for(what, predicate, timeout, self.events_path)

    def quorum(self, members: list[int]) -> dict:
        """The first generation of exactly these members, once every one of them has joined it."""
        gen = self.wait(f"generation of {members}",
                        lambda: next((q for q in self.events("quorum") if q["members"] == members), None))
        self.wait(f"generation {gen['gen']} formed",
                  lambda: len([j for j in self.events("join") if j["gen"] == gen["gen"]]) == len(members))
        return gen

    def run(self, drive):
        def driver():
            try:
                drive(self)
            except BaseException as e:  # noqa: BLE001 - reported by the test, after the controller stopped
                self.error = e
            finally:
                self.fleet.finish()

        thread = threading.Thread(target=driver, daemon=True)
        thread.start()
        try:
            return ElasticController(self.config, Target.function(print), launch=self.fleet.launch).run()
        finally:
            self.fleet.close()
            thread.join(10)
            if self.error is not None:
                raise self.error


def test_a_death_shrinks_the_run_and_its_replacement_regrows_it(tmp_path):
    run = _Run(tmp_path, replicas=2)

    def drive(run):
        run.quorum([0, 1])
        run.fleet.kill(1)
        run.quorum([0])
        run.quorum([0, 2])

    result = run.run(drive)
    assert [d["replica"] for d in run.events("death")] == [1]
    assert "pidfd" in run.events("death")[0]["detected_by"]
    assert sorted(s["replica"] for s in run.events("spawn")) == [0, 1, 2]
    assert sorted(result.values) == [0, 2]  # the two that finished


def test_below_min_replicas_the_run_stops_and_respawns_nobody(tmp_path):
    run = _Run(tmp_path, replicas=2, min_replicas=2)

    def drive(run):
        run.quorum([0, 1])
        run.fleet.kill(1)
        run.wait("the give-up", lambda: run.events("give_up"))

    with pytest.raises(ElasticRunAborted, match=r"1 live replica\(s\) left, below `min_replicas` 2"):
        run.run(drive)
    assert sorted(s["replica"] for s in run.events("spawn")) == [0, 1]


def test_a_run_out_of_restarts_trains_on_fewer_without_respawning(tmp_path):
    run = _Run(tmp_path, replicas=2, max_restarts=1)

    def drive(run):
        run.quorum([0, 1])
        run.fleet.kill(1)
        run.quorum([0, 2])
        run.fleet.kill(2)
        run.wait("the refusal", lambda: run.events("no_respawn"))
        run.wait("a generation of the survivor", lambda: [q for q in run.events("quorum")
                                                           if q["members"] == [0] and q["gen"] > 2])

    result = run.run(drive)
    assert run.events("no_respawn")[0]["reason"] == "`max_restarts` 1 used"
    assert sorted(s["replica"] for s in run.events("spawn")) == [0, 1, 2] and sorted(result.values) == [0]


def test_a_replacement_never_ready_is_treated_as_hung_and_replaced_after_join_timeout(tmp_path):
    # The bound is the first two replicas' start too: a loaded CI machine took more than 3 s to start them.
    run = _Run(tmp_path, never_ready=(2,), replicas=2, join_timeout_s=15)

    def drive(run):
        run.quorum([0, 1])
        run.fleet.kill(1)
        run.wait("the stuck replacement's hang", lambda: run.events("hang"), timeout=60)
        run.quorum([0, 3])

    run.run(drive)
    hang = run.events("hang")[0]
    assert (hang["replica"], hang["detected_by"]) == (2, "hang (never ready)") and "`join_timeout_s`" in hang["why"]
    deaths = run.events("death")
    assert [d["replica"] for d in deaths] == [1, 2] and deaths[1]["detected_by"] == "hang (never ready)"


def test_an_exception_in_one_replica_replaces_it_as_a_death_does(tmp_path):
    """Its proc still answers: the raise it reports is what takes it out, its steps are dropped, a replacement
    regrows the run, and an exception at another step in another replica is that replica's failure too."""
    run = _Run(tmp_path, replicas=3)

    def drive(run):
        run.quorum([0, 1, 2])
        run.fleet.raise_in(1, step=5)
        run.quorum([0, 2])
        run.quorum([0, 2, 3])
        run.fleet.raise_in(2, step=9)  # the same type, another step: no repetition
        run.quorum([0, 3])
        run.quorum([0, 3, 4])

    result = run.run(drive)
    deaths = run.events("death")
    assert [(d["replica"], d["detected_by"]) for d in deaths] == [
        (1, "raised RuntimeError at step 5"), (2, "raised RuntimeError at step 9")]
    assert not run.events("give_up") and sorted(result.values) == [0, 3, 4]


def test_the_runtimes_own_failure_in_a_worker_is_never_taken_for_the_training_codes(tmp_path):
    """Two replicas whose join timed out at the same step (a store that stopped answering, say) are two replicas to
    replace: the same exception at the same step stops the run only when the training code raised it."""
    run = _Run(tmp_path, replicas=3)

    def drive(run):
        run.quorum([0, 1, 2])
        run.fleet.raise_in(1, step=5, kind="monarch_plugin.wire.handshake.ProtocolError", runtime="join")
        run.quorum([0, 2])
        run.fleet.raise_in(2, step=5, kind="monarch_plugin.wire.handshake.ProtocolError", runtime="join")
        run.wait("both replacements", lambda: len([s for s in run.events("spawn") if not s["initial"]]) == 2)

    run.run(drive)
    assert [d["detected_by"] for d in run.events("death")] == ["its monarch-plugin join failed at step 5"] * 2
    assert not run.events("give_up")


def test_the_same_exception_at_the_same_step_in_a_second_replica_stops_the_run_with_both_tracebacks(tmp_path):
    run = _Run(tmp_path, replicas=3)

    def drive(run):
        run.quorum([0, 1, 2])
        run.fleet.raise_in(1, step=5, kind="builtins.ValueError")
        run.quorum([0, 2])
        run.fleet.raise_in(2, step=5, kind="builtins.ValueError")  # redoing the step on its new share
        run.wait("the give-up", lambda: run.events("give_up"))

    with pytest.raises(ReplicaCodeError, match="raised at step 5 in replica 1 and again in replica 2") as stopped:
        run.run(drive)
    assert "simulated in 1" in str(stopped.value) and "simulated in 2" in str(stopped.value)
    give_up = run.quorum([0])  # the one left in training holds the run's state: it writes the checkpoint
    assert give_up["action"] == "checkpoint" and run.events("give_up")[0]["reason"].startswith("the training code")


def test_a_replica_setting_up_raises_before_the_first_generation_stops_the_run_at_once(tmp_path):
    run = _Run(tmp_path, never_ready=(0, 1), replicas=2)

    def drive(run):
        run.wait("the spawns", lambda: len(run.events("spawn")) == 2)
        run.fleet.raise_in(1, step=-1)
        run.wait("the stop", lambda: run.events("user_error"))

    with pytest.raises(ReplicaCodeError, match="before its first step, while setting up"):
        run.run(drive)
    assert not run.events("respawn_scheduled") and not run.events("quorum")


def test_an_initial_replica_raising_before_its_first_step_in_a_formed_generation_stops_the_run_too(tmp_path):
    """Lightning joins the first generation in its set-up, before its sanity check and `on_train_start` hooks: an
    exception there is still the set-up's, which every replica runs alike; no replica is replaced for it."""
    run = _Run(tmp_path, replicas=2)

    def drive(run):
        run.quorum([0, 1])
        run.fleet.raise_in(0, step=-1, kind="lightning.pytorch.utilities.exceptions.MisconfigurationException")
        run.wait("the stop", lambda: run.events("user_error"))

    with pytest.raises(ReplicaCodeError, match="replica 0 before its first step, while setting up"):
        run.run(drive)
    assert not run.events("respawn_scheduled") and not run.events("death")


def test_out_of_memory_the_run_waits_for_replacements_instead_of_shrinking_and_stops_if_none_can_come(tmp_path):
    """Under a constant global batch, fewer replicas would each take a larger share than the one that did not fit:
    the survivors wait in a generation that trains nothing, until the replacement brings the run back to 3."""
    run = _Run(tmp_path, replicas=3)

    def drive(run):
        run.quorum([0, 1, 2])
        run.fleet.raise_in(1, step=4, kind="torch.OutOfMemoryError", oom=True)
        run.wait("the wait", lambda: [q for q in run.events("quorum") if q["action"] == "wait"])
        run.quorum([0, 2, 3])

    run.run(drive)
    plans = [(q["members"], q["action"]) for q in run.events("quorum")]
    assert plans == [([0, 1, 2], "train"), ([0, 2], "wait"), ([0, 2, 3], "train")]

    later = tmp_path / "no-restarts"
    later.mkdir()
    stopped = _Run(later, replicas=3, max_restarts=0)

    def drive(run):
        run.quorum([0, 1, 2])
        run.fleet.raise_in(1, step=4, kind="torch.OutOfMemoryError", oom=True)
        run.wait("the give-up", lambda: run.events("give_up"))

    with pytest.raises(ElasticRunAborted, match="trains on no fewer than 3.*no replacement is coming"):
        stopped.run(drive)
    assert [q["action"] for q in stopped.events("quorum")] == ["train", "wait", "checkpoint"]


def test_out_of_memory_under_a_constant_local_batch_shrinks_as_any_failure(tmp_path):
    run = _Run(tmp_path, replicas=3, batch_policy="constant_local")

    def drive(run):
        run.quorum([0, 1, 2])
        run.fleet.raise_in(1, step=4, kind="torch.OutOfMemoryError", oom=True)
        run.quorum([0, 2])
        run.quorum([0, 2, 3])

    run.run(drive)
    assert "wait" not in [q["action"] for q in run.events("quorum")]


def _notice(run, rid: int, sig: str = "SIGTERM") -> None:
    """What a replica's proc tells the controller when it receives a signal with notice (`procs.notice`)."""
    import datetime

    import torch.distributed as dist

    from monarch_plugin.wire.protocol import Drain, Key
    from monarch_plugin.wire.signing import SECRET_ENV, SignedStore

    port = run.events("run_start")[0]["store_port"]
    store = SignedStore(dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=10)),
                        bytes.fromhex(run.fleet.envs[rid][SECRET_ENV]))
    store.append(Key.DRAINS, Drain(rid, 0, sig, 0).line())
    store.add(Key.DRAIN_COUNT, 1)


def test_a_replica_told_to_go_leaves_at_a_step_boundary_and_a_replacement_regrows_the_run(tmp_path):
    run = _Run(tmp_path, replicas=3, min_replicas=2)

    def drive(run):
        run.quorum([0, 1, 2])
        _notice(run, 1)
        _notice(run, 1, "SIGUSR1")  # a second signal to the same replica changes nothing
        run.quorum([0, 2])
        run.quorum([0, 2, 3])

    result = run.run(drive)
    assert [q["interrupt"] for q in run.events("quorum")] == [False, False, False]
    assert [(d["replicas"], d["members"]) for d in run.events("drain")] == [([1], [0, 2])]
    assert [d["replica"] for d in run.events("drained")] == [1] and not run.events("death")
    assert [e["restarts"] for e in run.events("respawn_scheduled")] == [0]  # a drain's replacement is no restart
    assert sorted(result.values) == [0, 2, 3]


@pytest.mark.parametrize("told, why", [((0, 1, 2), "SIGTERM to every replica"),
                                       ((1, 2), "would leave 1 replica(s), below `min_replicas` 2")])
def test_every_replica_told_to_go_or_too_many_stops_the_run_with_a_checkpoint_instead(tmp_path, told, why):
    from monarch_plugin.errors import RunStopped

    run = _Run(tmp_path, replicas=3, min_replicas=2)

    def drive(run):
        run.quorum([0, 1, 2])
        for rid in told:
            _notice(run, rid)
        run.wait("the stop", lambda: run.events("give_up"))

    with pytest.raises(RunStopped, match=re.escape(why)) as stopped:
        run.run(drive)
    assert stopped.value.status == 143 and not run.events("drain")
    assert [q["action"] for q in run.events("quorum")] == ["train", "checkpoint"]


def test_sigusr1_to_the_controller_stops_the_run_with_a_checkpoint_and_status_138(tmp_path):
    import os
    import signal

    from monarch_plugin.errors import RunStopped

    run = _Run(tmp_path, replicas=2)

    def drive(run):
        run.quorum([0, 1])
        os.kill(os.getpid(), signal.SIGUSR1)
        run.wait("the stop", lambda: run.events("give_up"))

    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(RunStopped, match="SIGUSR1 received") as stopped:
        run.run(drive)
    assert stopped.value.status == stopped.value.code == 138
    assert run.events("quorum")[-1]["action"] == "checkpoint" and run.events("give_up")[0]["reason"] == "SIGUSR1 received"
    assert signal.getsignal(signal.SIGUSR1) is before  # the controller's handler went with its run


def test_a_replica_told_to_go_while_the_run_waits_for_replacements_leaves_at_once(tmp_path):
    """Nobody trains in a generation that waits (`Action.WAIT`), so none forms: a drain then is published at once, not
    held for a formation that never comes until `drain_grace_s` makes the drained replica a death."""
    import os
    import signal

    from monarch_plugin.errors import RunStopped

    run = _Run(tmp_path, never_ready=(3,), replicas=3)  # the replacement never comes: the run waits on

    def drive(run):
        run.quorum([0, 1, 2])
        run.fleet.raise_in(1, step=4, kind="torch.OutOfMemoryError", oom=True)
        run.wait("the wait", lambda: [q for q in run.events("quorum") if q["action"] == "wait"])
        _notice(run, 2)
        run.wait("replica 2 drained", lambda: run.events("drained"), timeout=5)
        os.kill(os.getpid(), signal.SIGUSR1)
        run.wait("the stop", lambda: run.events("give_up"))

    with pytest.raises(RunStopped):
        run.run(drive)
    plans = [(q["members"], q["action"]) for q in run.events("quorum")]
    assert plans[:3] == [([0, 1, 2], "train"), ([0, 2], "wait"), ([0], "wait")], plans
    assert [d["replica"] for d in run.events("drained")] == [2]
    assert 2 not in [d["replica"] for d in run.events("death")]


def test_a_stall_anyone_can_count_is_looked_at_and_never_acted_on(tmp_path):
    """The stall count carries no signature: moved by a process without the run's secret, again and again, with an
    unsigned key where a member's would be, it made the controller re-plan each generation (a livelock). Only a
    member's signed key is acted on."""
    import datetime
    import time

    import torch.distributed as dist

    run = _Run(tmp_path, replicas=2)

    def drive(run):
        gen = run.quorum([0, 1])["gen"]
        stranger = dist.TCPStore("127.0.0.1", run.events("run_start")[0]["store_port"], is_master=False,
                                 wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
        stranger.set(f"stalled/{gen}/0/0", b"1")
        for _ in range(5):
            stranger.add(f"stalled/{gen}", 1)
            time.sleep(0.2)
        run.wait("the forged key reported", lambda: run.events("forged_value"))
        time.sleep(1.0)  # past the stall's grace: a probe and a re-plan would have come by now

    run.run(drive)
    assert [q["members"] for q in run.events("quorum")] == [[0, 1]]
    assert {e["key"] for e in run.events("forged_value")} == {"stalled/0/0/0"}
