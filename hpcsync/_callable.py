"""Modules that are also their own main function: ``hpcsync.preemption()`` is
``hpcsync.preemption.preemption()``, and ``hpcsync.preemption`` is the module, whatever was
imported first.

A package attribute that names both a submodule and a function is the function only until the
submodule's first import rebinds it (or the other way round), so what ``hpcsync.requeue`` meant
depended on import order. One name, one object: the module, callable.
"""
from __future__ import annotations

import sys
import types
from typing import Any, Callable


def make_callable(module_name: str, fn: Callable[..., Any]) -> None:
    """Calling module ``module_name`` calls ``fn`` (its main function, of the same name)."""

    class CallableModule(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

    CallableModule.__call__.__doc__ = fn.__doc__
    sys.modules[module_name].__class__ = CallableModule
