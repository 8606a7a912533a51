"""The passes, one module each. A new pass is a new module here; nothing else changes.

Each module defines one subclass of `optpipe.pass_base.Pass`; the registry finds
it by import, so heavy libraries must be imported inside `run`, not at the top.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
from functools import lru_cache

from optpipe.pass_base import Pass


# Extra modules with passes, outside this package: comma-separated module names (plugins, tests).
PLUGINS_ENV = "OPTPIPE_PLUGINS"


@lru_cache(maxsize=1)
def registry() -> dict[str, type[Pass]]:
    found: dict[str, type[Pass]] = {}
    modules = [f"{__name__}.{info.name}" for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_")]
    modules += [name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(",") if name.strip()]
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            from optpipe.errors import OptpipeError

            raise OptpipeError(f"{PLUGINS_ENV}: cannot import pass module '{module_name}' ({exc}); fix the variable") from None
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Pass) and obj is not Pass and obj.__module__ == module.__name__:
                found[obj.name] = obj
    return dict(sorted(found.items()))


def get_pass(name: str) -> type[Pass]:
    return registry()[name]
