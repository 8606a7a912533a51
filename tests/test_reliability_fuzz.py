"""Property: whatever a recipe file says, loading and validating it either succeeds or raises
an OptpipeError with a one-line message; never another exception (a traceback for the user)."""
from __future__ import annotations

import copy

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_fixtures import onnx_recipe

from optpipe.core.errors import OptpipeError
from optpipe.safety.recipe_loading import load_recipe
from optpipe.plan.validate import validate_recipe

SCALARS = (
    st.none() | st.booleans() | st.integers(-(10**9), 10**9) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=16) | st.sampled_from(["export", "simplify", "batch", "../x", "/etc/passwd", "", "float32", "-1"])
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def base_recipe() -> dict:
    recipe = onnx_recipe(None, stages={
        "export": {"pass": "export"},
        "simplify": {"pass": "simplify", "after": "export", "params": {"backend": "onnxslim"}, "timeout_s": 30},
    })
    recipe["data"]["calibration"] = {"source": "synthetic", "samples": 4}
    recipe["targets"] = [{"kind": "ort", "stages": ["simplify"]}]
    return recipe


def containers(value, path=()):
    """Paths of every dict and list in `value` (the places a mutation can touch)."""
    if isinstance(value, (dict, list)):
        yield path
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            yield from containers(child, (*path, key))


def at(value, path):
    for key in path:
        value = value[key]
    return value


@st.composite
def mutated_recipes(draw):
    recipe = copy.deepcopy(base_recipe())
    for _ in range(draw(st.integers(1, 4))):
        places = list(containers(recipe))
        target = at(recipe, draw(st.sampled_from(places)))
        action = draw(st.sampled_from(["replace", "delete", "add", "rename"]))
        keys = list(target.keys()) if isinstance(target, dict) else list(range(len(target)))
        if action == "add" or not keys:
            if isinstance(target, dict):
                target[draw(st.text(max_size=10))] = draw(VALUES)
            else:
                target.append(draw(VALUES))
            continue
        key = draw(st.sampled_from(keys))
        if action == "replace":
            target[key] = draw(VALUES)
        elif action == "delete":
            del target[key]
        elif isinstance(target, dict):  # rename a key (a stage, a field) keeping its value
            target[draw(st.text(max_size=10) | st.sampled_from(["../../x", "a/b", "export"]))] = target.pop(key)
    return recipe


@settings(max_examples=int(__import__("os").environ.get("FUZZ_EXAMPLES", 150)), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=mutated_recipes())
def test_random_recipe_mutations_never_crash_the_validator(recipe, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz", numbered=True)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, allow_unicode=True))
    try:
        validate_recipe(load_recipe(path))
    except OptpipeError as exc:
        message = str(exc)
        assert message and "\n" not in message and "Traceback" not in message, message


def test_the_unmutated_recipe_is_valid(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(base_recipe()))
    validate_recipe(load_recipe(path))
