"""Semi-synchronous training (DiLoCo, LocalSGD): each replica takes `sync_every` local steps, then the replicas sync.

Between syncs a replica steps its own (inner) optimizer on its shares of the round's global batches and talks to
nobody; a sync is the run's commit point, one transaction of the same step protocol as a synchronous step
(`StepTransaction`): each replica puts its pseudo-gradient (the synced parameters minus its local ones, as the DiLoCo
paper and torchft's `DiLoCo`) where the gradients go, the reducer sums them weighted by the replica's share of the
round's samples, and every replica steps the outer optimizer from the synced parameters. LocalSGD is the same with an
outer SGD of learning rate 1 and no momentum: the synced parameters minus the mean pseudo-gradient are the mean of the
replicas' parameters.

A round's samples are learned exactly once (`Round`). A replica that dies, hangs or is removed before the sync
commits takes its local steps with it: its samples since the last sync were never learned by the synced model, so
the replicas of the generation that syncs train them first, cut over them as a step's global batch is (the runtime's
`share`), and the weights of the sync are each replica's fraction of the samples it trained. Every replica computes
the same cut from the same ledger, which holds because every member of a sync starts the next round in the same
generation (a round's start enters a new generation only on what the sync agreed, `ReplicaSession.needs_join`) and
joins the next one only at the round's sync. A replica healed in the middle of a sync receives the ledger with the
synced parameters and takes its part of the lost samples too; one the ledger says trained samples (a member that
dropped the sync its peers committed, healed to theirs) trained nothing of this round in the state it now holds, and
trains them again (`owed`).

Counters: the run's committed steps (`ElasticLoop.step`) and the data cursor move at a sync, by the round's steps, so
the state a newcomer heals from and a checkpoint holds is always a synced one. The learning-rate scheduler steps at
every step of the round's schedule, never for the lost samples trained again (they are the round's own steps, trained
late), so every replica's schedule stays at the run's step count; the inner optimizer steps for them (its own
counters, Adam's included, are per replica and run ahead on the replicas that trained more).
"""

from __future__ import annotations

import contextlib

import torch

from monarch_plugin.data.sampler import share
from monarch_plugin.worker.dtensors import local_part

__all__ = ["Round", "SemiSync", "default_outer_optimizer"]


def default_outer_optimizer(params, method: str) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer as the paper and torchtitan's torchft integration set it (Nesterov SGD, lr 0.7,
    momentum 0.9); LocalSGD's, plain SGD of learning rate 1: the mean of the replicas' parameters."""
    if method == "local_sgd":
        return torch.optim.SGD(params, lr=1.0)
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


class Round:
    """The samples of one round between syncs, and which replica trained which: the ledger of the round's sync.

    At the start, each member of the round's generation trains its share of each of the round's global batches.
    `regroup(members)` hands the samples of every replica no longer a member to those that are, cut into batches of
    the round's global batch size, each shared over them; it returns each member's new batches (to train before the
    sync). Pure: every member (and a newcomer given the ledger) computes the same."""

    def __init__(self, batches: list[list[int]], members: list[int]):
        self.size = len(batches[0])
        self.steps = len(batches)
        self.trained: dict[int, list[list[int]]] = {
            rid: [share(batch, rank, len(members)) for batch in batches] for rid, rank in zip(members, range(len(members)))
        }

    def regroup(self, members: list[int]) -> dict[int, list[list[int]]]:
        lost = [rid for rid in self.trained if rid not in members]
        orphans = [i for rid in lost for batch in self.trained.pop(rid) for i in batch]
        extra: dict[int, list[list[int]]] = {rid: [] for rid in members}
        for rid in members:
            self.trained.setdefault(rid, [])
        for start in range(0, len(orphans), self.size):
            chunk = orphans[start : start + self.size]
            for rank, rid in enumerate(members):
                mine = share(chunk, rank, len(members))
                if mine:
                    extra[rid].append(mine)
                    self.trained[rid].append(mine)
        return extra

    def weight(self, rid: int) -> float:
        """`rid`'s fraction of the samples the round's replicas trained: its pseudo-gradient's weight in the sync."""
        total = sum(len(batch) for batches in self.trained.values() for batch in batches)
        return sum(len(batch) for batch in self.trained.get(rid, ())) / total

    def samples(self) -> list[int]:
        return sorted(i for batches in self.trained.values() for batch in batches for i in batch)

    def state_dict(self) -> dict:
        return {"size": self.size, "steps": self.steps,
                "trained": [[rid, batches] for rid, batches in self.trained.items()]}

    @classmethod
    def from_state(cls, state: dict) -> "Round":
        ledger = cls.__new__(cls)
        ledger.size, ledger.steps = state["size"], state["steps"]
        ledger.trained = {int(rid): [list(b) for b in batches] for rid, batches in state["trained"]}
        return ledger


class SemiSync:
    """One replica's side of the syncs: the synced parameters (kept while the local ones move), the outer optimizer
    over the model's parameters, the round in progress (`Round`, None between rounds) and the metrics its local steps
    summed, which the sync sums over the replicas."""

    def __init__(self, model: torch.nn.Module, method: str, every: int, outer: torch.optim.Optimizer | None):
        self.method, self.every = method, every
        self.params = dict(model.named_parameters())
        first = {id(p): name for name, p in self.params.items()}
        self.aliases = {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
        """Every name a parameter has in the model's state dict (tied weights have several), to its one synced copy."""
        self.outer = outer or default_outer_optimizer(model.parameters(), method)
        self.synced = {name: local_part(p).detach().clone() for name, p in self.params.items()}
        self.round: Round | None = None
        self.schedule: dict = {}
        """The front end's schedule as the round started (its scheduler, its learning rates): what a checkpoint written
        mid-round holds beside the synced parameters."""
        self.owed: list[list[int]] = []
        """Batches the ledger says this replica trained this round that its state has not learned: to train before
        the sync."""
        self.syncs = 0
        """The run's syncs committed."""
        self.metrics: dict[str, torch.Tensor] = {}
        self.shapes: dict[str, list[int]] = {}
        """The metrics' names and shapes: what a replica that trained nothing this round still sums (zeros)."""

    def start(self, batches: list[list[int]], members: list[int], schedule: dict) -> None:
        self.round, self.schedule = Round(batches, members), schedule
        self.metrics, self.owed = {}, []

    def add_metrics(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.shapes[name] = list(t.shape)
            self.metrics[name] = self.metrics[name] + t if name in self.metrics else t.clone()

    def round_metrics(self) -> dict[str, torch.Tensor]:
        """The round's metrics, by name in one order on every replica; zeros for those it never passed."""
        return {n: self.metrics.get(n, torch.zeros(self.shapes[n], dtype=torch.float64)) for n in sorted(self.shapes)}

    def synced_state(self) -> dict[str, torch.Tensor]:
        """The synced parameters under every name the model's state dict gives them."""
        return {name: self.synced[first] for name, first in self.aliases.items()}

    def pseudo_gradients(self) -> None:
        """Each parameter's gradient is its pseudo-gradient: the synced value minus the local one."""
        with torch.no_grad():
            for name, p in self.params.items():
                local = local_part(p)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                local_part(p.grad).copy_(self.synced[name].to(local.device) - local)

    def outer_step(self) -> None:
        """The gradients hold the mean pseudo-gradient: from the synced parameters, the outer optimizer steps, and its
        result is the new synced state, every replica's parameters."""
        with torch.no_grad():
            for name, p in self.params.items():
                local_part(p).copy_(self.synced[name])
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, p in self.params.items():
                self.synced[name].copy_(local_part(p))
        self.round, self.metrics, self.syncs = None, {}, self.syncs + 1

    @contextlib.contextmanager
    def synced_parameters(self):
        """For the duration, the parameters hold the synced values (what a checkpoint or a heal of the run's state
        holds, mid-round); the local ones after."""
        with torch.no_grad():
            local = {name: local_part(p).detach().clone() for name, p in self.params.items()}
            for name, p in self.params.items():
                local_part(p).copy_(self.synced[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.params.items():
                    local_part(p).copy_(local[name])

    def state_dict(self) -> dict:
        """What a newcomer heals from besides the model (whose parameters it takes as synced): the outer optimizer's
        state, the round in progress and the schedule it started with, the metrics' shapes and the syncs count."""
        return {"outer": self.outer.state_dict(), "round": None if self.round is None else self.round.state_dict(),
                "schedule": self.schedule, "shapes": [[n, s] for n, s in self.shapes.items()], "syncs": self.syncs}

    def load_state_dict(self, state: dict, rid: int) -> None:
        """A heal's (replica `rid` receives it); the model's parameters were loaded with the synced values."""
        self.outer.load_state_dict(state["outer"])
        self.round = None if state["round"] is None else Round.from_state(state["round"])
        self.owed = list(self.round.trained.get(rid, [])) if self.round is not None else []
        self.schedule, self.shapes = state["schedule"], {n: list(s) for n, s in state["shapes"]}
        self.metrics, self.syncs = {}, state["syncs"]
        self.resync()

    def resync(self) -> None:
        """The parameters were loaded (a heal, a checkpoint): they are the synced ones."""
        with torch.no_grad():
            for name, p in self.params.items():
                self.synced[name].copy_(local_part(p))
