"""One worker's membership in the run: join a generation, heal, reduce within it, finish together.

A generation is the controller's decision of who trains together: a numbered plan in the store
(`plan/<g>`, then `latest`), announced to the procs concerned through their control actors. The session forms a fresh cross-replica group for each
generation it joins, catches up from a donor if it is behind, and leaves it when the controller aborts it
(a death: drop the step in flight) or when every member agrees, inside a committed step, that a grow is
waiting (so all members move at the same step boundary).

The procs of a replica with several (FSDP shards, or DDP inside the replica) make exactly the same
attempts in the same generations: their own collectives (FSDP's all-gathers, the user's all-reduces) pair
up attempt by attempt, so a proc that dropped a step its sibling committed, or stepped in another
generation, would silently train a different model from then on. They decide together, by a vote over the
replica's own group, at the three points where a decision is taken: the end of every attempt at a step,
the end of every attempt to join a generation, and the end of training. Which plan to join is picked by
local rank 0 alone and followed by the others (`pick/<replica>/<n>` in the store).
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable

import torch
import torch.distributed as dist

from monarch_plugin.backend import device_for_backend, resolve_backend
from monarch_plugin.wire.protocol import Action, Key, Phase, Plan, unfit_line
from monarch_plugin.errors import ProtocolError
from monarch_plugin.wire.handshake import (FORMATION_BOUND_S, CollectiveInterrupted, CollectiveTimedOut, GenerationChanged,
                                           barrier)
from monarch_plugin.worker.collectives import abandon, new_group, wait_all
from monarch_plugin.wire.signing import Forged
from monarch_plugin.worker.context import WorkerContext
from monarch_plugin.worker.heal import StateProvider, plan_heal, transfer_state

__all__ = ["ReplicaSession", "StopReplica", "PLAN_CHECK_S"]

PLAN_CHECK_S = 1.0
"""How long a worker waiting for its next generation waits for the controller's push before it reads the newest
plan from the store itself: one request a second per waiting proc, whatever the number of replicas."""



class StopReplica(BaseException):
    """The controller ended this replica's part in the run (finished without it, gave up, removed it)."""

    def __init__(self, reason: str, checkpoint: str | None = None):
        super().__init__(reason)
        self.checkpoint = checkpoint
        """The give-up checkpoint this proc wrote, if it is the one that wrote it."""


class ReplicaSession:
    def __init__(self, ctx: WorkerContext, provider: StateProvider, restore: Callable[[str], int] | None = None):
        """`restore(path)` loads a durable checkpoint of the front end's (lane 0's file `path`) mid-run and returns
        the committed steps it holds: a RESTORE generation (`Action.RESTORE`) calls it on every member."""
        self.ctx = ctx
        self.flags = ctx.flags
        self.provider = provider
        self.restore = restore
        self.backend = resolve_backend(ctx.config.backend)
        self.device = device_for_backend(self.backend, ctx.local_rank)
        if self.device.type == "cuda":  # NCCL binds a group to the current device: this lane's, not GPU 0
            torch.cuda.set_device(self.device)
        self.timeout_s = ctx.config.collective_timeout_s
        self.gen = -1
        self.rank = 0
        self.world = 1
        self.members: list[int] = []
        self.action = Action.TRAIN
        self.target = ctx.config.replicas
        self.pg = None
        self.intra = None  # this replica's own procs; they die together, so it is formed once
        self.fresh = True
        """This proc has never joined a generation: its state was never exchanged with anyone."""
        self.holds = False
        """This proc holds the run's trained state: it joined a generation, so it healed from a holder, was one, or
        restored the run's checkpoint (counted once in `Key.holds`)."""
        self.holders: list[int] = []
        self.checkpoint: str | None = None
        self.newest_seen = -1
        """The most committed steps this proc has seen a holder of the run's state at (its own, or a peer's when it
        joined): what a RESTORE generation's checkpoint is behind."""
        self._broken = False
        self._regroup_agreed = False
        self._picks = 0  # plans picked so far: the others of a multi-proc replica follow local rank 0's picks
        self._heal_rate: float | None = None  # bytes/s of the last heal this worker took part in
        self.loading: Callable[[], None] = lambda: None
        """Called just before a heal or a restore replaces this proc's state: until then, a join that fails leaves
        the state it had (`StepTransaction.held`)."""

    # -- generations ---------------------------------------------------------------------------------

    def needs_join(self, agreed_only: bool = False) -> bool:
        """Whether this proc enters a new generation at this boundary. `agreed_only`: only on what every member agreed
        in the last committed reduction (a grow, a drain) or a failed one, not on an abort heard alone: the start of a
        semi-synchronous round, which every member of the sync before must start in the same generation."""
        if self.gen < 0 or self._broken or self._regroup_agreed:
            return True
        if agreed_only:
            return False
        # A proc of a multi-proc replica leaves its generation only after a vote with its siblings: seen between
        # steps, an abort it reacted to alone would have it step in the next generation while a sibling, already
        # inside the step, finished it in this one. The step it starts instead fails at once and is dropped by all.
        return self.intra is None and self.flags.abort_gen > self.gen

    def join(self, step: int, patient: bool = False) -> None:
        """Block until this worker is a member of the newest generation and holds the group's state. `patient`: wait
        for it as long as the controller keeps this proc (a member of a stop's `Action.CHECKPOINT` generation that does
        not write waits so, for the stop or for the generation that replaces a writer lost mid-write)."""
        store = self.ctx.store
        if self.gen < 0:
            if self.ctx.procs_per_replica > 1 and self.intra is None:
                try:
                    self.intra = new_group(
                        store, Key.replica_group(self.ctx.replica_id), self.ctx.local_rank,
                        self.ctx.procs_per_replica, "gloo", self.ctx.config.join_timeout_s,
                        superseded=lambda: self.flags.stop,
                    )
                except CollectiveInterrupted as e:
                    if self.flags.stop:
                        raise StopReplica("the controller stopped this replica") from e
                    raise ProtocolError("join", f"this replica's own procs could not form their group: {e}") from e
            store.set(Key.ready(self.ctx.replica_id, self.ctx.local_rank), b"1")
            self.ctx.events.emit("ready", replica=self.ctx.replica_id, pid=os.getpid())
        self.flags.set_phase(Phase.JOIN)
        tried = -1
        waiting = patient
        while True:
            plan = self._agreed_plan(after=tried, waiting=waiting)
            tried = plan.gen
            waiting = plan.action == Action.WAIT
            if waiting:
                # Too few replicas to train at all: hold the state, train nothing, until a plan brings replacements.
                self.ctx.events.emit("wait", replica=self.ctx.replica_id, gen=plan.gen, reason=plan.reason)
                continue
            failure: CollectiveInterrupted | None = None
            held = step
            try:
                self._form(plan, step)
                held = self._catch_up(step)
            except CollectiveInterrupted as e:
                failure = e
                if not isinstance(e, GenerationChanged):
                    # Nobody has moved on (a construction error, a heal past its bound): the controller
                    # finds out who is stuck and plans the next generation; this worker waits for it.
                    self._stalled(plan.gen)
            failed, _, steps = self._vote(failed=failure is not None, gen=plan.gen, step=held)
            if not failed and steps[0] != steps[1]:
                # Each proc healed its own shard from the donor's proc of the same lane: procs at different steps
                # hold no one state, and could only train two models from here. The replica is replaced whole.
                self.report_unfit(plan.gen, f"its procs healed to different steps ({steps[0]} and {steps[1]})")
                failed = True
            if not failed:
                if not self.holds:  # before `formed`: a generation that formed is one whose members all hold it
                    self.holds = True
                    self.ctx.store.set(Key.holds(self.ctx.replica_id, self.ctx.local_rank), b"1")
                # Read by the controller, which publishes a grow only once the generation has formed:
                # a member leaving a half-formed generation for a newer plan would strand its peers in it.
                self.ctx.store.set(Key.formed(self.gen, self.ctx.replica_id, self.ctx.local_rank), b"1")
                return
            reason = str(failure) if failure else "another proc of this replica could not join this generation"
            self.ctx.events.emit("join_retry", gen=plan.gen, reason=reason)
            abandon(self.pg)
            self.pg = None

    def _agreed_plan(self, after: int, waiting: bool) -> Plan:
        """The plan to join next: local rank 0 picks it and publishes its pick, the other procs follow."""
        if self.intra is None:
            return self._next_plan(after, waiting)
        self._picks += 1
        key = Key.pick(self.ctx.replica_id, self._picks)
        store = self.ctx.store
        if self.ctx.local_rank == 0:
            try:
                plan = self._next_plan(after, waiting)
            except StopReplica as e:
                store.set(key, json.dumps({"stop": "StopReplica", "reason": str(e)}))
                raise
            except ProtocolError as e:
                store.set(key, json.dumps({"stop": "ProtocolError", "reason": e.detail}))
                raise
            store.set(key, plan.dumps())
            return plan
        started = time.monotonic()
        bound = self.ctx.config.join_timeout_s + FORMATION_BOUND_S  # local rank 0's own wait, and its pick after it
        while not store.check([key]):
            if self.flags.stop:
                raise StopReplica("the controller stopped this replica")
            # Bounded as local rank 0's own wait is: a spare (no generation yet) or a waiting member waits as long as
            # the controller keeps it.
            if self.gen >= 0 and not waiting and time.monotonic() - started > bound:
                raise ProtocolError("join", f"local rank 0 of replica {self.ctx.replica_id} picked no generation for "
                                    f"this proc in {bound:.0f} s")
            time.sleep(0.005 if time.monotonic() - started < 2.0 else 0.05)
        raw = store.get(key)
        pick = json.loads(raw)
        if "stop" in pick:
            if pick["stop"] == "StopReplica":
                raise StopReplica(pick["reason"])
            raise ProtocolError("join", pick["reason"])
        return Plan.loads(raw)

    def _next_plan(self, after: int, waiting: bool = False) -> Plan:
        """The newest plan that includes this worker, newer than its generation and than `after` (a plan
        it already failed to form: retrying that one could only fail again).

        The controller pushes each new generation's number to its members and to the members of the one it
        replaces (`ControlActor.plan`, `abort`, `regroup`), so a waiting worker learns of it as a message, not by
        asking the store every few milliseconds. It asks the store once every `PLAN_CHECK_S` all the same, for a
        push that could not be delivered and for a spare, which is pushed nothing until a plan includes it.

        A member of a generation waits at most `join_timeout_s` for the next one; a spare, or a member told to wait
        for replacements (`waiting`, an `Action.WAIT` plan), as long as the controller keeps it."""
        store = self.ctx.store
        rid = self.ctx.replica_id
        deadline = time.monotonic() + self.ctx.config.join_timeout_s
        seen = max(self.gen, after)
        while True:
            if self.flags.stop:
                raise StopReplica("the controller stopped this replica")
            latest = self.flags.latest
            if latest > seen:
                plan = Plan.loads(store.get(Key.plan(latest)))
                if rid in plan.members:
                    return plan
                if self.gen >= 0:
                    raise StopReplica(f"generation {latest} does not include replica {rid}")
                seen = latest
            if self.gen >= 0 and not waiting and time.monotonic() > deadline:
                raise ProtocolError(
                    "join", f"replica {rid} waited {self.ctx.config.join_timeout_s:.0f}s for the controller's next "
                    "generation after its own was aborted: is the controller still running?"
                )
            if not self.flags.wait_for_plan(seen, PLAN_CHECK_S):
                try:
                    self.flags.plan(int(store.get(Key.LATEST)))
                except Forged:  # reported; the controller's own announcements still come as messages
                    pass

    def _form(self, plan: Plan, step: int) -> None:
        g, members = plan.gen, plan.members
        rank, world = members.index(self.ctx.replica_id), len(members)
        self.flags.forming = g
        abandon(self.pg)
        self.pg = None
        t0 = time.time()
        self.pg = new_group(
            self.ctx.store, Key.group(g, self.ctx.local_rank), rank, world, self.backend, self.timeout_s,
            superseded=lambda: self.flags.stop or self.flags.latest > g,
            fault_point=lambda where: self.ctx.fault_point(where, step), construct_bound_s=FORMATION_BOUND_S,
            address=self.ctx.bind_address,
        )
        self.gen, self.rank, self.world, self.members = g, rank, world, list(members)
        self.action, self.target = plan.action, plan.target
        self.holders, self.checkpoint = list(plan.holders), plan.checkpoint
        self._broken = self._regroup_agreed = False
        self.ctx.events.emit(
            "join", replica=self.ctx.replica_id, gen=g, rank=rank, world=world, members=members,
            seconds=round(time.time() - t0, 4),
        )

    def _superseded(self) -> bool:
        return self.flags.stop or self.flags.latest > self.gen

    def _catch_up(self, step: int) -> int:
        """Hold the run's trained state at its newest step: heal from the generation's holders if behind (or load
        the checkpoint of a RESTORE generation). Returns the committed steps this proc holds now."""
        if self.action == Action.RESTORE:
            return self._restore()
        holders = [m in self.holders for m in self.members]
        if self.pg is None:
            if not holders[0]:
                raise ProtocolError("join", f"replica {self.ctx.replica_id} is alone in generation {self.gen} and "
                                    "holds no state of the run's: a generation like that is never published to "
                                    "train; a bug in monarch-plugin")
            self.fresh = False
            return step
        mine = torch.tensor([step, int(self.fresh)], dtype=torch.int64, device=self.device)
        everyone = [torch.zeros_like(mine) for _ in range(self.world)]
        wait_all([self.pg.allgather([everyone], [mine])], self.flags, self.gen, FORMATION_BOUND_S)
        steps = [int(t[0]) for t in everyone]
        fresh = [bool(t[1]) for t in everyone]
        self.newest_seen = max([self.newest_seen, *(n for n, held in zip(steps, holders) if held)])
        plan = plan_heal(steps, fresh, holders, self.ctx.config.heal_donors)
        if plan is None or self.rank not in (*plan.donors, *plan.recipients):
            self.fresh = False
            return step
        share = plan.donors.index(self.rank) if self.rank in plan.donors else None
        recipients = [self.members[r] for r in plan.recipients]
        donors = [self.members[d] for d in plan.donors]
        t0 = time.time()
        groups = []  # a donor forms its share's group; a recipient forms every share's, in the plan's order
        try:
            for j in range(len(plan.donors)) if share is None else (share,):
                order = [plan.donors[j], *plan.recipients]
                groups.append(new_group(
                    self.ctx.store, Key.heal_group(self.gen, self.ctx.local_rank, j), order.index(self.rank),
                    len(order), self.backend, self.timeout_s, superseded=self._superseded,
                    address=self.ctx.bind_address,
                ))
            state, moved = transfer_state(
                groups, share, len(plan.donors), self.provider, self.device, self.flags, self.gen,
                bytes_per_s=self._heal_rate,
                fault_point=lambda where: self.ctx.fault_point(where, step),
            )
        except CollectiveTimedOut as e:
            # Past its bound: never waited for. The controller treats the recipients as hung (unless a probe finds
            # a member that stopped answering, which is then the one at fault).
            for recipient in recipients:
                self.report_unfit(self.gen, "its heal did not finish within its bound", recipient)
            self.ctx.events.emit("heal_abandoned", gen=self.gen, donor=donors[0], donors=donors,
                                 recipients=recipients, reason=str(e))
            raise
        finally:
            for group in groups:
                abandon(group)
        if state is not None:
            self.loading()
            self.provider.load_state_dict(state)
        self.fresh = False
        self._heal_rate = moved.bytes / max(moved.seconds, 1e-6)
        if share is not None:  # one event per share: a heal's bytes are their sum, its time the longest
            self.ctx.events.emit(
                "heal", gen=self.gen, donor=donors[share], donors=donors, share=share, recipients=recipients,
                step=plan.step, bytes=moved.bytes, seconds=round(time.time() - t0, 4),
                transfer_s=round(moved.seconds, 4), bound_s=round(moved.bound_s, 1),
            )
        return plan.step if self.rank in plan.recipients else step

    def _restore(self) -> int:
        """Load the checkpoint of a RESTORE generation: the last holder of the run's state is gone, and what the run
        trained since this checkpoint is trained again."""
        if self.restore is None:
            raise ProtocolError("heal", f"generation {self.gen} restores {self.checkpoint}, but this front end cannot "
                                "load a checkpoint mid-run: a bug in monarch-plugin (only ElasticLoop's are restored)")
        t0 = time.time()
        self.loading()
        step = self.restore(self.checkpoint)
        self.fresh = False
        self.ctx.events.emit("restored", replica=self.ctx.replica_id, gen=self.gen, step=step, path=self.checkpoint,
                             seconds=round(time.time() - t0, 4), newest_seen=self.newest_seen)
        return step

    def _stalled(self, gen: int) -> None:
        """Tell the controller that a collective or formation of this proc's in generation `gen` failed or timed out: a
        signed key of this proc's (what it acts on), then the count it polls (which only makes it look)."""
        self.ctx.store.set(Key.stalled_by(gen, self.ctx.replica_id, self.ctx.local_rank), b"1")
        self.ctx.store.add(Key.stalled(gen), 1)

    def report_unfit(self, gen: int, why: str, replica: int | None = None) -> None:
        """Tell the controller a replica (this one, unless named) cannot go on in generation `gen` although its procs
        answer: it is replaced as a hung one is."""
        replica = self.ctx.replica_id if replica is None else replica
        self.ctx.events.emit("unfit", replica=replica, gen=gen, why=why)
        self.ctx.store.append(Key.unfit(gen), unfit_line(replica, why))
        self._stalled(gen)

    # -- steps ---------------------------------------------------------------------------------------

    def begin_step(self, reducer, weight: float) -> None:
        """Arm the reducer so this step's backward starts reducing on the current generation's group."""
        if self.pg is not None:
            reducer.arm(self.pg, weight, self.flags, self.gen, self.timeout_s)

    def reduce(self, reducer, weight: float, metrics: list[float]) -> list[float]:
        """One step's transaction over the current generation; raises CollectiveInterrupted to drop it."""
        failure: CollectiveInterrupted | None = None
        if self.pg is None:
            reducer.scale_local(weight)
            grow, reduced = self.flags.regroup_gen > self.gen, list(metrics)
            if self.flags.abort_gen > self.gen:  # alone, nothing else fails the step of an aborted generation
                failure = GenerationChanged(f"generation {self.gen} superseded by {self.flags.abort_gen}")
        else:
            self.flags.set_phase(Phase.REDUCE)
            try:
                grow, reduced = reducer.reduce(list(metrics))
            except CollectiveInterrupted as e:
                failure, grow, reduced = e, False, list(metrics)
                if not isinstance(e, GenerationChanged):
                    # A timeout, or an error of the backend's (a peer's connection reset) that no death explains
                    # yet: the controller waits a moment for one, then finds who is stuck or plans again.
                    self._stalled(self.gen)
        failed, grow, _ = self._vote(failed=failure is not None, gen=self.gen, grow=grow)
        if failed:
            self._broken = True
            raise failure or CollectiveInterrupted("another proc of this replica dropped the step")
        self._regroup_agreed = grow
        self.flags.set_phase(Phase.COMPUTE)
        return reduced

    def _vote(self, failed: bool, gen: int, grow: bool = False, step: int = 0) -> tuple[bool, bool, tuple[int, int]]:
        """Whether any proc of this replica failed, whether any saw a grow waiting, and the lowest and highest `step`
        among them: the procs of one replica commit or drop an attempt together and move to a new generation
        together, though their cross-replica groups can disagree when a peer dies mid-step.

        The vote is not interruptible by an abort: a proc that walked away from it while its sibling
        read the result would drop a step the sibling commits, and the two would part ways for good.
        Siblings die together (the controller kills the rest of a replica), so only a sibling that stopped making
        progress holds a vote up: past the collective timeout the replica reports itself unfit to go on (the
        controller replaces it whole) and counts the vote as failed, so this proc waits for the next plan."""
        if self.intra is None:
            return failed, grow, (step, step)
        vote = torch.tensor([failed, grow, gen, -gen, step, -step], dtype=torch.float64)  # exact to 2**53
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        try:
            wait_all([self.intra.allreduce([vote], opts)], self.flags, self.gen, self.timeout_s, interruptible=False)
        except CollectiveTimedOut:
            self.report_unfit(gen, f"a vote among its own procs took longer than {self.timeout_s:g} s (one of them "
                                   "stopped making progress)")
            self._broken = True
            return True, False, (step, step)
        if vote[2] != -vote[3]:
            raise ProtocolError("vote", f"the procs of replica {self.ctx.replica_id} voted from different generations "
                                f"({int(-vote[3])} and {int(vote[2])}): a bug in monarch-plugin")
        return bool(vote[0] > 0), bool(vote[1] > 0), (int(-vote[5]), int(vote[4]))

    def any_of(self, flag: bool) -> bool:
        """Whether `flag` holds in any proc of this replica: a decision its procs take together between steps (to skip
        a checkpoint whose previous write one of them is still doing). As a vote, so a silent sibling counts as True."""
        return self._vote(failed=flag, gen=self.gen)[0]

    def finish(self) -> bool:
        """Leave together: True once every member of this generation has reached the end of training.

        False if the generation was aborted first (a peer died at the very end); the caller rejoins, which
        heals any member that dropped the last step, and finishes again. A generation of one passes its barrier too:
        that it passed is how the controller knows training is over before anyone returned (`handshake.passed`).
        """
        self.flags.set_phase(Phase.FINISH)
        aborted = False
        try:
            barrier(self.ctx.store, Key.finished(self.gen, self.ctx.local_rank), self.rank, self.world,
                    self.ctx.config.join_timeout_s, lambda: self.flags.abort_gen > self.gen or self.flags.stop)
        except GenerationChanged:
            aborted = True
        except CollectiveTimedOut:
            raise ProtocolError("barrier", f"the replicas did not all reach the end of training within "
                                f"join_timeout_s {self.ctx.config.join_timeout_s:g}") from None
        if self._vote(failed=aborted, gen=self.gen)[0]:
            self._broken = True
            return False
        self.flags.finished_gen = self.gen
        return True

    def close(self) -> None:
        abandon(self.pg)
        abandon(self.intra)
        self.pg = None
        self.intra = None
