"""Probes for the control-path scripts (control_calls.py, control_hops.py): wrap a method of a
class so that a callable runs at its entry and another at its exit, on the rooms of
``scripts/control_bench.py`` run in this process."""

from __future__ import annotations

import functools
import importlib
import runpy
import sys
from collections.abc import Callable


def wrap(modname: str, clsname: str, meth: str, on_in: Callable[[], None] | None = None,
         on_out: Callable[[], None] | None = None, only: str | None = None) -> bool:
    """Wrap ``modname.clsname.meth`` (only on instances of type ``only`` when given); False when the
    module or class is not in this tree (the scripts then try an older tree's names)."""
    try:
        cls = getattr(importlib.import_module(modname), clsname)
        f = getattr(cls, meth)
    except (ImportError, AttributeError):
        return False

    @functools.wraps(f)
    def g(self, *a, **k):
        if only and type(self).__name__ != only:
            return f(self, *a, **k)
        if on_in:
            on_in()
        try:
            return f(self, *a, **k)
        finally:
            if on_out:
                on_out()

    setattr(cls, meth, g)
    return True


def wrap_message(modname: str, on_in: Callable[[], None] | None = None,
                 on_out: Callable[[], None] | None = None) -> bool:
    """Wrap the handler of ``Message`` events in a room machine module's ``_HANDLERS`` table (the
    machines take events through ``feed``; a class attribute patch would not reach the table);
    False when the module has no such table (an older tree)."""
    try:
        module = importlib.import_module(modname)
        table, message = module._HANDLERS, module.Message
    except (ImportError, AttributeError):
        return False
    f = table[message]

    def g(machine, event):
        if on_in:
            on_in()
        try:
            return f(machine, event)
        finally:
            if on_out:
                on_out()

    table[message] = g
    return True


def run_control_bench() -> None:
    """control_bench with the arguments after ``--``."""
    sys.argv = ["control_bench.py", *sys.argv[2:]]
    runpy.run_path("scripts/control_bench.py", run_name="__main__")
