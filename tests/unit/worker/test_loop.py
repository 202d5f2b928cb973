"""`ElasticLoop`'s checks of its arguments."""

from __future__ import annotations

import pytest

from monarch_plugin import ElasticConfig

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("procs, batch, ok", [(1, 3, True), (2, 5, False), (2, 6, True)])
def test_elastic_loop_refuses_a_global_batch_that_leaves_a_proc_without_samples(tmp_path, monkeypatch, procs, batch,
                                                                                ok):
    import torch

    from monarch_plugin import ElasticLoop
    from monarch_plugin.worker import context

    config = ElasticConfig(replicas=3, procs_per_replica=procs, events_path=str(tmp_path / "ev.jsonl"))
    monkeypatch.setattr(context, "_current", context.WorkerContext(
        replica_id=0, local_rank=0, procs_per_replica=procs, initial=True, config=config, store_host="127.0.0.1",
        store_port=1))
    model = torch.nn.Linear(2, 1)

    def loop():
        return ElasticLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset_size=64,
                           global_batch_size=batch, max_steps=1)

    if ok:
        loop()
        return
    with pytest.raises(ValueError, match=r"global_batch_size 5 is smaller than max_replicas 3 x procs_per_replica 2: "
                                         r".*raise global_batch_size to 6 or more"):
        loop()
