"""Checks before any stage runs, so that a broken model file or data set costs one line and
no compute: the ONNX source is a valid ONNX model (onnx.checker's full check, ONNX Runtime
can load it) whose inputs match the recipe, the data sets load with the recipe's shapes and dtypes.

Problems found here are the user's to fix (exit code 2); problems found while a stage
runs fail that stage and name it (exit code 1).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from optpipe.core.errors import DataError, RecipeError
from optpipe.recipe.schema import LABELLED_TASKS, Recipe
from optpipe.recipe.task_outputs import task_outputs

if TYPE_CHECKING:
    from optpipe.cache.store import StageCache

log = logging.getLogger("optpipe.recipe.schema")
_DATA_PREFIX = re.compile(r"^(data(\.\w+)?( source '\w+')?:\s*)")


def preflight(recipe: Recipe, onnx_path: Path | None, eval_set: Callable[[], object], calibration_set: Callable[[], object],
              cache: "StageCache | None" = None) -> list[str]:
    """`onnx_path`: the model file of an ONNX recipe (resolved by the caller, from model_source).
    The data sets are built (or loaded) through the run's builders, so the stages reuse them.
    `cache`: where a model file that passed is remembered (see `check_onnx_source`).
    Returns what it warned of the data (each said on the console as well): the report keeps them, since every
    figure of the run rests on that data (they had been said on the console only)."""
    if onnx_path is not None:
        check_onnx_source(recipe, onnx_path, cache)  # its memory: plan/source_preflight.py, which knows the passes
    _check_data(eval_set, "eval")
    evaluated = _sample_digests(eval_set())  # each sample's bytes hashed once, for the repeats and the overlap
    said = [_unread_labels(recipe, eval_set), _short(recipe.data.eval.samples, eval_set(), "eval"), _repeated(evaluated, "eval")]
    if recipe.data.calibration is not None:
        _check_data(calibration_set, "calibration")
        calibrated = _sample_digests(calibration_set())
        said += [_short(recipe.data.calibration.samples, calibration_set(), "calibration"), _repeated(calibrated, "calibration"),
                 *_alike(calibration_set()), _shared(eval_set(), calibration_set(), evaluated, calibrated)]
    for line in filter(None, said):
        log.warning("%s", line)
    return [line for line in said if line]


def check_onnx_source(recipe: Recipe, path: Path, cache: "StageCache | None" = None) -> None:
    """The cheap checks every run; the costly ones (onnx.checker's full check, an ONNX Runtime session,
    which reads every weight: seconds for a model of gigabytes) once per version of the files.

    A version is judged as make judges a file: its size and modification time (the model's and its
    external data's), with the library versions that judged it.
    """
    from optpipe.cache.store import StageCache, library_versions
    from optpipe.safety import onnx_guard

    graph = onnx_guard.check_named_parts(path, recipe.model_inputs(), "model.onnx")
    check_output_names(recipe, [o.name for o in graph.graph.output])
    files = onnx_guard.model_files(path, graph)
    key = StageCache.key(
        preflight="onnx-source",
        files=[(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files],
        libraries=library_versions(("onnx", "onnxruntime")),
    )
    if cache is None or not cache.get_result(key):
        onnx_guard.check_loadable(path, "model.onnx")
        if cache is not None:
            cache.put_result(key, {"passed": str(path)})
    _check_runs_on_recipe_inputs(recipe, path, key, cache)


def _check_runs_on_recipe_inputs(recipe: Recipe, path: Path, file_key: str, cache: "StageCache | None") -> None:
    """The model runs on the inputs the recipe's specs build (the passes' self-checks use the same):
    an integer `range` past an embedding table, a sequence `dims` past the model's positions, are
    the recipe's to fix, named here in one line rather than by every stage that meets them.
    Once per model version and input specs (one inference at the `opt` shape)."""
    from optpipe.cache.store import StageCache
    from optpipe.recipe.example_inputs import trace_inputs
    from optpipe.safety import onnx_guard

    shapes = recipe.model_inputs()
    key = StageCache.key(preflight="onnx-runs", model=file_key, inputs=[s.model_dump(mode="json") for s in shapes.inputs],
                         dims={name: dim.model_dump(mode="json") for name, dim in shapes.dims.items()})
    if cache is not None and cache.get_result(key):
        return
    onnx_guard.check_runs_on(path, trace_inputs(shapes))
    if cache is not None:
        cache.put_result(key, {"passed": str(path)})


def check_output_names(recipe: Recipe, outputs: list[str]) -> None:
    """The outputs the recipe names (per-output tolerances, the task's output) exist in the model:
    a misspelt name would otherwise hold nothing to its tolerance, or fail every stage's evaluation."""
    known = ", ".join(repr(n) for n in outputs)
    places = [("evaluate.tolerance.outputs", recipe.evaluate.tolerance)]
    places += [(f"stages.{name}.tolerance.outputs", spec.tolerance) for name, spec in recipe.stages.items() if spec.tolerance]
    for where, tolerance in places:
        for name in tolerance.outputs:
            if name not in outputs:
                raise RecipeError(f"{where}: the model has no output '{name}'; its outputs are {known}; fix the name")
    task = recipe.evaluate.task
    if task is not None and task.output is not None:
        task_outputs(task, outputs)  # each name the model's, a list for classification only


def _unread_labels(recipe: Recipe, eval_set: Callable[[], object]) -> str | None:
    """Labels the data carries by itself (an npz `labels` array, class subfolders) count only for a
    classification task; a file named in data.eval.labels without one is refused at validation."""
    task = recipe.evaluate.task
    if (task is None or task.kind not in LABELLED_TASKS) and getattr(eval_set(), "labels", None) is not None:
        now = f"evaluate.task is {task.kind}" if task else "evaluate.task is not set"
        return (f"data.eval: the evaluation data carries labels (an npz `labels` array or class subfolders), but {now}: "
                "they are not checked; set `evaluate.task: {kind: classification}` to hold top-1 on them")
    return None


def _short(asked: int, samples, which: str) -> str | None:
    """A file with fewer samples than `samples` asks for is used as it is (a text is repeated to fill them instead):
    said once, since every figure of the run then rests on fewer samples than the recipe reads as."""
    held = len(samples)
    if held >= asked:
        return None
    return (f"data.{which}: the data holds {held} samples, fewer than the {asked} `samples` asks for: what is measured or "
            f"calibrated on it rests on {held}; give more data or lower `samples`")


def _repeated(digests: list[bytes], which: str) -> str | None:
    """Samples that are copies of others: a text of 3 lines for `samples: 64` is repeated to fill them, and the report
    read "64 samples" for figures that rest on 3 sentences. Said with the count of distinct ones (samples compared
    whole, every input's bytes, after preprocessing: scikit-image's chessboard_GRAY and _RGB are one 96 x 96 image)."""
    distinct = len(set(digests))
    if distinct == len(digests):
        return None
    return (f"data.{which}: {distinct} of its {len(digests)} samples are distinct, the rest repeat them (a short file "
            f"repeated to fill `samples`, or one sample twice in the data): what is measured or calibrated on it rests on "
            f"{distinct}; give more data or lower `samples`")


def _alike(samples) -> list[str]:
    """A float input that is the same in every calibration sample (a folder of blank images, an npz of zeros) gives
    int8 one point to calibrate on: every int8 stage kept its layers in float or clipped on real data, and said only
    that. Said once, naming the input (an integer input alike in every sample, a mask of ones, is normal)."""
    said = []
    if len(samples) < 2:
        return said
    for name, array in samples.arrays.items():
        if np.issubdtype(array.dtype, np.floating) and array.size and bool((array == array[:1]).all()):
            what = f"the value {array.flat[0]:.4g} everywhere" if bool((array == array.flat[0]).all()) else "the same array"
            said.append(f"data.calibration: input '{name}' is {what} in all {len(samples)} samples: int8 ranges calibrated on "
                        "it fit that one input, so int8 stages keep in float or clip what real inputs feed; calibrate on "
                        "varied, real samples")
    return said


def _shared(eval_samples, calibration_samples, evaluated: list[bytes], calibrated: list[bytes]) -> str | None:
    """Evaluation samples that are also calibration samples (both sets read from one file): int8 stages are then
    measured on the data their ranges were fitted to, which reads better than data they have not seen. Said once,
    with the share; samples compared whole (every input's bytes). Synthetic sets are left to their own warning (made-up
    data: the figures mean little either way)."""
    if set(eval_samples.arrays) != set(calibration_samples.arrays) or "synthetic" in (eval_samples.origin, calibration_samples.origin):
        return None
    seen = set(calibrated)
    shared = sum(digest in seen for digest in evaluated)
    if not shared:
        return None
    return (f"data.eval: {shared} of its {len(eval_samples)} samples are also in data.calibration: int8 stages are measured "
            "on the samples their ranges were calibrated on, which reads better than unseen data; evaluate on other samples")


def _sample_digests(samples) -> list[bytes]:
    """Each sample's digest over every input's bytes (by input name)."""
    import hashlib

    names = sorted(samples.arrays)
    return [hashlib.blake2b(b"".join(np.ascontiguousarray(samples.arrays[n][i]).tobytes() for n in names), digest_size=16).digest()
            for i in range(len(samples))]


def _check_data(build, which: str) -> None:
    """Build (or load from the cache) a sample set; its errors name `data.<which>`."""
    try:
        build()
    except DataError as exc:
        raise DataError(f"data.{which}: {_DATA_PREFIX.sub('', str(exc))}") from None
