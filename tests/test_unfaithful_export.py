"""An export that is right on the recipe's synthetic inputs and wrong on the user's data.

A model that rescales images given in 0-255 (`if x.max() > 1: x = x / 255`) has a branch on tensor values. Dynamo
refuses it; the TorchScript trace records the branch its synthetic inputs (U(-1, 1)) took, and its self-check on
those inputs passes. On 0-255 images eager takes the other branch. Only eager's row (cosine -0.50 against the
export) said so: the export and every stage after it read "ok" at cosine 1.0, starred on the frontier, exit 0."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from helpers_recipes import compile_recipe, small_recipe  # noqa: E402
from optpipe.core.results import RunReport  # noqa: E402
from optpipe.evaluation.verdict import UNFAITHFUL_EXPORT, flag_unfaithful_reference  # noqa: E402

MODELS = '''import torch


class AutoScale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        if x.max() > 1:  # images given in 0-255
            x = x / 255.0
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def autoscale():
    torch.manual_seed(0)
    return AutoScale().eval()
'''

STAGES = {"export": {"pass": "export", "params": {"exporter": "torchscript"}},
          "simplify": {"pass": "simplify", "after": "export"}}


def _compile(tmp_path, cli_run, module: str, image_range: list | None = None, exporter: str = "torchscript"):
    (tmp_path / f"{module}.py").write_text(MODELS)  # one module name per test: a factory is imported from its recipe's folder only
    images = np.random.default_rng(1).integers(0, 256, size=(8, 3, 16, 16)).astype(np.float32)
    np.savez(tmp_path / "images.npz", x=images)
    spec = {"name": "x", "dtype": "float32", "shape": ["batch", 3, 16, 16], **({"range": image_range} if image_range else {})}
    stages = {**STAGES, "export": {"pass": "export", "params": {"exporter": exporter}}}
    recipe = small_recipe({"factory": f"{module}:autoscale", "path": "."}, inputs=[spec], stages=stages, samples=8)
    recipe["data"] = {"eval": {"source": "npz", "path": "images.npz", "samples": 8}}
    result = compile_recipe(tmp_path, cli_run, recipe)
    return result, json.loads((tmp_path / "run" / "report.json").read_text())


def test_an_export_wrong_on_the_data_puts_every_stage_out_of_tolerance(tmp_path, cli_run):
    result, report = _compile(tmp_path, cli_run, "unfaithful_scale")
    assert result.exit_code == 0, result.output  # out of tolerance, as any stage that breaks it: ran and measured
    rows = {s["name"]: s for s in report["stages"]}
    assert rows["export"]["info"]["self_check"]["passed"] is True  # right on the synthetic inputs
    assert "% of elements beyond max_abs 0.001" in rows["pytorch-eager"]["accuracy"]["export_mismatch"]
    for name in ("export", "simplify"):
        assert rows[name]["verdict"] == "out-of-tolerance", rows[name]["accuracy"]
        assert UNFAITHFUL_EXPORT in rows[name]["accuracy"]["violations"][0]
        assert rows[name]["accuracy"]["outputs"][0]["cosine_mean"] > 0.9999  # against the export itself: no help
    assert report["pareto"] == []
    warning = next(w for w in rows["export"]["warnings"] if UNFAITHFUL_EXPORT in w)
    assert "Python boolean" in warning and "`range`" in warning
    assert "OUT OF TOLERANCE" in next(line for line in result.output.splitlines() if "evaluate export" in line)
    # The report flags once, however often it is built (in process, then again by build_report).
    stages = RunReport.model_validate(report).stages
    flag_unfaithful_reference(stages, "export")
    assert sum(UNFAITHFUL_EXPORT in v for v in stages[1].accuracy.violations) == 1


def test_the_same_model_traced_on_inputs_like_the_data_is_within_tolerance(tmp_path, cli_run):
    result, report = _compile(tmp_path, cli_run, "faithful_scale", image_range=[0, 255])
    assert result.exit_code == 0, result.output
    rows = {s["name"]: s for s in report["stages"]}
    assert rows["pytorch-eager"]["accuracy"]["export_mismatch"] is None
    assert rows["pytorch-eager"]["verdict"] == rows["export"]["verdict"] == rows["simplify"]["verdict"] == "ok"
    assert report["pareto"]  # export or simplify, whichever timed faster: which one is the machine's noise


def test_a_failed_dynamo_capture_prints_nothing_on_the_terminal(tmp_path, cli_run):
    """torch.export prints the failed capture's FX graph on stderr (dozens of lines): the stage log keeps it."""
    result, _ = _compile(tmp_path, cli_run, "dynamo_scale", image_range=[0, 255], exporter="auto")
    assert result.exit_code == 0, result.output
    assert "def forward" not in result.output and "GraphModule" not in result.output
    assert "def forward" in (tmp_path / "run" / "logs" / "export.log").read_text()
