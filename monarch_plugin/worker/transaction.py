"""The step transaction: the one protocol every front end drives, whatever its training loop looks like.

torchft keeps its optimizer glue tiny with a narrow protocol (`start_quorum` / `allreduce` / `should_commit`).
This is ours; `ElasticLoop`, the Lightning strategies, the HF callback and the torchtitan trainer call it at
their own hooks, and none of them emits a worker event or names a phase itself:

    tx.sync(committed)                  # a step boundary: enter a waiting generation (join, heal, give up)
    tx.begin(step)                      # an attempt at the next step starts (faults, phase, buffers)
    tx.arm(weight)                      # its backward reduces as it goes, weighted by this replica's share
    ... forward / backward ...
    reduced = tx.reduce(step, metrics, zero_grad)
    if reduced is None: ...             # dropped (gradients cleared): sync and attempt the step again
    else: optimizer.step(); tx.committed(step)
    ...
    tx.finish(lambda: committed)        # after the last step: leave together

A framework's front end runs the middle as one call, `tx.commit(step, committed, attempt, zero_grad)`: the
commit-or-redo loop, which reduces the attempt and, while it is dropped, enters the new generation and has the
front end attempt the step again on its new shares, until it commits or a heal hands the step over.

`committed` is the number of steps this replica has committed; `step` is the front end's own number for the step
in flight, the one its users see and `--fault ...:step=N` names (0-based in ElasticLoop, Lightning and HF, 1-based
in torchtitan). The state a newcomer heals from is the front end's (a `StateProvider`); its RNG part is
`rng_state` / `set_rng_state` here, so every front end carries the same generators.
"""

from __future__ import annotations

import contextlib
import random
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from monarch_plugin.wire.protocol import Action, Phase
from monarch_plugin.errors import ProtocolError
from monarch_plugin.wire.handshake import CollectiveInterrupted
from monarch_plugin.worker import orphan
from monarch_plugin.worker.context import WorkerContext
from monarch_plugin.worker.heal import StateProvider
from monarch_plugin.worker.reducer import GradientReducer
from monarch_plugin.worker.session import ReplicaSession, StopReplica

__all__ = ["StepTransaction", "TrainingState", "rng_state", "set_rng_state", "PROGRESS_INTERVAL_S"]

PROGRESS_INTERVAL_S = 1.0
"""How often the generation's rank 0 records a `progress` event (its newest committed step): often enough for a
timeline of steps per second, rare enough that a long run's events file stays small."""


class StepTransaction:
    """One proc's part in the run's steps: its generation, its reducer, and the events of both."""

    def __init__(
        self,
        ctx: WorkerContext,
        provider: StateProvider,
        params: list[torch.nn.Parameter],
        *,
        buffers_of: list[torch.nn.Module] = (),
        overlap: bool = True,
        give_up: Callable[[int], str | None],
        newest_checkpoint: Callable[[], str | None] | None = None,
        restore: Callable[[str], int] | None = None,
        on_join: Callable[[], None] = lambda: None,
    ):
        """`give_up(committed)` writes the front end's checkpoint when the controller gives up, called on every
        proc of the generation's first replica (rank 0; an FSDP replica's procs all take part), and returns its
        path on the one proc that wrote it (None elsewhere); every replica then stops. `newest_checkpoint()` names
        the newest one the front end's own checkpointing holds, which a run that stops with no replica left holding
        its state tells its user to resume from (asked by the controller through the control actor, from its
        thread). `restore(path)` loads one mid-run (a RESTORE generation) and returns its committed steps. `on_join()`
        runs after this proc entered a generation, which may have moved its rank (who logs and writes)."""
        self.ctx = ctx
        ctx.transaction = self
        self.newest_checkpoint = newest_checkpoint or (lambda: None)
        self.session = ReplicaSession(ctx, provider, restore)
        self.session.loading = self._release
        self.reducer = GradientReducer(params, self.session.device, overlap=overlap, buffers_of=buffers_of)
        self._give_up = give_up
        self._on_join = on_join
        self._weight = 1.0
        self._announced_gen = -1
        self._progress_at = 0.0
        self._dropped_at: float | None = None
        self.recoveries = 0
        """Steps this proc had dropped for a failure and then, in a new generation, committed."""
        self.last_recovery_s: float | None = None
        """The newest of those: seconds from the drop to the commit, the pause in training as this proc lived it."""
        self._held_rng: dict = {}
        self._attempt_open = False
        """An attempt at a step began and has not committed: its forward passes may have moved the buffers."""
        self.held: int | None = None
        """The committed steps the front end's state holds untouched: set at each step boundary, kept through the
        attempt's forward, backward and reduction, None from a commit (the optimizer stepping) to the next boundary
        and while a heal loads. If the training code raises while it is set, this proc can still write the run's
        give-up checkpoint (`checkpoint_held`)."""
        self._step = -1
        self._inject_in_passes(buffers_of)

    @property
    def gen(self) -> int:
        return self.session.gen

    @property
    def rank(self) -> int:
        return self.session.rank

    @property
    def world(self) -> int:
        return self.session.world

    @property
    def device(self) -> torch.device:
        return self.session.device

    def sync(self, committed: int, agreed_only: bool = False) -> bool:
        """At a step boundary: enter the newest generation if one is waiting (a death, or a grow agreed inside
        the last step), healing from a peer if behind. True if this proc joined one, so the front end can
        re-read its rank and shares. A generation the controller gave up in writes the checkpoint and stops.
        `agreed_only`: the start of a semi-synchronous round (`ReplicaSession.needs_join`)."""
        session = self.session
        self._hold(committed)  # until a heal or a restore loads another state (`ReplicaSession.loading`)
        if session.flags.lost:  # the controller is gone: save the run and end (`orphan`)
            orphan.save(self)
        if not session.needs_join(agreed_only):
            return False
        try:
            with _runtime_part("join"):
                session.join(committed)
            self._hold(session.provider.step)  # past `committed` if the join healed this proc
            while session.action == Action.CHECKPOINT:
                # The controller gave up: the generation's rank 0 writes the checkpoint of the step the state holds;
                # the others wait for its word, a stop once it is written, or a generation without a writer it lost.
                if self.rank == 0:
                    raise StopReplica("the controller gave up; checkpoint written", checkpoint=self.write_held())
                with _runtime_part("join"):
                    session.join(self.held, patient=True)
                self._hold(session.provider.step)
        except (StopReplica, ProtocolError) as e:
            # Lost mid-join: what this proc holds is still the run's, if it holds a step (and wrote none just now).
            if session.flags.lost and getattr(e, "checkpoint", None) is None:
                orphan.save(self)
            raise
        self._on_join()
        return True

    def begin(self, step: int) -> None:
        """An attempt at `step` starts, before its first forward: the controller sees the proc computing it, the
        fault injected there fires, and the buffers are as the step's first attempt found them."""
        self._step, self._attempt_open = step, True
        self.session.flags.set_phase(Phase.COMPUTE, step)
        self.ctx.fault_point("step", step)
        self.reducer.begin_attempt(step)

    def local_step(self, step: int) -> None:
        """A semi-synchronous replica's own step `step` starts, after the round's first (`begin`): nothing is reduced
        until the round's sync, but the controller sees it computing and the fault injected there fires. Its state
        holds the last sync's at every such boundary (`held`), so a lost controller is answered here, not at the end
        of a round that may outlast `controller_loss_save_s`."""
        if self.session.flags.lost:
            orphan.save(self)
        self._step = step
        self.session.flags.set_phase(Phase.COMPUTE, step)
        self.ctx.fault_point("step", step)

    def arm(self, weight: float) -> None:
        """The attempt's (last) backward reduces as gradients arrive, each scaled by `weight`, this replica's
        fraction of the step's samples, so the sum over replicas is the mean over the global batch."""
        self._weight = weight
        self.session.begin_step(self.reducer, weight)

    def reduce(self, step: int, metrics: list[float], zero_grad: Callable[[], None]) -> list[float] | None:
        """Commit or drop the attempt: the metrics summed over the live replicas, or None if it was dropped, in
        which case the gradients are already cleared (`zero_grad`) and the front end syncs and tries again."""
        try:
            with _runtime_part("reduce"):
                reduced = self.session.reduce(self.reducer, self._weight, list(metrics))
            self.held, self._attempt_open = None, False  # committed: the front end steps its optimizer now
            return reduced
        except CollectiveInterrupted as e:
            zero_grad()
            if self._dropped_at is None:
                self._dropped_at = time.monotonic()
            self.ctx.events.emit("dropped_step", replica=self.ctx.replica_id, step=step, gen=self.gen,
                                 reason=type(e).__name__)
            return None

    def commit(self, step: int, committed: Callable[[], int], attempt: Callable[[bool], list[float]],
               zero_grad: Callable[[], None], *, computed: bool = False) -> list[float] | None:
        """Commit step `step`, redoing it as often as it is dropped: the commit-or-redo loop of every front end.

        Each round enters a waiting generation and calls `attempt(redo)`, which computes the step's forward and
        backward on this generation's shares (`redo`: a dropped attempt's gradients are gone) and returns the
        metrics to sum; then the reduction. `computed`: the first attempt's backward already ran (HF's loop runs
        it before the commit point), so the first round only reduces. Returns the summed metrics once the step
        committed, for the front end to step its optimizer; or None when a peer committed the step while ours
        was dropped and the heal handed this proc its result (`committed()`, the front end's count of committed
        steps, moved past the step's; its gradients are cleared)."""
        start, redo, metrics = committed(), False, []
        while True:
            if not computed:
                self.sync(start)
                if committed() > start:
                    zero_grad()
                    # The front end's loop now moves what the catching-up heal left as it was.
                    self.held, self._attempt_open = None, False
                    return None
                metrics = attempt(redo)
            reduced = self.reduce(step, metrics, zero_grad)
            if reduced is not None:
                return reduced
            computed, redo = False, True

    def committed(self, step: int) -> None:
        """Step `step` was committed (the optimizer stepped): the generation's first commit is an event, and one
        proc of the run (the generation's rank 0) records its progress every PROGRESS_INTERVAL_S."""
        self.session.newest_seen = max(self.session.newest_seen, step + 1)
        if self._announced_gen != self.gen:
            self._announced_gen = self.gen
            self.ctx.events.emit("first_commit", replica=self.ctx.replica_id, gen=self.gen, step=step,
                                 world=self.world)
        now = time.monotonic()
        if self._dropped_at is not None:
            self.recoveries += 1
            self.last_recovery_s, self._dropped_at = now - self._dropped_at, None
        if self.rank == 0 and self.ctx.local_rank == 0 and now - self._progress_at >= PROGRESS_INTERVAL_S:
            self._progress_at = now
            self.ctx.events.emit("progress", replica=self.ctx.replica_id, gen=self.gen, step=step, world=self.world)

    def metrics(self) -> dict[str, float]:
        """What a front end logs each step, as `elastic/*` metrics through its framework's logger: the replicas
        live in this step and the run's target, the recoveries this proc lived through and, once there was one,
        the newest's pause in seconds."""
        metrics = {"elastic/replicas": float(self.world), "elastic/target": float(self.session.target),
                   "elastic/recoveries": float(self.recoveries)}
        if self.last_recovery_s is not None:
            metrics["elastic/last_recovery_s"] = round(self.last_recovery_s, 3)
        return metrics

    def finish(self, committed: Callable[[], int]) -> None:
        """After the last step: leave once every live replica has committed it. A death meanwhile is healed
        first (a member that dropped the last step catches up from one that committed it), so `committed` is
        read again each time."""
        while True:
            self.sync(committed())
            with _runtime_part("barrier"):
                if self.session.finish():
                    break
        self.close()

    def checkpoint_held(self) -> str | None:
        """After the training code raised, from the control actor's thread (the training thread is gone): write the
        run's give-up checkpoint from this proc's state, if it is still that of a committed step (`held`). Its path,
        or None when the state changed mid-step or the front end writes none."""
        if self.held is None:
            return None
        self.session.rank, self.session.world = 0, 1  # out of every generation now: the run's one writer
        return self.write_held()

    def write_held(self) -> str | None:
        """Write the run's checkpoint of the committed steps the state holds (`held`), as the last commit left it: an
        attempt since moved the buffers (BatchNorm statistics) and drew from the RNG, and both go back to the step's
        start first, as a run that never failed has them there. Its path, on the proc that wrote it."""
        self.ctx.fault_point("stop_checkpoint", self.held)
        set_rng_state(self._held_rng, self.device)
        with self.reducer.first_attempt_buffers() if self._attempt_open else contextlib.nullcontext():
            path = self._give_up(self.held)
        if path is not None:
            self.ctx.events.emit("checkpoint", replica=self.ctx.replica_id, step=self.held, path=path)
        return path

    def _release(self) -> None:
        """The state is about to be replaced (a heal, a restore): it holds no committed step until the join ends."""
        self.held, self._attempt_open = None, False

    def _hold(self, committed: int) -> None:
        """At a step boundary: the state is that of `committed` steps, and its random generators are as the first
        boundary at that step found them (a dropped attempt drew from them since)."""
        if self.held != committed:
            self.held, self._held_rng = committed, rng_state(self.device)

    def _inject_in_passes(self, modules: list[torch.nn.Module]) -> None:
        """Faults configured to fire mid-forward (`at=forward`: when the model's first layer with parameters runs,
        however the training code calls it) or mid-backward (`at=backward`: when the gradient reaches its last
        layer with parameters), at the step in flight."""
        if not {fault.at for fault in self.ctx.faults} & {"forward", "backward"}:
            return
        fire = self.ctx.fault_point
        leaves = [m for module in modules for m in module.modules()
                  if not list(m.children()) and list(m.parameters(recurse=False))]
        if leaves:
            leaves[0].register_forward_pre_hook(lambda *_: fire("forward", self._step))
            leaves[-1].register_full_backward_pre_hook(lambda *_: fire("backward", self._step))

    def close(self) -> None:
        self.session.close()


@contextlib.contextmanager
def _runtime_part(phase: str):
    """The runtime's own part of a worker: a store it cannot reach, a backend error of its own groups, or a formation
    of its own that could not complete, is a `ProtocolError` of that phase, never reported as the training code's."""
    try:
        yield
    except (dist.DistError, CollectiveInterrupted) as e:
        if isinstance(e, CollectiveInterrupted) and phase == "reduce":
            raise  # the step is dropped: `reduce` handles it
        raise ProtocolError(phase, f"{type(e).__name__}: {e}") from e


class TrainingState:
    """The base of the front ends' heal states (their `StateProvider`): what a newcomer, or a member that dropped a
    step its peers committed, receives from a live peer.

    It carries what every front end has: the modules' and optimizers' states, the RNG and the committed steps; a
    front end adds its own (`extra_state`, `load_extra`). A newcomer takes everything. A member healed while
    `catching_up` (inside a step it dropped and a peer committed, in a loop that is about to finish that step)
    keeps its own learning rates, schedulers, loop progress and RNG, because its loop advances them past the step
    exactly as the donor's already did; it takes the weights, the optimizer's state and the data cursor.
    """

    def __init__(self, owner: object, counter: str, device: Callable[[], torch.device], *,
                 modules: Callable[[], list[torch.nn.Module]], optimizers: Callable[[], list[torch.optim.Optimizer]],
                 schedulers: Callable[[], list] = list):
        """`owner` is the front end, and `counter` the name of its attribute that counts the committed steps (`step`).
        The other arguments are read when the state is served or loaded, since frameworks build these objects after
        the front end (HF's optimizer and scheduler in `train()`): the proc's device, the modules, the optimizers,
        and the learning-rate schedulers if any (anything with `state_dict` and `load_state_dict`)."""
        self.owner, self.counter = owner, counter
        self.device, self.modules, self.optimizers, self.schedulers = device, modules, optimizers, schedulers

    @property
    def step(self) -> int:
        """The committed steps: the front end's own counter."""
        return getattr(self.owner, self.counter)

    @step.setter
    def step(self, value: int) -> None:
        setattr(self.owner, self.counter, value)

    def sharded(self) -> dict:
        """The modules' state as held now: a heal checks a donor's shards against it and rebuilds them on its meshes."""
        return {"model": [m.state_dict() for m in self.modules()]}

    def catching_up(self) -> bool:
        return False

    def extra_state(self) -> dict:
        return {}

    def load_extra(self, state: dict, whole: bool) -> None:
        """Load the front end's own parts of `state`; `whole`: everything (not `catching_up`)."""

    def state_dict(self) -> dict:
        return {"step": self.step, "model": [m.state_dict() for m in self.modules()],
                "optimizers": [o.state_dict() for o in self.optimizers()],
                "schedulers": [s.state_dict() for s in self.schedulers()], **self.extra_state(),
                "rng": rng_state(self.device())}  # last: a stream's state read ahead, and the RNG as of after it

    def load_state_dict(self, state: dict) -> None:
        whole = not self.catching_up()
        for module, saved in zip(self.modules(), state["model"]):
            module.load_state_dict(saved)
        for optimizer, saved in zip(self.optimizers(), state["optimizers"]):
            own = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            optimizer.load_state_dict(saved)
            if not whole:
                for group, hyper in zip(optimizer.param_groups, own):
                    group.update(hyper)
        self.load_extra(state, whole)
        if whole:
            for scheduler, saved in zip(self.schedulers(), state["schedulers"]):
                scheduler.load_state_dict(saved)
            set_rng_state(state["rng"], self.device())
        self.step = state["step"]


def rng_state(device: torch.device) -> dict:
    """This proc's random generators: Python's, NumPy's, torch's CPU one, and the GPU it trains on. Only that one:
    a proc of a k-proc replica sees its replica's k GPUs, and reading a sibling's would create a context there.
    In types that a heal's skeleton and a checkpoint carry without running code (tensors, numbers, strings, lists):
    NumPy's key array as a tensor."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype("int64")),
                       "rest": [name, int(pos), int(has_gauss), float(cached)]}}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore what `rng_state` took; tensors may arrive on the wire's device (a GPU under NCCL), and sequences as
    lists (a checkpoint's)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        name, pos, has_gauss, cached = state["numpy"]["rest"]
        np.random.set_state((name, state["numpy"]["keys"].cpu().numpy().astype("uint32"), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
