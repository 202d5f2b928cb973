"""The controller's decisions, as pure functions of what it knows: who trains next, whether to respawn, when to stop.

`ElasticController` gathers the facts (who is alive, who is ready, how many replacements died early) and acts on
these answers (publish a generation, schedule a spawn, give up with a checkpoint); nothing here touches a
process, the store or the clock, so every policy is unit-tested as it is.
"""

from __future__ import annotations

from monarch_plugin.config import ElasticConfig
from monarch_plugin.wire.protocol import Raised

__all__ = ["MAX_BACKOFF_S", "WAIT_WHY", "admit", "below_min", "crash_loop", "grown", "next_members", "oom_floor",
           "place", "respawn_delay", "respawn_refused", "respawn_wanted", "same_error", "short_of_floor", "state_lost"]

MAX_BACKOFF_S = 30.0
"""The longest a replacement waits after replacements that died before joining."""


def next_members(survivors: list[int], waiting: list[int], wanted: int) -> list[int]:
    """The generation after a death: the survivors, then ready replicas (hot spares, replacements that finished
    starting) in the order they became ready, up to the `wanted` size (`grown`)."""
    return survivors + waiting[: max(wanted - len(survivors), 0)]


def admit(members: list[int], waiting: list[int], wanted: int) -> list[int]:
    """Ready replicas to grow the current generation with, up to `wanted`; the rest wait as hot spares."""
    return waiting[: max(wanted - len(members), 0)]


def grown(wanted: int, slots: int, config: ElasticConfig) -> int:
    """The run's size once a machine joins mid-run with room for `slots` replicas: new capacity grows it, from
    `replicas` up to `max_replicas` (a host that comes back only gives room to the replicas it lost)."""
    return min(wanted + slots, config.max_replicas)


def below_min(trainable: int, config: ElasticConfig) -> str | None:
    """Why the run must stop after a death, if too few replicas can keep training: the survivors, and the ready
    replicas (replacements, hot spares) of the next generation, which heal from them (`next_members`)."""
    if trainable >= config.min_replicas:
        return None
    return (f"{trainable} live replica(s) left, below `min_replicas` {config.min_replicas}: stopping (lower "
            "`min_replicas` to keep training on fewer)")


def drain_stop(staying: int, leaving: list[int], signal: str, config: ElasticConfig) -> str | None:
    """Why the run stops instead of draining the replicas told to go (`leaving`, by `signal`): none would stay (a
    scheduler preempting the whole job), or fewer than `min_replicas`. A drain never takes the run below its minimum:
    it stops with a checkpoint, which a relaunch resumes."""
    who = f"replica {leaving[0]}" if len(leaving) == 1 else f"replicas {leaving}"
    if staying == 0:
        return f"{signal} to every replica ({who}): the job is being stopped"
    if staying < config.min_replicas:
        return (f"{signal} to {who} would leave {staying} replica(s), below `min_replicas` {config.min_replicas}: "
                "the run stops with a checkpoint instead of draining (lower `min_replicas` to train on fewer)")
    return None


def state_lost(checkpoint: str | None) -> str | None:
    """Why the run must stop when no live replica holds its trained state any more (the last that did died before
    another had healed from it): no checkpoint of this run's own (`checkpoint_steps`) to restore mid-run. Training
    on from any replica's own weights would throw away what the run trained, silently."""
    if checkpoint is not None:
        return None
    return ("the last replica holding the run's trained state died before another had healed from it, and this run "
            "wrote no checkpoint to restore mid-run (ElasticLoop's `checkpoint_steps`)")


def same_error(first: int, second: int, raised: Raised) -> str:
    """Why the run stops when replica `second` raised what replica `first` raised, the same exception at the same step
    (`raised`): on other data, the same code failed at the same place, which a replacement would run again."""
    if raised.oom:
        return (f"replicas {first} and {second} both ran out of memory at step {raised.step} ({raised.error}): a "
                "share of the global batch does not fit on one device; lower the per-device batch (or the model's "
                "memory: activation checkpointing, a smaller sequence length), or train on more devices")
    return (f"the training code raised at step {raised.step} in replica {first} and again in replica {second}, on "
            f"other data ({raised.error}): the same exception at the same step is the code's own, which replacing "
            "replicas cannot fix")


def forged(replica: int, error: str, store: str) -> str:
    """Why the run stops when replica `replica` found a value in the run's store that the run did not write (`error`,
    `signing.Forged`'s message): something without the run's secret reaches its store, at `store`, and may have erased
    or replaced what the replica needed. Acting on it could train the wrong model, and another replica would meet it
    again: the run stops with its checkpoint."""
    what = error.split("monarch-plugin's store: ", 1)[-1]
    return (f"replica {replica} found {what}; something without the run's secret can reach the run's store at {store}: "
            "the run stopped rather than act on it. Keep the store's address on a network only the job's hosts reach "
            "(`store_host`), and see docs/reliability.md, \"Who can steer a run\"")


WAIT_WHY = ("a replica ran out of memory, and on fewer replicas each would take a larger share of the global batch "
            "(`batch_policy` constant_global)")
"""Why a generation waits for replacements instead of training (`oom_floor`)."""


def oom_floor(members: int, config: ElasticConfig) -> int:
    """The fewest replicas the run may train on once a member of a generation of `members` ran out of memory.

    The global batch is constant ("constant_global", every framework front end's): on fewer replicas each one's share
    is larger than the one that did not fit, and the survivors would run out of memory in turn. So the run never
    shrinks below that size again: it waits for replacements (`Action.WAIT`), and stops if none can come. Under
    ElasticLoop's "constant_local" a share keeps its size whatever the replica count: no floor (0)."""
    return members if config.batch_policy == "constant_global" else 0


def short_of_floor(members: int, coming: int, floor: int, waited_s: float, config: ElasticConfig) -> str | None:
    """Why the run must stop when its waiting `members` and the replicas `coming` (starting, or due to) cannot reach
    the `oom_floor`: no replacement can come (`max_restarts` used, or it died), or they waited `join_timeout_s` for
    them (no host has room, or they never get ready): nothing waits unbounded."""
    fixes = ("lower the per-device batch, keep replacements ready (`spares`), or under ElasticLoop use "
             "`batch_policy` constant_local, which keeps each replica's share when the run shrinks")
    if members + coming < floor:
        return (f"{WAIT_WHY}, so it trains on no fewer than {floor}; {members} replica(s) are left and "
                f"{'no replacement is' if not coming else f'only {coming} replacement(s) are'} coming: {fixes}")
    if waited_s > config.join_timeout_s:
        return (f"{WAIT_WHY}, so it trains on no fewer than {floor}; {members} replica(s) waited `join_timeout_s` "
                f"{config.join_timeout_s:g} for the replacements to join: {fixes}")
    return None


def crash_loop(early_deaths: int, config: ElasticConfig) -> str | None:
    """Why the run must stop, if replacements keep dying before they join (`crash_loop_limit` 0: never)."""
    if config.crash_loop_limit <= 0 or early_deaths < config.crash_loop_limit:
        return None
    return (f"{early_deaths} replacement replicas in a row died before joining: a crash loop, probably a bug in "
            "the training code or the environment; see the worker logs")


def respawn_wanted(live: int, scheduled: int, wanted: int, config: ElasticConfig) -> bool:
    """Whether a replica is missing: fewer live and scheduled than the `wanted` size plus `spares`."""
    return live + scheduled < wanted + config.spares


def respawn_refused(restarts: int, scheduled: int, config: ElasticConfig) -> str | None:
    """Why a missing replica may not be replaced: `max_restarts` replacements already spawned or scheduled."""
    if restarts + scheduled < config.max_restarts:
        return None
    return f"`max_restarts` {config.max_restarts} used"


def respawn_delay(early_deaths: int, config: ElasticConfig) -> float:
    """Seconds before the next replacement: none after a death (the first replacement goes at once), doubling
    from `restart_backoff_s` with each replacement in a row that died before joining, at most MAX_BACKOFF_S."""
    if not early_deaths or config.restart_backoff_s <= 0:
        return 0.0
    return min(config.restart_backoff_s * 2 ** (early_deaths - 1), MAX_BACKOFF_S)


def place(rooms: dict[int, tuple[int, set[int]]]) -> tuple[int, int] | None:
    """Where a new replica goes, given each live host's `(slots, held slots)`: the host holding the fewest replicas
    that has a free slot (ties: the lowest host number), in its lowest free slot; None when no host has room.

    Spreading keeps a host's loss from taking more replicas than it must; a replacement lands on whichever host
    has room, the one that lost it (its slot freed) or one that came back or joined."""
    free = [(len(held), host, min(set(range(slots)) - held)) for host, (slots, held) in rooms.items()
            if len(held) < slots]
    if not free:
        return None
    _, host, slot = min(free)
    return host, slot
