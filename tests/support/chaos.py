"""Seeded chaos for the end-to-end tests: draw several failures, inject them into a live run, check the events.

A schedule is drawn from one seed (printed, and named in every assertion, so a failing draw can be replayed with
`CHAOS_SEED=<seed> pytest ...`). Its failures are of these kinds:

    sigkill, sigsegv, sigstop    that signal, sent from here to a pid of one training member, at a random point of
                                 a step (computing or in the reduction); a SIGSTOPped proc answers nothing
    two_at_once                  SIGKILL two members together
    death_during_recovery        SIGKILL one member, and another as soon as the first death is noticed
    drain                        SIGTERM to a member: it leaves at a step boundary (drained, not dead)
    death_during_drain           SIGTERM to a member, and SIGKILL to another once the drain is published: the draining
                                 one is aborted with the members, and leaves drained
    last_step                    SIGKILL a member during the run's last step
    after_end                    SIGKILL a member in its own code after training ended (the workload lingers there):
                                 the run, whose training is complete, still ends with success
    exit                         os._exit(1) inside a member at a drawn step (`--fault exit:...`)
    raise                        an exception in a member's backward at a drawn step (`--fault raise:...:at=backward`):
                                 its process lives on, and the replica is replaced as after a death
    donor_mid_heal               the member serving a newcomer's heal dies mid-transfer (`at=heal_donor`)
    newcomer_mid_heal            the first newcomer dies mid-transfer while being healed (`at=heal_recipient`):
                                 replica `replicas`, the hot spare if the run has one, else the first replacement

The last four are configured at launch (`Chaos.faults`); the others are sent by PID from this process
(`Chaos.inject`). One replica, the witness (the last initial one), is never hit, so a replica that trained from
the start counts the samples and at least one (`min_replicas` 1) stays live. A replica with a launch-time fault
still to fire is not hit from outside either, so every fault drawn fires.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field

from .procs import alive as _alive

__all__ = ["Chaos", "KINDS", "seed_from_env"]

OUTSIDE = ("sigkill", "sigsegv", "sigstop", "two_at_once", "death_during_recovery", "drain", "death_during_drain",
           "last_step", "after_end")
_AT_THE_END = ("last_step", "after_end")
AT_LAUNCH = ("exit", "raise", "donor_mid_heal", "newcomer_mid_heal")
KINDS = OUTSIDE + AT_LAUNCH
_SIGNALS = {"sigkill": signal.SIGKILL, "sigsegv": signal.SIGSEGV, "sigstop": signal.SIGSTOP}


def seed_from_env() -> int:
    """`CHAOS_SEED` if set (to replay a draw), else a fresh one: each CI run tries another draw."""
    return int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(1 << 20))


@dataclass(frozen=True)
class Failure:
    kind: str
    step: int
    """The witness's committed step it waits for (for `exit` and `raise`, the step it fires at; for `donor_mid_heal`, the step
    from which the next heal this donor serves is its last)."""
    delay: float
    """Seconds after that step was seen, so the signal lands anywhere in the next step."""


@dataclass
class Injected:
    kind: str
    replica: int
    pid: int
    signal: int
    ts: float


@dataclass
class Chaos:
    seed: int
    total: int
    """The run's steps, as the witness's progress counts them (committed steps)."""
    replicas: int
    """Initial replicas: ids 0..replicas-1; hot spares, then replacements, are numbered from `replicas` on."""
    count: int = 4
    kinds: tuple[str, ...] = KINDS
    """What may be drawn: `after_end` needs a workload that stays in its own code after its loop."""
    schedule: list[Failure] = field(init=False)
    injected: list[Injected] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        kinds = rng.sample(self.kinds, self.count)
        single = [k for k in _SIGNALS if k not in kinds]
        if "exit" in kinds and "raise" in kinds:  # both hit replica 1: the first takes it, the second would not fire
            kinds[kinds.index("raise")] = single.pop(rng.randrange(len(single)))
        for held in ("exit", "raise"):
            if held in kinds and "donor_mid_heal" in kinds:  # each holds back a non-witness replica: none left to hit
                kinds[kinds.index(held)] = single.pop(rng.randrange(len(single)))
        if "donor_mid_heal" in kinds:
            # It fires at the next heal that replica 0 serves: right after it, a single member is hit (one
            # other than replica 0 and the witness), so that heal comes, with replica 0 as its donor.
            kinds.remove("donor_mid_heal")
            after = next((k for k in kinds if k in _SIGNALS), None)
            if after is None:
                after = single.pop(rng.randrange(len(single)))
                kinds.pop(next((i for i, k in enumerate(kinds) if k in OUTSIDE and k not in _AT_THE_END), -1))
            else:
                kinds.remove(after)
            kinds[:0] = ["donor_mid_heal", after]
        kinds.sort(key=lambda k: _AT_THE_END.index(k) + 1 if k in _AT_THE_END else 0)  # the last failures, in order
        spread = sorted(rng.sample(range(self.total // 10, self.total - self.total // 3), self.count))
        at = {"last_step": self.total - 1, "after_end": self.total}
        self.schedule = [Failure(k, at.get(k, s), round(rng.uniform(0, 0.15), 3)) for k, s in zip(kinds, spread)]
        self._rng = rng

    @property
    def witness(self) -> int:
        return self.replicas - 1

    def _reserved(self) -> dict[str, int]:
        """The replica each launch-time fault of the schedule hits."""
        return {"exit": 1, "raise": 1, "donor_mid_heal": 0, "newcomer_mid_heal": self.replicas}

    def fault_args(self) -> tuple[str, ...]:
        """`--fault ...` for the front end's launcher (nothing if no launch-time fault was drawn)."""
        return ("--fault", self.faults()) if self.faults() else ()

    def survive(self, run, progress) -> None:
        """Inject the schedule into the started `run`, then check that it finished, that its events tell exactly
        what was injected, and that no process of it is left."""
        self.inject(run, progress)
        assert run.wait(timeout=180) == 0, f"{self}\n{run.output}"
        self.check_events(run)
        assert not any(_alive(pid) for pids in run.pids().values() for pid in pids), str(self)

    def faults(self) -> str:
        """The `--fault` setting for the schedule's launch-time failures ('' if none)."""
        spec = {"exit": "exit:replica={r}:step={s}", "raise": "raise:replica={r}:step={s}:at=backward",
                "donor_mid_heal": "sigkill:replica={r}:at=heal_donor:step={s}",
                "newcomer_mid_heal": "sigkill:replica={r}:at=heal_recipient"}
        return ",".join(spec[f.kind].format(r=self._reserved()[f.kind], s=f.step)
                        for f in self.schedule if f.kind in AT_LAUNCH)

    def __str__(self) -> str:
        return f"chaos seed {self.seed} (replay: CHAOS_SEED={self.seed}): " + ", ".join(
            f"{f.kind}@{f.step}" for f in self.schedule)

    # -- injecting -------------------------------------------------------------------------------------------

    def _candidates(self, run) -> list[int]:
        """Members of the newest generation that trained in it or before, and may be hit from here."""
        events = run.events()
        quorums = [e for e in events if e["event"] == "quorum"]
        if not quorums:
            return []
        fired = {e["replica"] for e in events if e["event"] == "fault_injected"}  # dying by it, maybe not yet noticed
        gone = {e["replica"] for e in events if e["event"] in ("death", "hang", "drained")}
        gone |= {i.replica for i in self.injected} | {e["replica"] for e in events if e["event"] == "finished"}
        gone |= fired
        held = {self._reserved()[f.kind] for f in self.schedule if f.kind in AT_LAUNCH} - fired
        trained = {e["replica"] for e in events if e["event"] == "first_commit"}
        return sorted(m for m in quorums[-1]["members"]
                      if m != self.witness and m not in gone | held and m in trained)

    def _wait(self, run, predicate, what: str, timeout: float = 60.0):
        return run.wait_for(predicate, timeout=timeout, what=f"{what} [{self}]")

    def _hit(self, run, kind: str, replica: int, sig: int) -> None:
        pid = self._rng.choice(run.pids()[replica])
        os.kill(pid, sig)
        self.injected.append(Injected(kind, replica, pid, sig, time.time()))

    def _noticed(self, run, replica: int) -> bool:
        """Its death, or (told to go) its drain, is in the events."""
        return any(e["replica"] == replica for e in run.events("death") + run.events("drained"))

    def inject(self, run, progress) -> None:
        """Send the schedule's outside failures into `run` as the witness's `progress()` reaches each one's step;
        return once every one was sent and noticed. Launch-time faults fire by themselves."""
        for f in self.schedule:
            if f.kind in AT_LAUNCH:
                continue
            self._wait(run, lambda: progress() >= f.step, f"step {f.step} for {f.kind}", timeout=180)
            if f.kind not in _AT_THE_END:
                time.sleep(f.delay)
            elif f.kind == "after_end":
                time.sleep(0.5)  # every member left its loop together (milliseconds), and lingers after it
            need = 2 if f.kind in ("two_at_once", "death_during_recovery", "death_during_drain") else 1
            chosen = self._rng.sample(self._wait(run, lambda: len(self._candidates(run)) >= need and
                                                 self._candidates(run), f"{need} member(s) to hit with {f.kind}"),
                                      need)
            if f.kind == "last_step" and progress() >= self.total:
                raise AssertionError(f"the last step passed before it could be hit [{self}]")
            told = f.kind in ("drain", "death_during_drain")
            self._hit(run, f.kind, chosen[0], signal.SIGTERM if told else _SIGNALS.get(f.kind, signal.SIGKILL))
            if f.kind == "two_at_once":
                self._hit(run, f.kind, chosen[1], signal.SIGKILL)
            elif f.kind == "death_during_recovery":
                self._wait(run, lambda: self._noticed(run, chosen[0]), f"replica {chosen[0]}'s death noticed")
                self._hit(run, f.kind, chosen[1], signal.SIGKILL)
            elif f.kind == "death_during_drain":
                self._wait(run, lambda: any(chosen[0] in d["replicas"] for d in run.events("drain")) or
                           self._noticed(run, chosen[0]), f"replica {chosen[0]}'s drain published")
                self._hit(run, f.kind, chosen[1], signal.SIGKILL)
            for replica in chosen:
                self._wait(run, lambda: self._noticed(run, replica), f"replica {replica}'s death noticed")

    # -- checking --------------------------------------------------------------------------------------------

    def check_events(self, run) -> None:
        """The events tell what was injected, and nothing else: one death for each replica hit, noticed after the
        hit and by what can notice it; each launch-time fault fired and its replica died; the witness never."""
        deaths = {}
        for e in run.events("death"):
            assert e["replica"] not in deaths, f"replica {e['replica']} died twice [{self}]"
            deaths[e["replica"]] = e
        fired = {e["replica"]: e for e in run.events("fault_injected")}
        launched = {self._reserved()[f.kind] for f in self.schedule if f.kind in AT_LAUNCH}
        assert set(fired) == launched, f"faults fired in {sorted(fired)}, drawn for {sorted(launched)} [{self}]"
        told = {i.replica for i in self.injected if i.signal == signal.SIGTERM}
        hit = {i.replica for i in self.injected} - told
        assert set(deaths) == hit | launched, f"deaths {sorted(deaths)}, injected {sorted(hit | launched)} [{self}]"
        drained = [e["replica"] for e in run.events("drained")]
        assert sorted(drained) == sorted(told), f"drained {drained}, told to go {sorted(told)} [{self}]"
        for i in self.injected:
            if i.replica in told:
                continue
            death = deaths[i.replica]
            assert death["ts"] > i.ts, (i, death, str(self))
            how = death["detected_by"]
            if i.signal == signal.SIGSTOP:  # frozen: Monarch's supervision, or the probe of a stalled reduction
                assert how.startswith(("supervision", "hang")), (i, death, str(self))
            else:
                assert how.startswith(("pidfd", "supervision")), (i, death, str(self))
        for rid, e in fired.items():
            how = deaths[rid]["detected_by"]
            assert deaths[rid]["ts"] >= e["ts"], (e, deaths[rid], str(self))
            assert how == f"raised InjectedFault at step {e['step']}" if e["mode"] == "raise" else how.startswith(
                ("pidfd", "supervision")), (e, deaths[rid], str(self))
        assert [s["replica"] for s in run.events("spawn")].count(self.witness) == 1
