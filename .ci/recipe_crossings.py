"""Count where the whole Recipe crosses from one optpipe package into another during one compile.

    python .ci/recipe_crossings.py RECIPE.yaml [MORE.yaml ...] [--list]

Runs `optpipe compile RECIPE.yaml ...` in this process (two recipes or more take the fan-out path:
`execution/fan_out.py`, the local executor, `stage_tasks`) under a profiler hook and records every call
from a function of one package (cli, execution, plan, passes, evaluation, targets, ...) into a
function of another whose arguments hold a `Recipe`: as the argument itself, or one attribute
deep (a context or plan object carrying it, as `PassContext.recipe` did). Each distinct
(caller function, callee function) pair counts once, however often it runs. Calls into
`optpipe.recipe` itself (the Recipe's own methods, its typed parts) do not count: that is the
recipe's own package, not a layer it climbs into. Stage workers (`timeout_s`) and Ray tasks run in
other processes and are not seen; docs/architecture.md ("What each layer takes") has the figures.
"""
from __future__ import annotations

import sys
import threading
from collections import Counter
from typing import Any, Callable


def package_of(module: str) -> str | None:
    """The optpipe package a module belongs to: optpipe.execution.pipeline -> execution."""
    parts = module.split(".")
    if parts[0] != "optpipe" or len(parts) < 2:
        return None
    return parts[1]


def holds_recipe(value, recipe_type) -> bool:
    if isinstance(value, recipe_type):
        return True
    attributes = getattr(value, "__dict__", None)
    if not isinstance(attributes, dict) or isinstance(value, type):
        return False
    return any(isinstance(v, recipe_type) for v in list(attributes.values()))


def crossings(run: Callable[[], Any]) -> tuple[Any, Counter[tuple[str, str]]]:
    """What `run()` returns, and each (caller, callee) crossing seen while it ran, with its call count."""
    from optpipe.recipe.schema import Recipe

    seen: Counter[tuple[str, str]] = Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        callee_module = frame.f_globals.get("__name__", "")
        callee = package_of(callee_module)
        caller_frame = frame.f_back
        if callee is None or callee == "recipe" or caller_frame is None:
            return
        caller = package_of(caller_frame.f_globals.get("__name__", ""))
        if caller is None or caller == callee:
            return
        code = frame.f_code
        arguments = [frame.f_locals.get(name) for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
        if any(holds_recipe(value, Recipe) for value in arguments):
            where = f"{caller_frame.f_globals['__name__']}.{caller_frame.f_code.co_name}"
            seen[(where, f"{callee_module}.{code.co_name}")] += 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        return run(), seen
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def main(argv: list[str]) -> int:
    from click.testing import CliRunner

    from optpipe.cli import cli

    recipes = [arg for arg in argv if not arg.startswith("--")]
    result, crossings_seen = crossings(lambda: CliRunner().invoke(cli, ["compile", *recipes], catch_exceptions=True))
    if result.exception and not isinstance(result.exception, SystemExit):
        print(result.output, file=sys.stderr)
        raise result.exception
    if "--list" in argv:
        for (caller, callee), calls in sorted(crossings_seen.items()):
            print(f"{caller} -> {callee}  ({calls}x)")
    by_layer = Counter(package_of(callee.rsplit(".", 1)[0]) for _, callee in crossings_seen)
    print(f"{len(crossings_seen)} places where the Recipe crosses a package boundary; by the package it enters: "
          + ", ".join(f"{name} {count}" for name, count in sorted(by_layer.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
