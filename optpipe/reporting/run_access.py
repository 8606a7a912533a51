"""Finding a finished run and its stages on disk: report.json, stages/<name>/, the saved sample inputs.

The run-folder I/O of `optpipe inspect`, `diff` and `report`: everything else in
reporting/inspection.py works on what these functions return.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from optpipe.core.errors import RunFolderError
from optpipe.graph.stats import describe_graph
from optpipe.core.results import RunReport, StageResult

#: A few evaluation samples saved in the run folder, so a layer-wise comparison uses real inputs.
SAMPLE_INPUTS_FILE = "eval_inputs.npz"
SAMPLE_INPUTS_COUNT = 4


def open_run(path: str | Path) -> RunReport:
    run_dir = Path(path)
    if not (run_dir / "report.json").is_file():
        raise RunFolderError(f"'{run_dir}' is not a run folder (no report.json); pass the output folder of `optpipe compile`")
    try:
        return RunReport.load(run_dir)
    except ValueError as exc:
        raise RunFolderError(f"'{run_dir / 'report.json'}' is not a readable optpipe report ({str(exc).splitlines()[0]}); rerun `optpipe compile`") from None


@dataclass
class StageHandle:
    """One stage of one run: its report row and, for ONNX stages, its model in the run folder."""

    run_dir: Path
    report: RunReport
    result: StageResult
    show_run: bool = False

    @property
    def name(self) -> str:
        return self.result.name

    @property
    def label(self) -> str:
        return f"{self.run_dir}:{self.name}" if self.show_run else self.name

    @property
    def model_path(self) -> Path | None:
        path = self.run_dir / "stages" / self.name / "model.onnx"
        return path if path.is_file() else None

    @cached_property
    def graph(self) -> dict[str, Any] | None:
        """describe_graph of the stage's model; None for PyTorch eager.

        Counts and bytes come from the initializers' dims and dtypes, so the weights stay on disk."""
        if self.model_path is None:
            return None
        import onnx

        return describe_graph(onnx.load(str(self.model_path), load_external_data=False))


def stage_handle(run_dir: str | Path, name: str, report: RunReport | None = None) -> StageHandle:
    run_dir = Path(run_dir)
    report = report or open_run(run_dir)
    result = report.stage(name)
    if result is None:
        from optpipe.recipe.schema import suggest

        names = ", ".join(s.name for s in report.stages)
        raise RunFolderError(f"run '{run_dir}' has no stage '{name}'{suggest(name, [s.name for s in report.stages])}; its stages are: {names}")
    return StageHandle(run_dir, report, result)


def parse_stage_ref(text: str, default_run: Path | None) -> StageHandle:
    """'STAGE' (in default_run) or 'RUN:STAGE' (a stage of another run folder)."""
    run_part, sep, stage = text.rpartition(":")
    if sep and run_part and (Path(run_part) / "report.json").is_file():
        handle = stage_handle(run_part, stage)
        handle.show_run = True
        return handle
    if default_run is None:
        raise RunFolderError(f"'{text}' names no run folder; write it as RUN:STAGE, e.g. runs/minilm:simplify")
    return stage_handle(default_run, text)


def stage_order(report: RunReport) -> list[StageResult]:
    return list(report.stages)


def save_sample_inputs(run_dir: Path, arrays: dict[str, np.ndarray], count: int = SAMPLE_INPUTS_COUNT) -> Path:
    """Keep the first evaluation samples beside the report (small: a few samples)."""
    path = run_dir / SAMPLE_INPUTS_FILE
    tmp = run_dir / f".{SAMPLE_INPUTS_FILE}.tmp.npz"
    np.savez(tmp, **{name: array[:count] for name, array in arrays.items()})
    tmp.replace(path)
    return path


def sample_inputs(run_dir: Path, count: int) -> dict[str, np.ndarray] | None:
    path = run_dir / SAMPLE_INPUTS_FILE
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name][:count] for name in data.files}
