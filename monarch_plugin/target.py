"""What a replica runs: a script (torchrun style), a module (`-m`), or a picklable function.

Lives on both sides of the controller/worker boundary: the controller builds it, sends it to the replica
actor, and the worker runs it (a script or module as `__main__` with the argv the user gave). It is plain
data that only needs this package to unpickle: a function travels as cloudpickled bytes that the worker
loads itself, after entering the controller's working directory and sys.path, as ddp_spawn's children do.
"""

from __future__ import annotations

import ast
import functools
import inspect
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
    entry: str  # the script's path, the module's name, or the function's name (for `describe`)
    args: list[str] = field(default_factory=list)
    cwd: str = field(default_factory=os.getcwd)  # every kind runs here; `-m` resolves modules from here
    payload: bytes = b""  # a function target: its cloudpickled (fn, args, kwargs)
    sys_path: list[str] = field(default_factory=list)  # a function target: the controller's, to unpickle it
    imports: list[str] = field(default_factory=list)  # top-level packages its source file imports (read, not run)

    @classmethod
    def script(cls, path: str, args: list[str] | None = None) -> "Target":
        if not os.path.isfile(path):
            raise ConfigError(f"training script {path!r} not found: pass the path of a .py file")
        return cls("script", os.path.abspath(path), list(args or []), imports=_imports_of(path))

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
        return cls("module", name, list(args or []), imports=_imports_of(found.origin))

    @classmethod
    def function(cls, fn: Callable, *args: Any, **kwargs: Any) -> "Target":
        import cloudpickle

        try:
            payload = cloudpickle.dumps((fn, args, kwargs))
        except Exception as e:  # noqa: BLE001 - any pickling failure means the same fix
            raise ConfigError(
                f"{getattr(fn, '__name__', fn)!r} or its arguments cannot be pickled to send to the "
                f"replicas ({type(e).__name__}: {e}): define it at module level and pass plain data"
            ) from e
        name = getattr(fn, "__qualname__", None) or repr(fn)
        try:
            source = inspect.getsourcefile(fn if inspect.isroutine(fn) else type(fn))
        except TypeError:  # a builtin or a callable object: nothing to read
            source = None
        return cls("function", name, payload=payload, sys_path=list(sys.path), imports=_imports_of(source))

    def describe(self) -> str:
        return f"{self.kind} {self.entry} {' '.join(map(str, self.args))}".strip()

    def load(self) -> Callable[[], Any]:
        """In the worker: enter the controller's working directory and, for a function, put the
        controller's sys.path first and unpickle it; returns what runs the target.

        A function defined in a module the controller imported from a path it added at runtime would
        otherwise not import in the replica; a module the replica still cannot import raises here, inside
        the worker's error handling, so the controller reports the ModuleNotFoundError and its traceback
        instead of a replica that failed to start for a reason only Monarch's log shows.
        """
        os.chdir(self.cwd)
        if self.kind != "function":
            return self._run_program
        import cloudpickle

        sys.path[:] = [*self.sys_path, *(p for p in sys.path if p not in self.sys_path)]
        fn, args, kwargs = cloudpickle.loads(self.payload)
        return functools.partial(fn, *args, **kwargs)

    def _run_program(self) -> None:
        """Run the script or module in the calling (worker) process; a clean `sys.exit(0)` counts as success."""
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


def _imports_of(path: str | None) -> list[str]:
    """The top-level packages a Python source file imports anywhere in it; [] if it cannot be read as one."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, TypeError, ValueError):
        return []
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    return sorted({name.split(".")[0] for name in names})
