"""What a replica runs: a script (torchrun style), a module (`-m`), or a picklable function.

Lives on both sides of the controller/worker boundary: the controller builds it, pickles it to the
replica actor, and the worker runs it as `__main__` with the argv the user gave.
"""

from __future__ import annotations

import os
import runpy
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from monarch_plugin.errors import ConfigError

__all__ = ["Target"]


@dataclass
class Target:
    kind: str  # "script" | "module" | "function"
    entry: Any
    args: list[str] = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    cwd: str = field(default_factory=os.getcwd)  # `-m` resolves modules from here, as `python -m` does

    @classmethod
    def script(cls, path: str, args: list[str] | None = None) -> "Target":
        if not os.path.isfile(path):
            raise ConfigError(f"training script {path!r} not found: pass the path of a .py file")
        return cls("script", os.path.abspath(path), list(args or []))

    @classmethod
    def module(cls, name: str, args: list[str] | None = None) -> "Target":
        import importlib.util

        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise ConfigError(f"module {name!r} not found: check the name and that it is importable (-m)")
        return cls("module", name, list(args or []))

    @classmethod
    def function(cls, fn: Callable, *args: Any, **kwargs: Any) -> "Target":
        import cloudpickle

        try:
            cloudpickle.dumps((fn, args, kwargs))
        except Exception as e:  # noqa: BLE001 - any pickling failure means the same fix
            raise ConfigError(
                f"{getattr(fn, '__name__', fn)!r} or its arguments cannot be pickled to send to the "
                f"replicas ({type(e).__name__}: {e}): define it at module level and pass plain data"
            ) from e
        return cls("function", fn, list(args), dict(kwargs))

    def describe(self) -> str:
        name = getattr(self.entry, "__qualname__", self.entry)
        return f"{self.kind} {name} {' '.join(map(str, self.args))}".strip()

    def run(self) -> Any:
        """Run in the calling (worker) process; a clean `sys.exit(0)` counts as success."""
        if self.kind == "function":
            return self.entry(*self.args, **self.kwargs)
        saved_argv = sys.argv
        try:
            if self.kind == "script":
                sys.argv = [self.entry, *self.args]
                sys.path.insert(0, os.path.dirname(self.entry))
                runpy.run_path(self.entry, run_name="__main__")
            else:
                sys.argv = [self.entry, *self.args]
                if self.cwd not in sys.path:
                    sys.path.insert(0, self.cwd)
                runpy.run_module(self.entry, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise
        finally:
            sys.argv = saved_argv
        return None
