"""inspect / diff / layer-wise view and report.html on the real all-MiniLM-L6-v2 (slow: exports the model once)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from optpipe.cli import cli
from optpipe.reporting.inspection import diff_stages, stage_handle
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import parse_recipe

pytestmark = pytest.mark.slow
RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "minilm.yaml"


@pytest.fixture(scope="module")
def minilm_run(tmp_path_factory):
    """The bundled recipe's stages, evaluated briefly (the stages themselves are the recipe's own)."""
    data = yaml.safe_load(RECIPE.read_text())
    data["data"]["eval"]["samples"] = 8
    data["evaluate"].update(batch_sizes=[1], warmup=1, iterations=2, eager_baseline=False,
                            sweep={"sequence": [32, 128]}, sweep_iterations=1, sweep_stages="all")
    data["output"] = str(tmp_path_factory.mktemp("minilm") / "run")
    report = compile_recipe(parse_recipe(data, base_dir=RECIPE.parent))
    assert not report.failed, [s.reason for s in report.failed]
    return Path(data["output"]), report


def test_inspect_every_stage(minilm_run):
    run_dir, report = minilm_run
    for stage in report.stages:
        if stage.not_run:  # ov-int8 / ov-bf16 on a CPU class where they cannot pay: skipped, nothing to inspect
            continue
        result = CliRunner().invoke(cli, ["inspect", str(run_dir), stage.name])
        assert result.exit_code == 0, result.output
        if stage.info.get("runtime") == "openvino":  # an IR stage: said so, never called a missing copy
            assert "an OpenVINO IR stage" in result.output and "is missing" not in result.output, result.output
            assert "int8_layers" in result.output
            continue
        assert "input  input_ids: int64 [batch, sequence]" in result.output
        assert "MatMul" in result.output and re.search(r"bytes by dtype: .*float(16)? \d", result.output)


def test_diff_export_to_simplify_lists_op_changes_and_finds_no_lost_accuracy(minilm_run):
    run_dir, report = minilm_run
    diff = diff_stages(stage_handle(run_dir, "export"), stage_handle(run_dir, "simplify"), layers=True, samples=2)
    nodes_before, nodes_after = diff.graph["nodes"]
    assert nodes_after < nodes_before and diff.graph["ops_removed"]
    assert diff.graph["parameters"][0] == pytest.approx(diff.graph["parameters"][1], rel=0.01)  # folding, not pruning
    assert [row["sweep"] for row in diff.latency] == ["", "sequence", "sequence"]
    layers = diff.layers
    assert layers.compared > 100  # most activations keep their names through onnxslim
    assert not layers.exceeding, layers.render()


def test_report_html_has_the_sequence_curve(minilm_run):
    run_dir, _ = minilm_run
    html = (run_dir / "report.html").read_text()
    assert "id='plot-latency-vs-sequence'" in html and "id='plot-pareto'" in html
