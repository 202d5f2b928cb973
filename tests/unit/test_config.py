"""`config.ElasticConfig`: every setting checked before anything is spawned, with an error that names the fix."""

from __future__ import annotations

import dataclasses

import pytest

from monarch_plugin import ConfigError, ElasticConfig
from monarch_plugin.config import cli_flag, in_slurm_allocation, spell_fields

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(replicas=2, min_replicas=3, max_replicas=2), "lower `min_replicas` or raise `max_replicas`"),
        (dict(replicas=0), "`replicas` must be a positive integer"),
        (dict(replicas=4, max_replicas=3), "must lie between"),
        (dict(backend="mpi"), "choose one of auto, gloo, nccl"),
        (dict(batch_policy="whatever"), "choose one of constant_global, constant_local"),
        (dict(scale_lr_with_replicas=True), "only applies to `batch_policy`='constant_local'"),
        (dict(collective_timeout_s=0), "positive number of seconds"),
        (dict(sync_every=0), "`sync_every` must be 1 \\(synchronous\\) or more"),
        (dict(sync_every=4, semi_sync="diloco2"), "choose one of diloco, local_sgd"),
        (dict(sync_every=4, procs_per_replica=2), "set `procs_per_replica` 1, or `sync_every` 1"),
        (dict(fault="explode:step=3"), "unknown fault mode"),
        (dict(fault="sigkill:replica=1"), "needs a step"),
        (dict(fault="sigkill:replica=1:step=3,boom:step=4"), "unknown fault mode 'boom'"),
    ],
)
def test_bad_config_names_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ElasticConfig(**kwargs)


_WRONG = {"int": "2", "float": "2.5", "str": 2, "bool": "yes", "list[str]": "tcp://10.0.0.2:26600",
          "dict[str, str]": {"OMP_NUM_THREADS": 1}}


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(ElasticConfig)])
def test_every_setting_of_the_wrong_type_is_refused_naming_it(name):
    kind = next(f.type for f in dataclasses.fields(ElasticConfig) if f.name == name).removesuffix(" | None")
    with pytest.raises(ConfigError, match=rf"^`{name}` must be ") as raised:
        ElasticConfig(**{name: _WRONG[kind]})
    assert raised.value.field == name


_FLOATS = [f.name for f in dataclasses.fields(ElasticConfig) if f.type == "float"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", _FLOATS)
def test_every_float_setting_refuses_nan_and_inf_naming_it(name, value):
    with pytest.raises(ConfigError, match=rf"^`{name}` must be a finite number, got {value!r}: ") as raised:
        ElasticConfig(**{name: value})
    assert raised.value.field == name
    assert len(_FLOATS) == 7  # a new float setting is covered here by its type, whatever its name


def test_a_config_error_names_its_field_in_each_front_ends_spelling():
    with pytest.raises(ConfigError) as raised:
        ElasticConfig(replicas=2, min_replicas=3, max_replicas=2)
    assert raised.value.field == "min_replicas"
    assert spell_fields(str(raised.value), cli_flag).startswith("--min-replicas (3) is larger than --max-replicas (2)")
    assert spell_fields("`backend`, `join_timeout_s` and `devices`", cli_flag) == (
        "--backend, --join-timeout and `devices`")  # not a runtime field: left as written


def test_config_round_trips_through_the_worker_environment(monkeypatch):
    cfg = ElasticConfig(replicas=3, min_replicas=2, fault="sigkill:replica=1:step=4", env={"A": "1"})
    monkeypatch.setenv("MONARCH_PLUGIN_CONFIG", cfg.to_env()["MONARCH_PLUGIN_CONFIG"])
    assert ElasticConfig.from_env() == cfg


_ALLOCATION = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "n[0-3]"}


@pytest.mark.parametrize("environ, inside", [
    ({}, False),
    (_ALLOCATION, True),  # a batch script (or salloc shell) of four nodes
    ({**_ALLOCATION, "SLURM_JOB_NUM_NODES": "1"}, False),  # one node: this machine is the run's
    ({**_ALLOCATION, "SLURM_STEP_ID": "0"}, False),  # under srun: every task would be a controller
])
def test_a_run_takes_the_slurm_allocation_only_from_its_batch_script(environ, inside):
    assert in_slurm_allocation(environ) is inside


def test_inside_an_allocation_the_run_is_multi_host_unless_told_its_hosts(monkeypatch):
    for name, value in _ALLOCATION.items():
        monkeypatch.setenv(name, value)
    found = ElasticConfig()
    assert found.slurm is True and found.multi_host and found.store_host is None  # found from the nodes, later
    assert ElasticConfig(hosts=["tcp://127.0.0.1:26600"]).slurm is False
    assert ElasticConfig(slurm=False).slurm is False and ElasticConfig(slurm=False).store_host == "127.0.0.1"
