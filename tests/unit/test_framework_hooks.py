"""The front ends' private framework access and their settings, checked without spawning anything."""

import dataclasses
import inspect

import pytest

from monarch_plugin.config import ElasticConfig
from monarch_plugin.integrations.lightning import MonarchStrategy
from monarch_plugin.integrations.lightning import _lightning_hooks
from monarch_plugin.integrations.lightning.launcher import ARGUMENTS, argument


def test_every_lightning_argument_sets_a_config_field_with_its_default():
    params = inspect.signature(MonarchStrategy.__init__).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(ElasticConfig)}
    for name, field in ARGUMENTS.items():
        assert name in params, name
        if params[name].default is not None:  # None: filled in from `devices` or `default_root_dir`
            assert params[name].default == defaults[field], name
        assert f"{name}: " in MonarchStrategy.__doc__
    assert argument("cross_backend") == "`backend`" and argument("spares") == "`spares`"


def test_lightning_private_api_is_checked_and_a_missing_name_says_what_to_install(monkeypatch):
    _lightning_hooks.check_version()  # the installed Lightning has everything used
    monkeypatch.delattr(_lightning_hooks._call, "_call_callbacks_state_dict")
    with pytest.raises(RuntimeError, match=f"install lightning=={_lightning_hooks.CHECKED_ON}"):
        _lightning_hooks.check_version()


def test_the_strategy_turns_a_config_error_into_lightnings_own_spelling():
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    strategy = MonarchStrategy(min_replicas=1, max_replicas=1, backend="gloo")
    strategy.parallel_devices = ["cpu"] * 2
    with pytest.raises(MisconfigurationException, match="`max_replicas`"):
        strategy.elastic_config()
