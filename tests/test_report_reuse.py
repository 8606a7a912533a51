"""The report tells a cached pass from a cached evaluation: a rerun whose evaluation settings
changed reuses every stage's model but measures again, and says so (report.json, table, progress)."""
from __future__ import annotations

import io
import json

from optpipe.pass_infra.instruments import ConsoleProgress
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.reporting.run_report import stage_table
from optpipe.core.results import StageResult
from optpipe.safety.recipe_loading import load_recipe


def _compile(path, cache_dir):
    stream = io.StringIO()
    report = compile_recipe(load_recipe(path), RunOptions(cache_dir=cache_dir, instruments=[ConsoleProgress(stream)]))
    return report, stream.getvalue()


def _status_cells(report) -> dict[str, str]:
    lines = [[cell.strip() for cell in line.split("|")[1:-1]] for line in stage_table(report).splitlines() if line.startswith("|")]
    status = lines[0].index("status")
    return {cells[0]: cells[status] for cells in lines[2:]}


def test_a_new_evaluation_of_cached_models_reads_pass_cached(tiny_recipe, cache_dir, tmp_path):
    first, _ = _compile(tiny_recipe(), cache_dir)
    assert [(s.cached, s.evaluation_cached) for s in first.stages if s.name != "pytorch-eager"] == [(False, False)] * 2

    # Other latency settings: the models are the same, their figures are measured again.
    remeasured, progress = _compile(tiny_recipe({"evaluate": {"iterations": 4}}), cache_dir)
    for name in ("export", "simplify"):
        stage = remeasured.stage(name)
        assert (stage.cached, stage.evaluation_cached, stage.reused) == (True, False, "pass cached"), name
        assert f"cached {name} (" in progress, progress  # its pass line
        assert f"ok evaluate {name} (" in progress, progress  # its evaluation line: measured again
    stored = {s["name"]: s for s in json.loads((tmp_path / "run" / "report.json").read_text())["stages"]}
    assert (stored["simplify"]["cached"], stored["simplify"]["evaluation_cached"]) == (True, False)
    cells = _status_cells(remeasured)
    assert cells["simplify"] == "ok (pass cached)", cells
    assert "'pass cached': the stage's model came from the cache" in stage_table(remeasured)

    again, progress = _compile(tiny_recipe({"evaluate": {"iterations": 4}}), cache_dir)
    assert all(s.reused == "cached" for s in again.stages), [(s.name, s.reused) for s in again.stages]
    assert _status_cells(again)["simplify"] == "ok (cached)"
    assert "'pass cached'" not in stage_table(again)
    assert "cached evaluate simplify (" in progress


def test_reused_names_each_half():
    def stage(cached, evaluation_cached, status="ok"):
        return StageResult(name="s", pass_name="p", status=status, cached=cached, evaluation_cached=evaluation_cached).reused

    assert stage(True, True) == "cached"
    assert stage(True, False) == "pass cached"
    assert stage(False, True) == "eval cached"  # the pass ran again and made the same bytes
    assert stage(False, False) is None
    assert stage(True, None) == "cached"  # not evaluated (yet): the pass alone
    assert stage(True, True, status="failed") is None


def test_a_progress_line_is_one_line_in_a_pipe_and_its_text_is_never_markup():
    """Seen: rich wrapped lines at 80 columns in a log (`fp32` / `100%` on two lines), and a reason
    quoting a path in brackets ("[/tmp/x]") raised MarkupError out of the progress printer."""
    stream = io.StringIO()
    progress = ConsoleProgress(stream)
    failed = StageResult(name="export", pass_name="export", status="failed",
                         reason="could not read [/tmp/x] " + "and a long explanation " * 8)
    progress.stage_done(failed)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith(failed.reason) and "[/tmp/x]" in lines[0], lines
