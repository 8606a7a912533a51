"""A forward that draws random numbers is refused by the export, saying so (passes/export.py).

Every stage is measured against eager, which such a model cannot match even against itself; the export's
check used to fail with 'raise check_atol/check_rtol only if this is rounding', which cannot help."""
from __future__ import annotations

import pytest
import yaml

MODELS = '''import torch


class Noisy(torch.nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.a, self.b, self.dropout = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4), dropout

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.dropout:
            return self.b(torch.nn.functional.dropout(h, 0.3, training=True))  # MC dropout: on in eval mode
        return self.b(h + 0.5 * torch.randn_like(h))


def noise():
    torch.manual_seed(0)
    return Noisy(False).eval()


def dropout():
    torch.manual_seed(0)
    return Noisy(True).eval()
'''


@pytest.mark.parametrize("factory", ["noise", "dropout"])
def test_a_random_forward_is_refused_naming_the_output_and_the_cause(tmp_path, cli_run, factory):
    (tmp_path / f"noisy_{factory}.py").write_text(MODELS)  # a module per test: an imported one is held to its folder
    recipe = {"name": "noisy", "model": {"factory": f"noisy_{factory}:{factory}", "path": "."},
              "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 16]}],
              "dims": {"batch": {"min": 1, "opt": 2, "max": 4}}, "data": {"eval": {"source": "synthetic", "samples": 4}},
              "stages": {"export": {"pass": "export"}}, "evaluate": {"batch_sizes": [2], "warmup": 1, "iterations": 2},
              "output": "run"}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = cli_run("compile", str(tmp_path / "recipe.yaml"))
    assert result.exit_code == 2, result.output
    assert "forward() gives different outputs on the same inputs (output 'output' differs by" in result.output
    assert "make forward deterministic" in result.output and "check_atol" not in result.output
