"""Deferred imports: a command that needs no tensor (`SELECT 1`, `info`) never pays for torch.

`torch` costs seconds of CPU to import (more than the rest of actdb together). It is put in
`sys.modules` as a lazy module, so the `import torch` lines of the query layer bind at once and
the real import happens on the first attribute used, i.e. when a tensor function first runs.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from types import ModuleType

_LOCK = threading.Lock()


def lazy_module(name: str) -> ModuleType:
    """`name` as a module that is imported on first attribute access (at once if it already is
    imported, or if it cannot be found: then the plain import raises where it used to)."""
    with _LOCK:
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return importlib.import_module(name)
        loader = importlib.util.LazyLoader(spec.loader)
        spec.loader = loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        loader.exec_module(module)
        return module


def load(module: ModuleType) -> ModuleType:
    """Finish a lazy import now, on this thread, under the lock (Python 3.11's lazy modules
    are not safe to finish from two threads at once: the read-ahead thread and the query)."""
    with _LOCK:
        getattr(module, "__name__")  # noqa: B009 - any attribute access runs the import
        return module
