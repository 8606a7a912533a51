"""The passes, one module each. A new pass is a new module here; nothing else changes.

Each module defines one subclass of `optpipe.pass_base.Pass`; the registry finds
it by import, so heavy libraries must be imported inside `run`, not at the top.
"""
from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from optpipe.pass_base import Pass


@lru_cache(maxsize=1)
def registry() -> dict[str, type[Pass]]:
    found: dict[str, type[Pass]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Pass) and obj is not Pass and obj.__module__ == module.__name__:
                found[obj.name] = obj
    return dict(sorted(found.items()))


def get_pass(name: str) -> type[Pass]:
    return registry()[name]
