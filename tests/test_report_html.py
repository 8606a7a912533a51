"""report.html: self-contained (inline SVG plots, no external resources), rebuilt by `optpipe report`."""
from __future__ import annotations

import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from inspect_models import mlp_model, mlp_recipe, save
from optpipe.cli import cli
from optpipe.core.results import Accuracy, Latency, OutputAccuracy, StageResult, TargetResult
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import parse_recipe
from optpipe.reporting.run_report import RunReport
from optpipe.reporting.html import render_html

SVG = re.compile(r"<figure class='plot' id='plot-([\w-]+)'>(<svg.*?</svg>)</figure>", re.S)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("html")
    model_path = save(mlp_model(), root / "mlp.onnx")
    recipe = parse_recipe(mlp_recipe(model_path, root / "run", sweep_stages="all"))  # a curve for every stage
    report = compile_recipe(recipe, RunOptions(cache_dir=root / "cache"))
    assert not report.failed
    return root / "run"


def plots(html: str) -> dict[str, str]:
    return {name: svg for name, svg in SVG.findall(html)}


def test_compile_writes_a_self_contained_report_with_every_plot(run_dir):
    html = (run_dir / "report.html").read_text()
    found = plots(html)
    # The sweep of the batch dim is the batch-size chart: drawn once, not twice (issue 18).
    assert set(found) == {"dag", "pareto", "latency-vs-batch-size", "latency-vs-sequence"}
    for svg in found.values():
        ET.fromstring(svg)  # each plot is well-formed inline SVG
    without_namespaces = re.sub(r'xmlns(:\w+)?="[^"]*"', "", html)
    assert not re.search(r"https?://|<script|<link|<img", without_namespaces)


def test_plots_name_the_stages_and_the_frontier(run_dir):
    found = plots((run_dir / "report.html").read_text())
    assert "simplify" in found["pareto"] and "accuracy error" in found["pareto"]
    assert "p50 latency, ms" in found["latency-vs-sequence"] and "throughput, samples/s" in found["latency-vs-sequence"]
    assert "export" in found["latency-vs-sequence"] and "simplify" in found["latency-vs-sequence"]
    for stage in ("export", "simplify"):
        assert stage in found["dag"]


def test_stage_table_shows_deltas_against_the_parent(run_dir):
    html = (run_dir / "report.html").read_text()
    row = re.search(r"<tr><td><b>simplify</b></td>(.*?)</tr>", html).group(1)
    cells = re.findall(r"<td>(.*?)</td>", row)
    assert cells[0] == "simplify" and cells[1] == "export"  # pass, after
    assert re.fullmatch(r"\d+\.\d\dx( ⚠busy)?", cells[6])  # speed-up vs parent (flagged when timed on a busy machine)
    assert cells[8] == "+0.00000"  # cosine delta vs parent: simplify is exact


def test_report_command_rebuilds_without_recomputing(run_dir):
    before = (run_dir / "report.json").read_bytes()
    (run_dir / "report.html").unlink()
    result = CliRunner().invoke(cli, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert (run_dir / "report.json").read_bytes() == before
    assert "pareto" in plots((run_dir / "report.html").read_text())


def test_failed_and_out_of_tolerance_stages_render():
    accuracy = Accuracy(reference="export", samples=4, within_tolerance=False, violations=["output 'y' cosine 0.9 < 0.99"],
                        outputs=[OutputAccuracy(name="y", max_abs=1.0, mean_abs=0.1, cosine_mean=0.9, cosine_min=0.5)])
    latency = [Latency(batch_size=1, shape={"x": [1, 4]}, p50_ms=1.0, p90_ms=1.1, p99_ms=1.2, mean_ms=1.0, throughput=1000, iterations=3, provider="cpu")]
    stages = [
        StageResult(name="export", pass_name="export", status="ok", latency=latency, size_bytes=100, pareto=True),
        StageResult(name="int8", pass_name="int8", parent="export", status="ok", latency=latency, size_bytes=30, accuracy=accuracy),
        StageResult(name="fp16", pass_name="fp16", parent="export", status="failed", reason="boom"),
    ]
    report = RunReport(optpipe_version="dev", recipe="t", created="now", machine={}, evaluation={"batch_sizes": [1]},
                       reference="export", stages=stages, pareto=["export"])
    html = render_html(report)
    assert "<code>fp16</code> failed: boom" in html
    assert "int8</code> is out of tolerance" in html
    assert set(plots(html)) == {"dag", "pareto"}  # one latency point per stage: no curves


def _targets_html(targets: list[TargetResult]) -> str:
    stages = [StageResult(name="export", pass_name="export", status="ok", size_bytes=100)]
    report = RunReport(optpipe_version="dev", recipe="t", created="now", machine={}, evaluation={"batch_sizes": [1]},
                       reference="export", stages=stages, targets=targets)
    section = re.search(r"<section><h2>Targets</h2>(.*?)</section>", render_html(report), re.S)
    return section.group(1) if section else ""


def test_targets_show_the_ray_node_that_built_them_and_nothing_for_a_local_build():
    node = {"host": "gpu-box-7", "cpu": "AMD EPYC 9654", "cores": 16, "gpu": ["NVIDIA L4"], "ray_node": "3f9a0c2b71de"}
    table = _targets_html([
        TargetResult(kind="tensorrt", stage="int8", status="ok", path="targets/tensorrt/int8", precision="int8", built_on=node),
        TargetResult(kind="ort", stage="export", status="failed", reason="no such provider"),  # failed before any node built it
    ])
    head = re.findall(r"<th>(.*?)</th>", table)
    assert head[-1] == "built on"
    rows = {cells[0]: cells for cells in (re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table)) if cells}
    assert rows["tensorrt"][-1] == "gpu-box-7 [3f9a0c2b71de] · AMD EPYC 9654 x16 · NVIDIA L4"
    assert rows["ort"][-1] == "" and "failed: no such provider" in rows["ort"][2]
    # A local run: the driver built every target, built_on is None, and the page has no such column.
    local = _targets_html([TargetResult(kind="ort", stage="export", status="ok", path="targets/ort/export")])
    assert "<code>export</code>" in local and "built on" not in local
    assert _targets_html([]) == ""


@pytest.mark.skipif(not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")), reason="no headless Chromium here")
def test_report_renders_in_headless_chromium(run_dir, tmp_path):
    browser = next(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b))
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", (run_dir / "report.html").as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert dom.count("<svg") >= 4 and "plot-pareto" in dom
