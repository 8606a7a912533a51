"""What a recipe file from elsewhere may not do: reach outside its folders, name files with
its stage names, or blow up the YAML loader.

A recipe is parsed with a safe loader (no Python objects, no duplicate keys, bounded
nesting: optpipe.safety.yaml_loader). Then:
- every path it names (model, checkpoint, data, output, cache) must resolve,
  symlinks followed, inside the recipe's folder or the working directory, or a
  folder the user allows explicitly (`--allow-path`); a recipe cannot make
  optpipe read `~/.ssh/id_rsa` as "data" or write its run folder over `~/`;
- names that become file names (the recipe's name, stage names) are plain
  names, so `stages: {../../x: ...}` cannot write outside the run folder;
- a model factory is code the recipe runs with its own arguments: it must be a
  module inside the recipe's `model.path` folder (code that travels with the
  recipe), one of optpipe's own model builders, or a module the user names with
  `--allow-factory`; `numpy:savetxt` with a `fname` kwarg would otherwise write
  wherever the recipe says;
- the loaded YAML is walked with a budget, so a few nested aliases (the
  "billion laughs") cannot expand into billions of values downstream.

These checks apply to recipe files (`load_recipe`); a recipe built in Python
(`parse_recipe`) is code its author wrote and is trusted with its paths.
"""
from __future__ import annotations

import importlib.machinery
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable

from optpipe.core.errors import RecipeError
from optpipe.recipe.model_specs import standard_library_refusal
from optpipe.recipe.schema import FactoryModel, HFModel, OnnxModel, Recipe, TorchScriptModel

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
MAX_RECIPE_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000
# Factories every recipe may name: optpipe's own model builders.
BUILTIN_FACTORIES = ("optpipe.models",)


def check_yaml_budget(data: Any, origin: str) -> None:
    """Refuse YAML that expands (through aliases) to more values than any recipe needs."""
    stack, seen = [data], 0
    while stack:
        value = stack.pop()
        seen += 1
        if seen > MAX_YAML_VALUES:
            raise RecipeError(
                f"{origin}: the YAML expands to more than {MAX_YAML_VALUES} values (nested anchors and aliases?); "
                "a recipe is small, write its values out"
            )
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def check_names(recipe: Recipe, origin: str) -> None:
    """The recipe's name and its stage names become folder and file names: plain names only."""
    if not SAFE_NAME.fullmatch(recipe.name) or ".." in recipe.name:
        raise RecipeError(f"{origin}: name: '{recipe.name}' is not a plain name; use letters, digits, '_', '-' and '.'")
    for stage in recipe.stages:
        if not SAFE_NAME.fullmatch(stage) or ".." in stage:
            raise RecipeError(f"{origin}: stages: '{stage}' is not a plain name; use letters, digits, '_', '-' and '.'")


def recipe_paths(recipe: Recipe) -> Iterable[tuple[str, str]]:
    """(YAML path, value) of every file or folder a recipe names."""
    model = recipe.model
    if isinstance(model, OnnxModel):
        yield "model.onnx", model.onnx
    if isinstance(model, HFModel) and model.hf:
        yield "model.hf", model.hf
    if isinstance(model, TorchScriptModel):
        yield "model.torchscript", model.torchscript
    if isinstance(model, FactoryModel):
        if model.path:
            yield "model.path", model.path
        if model.checkpoint:
            yield "model.checkpoint", model.checkpoint
    for which in ("eval", "calibration"):
        source = getattr(recipe.data, which)
        if source is not None and source.path:
            yield f"data.{which}.path", source.path
    yield "output", recipe.output
    if recipe.cache:
        yield "cache", recipe.cache


def allowed_roots(recipe: Recipe, allow: Iterable[Path] = ()) -> list[Path]:
    return [recipe.base_dir.resolve(), Path.cwd().resolve(), *(Path(p).expanduser().resolve() for p in allow)]


def check_paths(recipe: Recipe, origin: str, allow: Iterable[Path] = ()) -> None:
    """Every path in the recipe resolves inside one of the allowed folders."""
    roots = allowed_roots(recipe, allow)
    for where, value in recipe_paths(recipe):
        if "\0" in value:
            raise RecipeError(f"{origin}: {where}: the path contains a NUL character; give a plain path")
        try:
            resolved = Path(os.path.realpath(recipe.resolve(value)))
        except (RuntimeError, OSError):  # pathlib's "Symlink loop"
            raise RecipeError(f"{origin}: {where}: '{value}' is a symlink loop; give a real path") from None
        if not any(resolved.is_relative_to(root) for root in roots):
            raise RecipeError(
                f"{origin}: {where}: '{value}' resolves to {resolved}, outside the recipe's folder and the working "
                "directory; move it inside them or allow its folder with --allow-path"
            )


def check_recipe_file(recipe: Recipe, origin: str, allow: Iterable[Path] = ()) -> None:
    check_names(recipe, origin)
    check_paths(recipe, origin, allow)


def check_factory(recipe: Recipe, origin: str, allow: Iterable[str] = ()) -> None:
    """A factory module lives in the recipe's `model.path`, or is allowed by name (with its submodules)."""
    model = recipe.model
    if not isinstance(model, FactoryModel):
        return
    folder = recipe.resolve(model.path) if model.path else None
    problem = factory_refusal(model.factory, folder, allow)
    if problem:
        raise RecipeError(f"{origin}: model.factory: {problem}")


def factory_refusal(spec: str, folder: Path | None, allow: Iterable[str] = (), place: str = "model.path") -> str | None:
    """Why the factory `module:function` may not be called, or None: its module must be found in `folder`
    (the recipe's model.path; for `optpipe init`, the working directory it writes as model.path), be one of
    optpipe's builders or allowed by name; never Python's standard library. Checked before any import."""
    refusal = standard_library_refusal(spec)
    if refusal:
        return refusal
    module = spec.partition(":")[0]
    if any(module == name or module.startswith(name + ".") for name in (*BUILTIN_FACTORIES, *allow)):
        return None
    if folder is not None and _module_in(module, folder):
        return None
    where = f"in {place} ({folder})" if folder else "in a `model.path` folder (none is set)"
    return (f"module '{module}' is not {where}; a factory runs code with the recipe's arguments, "
            f"so it must live in the recipe's model.path, or be allowed with --allow-factory {module.split('.')[0]}")


def _module_in(module: str, folder: Path) -> bool:
    """The module's top-level package is found in `folder`, and no module of that name from
    elsewhere is already imported (an import would then return that one)."""
    top = module.split(".")[0]
    try:
        spec = importlib.machinery.PathFinder.find_spec(top, [str(folder)])
    except (ImportError, ValueError):
        return False
    if spec is None or spec.origin is None:
        return False
    loaded = getattr(sys.modules.get(top), "__file__", None)
    return loaded is None or Path(os.path.realpath(loaded)).is_relative_to(os.path.realpath(folder))
