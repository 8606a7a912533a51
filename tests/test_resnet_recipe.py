"""recipes/resnet50.yaml validates on the default install, and its factory is torchvision's ResNet-50 layout."""
from __future__ import annotations

from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "resnet50.yaml"


def test_resnet50_recipe_validates_with_its_stages():
    from optpipe.safety.recipe_loading import load_recipe
    from optpipe.plan.validate import validate_recipe

    recipe = load_recipe(RECIPE)
    graph, passes = validate_recipe(recipe)
    assert {"export", "simplify", "fp16", "prune", "sparse-2-4"} <= set(graph.nodes)
    assert passes["prune"].params.amount == 0.5


def test_resnet50_factory_has_torchvisions_parameter_count_and_is_seeded():
    import torch

    from optpipe.models.resnet import resnet50

    a, b = resnet50(seed=0), resnet50(seed=0)
    assert sum(p.numel() for p in a.parameters()) == 25_557_032  # torchvision.models.resnet50(weights=None)
    assert torch.equal(a.fc.weight, b.fc.weight)
    with torch.inference_mode():
        assert a(torch.zeros(1, 3, 64, 64)).shape == (1, 1000)
