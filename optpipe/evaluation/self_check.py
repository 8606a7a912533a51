"""The numeric self-check after a pass: its output against its input on the same inputs.

It runs as an instrument (`NumericSelfCheck`, TVM's sense: after the pass, outside it)
for every pass whose params inherit `SelfCheckParams`: the stage runner calls it after
the pass and the contract checks, before the output is published, and records the
result as info.json's `self_check`. A pass that starts from the PyTorch model (export)
is checked against PyTorch eager instead of an input artifact.

The inputs: `example_inputs.trace_inputs` (synthetic, from the recipe's input specs,
dynamic dims at `opt`), the same for every pass. Threads: the recipe's `evaluate.threads`.

The metric is the report's own (`evaluation.accuracy.compare`), so `self_check` in
info.json and `accuracy` in report.json mean the same:
- `max_abs`: the largest elementwise |output - reference|, over all outputs;
- `cosine`: per output, the cosine similarity of each row of the last axis (per token for
  transformers; real tokens only when an `attention_mask` is an input), averaged over
  rows; the figure recorded is the worst output's.
A KV-cache decoder's export (its info has `kv_cache`) is also checked by a short greedy generation against
eager's (optpipe/evaluation/generation_check.py), recorded as `generation_check`.

Eager's reference: a pass that had the torch model loaded may hand over eager's outputs (`hand_over_eager`:
a file beside its workdir), so that the check does not load the model again beside the result's ONNX Runtime
session. The export does, before it exports: in its own worker process (a big dynamo export) the worker then
never holds the model and a session at once, and the compile's process never loads the model for the check
(1.1 B: the export's worker peaked at 2.20x the FP32 weights with both; docs/memory.md). The reference is
eager_outputs() on the same trace inputs, and is used only when its feeds equal the check's.

The check passes when every element satisfies |output - reference| <= check_atol +
check_rtol * |reference| (numpy.isclose's rule). The relative term keeps outputs in the
hundreds (detector boxes in pixels, logits of random weights) from failing on float
rounding; `check_atol` alone covers outputs near zero. With both None the figures are
recorded and the stage never fails on them (prune: its outputs move by design; the stage
evaluation reports by how much).
"""
from __future__ import annotations

import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from pydantic import Field

from optpipe.core.errors import DataError, PassError, first_line
from optpipe.core.process_memory import release_freed_memory
from optpipe.evaluation.accuracy import compare
from optpipe.graph.weight_mix import file_uses_bfloat16
from optpipe.recipe.example_inputs import trace_inputs
from optpipe.pass_infra.instruments import Instrument, StageInfo
from optpipe.pass_infra.pass_base import PassParams
from optpipe.pass_infra.progress import Steps
from optpipe.recipe.schema import ModelInputs, OnnxModel, OutputTolerance, Tolerance
from optpipe.core.results import EAGER
from optpipe.core.runtime import Feeds, Outputs, as_exported, eager_runner, first_non_finite, ort_runner, ort_session

if TYPE_CHECKING:
    from optpipe.core.artifact import ModelArtifact

INPUT = "input"
#: Beside the stage's workdir (the workdir holds only the artifact's files): eager's outputs a pass handed over.
HANDOVER_SUFFIX = ".eager.npz"
#: check_atol / check_rtol left at their defaults (1e-3, float32's) hold a float16 output to this instead: an exact
#: rewrite of a float16 graph moves its outputs by a few units in float16's last place, beyond 1e-3 + 1e-3 x |out|
#: (all-MiniLM-L6-v2 converted to FP16 as an ONNX source: simplify 0.0020 and ORT's fuser 0.0039 max abs at
#: |out| <= 5.7, cosine 0.9999997; both failed the check). 1e-2 is ten times float16's epsilon (9.8e-4).
FLOAT16_CHECK = 1e-2


class SelfCheckParams(PassParams):
    """Params of a pass that must keep its input's numerics: the pass is then self-checked."""

    check_atol: Optional[float] = Field(
        1e-3, ge=0, description="self-check: absolute tolerance against the pass's input (export: PyTorch eager)"
    )
    check_rtol: Optional[float] = Field(
        1e-3, ge=0, description="self-check: relative tolerance; an element passes when |out - ref| <= atol + rtol x |ref|"
    )

    @property
    def check_enforced(self) -> bool:
        return self.check_atol is not None or self.check_rtol is not None


class NumericSelfCheck(Instrument):
    """After a self-checked pass ran: measure its output against its input, record it, fail when out of tolerance."""

    def after_stage(self, info: StageInfo, input: "ModelArtifact | None", output: "ModelArtifact") -> None:
        params = info.pass_.params
        ctx = info.ctx
        handed = take_eager(output.folder)  # taken (and removed) whatever follows: it belongs to this stage only
        if not isinstance(params, SelfCheckParams):
            return
        if input is None and isinstance(ctx.model_source.model, OnnxModel):
            return  # an imported ONNX file is its own reference
        # The pass's copies are freed by now but still held by the allocator; the check's two sessions would
        # peak on top of them (Gemma 3 270M's simplify: core/process_memory.py).
        release_freed_memory()
        feeds = trace_inputs(ctx.inputs)
        threads = ctx.evaluate.threads
        decoder = input is None and "kv_cache" in output.info
        steps = Steps(ctx.progress, "self-check", 3 if decoder else 2)  # part of the stage's time: shown as its progress
        if input is None:
            given = _handed_outputs(handed, feeds)
            steps("PyTorch eager outputs" + (" (handed over by the pass)" if given else ""))
            against, reference = EAGER, given or eager_outputs(ctx.torch_model(), feeds, threads)
        else:
            steps("the input model's outputs (ONNX Runtime)")
            against, reference = INPUT, input_outputs(input.path, feeds, threads)
            # Its session is gone: the freed pages go back before the result's session is built on top of them
            # (Gemma 3 270M's simplify: the second session started 0.55 GB higher without this).
            release_freed_memory()
        steps("the result's outputs (ONNX Runtime)")
        session = load_session(output.path, threads)
        record = numeric_check(onnx_outputs(output.path, feeds, threads, session), reference, feeds, params, against,
                               info.pass_.check_hint)
        output.info["self_check"] = record
        ctx.log.info("self-check against %s: %s", against, record)
        if decoder:
            steps("greedy generation against eager")
            output.info["generation_check"] = _generation_check(output, handed, session, ctx, params)


def hand_over_eager(workdir: Path, feeds: Feeds, outputs: Outputs, generation: dict[str, np.ndarray] | None = None) -> None:
    """Leave eager's `outputs` on `feeds` (and a decoder's generation reference) for this stage's self-check."""
    arrays = {f"feeds/{k}": np.asarray(v) for k, v in feeds.items()} | {f"outputs/{k}": np.asarray(v) for k, v in outputs.items()}
    arrays |= {f"generation/{k}": np.asarray(v) for k, v in (generation or {}).items()}
    np.savez(_handover_path(workdir), **arrays)


def take_eager(folder: Path) -> dict[str, dict[str, np.ndarray]] | None:
    """What the pass handed over for the stage in `folder` (feeds, outputs, generation), removed from disk; None if nothing."""
    path = _handover_path(folder)
    if not path.is_file():
        return None
    handed: dict[str, dict[str, np.ndarray]] = {"feeds": {}, "outputs": {}, "generation": {}}
    try:
        with np.load(path, allow_pickle=False) as data:
            for name in data.files:
                group, _, key = name.partition("/")
                if group in handed:
                    handed[group][key] = data[name]
    except (OSError, ValueError, zipfile.BadZipFile):  # torn or foreign: the check computes its own reference
        return None
    finally:
        path.unlink(missing_ok=True)
    return handed


def _handover_path(workdir: Path) -> Path:
    workdir = Path(workdir)
    return workdir.with_name(workdir.name + HANDOVER_SUFFIX)


def _handed_outputs(handed: dict | None, feeds: Feeds) -> Outputs | None:
    """Eager's handed-over outputs when they are for exactly these feeds; else None (eager runs here)."""
    given = (handed or {}).get("feeds", {})
    same = bool(given) and given.keys() == feeds.keys() and all(np.array_equal(given[k], np.asarray(v)) for k, v in feeds.items())
    return (handed["outputs"] or None) if same else None


def _generation_check(output: "ModelArtifact", handed: dict | None, session, ctx, params: "SelfCheckParams") -> dict:
    """The decoder's greedy generation against eager's: the handed-over reference, else eager run here."""
    from optpipe.evaluation import generation as gen
    from optpipe.evaluation.generation_check import check_generation, eager_reference
    from optpipe.source.decoder_export import DecoderLayout, hf_causal_lm

    layout = DecoderLayout.from_dict(output.info["kv_cache"])
    reference = (handed or {}).get("generation") or eager_reference(hf_causal_lm(ctx.torch_model()), layout, ctx.evaluate.threads)
    runner = gen.OrtRunner(output.path, layout, ctx.evaluate.threads, session=session)
    return check_generation(runner, layout, reference, params.check_atol)


def self_check_fingerprint(params: PassParams, shapes: ModelInputs) -> dict[str, Any] | None:
    """What the self-check's verdict depends on besides the models: its inputs' specs and dims
    (part of the stage key of a self-checked pass, so a recorded verdict is never for other inputs)."""
    if not isinstance(params, SelfCheckParams):
        return None
    return {"inputs": [spec.model_dump(mode="json") for spec in shapes.inputs],
            "dims": {name: dim.model_dump(mode="json") for name, dim in shapes.dims.items()}}


def numeric_check(candidate: Outputs, reference: Outputs, feeds: Feeds, params: SelfCheckParams, against: str,
                  hint: str = "") -> dict[str, Any]:
    """The self-check's record (info.json's `self_check`); PassError when enforced and out of tolerance."""
    require_finite(reference, f"the {against} outputs" if against != INPUT else "the model it starts from outputs", PassError, feeds,
                   like=reference)
    enforced = params.check_enforced
    accuracy, half = _checked(candidate, reference, feeds, params, against)
    record = {
        "against": against,
        "inputs": "synthetic (example_inputs.trace_inputs)",
        "samples": accuracy.samples,
        "max_abs": max((o.max_abs for o in accuracy.outputs), default=0.0),
        "cosine": accuracy.worst_cosine if accuracy.outputs else 1.0,
        "check_atol": params.check_atol,
        "check_rtol": params.check_rtol,
        "enforced": enforced,
        "passed": accuracy.within_tolerance if enforced else None,  # None: recorded, not judged
    }
    if half:
        record["float16_outputs"] = {name: own.model_dump(exclude_unset=True) for name, own in half.items()}
    if enforced and not accuracy.within_tolerance:
        advice = f"; {hint}" if hint else ""
        held = f"; float16 outputs {FLOAT16_CHECK} where left at the defaults" if half else ""
        raise PassError(
            f"self-check against {against} failed: {accuracy.violations[0]} (check_atol {params.check_atol}, "
            f"check_rtol {params.check_rtol}{held}){advice}; raise check_atol/check_rtol only if this is rounding on large outputs"
        )
    return record


def _checked(candidate: Outputs, reference: Outputs, feeds: Feeds, params: SelfCheckParams, against: str):
    """The comparison by the self-check's rule (float16 outputs held to FLOAT16_CHECK where left at the defaults),
    and those float16 tolerances."""
    enforced = params.check_enforced
    half = _float16_tolerances(params, reference) if enforced else {}
    tolerance = Tolerance(
        cosine_min=None,
        max_abs=(params.check_atol or 0.0) if enforced else None,
        rtol=params.check_rtol if enforced else None,
        outputs=half,
    )
    try:
        return compare(candidate, reference, feeds, tolerance, against, top1=False), half
    except ValueError as exc:  # an output count changed (unlike shapes are a verdict, OutputAccuracy.shapes)
        raise PassError(f"self-check against {against}: {first_line(exc)}") from None


def export_mismatch(export: Outputs, eager: Outputs, feeds: Feeds, params: SelfCheckParams) -> str | None:
    """Why the export does not compute what PyTorch eager does on `feeds` (the evaluation data), by the export's own
    self-check rule (rounding passes, as on the trace inputs); None where it does. The self-check ran on synthetic
    inputs only: a trace that recorded one branch of an `if` on tensor values passes there, and is wrong on data
    that takes the other branch (images in 0-255 where the trace saw [-1, 1])."""
    try:
        accuracy, _ = _checked(export, eager, feeds, params, EAGER)
    except PassError as exc:
        return first_line(exc)
    return None if accuracy.within_tolerance else f"{accuracy.violations[0]}, on {accuracy.samples} samples"


def _float16_tolerances(params: SelfCheckParams, reference: Outputs) -> dict[str, OutputTolerance]:
    """Per float16 output of the reference: FLOAT16_CHECK for each of check_atol / check_rtol the recipe left at its
    default (a value the recipe set is kept, for every output)."""
    own = {key: FLOAT16_CHECK for key, param in (("max_abs", "check_atol"), ("rtol", "check_rtol"))
           if param not in params.model_fields_set}
    if not own:
        return {}
    return {name: OutputTolerance(**own) for name, value in reference.items() if np.asarray(value).dtype == np.float16}


def load_session(path: Path, threads: int = 2):
    """The ORT session the self-check runs `path` in; PassError when ONNX Runtime cannot load it."""
    try:
        return ort_session(path, threads)
    except Exception as exc:  # ORT raises its own exception types for invalid graphs
        cause = f"; {BFLOAT16_GRAPH}" if "Could not find an implementation" in str(exc) and file_uses_bfloat16(path) else ""
        raise PassError(f"ONNX Runtime cannot load the result: {first_line(exc)}{cause}") from None


#: Why ORT lacks the kernel when the graph casts to bfloat16 (passes/export.py's hints match on it)
BFLOAT16_GRAPH = "the model computes in bfloat16 (autocast or a cast in forward), which ONNX Runtime's CPU kernels mostly do not run"


def onnx_outputs(path: Path, feeds: Feeds, threads: int = 2, session=None) -> Outputs:
    """`path`'s outputs on `feeds`; `session`: one load_session(path, threads) built already (export
    checks one model at several shapes: one session, not one per shape)."""
    return ort_runner(session if session is not None else load_session(path, threads))(feeds)


def input_outputs(path: Path, feeds: Feeds, threads: int) -> Outputs:
    """The pass's input model on the recipe's synthetic inputs. When it fails at run time, the pass
    is not to blame, and neither are the inputs: preflight ran the recipe's own model on these very
    inputs (a `range` past its vocabulary is refused there, exit 2), so a stage before broke it."""
    try:
        return onnx_outputs(path, feeds, threads)
    except PassError:
        raise
    except Exception as exc:  # ORT's own exception types: a Gather index out of range, a Reshape that cannot fit
        raise PassError(f"the model this stage starts from fails on the recipe's inputs ({first_line(exc)[:300]})") from None


def eager_outputs(torch_model, feeds: Feeds, threads: int) -> Outputs:
    try:
        with as_exported():
            return eager_runner(torch_model, threads)(feeds)
    except Exception as exc:  # whatever forward() raises on inputs it does not accept
        raise PassError(f"PyTorch eager fails on the recipe's inputs: {first_line(exc)}") from None


def require_finite(outputs: Outputs, whose: str, error: type[Exception] = DataError, inputs: Feeds | None = None,
                   like: Outputs | None = None) -> Outputs:
    """`outputs` unchanged when every value is finite, or ±inf where `like` has the same (a reference's own: -inf is
    what a masked-logits model means); else one sentence naming the output, and the input where the data itself holds
    NaN or Inf (a missing value in a table, an overflowed preprocessing step): the cause to fix is then the data, not
    the model's range or precision."""
    found = first_non_finite(outputs, like)
    if found:
        name, bad, size = found
        raise error(f"{whose} NaN or Inf in '{name}' ({bad} of {size} values); {_non_finite_cause(inputs or {})}")
    return outputs


def _non_finite_cause(inputs: Feeds) -> str:
    found = first_non_finite(inputs)
    if found:
        name, bad, size = found
        return (f"the data itself has NaN or Inf in input '{name}' ({bad} of {size} values): fix the data, or give the model "
                "inputs it handles")
    return "check that the inputs' `range`/data fit the model, or keep the ops that overflow in higher precision"
