"""Deferred imports (actdb/lazy.py): the stand-in never enters sys.modules, so a module that
reads its own attributes while it loads (as torch does) imports the ordinary way; once
imported, the real module replaces the stand-in in every namespace that bound it."""

from __future__ import annotations

import sys
import textwrap
import threading
from pathlib import Path

import pytest

from actdb import lazy

SELF_READING = textwrap.dedent('''
    import sys
    VALUE = 41
    # torch's __init__ reads attributes of its own module while it loads; Python 3.12.3's
    # LazyLoader recursed without end on this (CPython gh-117178)
    VALUE = sys.modules[__name__].VALUE + 1
    import {name} as itself
    SAME = itself is sys.modules[__name__]
    LOADS = globals().get("LOADS", 0) + 1
''')


@pytest.fixture
def module_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def make(name: str) -> str:
        (tmp_path / f"{name}.py").write_text(SELF_READING.format(name=name))
        made.append(name)
        return name

    yield make
    for name in made:
        sys.modules.pop(name, None)


def test_the_stand_in_stays_out_of_sys_modules_and_is_replaced(module_named):
    name = module_named("actdb_lazy_probe_a")
    mod = lazy.lazy_module(name)
    globals()["_probe"] = mod  # bound in this module's namespace, as `torch = ...` is
    assert name not in sys.modules, "the stand-in must not be what `import` finds"
    assert isinstance(mod, lazy._Deferred)
    assert mod.VALUE == 42  # the first read imports it, the ordinary way
    real = sys.modules[name]
    assert real.SAME and real.LOADS == 1
    assert globals()["_probe"] is real, "the namespace that bound the stand-in holds the module"
    assert lazy.load(real) is real and lazy.lazy_module(name) is real
    del globals()["_probe"]


def test_load_finishes_the_import_once_from_many_threads(module_named):
    name = module_named("actdb_lazy_probe_b")
    mod = lazy.lazy_module(name)
    got: list[object] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        got.append(lazy.load(mod))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(g is sys.modules[name] for g in got)
    assert sys.modules[name].LOADS == 1


def test_a_missing_module_raises_where_it_is_imported():
    with pytest.raises(ModuleNotFoundError):
        lazy.lazy_module("actdb_no_such_module_anywhere")
