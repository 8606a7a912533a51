"""Loading a recipe: a YAML file read safely, parsed into the schema (optpipe/recipe/schema.py), then
checked by the guards beside it (recipe_guard.py: paths, factories, names; resource_bounds.py:
sizes). Here, not in recipe.py, so that the schema imports nothing that imports it back."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from optpipe.core.errors import RecipeError, TargetError
from optpipe.recipe.schema import Recipe, describe_validation_error
from optpipe.safety.recipe_guard import MAX_RECIPE_BYTES, check_factory, check_names, check_paths, check_yaml_budget
from optpipe.safety.resource_bounds import check_resources
from optpipe.safety.yaml_loader import load_yaml


def load_recipe(path: str | Path, allow_paths: tuple[Path, ...] = (), allow_factories: tuple[str, ...] = ()) -> Recipe:
    """A recipe file, parsed safely; the paths it names must stay inside its folder, the working
    directory or `allow_paths`, and a model factory inside `model.path` or `allow_factories`
    (see optpipe.safety.recipe_guard)."""
    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"recipe '{path}' is a folder; pass the path of a YAML recipe file inside it")
    if path.exists() and not path.is_file():  # a device, a FIFO: reading it could block or never end
        raise RecipeError(f"recipe '{path}' is not a regular file; pass the path of a YAML recipe file")
    if not path.is_file():
        raise RecipeError(f"recipe file '{path}' does not exist; pass the path of a YAML recipe")
    if path.stat().st_size > MAX_RECIPE_BYTES:
        raise RecipeError(f"{path}: {path.stat().st_size} bytes is too large for a recipe (limit {MAX_RECIPE_BYTES}); pass a recipe file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: not a UTF-8 text file; a recipe is YAML text") from None
    return recipe_from_text(text, path, allow_paths, allow_factories)


def recipe_from_text(text: str, path: Path, allow_paths: tuple[Path, ...] = (), allow_factories: tuple[str, ...] = ()) -> Recipe:
    """The recipe file `path` would hold with `text`, checked as load_recipe checks it (`optpipe init`
    validates its recipe this way before writing anything)."""
    try:
        # A safe loader: a recipe can never construct Python objects; duplicate keys and deep nesting are errors.
        data = load_yaml(text)
    except yaml.constructor.ConstructorError as exc:
        tag = getattr(exc, "problem", "") or ""
        raise RecipeError(f"{path}: a YAML tag tries to build an object ({tag}); a recipe holds plain values only, remove the tag") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise RecipeError(f"{path}: malformed YAML{where}: {problem}; fix the syntax there") from None
    check_yaml_budget(data, str(path))
    recipe = parse_recipe(data, base_dir=path.resolve().parent, origin=str(path))
    check_paths(recipe, str(path), allow_paths)
    check_factory(recipe, str(path), allow_factories)
    return recipe


def parse_recipe(data: Any, base_dir: Path = Path("."), origin: str = "recipe") -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"{origin}: expected a mapping with keys model, inputs, stages; got {type(data).__name__}")
    try:
        recipe = Recipe.model_validate({**data, "base_dir": base_dir})
    except ValidationError as exc:
        raise RecipeError(f"{origin}: {describe_validation_error(exc, Recipe, data)}") from None
    if "base_dir" in data:
        raise RecipeError(f"{origin}: base_dir: unknown key; remove it")
    check_names(recipe, origin)
    check_resources(recipe, origin)
    return recipe


# --- the run folder's snapshot of the recipe ---------------------------------------------------

SNAPSHOT_FILE = "recipe.json"


def write_recipe_snapshot(recipe: Recipe, run_dir: Path) -> None:
    """The validated recipe beside the report, so a later export knows the dims, inputs and data."""
    document = {"base_dir": str(recipe.base_dir), "recipe": recipe.model_dump(mode="json", by_alias=True)}
    (run_dir / SNAPSHOT_FILE).write_text(json.dumps(document, indent=2))


def load_recipe_snapshot(run_dir: Path) -> Recipe:
    path = run_dir / SNAPSHOT_FILE
    if not path.is_file():
        raise TargetError(f"'{run_dir}' has no {SNAPSHOT_FILE} (written by `optpipe compile` since targets exist); rerun the compile")
    document = json.loads(path.read_text())
    return parse_recipe(document["recipe"], base_dir=Path(document["base_dir"]), origin=str(path))
