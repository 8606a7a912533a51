"""The passes, one module each. A new pass is a new module here; nothing else changes.

Each module defines one subclass of `optpipe.pass_infra.pass_base.Pass`; the registry finds
it by import, so heavy libraries must be imported inside `run`, not at the top.
Passes from other packages register through the `optpipe.passes` entry-point
group, through OPTPIPE_PLUGINS (comma-separated module names), or at run time
with `register_pass` (used by tests and notebooks).

What a new pass declares, shown on the simplest one possible::

    class RenameParams(PassParams):                      # typed params; unknown keys are recipe errors
        prefix: str = Field("x_", description="...")      # the description feeds `optpipe passes`

    class RenamePass(Pass[RenameParams]):
        '''Prefix every node name.'''                     # first line: the summary in `optpipe passes`

        name = "rename"                                   # the recipe's `pass:` value
        version = "1"                                     # bump when the output for the same input changes
        Params = RenameParams
        libraries = ("onnx",)                             # their versions join the cache key

        def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
            proto = model.load()                          # read the input; never write into model.folder
            for node in proto.graph.node:
                node.name = self.params.prefix + node.name
            return save_model(proto, ctx.workdir, {"renamed": len(proto.graph.node)})

Optional: `needs_input = False` for a pass that starts from the recipe's model
(export); `fingerprint(ctx)` returning hashes of anything else the output depends
on (export: the model source); params inheriting
`optpipe.evaluation.self_check.SelfCheckParams` for a pass that must keep its
input's numerics (`check_atol`, `check_rtol`): the numeric self-check then runs
after it, as an instrument, with `check_hint` as the advice when it fails. Nothing else: the manager enforces the rest
(optpipe/execution/contract.py). It publishes the artifact `run` returns; it
refuses a workdir holding anything besides model.onnx, model.onnx.data and
info.json (clean scratch files up); it fails the stage if the input changed; and
the data sets read through `ctx.eval_set()` / `ctx.calibration_set()` join the
stage's cache key by themselves.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
from functools import lru_cache
from importlib import metadata

from optpipe.pass_infra.pass_base import Pass

_registered: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Make a Pass subclass usable in recipes by its `name` (usable as a class decorator)."""
    _registered[cls.name] = cls
    registry.cache_clear()
    return cls


def unregister_pass(name: str) -> None:
    _registered.pop(name, None)
    registry.cache_clear()


# Extra modules with passes, outside this package: comma-separated module names (plugins, tests).
PLUGINS_ENV = "OPTPIPE_PLUGINS"


@lru_cache(maxsize=1)
def registry() -> dict[str, type[Pass]]:
    found: dict[str, type[Pass]] = {}
    builtin = [f"{__name__}.{info.name}" for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_")]
    plugins = [name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(",") if name.strip()]
    for module_name in builtin + plugins:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            from optpipe.core.errors import OptpipeError

            if module_name in plugins:
                raise OptpipeError(f"{PLUGINS_ENV}: cannot import pass module '{module_name}' ({exc}); fix the variable") from None
            # A built-in pass: the install is broken (a library it imports is missing or mismatched), not the user's variable.
            raise OptpipeError(f"optpipe's pass module '{module_name}' cannot be imported ({exc}): a library it needs is "
                               "missing or broken; reinstall optpipe (pip install -e '.[dev]', or the package named)") from None
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Pass) and obj is not Pass and obj.__module__ == module.__name__:
                found[obj.name] = obj
    for entry in metadata.entry_points(group="optpipe.passes"):
        cls = entry.load()
        found[cls.name] = cls
    found.update(_registered)
    return dict(sorted(found.items()))


def get_pass(name: str) -> type[Pass]:
    return registry()[name]

