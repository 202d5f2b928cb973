"""HF transformers front end: `Trainer(..., callbacks=[MonarchElasticCallback()])`, launched by `monarch-run`.

Each replica runs the user's unchanged `Trainer.train()`; the callback turns every optimizer step into the
runtime's step transaction, owns the sharding of data over the live replicas, and heals replacements from a live
peer. Under plain `python` it is inactive and the script trains as usual.
"""

from monarch_plugin.integrations.hf.callback import MonarchElasticCallback

__all__ = ["MonarchElasticCallback"]
