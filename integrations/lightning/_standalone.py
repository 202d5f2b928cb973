"""`MonarchStrategy` and `MonarchFSDPStrategy` for the standalone `pytorch_lightning` package.

`pytorch_lightning` ships its own copies of every Lightning class and its own StrategyRegistry, so a strategy
built on `lightning.pytorch` fails its Trainer's type checks. Rather than keep two copies of the glue, this
module compiles `_lightning_hooks.py`, `checkpoint_io.py`, `launcher.py`, `strategy.py` and `fsdp.py` with the package names swapped into its own
namespace; the classes live here, so replicas unpickle them by reference like any other class.
"""

from pathlib import Path

_HERE = Path(__file__).parent
_SWAPS = (
    ("lightning.pytorch", "pytorch_lightning"),
    ("lightning.fabric", "lightning_fabric"),
    ("monarch_plugin.integrations.lightning._lightning_hooks", __name__),
    ("monarch_plugin.integrations.lightning.checkpoint_io", __name__),
    ("monarch_plugin.integrations.lightning.launcher", __name__),
    ("monarch_plugin.integrations.lightning.strategy", __name__),
)


def _compile_into_this_module(filename: str) -> None:
    source = (_HERE / filename).read_text()
    for old, new in _SWAPS:
        source = source.replace(old, new)
    exec(compile(source, str(_HERE / filename), "exec"), globals())


_doc = __doc__
_compile_into_this_module("_lightning_hooks.py")
_compile_into_this_module("checkpoint_io.py")
_compile_into_this_module("launcher.py")
_compile_into_this_module("strategy.py")
_compile_into_this_module("fsdp.py")
__doc__ = _doc
__all__ = ["MonarchFSDPStrategy", "MonarchStrategy"]
