"""`procs.forkserver`: what the server imports ahead."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(60)


def test_the_forkserver_loads_torch_and_its_optimizer_imports_and_only_frameworks_the_training_code_imports():
    from monarch_plugin.procs.forkserver import ALWAYS, preload_for

    assert preload_for(set()) == list(ALWAYS) == ["torch", "torch._dynamo"]
    assert preload_for({"lightning", "torch", "my_model", "os"}) == [*ALWAYS, "lightning"]
    assert preload_for({"torchtitan", "transformers"}) == [*ALWAYS, "transformers", "torchtitan.train"]
