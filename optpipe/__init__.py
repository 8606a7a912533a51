"""optpipe: a compiler-style model optimization pipeline.

    from optpipe import load_recipe, compile_recipe
    report = compile_recipe(load_recipe("recipes/minilm.yaml"))
    session = load("runs/minilm/targets/ort/simplify")  # an ORT bundle -> InferenceSession
    compiled = load("runs/minilm/targets/openvino/ov-int8")  # an OpenVINO folder -> CompiledModel
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from optpipe.core.library_files import ort_telemetry_off

ort_telemetry_off()  # before anything imports onnxruntime: its telemetry writes into the home folder

__all__ = ["compile_recipe", "load_recipe", "load", "RunOptions", "RunReport"]

if TYPE_CHECKING:
    from optpipe.execution.pipeline import RunOptions, compile_recipe
    from optpipe.safety.recipe_loading import load_recipe
    from optpipe.reporting.run_report import RunReport
    from optpipe.targets.loading import load


def __getattr__(name: str) -> Any:
    # Lazy: `import optpipe` stays cheap; torch and onnxruntime load only when a run needs them.
    if name in ("compile_recipe", "RunOptions"):
        from optpipe.execution import pipeline

        return getattr(pipeline, name)
    if name == "load_recipe":
        from optpipe.safety.recipe_loading import load_recipe

        return load_recipe
    if name == "RunReport":
        from optpipe.reporting.run_report import RunReport

        return RunReport
    if name == "load":
        from optpipe.targets.loading import load

        return load
    raise AttributeError(name)
