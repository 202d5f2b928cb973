"""The front ends' private framework access and their settings, checked without spawning anything."""

import dataclasses
import inspect

import pytest

from monarch_plugin.config import LOOP_ONLY, ElasticConfig, field_default, front_end_fields
from monarch_plugin.integrations.lightning import MonarchStrategy
from monarch_plugin.integrations.lightning import _lightning_hooks
from monarch_plugin.integrations.lightning.launcher import FROM_TRAINER


def test_every_setting_is_a_lightning_argument_with_its_one_default():
    params = inspect.signature(MonarchStrategy).parameters
    settable = front_end_fields(tuple(FROM_TRAINER))
    assert {f.name for f in settable} | set(FROM_TRAINER) | set(LOOP_ONLY) == {
        f.name for f in dataclasses.fields(ElasticConfig)}
    for f in settable:
        assert params[f.name].default == field_default(f), f.name
        assert f"{f.name}: " in MonarchStrategy.__doc__
    assert MonarchStrategy(min_replicas=2, heal_donors=1).settings == {"min_replicas": 2, "heal_donors": 1}


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_replica=2), "no argument `min_replica`: did you mean `min_replicas`?"),
    (dict(replicas=3), r"MonarchStrategy\(replicas=...\) is set by `Trainer\(devices=..., num_nodes=...\)`"),
    (dict(checkpoint_steps=5), "ElasticLoop's own: .* ModelCheckpoint"),
    (dict(sync_every=20), r"sync_every=...\) is ElasticLoop's own: .*semi-synchronous training is ElasticLoop's only"),
    (dict(elastic=ElasticConfig(batch_policy="constant_local")), r"batch_policy=...\) is ElasticLoop's own"),
])
def test_a_strategy_argument_it_cannot_honour_is_refused_naming_the_fix(kwargs, message):
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=message):
        MonarchStrategy(**kwargs)


def test_an_elastic_config_gives_the_settings_its_caller_chose():
    strategy = MonarchStrategy(ElasticConfig(replicas=4, min_replicas=3, heal_donors=1), spares=1)
    assert strategy.settings == {"replicas": 4, "min_replicas": 3, "heal_donors": 1, "spares": 1}


def test_every_lightning_argument_reaches_the_runs_config():
    from monarch_plugin.integrations.lightning.launcher import _MonarchLauncher

    strategy = MonarchStrategy(heal_donors=1, crash_loop_limit=5, restart_backoff_s=0.5, backend="gloo")
    strategy.parallel_devices = ["cpu"] * 3
    launcher = object.__new__(_MonarchLauncher)
    launcher._strategy = strategy
    config = launcher.config(log_dir="/tmp/run")
    assert (config.heal_donors, config.crash_loop_limit, config.restart_backoff_s) == (1, 5, 0.5)
    assert (config.replicas, config.max_replicas, config.backend) == (3, 3, "gloo")  # from Trainer(devices=3)


def test_lightning_private_api_is_checked_and_a_missing_name_says_what_to_install(monkeypatch):
    _lightning_hooks.check_version()  # the installed Lightning has everything used
    monkeypatch.delattr(_lightning_hooks._call, "_call_callbacks_state_dict")
    with pytest.raises(RuntimeError, match=f"install lightning=={_lightning_hooks.CHECKED_ON}"):
        _lightning_hooks.check_version()


@pytest.mark.parametrize("strategy, message", [
    (dict(min_replicas=1, max_replicas=1, backend="gloo"), "`max_replicas`"),
    (dict(elastic=ElasticConfig(replicas=3)), r"ElasticConfig\(replicas=3\)\) disagrees with the Trainer, which gives 2"),
])
def test_the_launcher_builds_the_config_from_the_trainers_devices_and_refuses_naming_the_fix(strategy, message):
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from monarch_plugin.integrations.lightning.launcher import _MonarchLauncher

    strategy = MonarchStrategy(**strategy)
    strategy.parallel_devices = ["cpu"] * 2
    launcher = object.__new__(_MonarchLauncher)  # its checks of the accelerator need a Trainer
    launcher._strategy = strategy
    with pytest.raises(MisconfigurationException, match=message):
        launcher.config()
