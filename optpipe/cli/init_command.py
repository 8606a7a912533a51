"""`optpipe init PATH`: write a commented recipe for a model, and validate it.

The same guards as `compile`: a `module:factory` is code, so its module must be found in the working
directory (which the recipe names as model.path), be one of optpipe's builders or be allowed with
--allow-factory, and is never Python's standard library; checked before anything is imported. The
recipe is validated before it is written (paths outside the allowed folders, as compile's
--allow-path, included): a failed init leaves no file behind.
"""
from __future__ import annotations

from pathlib import Path

import click

from optpipe.core.errors import RecipeError

ALLOW_HELP = "a folder outside the recipe's folder and the working directory that the recipe may name (repeatable)"
FACTORY_HELP = "an installed module whose function MODEL may name (repeatable); a factory runs code"


@click.command("init")
@click.argument("model")
@click.option("--output", "-o", type=click.Path(path_type=Path), help="recipe file to write (default: <model name>.yaml here)")
@click.option("--force", is_flag=True, help="overwrite an existing recipe file")
@click.option("--allow-path", "allow_paths", multiple=True, type=click.Path(path_type=Path), help=ALLOW_HELP)
@click.option("--allow-factory", "allow_factories", multiple=True, metavar="MODULE", help=FACTORY_HELP)
def init_command(model: str, output: Path | None, force: bool, allow_paths: tuple[Path, ...], allow_factories: tuple[str, ...]) -> None:
    """Write a recipe for MODEL: an .onnx file, a Hugging Face model folder, or module:factory."""
    from optpipe.authoring.init_recipe import FILL_IN, inspect_path, render_recipe
    from optpipe.core.artifact import write_text_atomic
    from optpipe.plan.dag import execution_order
    from optpipe.plan.validate import validate_recipe
    from optpipe.safety.os_errors import folder_errors
    from optpipe.safety.recipe_loading import recipe_from_text

    recipe_dir = (output.parent if output else Path.cwd())
    _check_factory(model, allow_factories)
    _check_config(Path(model))
    facts = inspect_path(model, recipe_dir)
    path = output or Path(f"{facts.name}.yaml")
    if path.exists() and not force:
        raise RecipeError(f"'{path}' exists; choose another file with --output, or pass --force to overwrite it")
    if path.exists() and not path.is_file():
        raise RecipeError(f"'{path}' is not a regular file; choose another file with --output")
    text = render_recipe(facts, model)
    graph, _ = validate_recipe(recipe_from_text(text, path, allow_paths, allow_factories))
    if not path.parent.is_dir():
        raise RecipeError(f"--output: folder '{path.parent}' does not exist; create it or choose another file")
    with folder_errors("output folder", path.parent):  # read-only, full, or a /proc that creates nothing: one line
        write_text_atomic(path, text)  # only a valid recipe is written, whole or not at all
    click.echo(f"wrote {path}: a {facts.kind} recipe, valid; stages: {', '.join(execution_order(graph))}")
    for note in facts.notes:
        click.echo(f"note: {note}")
    flags = "".join(f" --allow-path {p}" for p in allow_paths) + "".join(f" --allow-factory {m}" for m in allow_factories)
    click.echo(f"next: replace {FILL_IN} in its `data` section with your samples, then `optpipe compile {path}{flags}`")


def _check_factory(model: str, allow_factories: tuple[str, ...]) -> None:
    """MODEL as module:factory follows compile's factory rule before init imports and calls it."""
    from optpipe.safety.recipe_guard import factory_refusal

    if ":" not in model or Path(model).exists() or Path(model).suffix == ".onnx":
        return
    problem = factory_refusal(model, Path.cwd(), allow_factories, place="the working directory")
    if problem:
        raise RecipeError(f"init: {problem}")


def _check_config(folder: Path) -> None:
    """A Hugging Face folder's config.json is read as JSON: a broken one is the user's file, in one line."""
    import json

    config = folder / "config.json"
    if not folder.is_dir() or not config.is_file():
        return
    try:
        document = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecipeError(f"init: '{config}' is not valid JSON ({str(exc).splitlines()[0]}); fix it or save the model again") from None
    if not isinstance(document, dict):
        raise RecipeError(f"init: '{config}' holds a {type(document).__name__}, not a config object; save the model again")
