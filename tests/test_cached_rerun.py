"""A fully cached rerun measures nothing and imports no heavy library: the figures come from the
cache (evaluation, sweeps, precision coverage) and report.html's plots are reused when the data
they show is unchanged."""
from __future__ import annotations

import json
import subprocess
import sys

from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import load_recipe

#: Libraries a cached rerun has no use for: the model (torch, transformers), the plots (matplotlib),
#: the passes (onnxslim, openvino, nncf) and Polygraphy (the accuracy runs).
HEAVY = ("torch", "matplotlib", "transformers", "onnxslim", "openvino", "nncf", "polygraphy")

COMPILE_AND_LIST_MODULES = """
import json, sys
from optpipe.cli import main
code = 0
sys.argv = ["optpipe", "compile", sys.argv[1], "--cache-dir", sys.argv[2]]
try:
    main()
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "heavy": sorted(m for m in sys.modules if m.split(".")[0] in %r)}))
""" % (HEAVY,)


def _compile_in_subprocess(recipe, cache) -> dict:
    out = subprocess.run([sys.executable, "-c", COMPILE_AND_LIST_MODULES, str(recipe), str(cache)],
                         capture_output=True, text=True, timeout=600)
    assert out.stdout.strip(), out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _recipe(tiny_recipe):
    return tiny_recipe({"stages": {"int8": {"pass": "int8", "after": "simplify", "params": {"mode": "dynamic"}}},
                        "evaluate": {"sweep": {"batch": [1, 4]}, "sweep_iterations": 2}})


def test_a_cached_rerun_imports_no_heavy_library(tiny_recipe, cache_dir, tmp_path):
    recipe = _recipe(tiny_recipe)
    first = _compile_in_subprocess(recipe, cache_dir)
    assert first["code"] in (0, None) and "torch" in first["heavy"] and "matplotlib" in first["heavy"]
    html = (tmp_path / "run" / "report.html").read_text()
    again = _compile_in_subprocess(recipe, cache_dir)
    assert again["code"] in (0, None)
    assert again["heavy"] == [], f"a cached rerun imported {again['heavy']}"
    # The page is the same but for its creation time: the plots were reused, not left out.
    assert (tmp_path / "run" / "report.html").read_text().count("<svg") == html.count("<svg") >= 3


def test_a_cached_rerun_reads_coverage_and_redraws_plots_only_when_the_data_changes(tiny_recipe, cache_dir, tmp_path, monkeypatch):
    from optpipe.reporting.html import render_html

    recipe = load_recipe(_recipe(tiny_recipe))
    first = compile_recipe(recipe, RunOptions(cache_dir=cache_dir))

    def no_counting(*args, **kwargs):
        raise AssertionError("coverage counted again")

    monkeypatch.setattr("optpipe.evaluation.verdict.precision_coverage", no_counting)
    again = compile_recipe(recipe, RunOptions(cache_dir=cache_dir))
    assert [s.coverage for s in again.stages] == [s.coverage for s in first.stages]
    assert again.stage("int8").coverage.share("int8") > 0.5
    assert [s.model_dump(exclude={"cached", "evaluation_cached", "duration_s"}) for s in again.stages] == \
           [s.model_dump(exclude={"cached", "evaluation_cached", "duration_s"}) for s in first.stages]

    # Other figures: the plots are drawn anew and show them.
    plots_file = tmp_path / "run" / ".report-plots.json"
    kept = plots_file.read_text()
    assert render_html(again, plots_file) == render_html(again, plots_file) and plots_file.read_text() == kept
    slower = again.model_copy(deep=True)
    slower.stage("int8").latency[0].p50_ms *= 7
    render_html(slower, plots_file)
    assert plots_file.read_text() != kept
