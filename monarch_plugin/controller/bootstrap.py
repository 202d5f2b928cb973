"""A run's start, before anything is spawned: its store, its events file, what a killed run left half-written, the
checkpoint it resumes.

It decides which checkpoint the replicas resume (`resume`, "auto": the newest intact one) and refuses a damaged one
named; it may not touch a replica, a host or a generation: nothing of those exists yet.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from monarch_plugin.config import ElasticConfig
from monarch_plugin.errors import ConfigError
from monarch_plugin.events import EventLog
from monarch_plugin.procs.stores import serve
from monarch_plugin.storage.checkpoint import clean_stale, damage, newest
from monarch_plugin.storage.runlock import holds_checkpoints
from monarch_plugin.wire.protocol import Key
from monarch_plugin.wire.signing import SignedStore, forged_reporter

__all__ = ["damaged", "open_store", "resume_from", "start_files"]

logger = logging.getLogger("monarch_plugin")


def open_store(config: ElasticConfig, secret: str, events: EventLog) -> SignedStore:
    """The run's store, served from this process and signed with `secret`, its latest generation none yet."""
    store = SignedStore(serve(config.store_host, 0, config.join_timeout_s), bytes.fromhex(secret),
                        on_forged=forged_reporter(events))
    store.set(Key.LATEST, "-1")
    return store


def start_files(config: ElasticConfig, events: EventLog) -> None:
    """A fresh events file (one a run, so reports never mix runs); where this run holds the checkpoint directory,
    what a killed run left half-written there goes; a run whose replicas would not save it if the controller were lost
    is told so."""
    if config.events_path:
        open(config.events_path, "w").close()
    if holds_checkpoints(config):
        stale = clean_stale(config.checkpoint_dir)
        if stale:
            events.emit("checkpoint_cleaned", paths=stale)
    if not config.controller_loss_save_s:
        logger.warning("`controller_loss_save_s` is 0: if this controller is lost, its replicas end with it and the "
                       "run loses every step since its last periodic checkpoint (set it above 0 to have them write "
                       "the last committed step first)")


def resume_from(config: ElasticConfig) -> tuple[ElasticConfig, list[tuple[str, str]]]:
    """The checkpoint the replicas resume (`resume`), checked against the digests written with it: "auto" takes the
    newest intact one, passing over damaged ones (returned as (path, why), to report), and the config returned names
    it, so that the replicas all load the same one, found once here; a damaged one named, or only damaged ones
    there, is a ConfigError before anything is spawned."""
    if config.resume is None:
        return config, []
    if config.resume != "auto":
        why = damage(config.resume)
        if why:
            raise ConfigError(f"`resume`: the checkpoint {config.resume} is damaged: {why}; resume another "
                              "one, or 'auto' for the newest intact one in `checkpoint_dir`", "resume")
        return config, []
    passed_over: list[tuple[str, str]] = []
    path = newest(config.checkpoint_dir, skipped=lambda p, why: passed_over.append((p, why)))
    if path is None and passed_over:
        raise ConfigError(f"`resume` auto: every complete checkpoint in {config.checkpoint_dir} is damaged (the "
                          f"newest, {passed_over[0][0]}: {passed_over[0][1]}): resume one by its path if you trust it, "
                          "or give this run another `checkpoint_dir` to start from scratch", "resume")
    return replace(config, resume=path), passed_over


def damaged(events: EventLog, path: str, why: str) -> None:
    """A damaged checkpoint passed over for an older one (`checkpoint.damage`)."""
    events.emit("checkpoint_damaged", path=path, why=why)
    logger.warning("the checkpoint %s is damaged: %s; it is passed over for an older one", path, why)
