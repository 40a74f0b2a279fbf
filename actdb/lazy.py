"""Deferred imports: a command that needs no tensor (`SELECT 1`, `info`) never pays for torch.

`torch` costs seconds of CPU to import (more than the rest of actdb together). A module that
needs it binds `torch = lazy_module("torch")`: a stand-in whose first attribute read imports
torch, and which then puts the real module in its place in every namespace that bound it, so
later reads are plain module lookups (and see what a test or notebook patches on torch).

The stand-in never enters `sys.modules`: torch's own import, and anyone else's `import torch`,
run the ordinary import machinery. (An earlier version put an `importlib.util.LazyLoader`
module there; Python 3.12.3, the system Python of Ubuntu 24.04, has a LazyLoader that recurses
without end on a module that reads its own attributes while it loads, as torch does:
CPython gh-117178.)
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Any

_LOCK = threading.RLock()
_STAND_INS: dict[str, _Deferred] = {}  # one per module name, shared by all that bind it


class _Deferred(ModuleType):
    """Stands for the module `__name__` until something reads an attribute of it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__dict__["_actdb_binders"] = []  # the namespaces that bound this stand-in

    def __getattr__(self, attr: str) -> Any:  # only for names not set on the stand-in itself
        return getattr(_finish(self), attr)


def lazy_module(name: str) -> ModuleType:
    """`name`, imported on first attribute access (at once if it already is imported, or if
    it cannot be found: then the plain import raises where it used to). The caller's module
    namespace is recorded, so the real module replaces the stand-in there once imported."""
    with _LOCK:
        if name in sys.modules:
            return sys.modules[name]
        # A submodule's spec is found by importing its package: look for the package alone
        # (a missing submodule then raises at first use, where the import would have).
        if importlib.util.find_spec(name.partition(".")[0]) is None:
            return importlib.import_module(name)
        stand_in = _STAND_INS.setdefault(name, _Deferred(name))
        stand_in.__dict__["_actdb_binders"].append(sys._getframe(1).f_globals)
        return stand_in


def load(module: ModuleType) -> ModuleType:
    """The real module for `module` (a stand-in or a module), imported now on this thread."""
    return _finish(module) if isinstance(module, _Deferred) else module


def _finish(stand_in: _Deferred) -> ModuleType:
    with _LOCK:
        real = importlib.import_module(stand_in.__name__)
        _STAND_INS.pop(stand_in.__name__, None)
        for namespace in stand_in.__dict__["_actdb_binders"]:
            for key, value in list(namespace.items()):
                if value is stand_in:
                    namespace[key] = real
        return real
