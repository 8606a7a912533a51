"""`optpipe init PATH`: write a commented recipe for a model, and validate it."""
from __future__ import annotations

from pathlib import Path

import click

from optpipe.core.errors import RecipeError


@click.command("init")
@click.argument("model")
@click.option("--output", "-o", type=click.Path(path_type=Path), help="recipe file to write (default: <model name>.yaml here)")
@click.option("--force", is_flag=True, help="overwrite an existing recipe file")
def init_command(model: str, output: Path | None, force: bool) -> None:
    """Write a recipe for MODEL: an .onnx file, a Hugging Face model folder, or module:factory."""
    from optpipe.plan.dag import execution_order
    from optpipe.authoring.init_recipe import FILL_IN, inspect_path, render_recipe
    from optpipe.safety.recipe_loading import load_recipe
    from optpipe.plan.validate import validate_recipe

    recipe_dir = (output.parent if output else Path.cwd())
    facts = inspect_path(model, recipe_dir)
    path = output or Path(f"{facts.name}.yaml")
    if path.exists() and not force:
        raise RecipeError(f"'{path}' exists; choose another file with --output, or pass --force to overwrite it")
    path.write_text(render_recipe(facts, model), encoding="utf-8")
    graph, _ = validate_recipe(load_recipe(path))
    click.echo(f"wrote {path}: a {facts.kind} recipe, valid; stages: {', '.join(execution_order(graph))}")
    for note in facts.notes:
        click.echo(f"note: {note}")
    click.echo(f"next: replace {FILL_IN} in its `data` section with your samples, then `optpipe compile {path}`")
