"""One StageRow for both report views, typed target results, and the headline latency read in one place."""
from __future__ import annotations

import html as html_lib
import re

import pytest
from pydantic import ValidationError

from optpipe.reporting import rows
from optpipe.reporting.html import render_html
from optpipe.reporting.rows import Cell, Column
from optpipe.reporting.run_report import pareto_frontier, render_markdown, stage_table
from optpipe.core.results import Accuracy, GuardCheck, Latency, OutputAccuracy, RunReport, StageResult, TargetResult


def latency(p50: float, batch: int = 1, sweep: str | None = None) -> Latency:
    return Latency(batch_size=batch, shape={"x": [batch, 4]}, p50_ms=p50, p90_ms=p50 * 1.1, p99_ms=p50 * 1.2, mean_ms=p50,
                   throughput=batch / p50 * 1000, iterations=3, provider="cpu", sweep=sweep, sweep_value=8 if sweep else None)


def accuracy(cosine: float, within: bool, guard: GuardCheck | None = None) -> Accuracy:
    return Accuracy(reference="export", samples=4, within_tolerance=within, guard=guard,
                    violations=[] if within else [f"output 'y' cosine {cosine} < 0.99"],
                    outputs=[OutputAccuracy(name="y", max_abs=0.01, mean_abs=0.001, cosine_mean=cosine, cosine_min=cosine)])


def report() -> RunReport:
    # A sweep point listed first must never be taken for the headline latency.
    stages = [
        StageResult(name="pytorch-eager", pass_name="eager", status="ok", latency=[latency(8.0)]),
        StageResult(name="export", pass_name="export", status="ok", latency=[latency(99.0, sweep="sequence"), latency(4.0)],
                    size_bytes=1_000_000, accuracy=accuracy(1.0, True)),
        StageResult(name="fp16", pass_name="fp16", parent="export", status="ok", latency=[latency(2.0)], size_bytes=500_000,
                    accuracy=accuracy(0.99979, False, GuardCheck(numerics="emulated FP16 storage", cosine=0.0, max_abs=1.0,
                                                                 within_tolerance=False, gave_up="the guard is off"))),
        StageResult(name="int8", pass_name="int8", parent="export", status="failed", reason="boom"),
    ]
    targets = [TargetResult(kind="ort", stage="export", status="ok", path="targets/ort/export", latency=[latency(4.0)]),
               TargetResult(kind="tensorrt", stage="export", status="skipped", reason="TensorRT is not installed here")]
    return RunReport(optpipe_version="dev", recipe="t", created="now", machine={}, evaluation={"batch_sizes": [1]},
                     reference="export", baseline="pytorch-eager", stages=stages, pareto=pareto_frontier(stages), targets=targets)


def markdown_cells(table: str, stage: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(f"| {stage} |"))
    return [cell.strip() for cell in line.strip("|").split(" | ")]


def html_cells(page: str, stage: str) -> list[str]:
    row = re.search(rf"<tr><td><b>{stage}</b></td>(.*?)</tr>", page).group(1)
    return [stage] + [html_lib.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td>(.*?)</td>", row)]


def test_markdown_and_html_render_the_same_rows():
    data = report()
    table, page = stage_table(data), render_html(data)
    for stage in ("pytorch-eager", "export", "fp16", "int8"):
        assert markdown_cells(table, stage) == html_cells(page, stage)
    export = markdown_cells(table, "export")
    headers = rows.headers()
    assert export[headers.index("p50 ms")] == "4.00" and export[headers.index("vs eager")] == "2.00x"
    fp16 = markdown_cells(table, "fp16")
    # The verdict is out of tolerance, and both figures are shown.
    assert fp16[headers.index("cosine")] == "0.99979 (guard 0.00000, emulated FP16 storage) ⚠"
    assert fp16[headers.index("vs parent")] == "2.00x" and fp16[headers.index("Δ size")] == "-50%"


def test_a_new_column_is_one_entry_and_shows_in_both_views(monkeypatch):
    monkeypatch.setattr(rows, "COLUMNS", [*rows.COLUMNS, Column("coverage", lambda c: Cell(f"{len(c.stage.name)} chars"))])
    data = report()
    assert markdown_cells(stage_table(data), "fp16")[-1] == "4 chars"
    assert html_cells(render_html(data), "fp16")[-1] == "4 chars"
    assert "<th>coverage</th>" in render_html(data)


def test_the_headline_latency_skips_sweep_points_everywhere():
    data = report()
    assert data.stage("export").headline.p50_ms == 4.0
    assert data.pareto == ["export"]  # fp16 is faster, but out of tolerance: never on the frontier
    assert "| ort | export | ok |  |  | 4.00 | targets/ort/export |" in render_markdown(data)


def test_target_results_are_typed():
    data = report()
    skipped = data.targets[1]
    assert skipped.status == "skipped" and not skipped.failed and skipped.describe() == "skipped: TensorRT is not installed here"
    assert "| tensorrt | export | skipped: TensorRT is not installed here |" in render_markdown(data)
    with pytest.raises(ValidationError):
        TargetResult(kind="ort", stage="export", status="failed: boom")
    assert RunReport.model_validate_json(data.model_dump_json()).targets == data.targets


def test_an_out_of_tolerance_stage_has_its_own_verdict_in_the_table_the_page_and_report_json():
    data = report()
    fp16 = data.stage("fp16")
    assert fp16.status == "ok" and fp16.verdict == "out-of-tolerance"  # it ran; it is not usable
    assert markdown_cells(stage_table(data), "fp16")[3].startswith("out-of-tolerance")
    assert markdown_cells(stage_table(data), "export")[3] == "ok"
    dumped = __import__("json").loads(data.model_dump_json())
    assert {s["name"]: s["verdict"] for s in dumped["stages"]} == {
        "pytorch-eager": "ok", "export": "ok", "fp16": "out-of-tolerance", "int8": "failed"}
    assert dumped["schema_version"] == 3 and RunReport.model_validate(dumped).stage("fp16").verdict == "out-of-tolerance"
    assert "out-of-tolerance" in render_html(data)


def test_the_frontier_is_latency_vs_accuracy_error_and_the_report_says_so():
    """A MobileNet's int8 stage: smaller than fuse but slower and less accurate; size is no axis, so no star."""
    stages = [
        StageResult(name="fuse", pass_name="fuse", status="ok", latency=[latency(1.0)], size_bytes=4_000_000, accuracy=accuracy(1.0, True)),
        StageResult(name="int8", pass_name="int8", parent="fuse", status="ok", latency=[latency(16.0)], size_bytes=1_000_000,
                    accuracy=accuracy(0.995, True)),
        StageResult(name="fp16", pass_name="fp16", parent="fuse", status="ok", latency=[latency(0.5)], size_bytes=2_000_000,
                    accuracy=accuracy(0.999, True)),
    ]
    assert pareto_frontier(stages) == ["fuse", "fp16"]
    data = RunReport(optpipe_version="dev", recipe="t", created="now", machine={}, evaluation={"batch_sizes": [1]},
                     reference="fuse", stages=stages, pareto=pareto_frontier(stages))
    assert "Pareto frontier (p50 latency at the first batch size vs accuracy error" in render_markdown(data)
    assert data.frontier_axes[0].startswith("p50 latency") and len(data.frontier_axes) == 2
