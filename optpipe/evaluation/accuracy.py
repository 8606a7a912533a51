"""Accuracy of a stage against the reference: per output max/mean abs error, cosine, top-1.

Polygraphy runs the ONNX models (`Comparator.run` over an `OnnxrtRunner`) and its
compare function (`Comparator.compare_accuracy`, atol/rtol per output) is part of the
verdict: `Accuracy.polygraphy_match`, a violation when it fails. The figures the
report shows (max/mean abs error, cosine, top-1) and the task metrics, which
Polygraphy does not offer, are computed here. Cosine is per row of the last axis (per token for
transformers) over real tokens only when the inputs have an attention mask.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Callable

import numpy as np

from optpipe.core.errors import RecipeError
from optpipe.core.results import Accuracy, OutputAccuracy
from optpipe.evaluation.cosine import cosine_of_rows, real_tokens
from optpipe.evaluation.figure_warnings import MEANINGLESS, magnitude_warnings
from optpipe.evaluation.variation import Variation, cosine_cannot_tell, explained_bound, explained_violation, variation
from optpipe.evaluation.task_metrics import task_accuracy
from optpipe.recipe.schema import TaskSpec, Tolerance
from optpipe.recipe.task_bounds import own_bounds
from optpipe.core.runtime import Feeds, Outputs, join_batches
from optpipe.pass_infra.progress import counted


def quiet_polygraphy() -> None:
    from polygraphy.logger import G_LOGGER  # verdicts are read as values: no "[E] FAILED" lines on the terminal

    G_LOGGER.module_severity = G_LOGGER.CRITICAL


def run_onnx(path: Path, batches: list[Feeds], threads: int, providers: list[str] | None = None, session=None,
             progress: Callable[[int, int], None] | None = None) -> Outputs:
    """Outputs of an ONNX model over all batches, through Polygraphy, concatenated along axis 0.

    `session`: an ORT session of `path` already built (the stage's timing session), reused.
    `progress(n, total)`: told as Polygraphy's Comparator takes batch n (none on a memo hit).
    The process's outputs memo is asked first (same model bytes, inputs and session settings);
    the arrays returned are read-only."""
    from optpipe.evaluation import outputs_memo

    key = outputs_memo.run_key(path, batches, threads, providers, session)
    return outputs_memo.MEMO.outputs(key, lambda: _run_onnx(path, counted(batches, progress), threads, providers, session), str(path))


def _run_onnx(path: Path, batches: Sequence[Feeds], threads: int, providers: list[str] | None, session) -> Outputs:
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.comparator import Comparator

    from optpipe.core.runtime import ort_session, prefill_feeds

    quiet_polygraphy()
    session = session if session is not None else ort_session(path, threads, providers)
    shapes = [(i.name, list(i.shape)) for i in session.get_inputs()]
    batches = [prefill_feeds(feeds, shapes) for feeds in batches]  # a KV-cache decoder's one forward is its prefill
    runner = OnnxrtRunner(session, name="candidate")
    results = Comparator.run([runner], data_loader=batches)
    return join_batches(list(results["candidate"]))


def run_callable(run: Callable[[Feeds], Outputs], batches: list[Feeds], progress: Callable[[int, int], None] | None = None) -> Outputs:
    return join_batches([run(b) for b in counted(batches, progress)])


def compare(
    candidate: Outputs,
    reference: Outputs,
    inputs: Feeds,
    tolerance: Tolerance,
    reference_name: str,
    top1: bool | None = None,
    task: TaskSpec | None = None,
    labels: np.ndarray | None = None,
    min_input_sensitivity: float = 1e-3,
) -> Accuracy:
    """Compare outputs pairwise, by name when the names match, else by position.

    With a `task`, the task's metric (against the reference, and the `labels` where given) is
    the verdict, with only the tolerance keys the recipe set explicitly beside it. Outputs of
    the reference that barely change across samples make every figure meaningless: warned.
    """
    check_tolerance_outputs(tolerance, list(reference))
    pairs = _pair_outputs(candidate, reference)
    mask = real_tokens(inputs)
    outputs = [_output_accuracy(name, c, r, mask, top1, tolerance.for_output(name)) for name, c, r in pairs]
    task_result = None
    unlike = [o for o in outputs if o.shapes]  # no metric or elementwise rule reads outputs of unlike shapes
    if unlike:
        pairs = [pair for pair, out in zip(pairs, outputs) if not out.shapes]
    if task is not None and not unlike:
        task = task.bounded(tolerance.task)
        task_result = task_accuracy(task, {n: c for n, c, _ in pairs}, {n: r for n, _, r in pairs}, inputs, labels)
        task_result.own_bounds = own_bounds(tolerance.task)
        violations = [f"output '{o.name}' has NaN or Inf values unlike the reference's" for o in outputs if not o.finite]
        violations += task_result.violations + _violations(outputs, tolerance, only_explicit=True)
    else:
        violations = _violations(outputs, tolerance)
    # Polygraphy's compare function gives the elementwise (atol/rtol) verdict; ours computes the
    # same rule for the figures it reports. Where they disagree, the stricter one stands.
    polygraphy_match = _polygraphy_match(pairs, tolerance)
    if polygraphy_match is False and not violations:
        violations.append("Polygraphy's elementwise comparison (atol/rtol per output) fails")
    return Accuracy(
        reference=reference_name,
        samples=len(next(iter(inputs.values()))) if inputs else 0,
        outputs=outputs,
        within_tolerance=not violations, violations=violations,
        polygraphy_match=polygraphy_match,
        task=task_result,
        warnings=magnitude_warnings(pairs) + _sensitivity_warnings(outputs, task_result, min_input_sensitivity)
        + (task_result.notes if task_result else []),  # a task figure not measured, or meaning nothing (labels at chance)
    )


def input_sensitivity(reference: np.ndarray) -> float | None:
    """How much an output moves between samples, relative to its size: the mean (over elements)
    of the spread across samples, over the mean magnitude. None with fewer than 2 samples.

    Measured: a random-init YOLOv5s moved 3e-4 px between photos on outputs of hundreds of
    pixels (~1e-6); a random-weight CNN classifier on real photos, or a real text encoder,
    is in the 1e-2..1 range. Computed a block of elements at a time (SLICE_ELEMENTS), in float64.
    """
    ref = np.asarray(reference)
    if ref.ndim == 0 or len(ref) < 2:
        return None
    flat = ref.reshape(len(ref), -1)
    step = max(SLICE_ELEMENTS // len(ref), 1)
    total_abs = total_std = 0.0
    for start in range(0, flat.shape[1], step):
        block = flat[:, start:start + step].astype(np.float64)
        block[np.isinf(block)] = 0.0  # -inf where a model masks: no magnitude, no spread
        if not np.isfinite(block).all():
            return None
        total_abs += float(np.abs(block).sum())
        total_std += float(block.std(axis=0).sum())
    magnitude = total_abs / flat.size if flat.size else 0.0
    if magnitude == 0:
        return 0.0
    return total_std / flat.shape[1] / magnitude


def _sensitivity_warnings(outputs: list[OutputAccuracy], task, threshold: float) -> list[str]:
    """The warning when the reference hardly depends on the inputs, judged per output: all of them
    (or the task's) -> the figures mean nothing; some -> those outputs' figures mean little (a
    YOLOS's pred_boxes moved 6e-4 of their size while its logits moved: one model-wide figure hid it)."""
    measured = [o for o in outputs if o.input_sensitivity is not None]
    # An output R² holds as well: a random-init BERT scorer's ~0.0073 +- 5e-6 let ov-bf16 read R² -60 on noise.
    low = [o for o in measured if o.input_sensitivity < threshold]
    if not low:
        return []
    task_output_low = task is not None and any(o.name in task.output.split(", ") for o in low)
    if len(low) == len(measured) or task_output_low:
        worst = max(o.input_sensitivity for o in low)
        return [f"the reference's outputs barely change across the evaluation samples (spread {worst:.1e} of their magnitude, "
                f"below {threshold:g}): the model ignores its inputs (random weights?) or the samples are alike, "
                f"so {MEANINGLESS}"]
    shown = ", ".join(f"'{o.name}' (spread {o.input_sensitivity:.1e})" for o in low)
    return [f"output{'s' if len(low) > 1 else ''} {shown} barely change{'' if len(low) > 1 else 's'} across the evaluation "
            f"samples (below {threshold:g} of {'their' if len(low) > 1 else 'its'} magnitude) while the others do: the "
            f"figures for {'them' if len(low) > 1 else 'it'} mean little (random weights, or samples alike for that output)"]


def check_tolerance_outputs(tolerance: Tolerance, outputs: list[str]) -> None:
    """A per-output tolerance for an output the model does not have would hold nothing to it,
    silently: the recipe's to fix."""
    unknown = sorted(set(tolerance.outputs) - set(outputs))
    if unknown:
        raise RecipeError(f"tolerance.outputs: the model has no output {', '.join(repr(n) for n in unknown)}; its outputs are "
                          f"{sorted(outputs)}; fix the name under evaluate.tolerance.outputs (or the stage's tolerance.outputs)")


def _pair_outputs(candidate: Outputs, reference: Outputs) -> list[tuple[str, np.ndarray, np.ndarray]]:
    if set(candidate) >= set(reference):  # a KV-cache decoder against eager: its presents have no counterpart
        return [(name, candidate[name], reference[name]) for name in reference]
    if len(candidate) != len(reference):
        raise ValueError(f"the model has {len(candidate)} outputs, the reference {len(reference)}")
    return [(rname, c, reference[rname]) for (rname, c) in zip(reference, candidate.values())]


#: Elements of one output compared at a time, in float64 with a few temporaries each. In one piece, a
#: 262k-vocabulary LM's logits for 2 x 64 tokens (33 M elements) took the comparison 1.3 GB above its two
#: inputs (measured): the peak of Gemma 3 270M's export self-check, its session still alive beside it.
SLICE_ELEMENTS = 1 << 22


def _output_accuracy(name: str, cand: np.ndarray, ref: np.ndarray, mask, top1: bool | None, tol: Tolerance) -> OutputAccuracy:
    cand, ref = np.asarray(cand), np.asarray(ref)
    if cand.shape != ref.shape:
        return OutputAccuracy(name=name, max_abs=float("inf"), mean_abs=float("inf"), cosine_mean=0.0, cosine_min=0.0,
                              shapes=(list(cand.shape), list(ref.shape)))
    discrete = ref.dtype.kind in "iub"  # class ids, token ids, masks: equal or not
    want_top1 = top1 if top1 is not None else "logit" in name.lower()
    sums = _Sums(want_top1, discrete, tol)
    rows_c, keep = _row_view(cand, mask)
    rows_r, _ = _row_view(ref, mask)
    step = max(SLICE_ELEMENTS // max(rows_r.shape[1], 1), 1)
    for start in range(0, len(rows_r), step):
        part = slice(start, start + step)
        sums.add(rows_c[part], rows_r[part], None if keep is None else keep[part])
    found, sensitivity = None if discrete else variation(cand, ref, mask), input_sensitivity(ref)
    return sums.result(name, sensitivity, found if cosine_cannot_tell(found, tol.cosine_min, sensitivity) else None)


def _row_view(array: np.ndarray, mask) -> tuple[np.ndarray, np.ndarray | None]:
    """`array` as [rows, last axis], and which rows the cosine and top-1 count (None: all): the rows
    cosine.rows_of selects (real tokens where a [batch, seq] mask fits), kept in place so that every
    element still counts for the absolute errors."""
    if array.ndim <= 1:
        return array.reshape(1, -1), None
    rows = array.reshape(-1, array.shape[-1])
    if array.ndim >= 3 and mask is not None and array.shape[:2] == np.shape(mask):
        per_token = int(np.prod(array.shape[2:-1], dtype=np.int64))
        return rows, np.repeat(np.asarray(mask).astype(bool).ravel(), per_token)
    return rows, None


class _Sums:
    """The figures of one output, summed over its slices of rows (_output_accuracy)."""

    def __init__(self, top1: bool, discrete: bool, tol: Tolerance):
        self.top1, self.discrete, self.tol = top1, discrete, tol
        self.finite, self.max_abs, self.sum_abs, self.count = True, 0.0, 0.0, 0
        self.cosines: list[np.ndarray] = []
        self.agree = self.rows = self.beyond = self.equal = 0

    def add(self, cand: np.ndarray, ref: np.ndarray, keep: np.ndarray | None) -> None:
        c, r = shared_infinities_zeroed(cand.astype(np.float64), ref.astype(np.float64))
        finite = bool(np.isfinite(c).all() and np.isfinite(r).all())
        self.finite &= finite
        # nan_to_num copies (a NaN counts as an infinite error); on finite values it is the identity, so skipped.
        diff = np.abs((c if finite else np.nan_to_num(c, nan=np.inf)) - r)
        if diff.size:
            self.max_abs = max(self.max_abs, float(diff.max()))
            self.sum_abs += float(diff.sum())
            self.count += diff.size
        if self.tol.rtol is not None:
            self.beyond += int(np.count_nonzero(diff > (self.tol.max_abs or 0.0) + self.tol.rtol * np.abs(r)))
        if self.discrete:
            self.equal += int(np.count_nonzero(c == r))
        del diff
        if keep is not None:
            c, r = c[keep], r[keep]
        self.cosines.append(cosine_of_rows(c if finite else np.nan_to_num(c), r))
        if self.top1:  # on the values as given: a masked -inf zeroed above could outrank negative logits
            same = cand.argmax(-1) == ref.argmax(-1)
            self.agree += int(np.count_nonzero(same if keep is None else same[keep]))
            self.rows += len(r)

    def result(self, name: str, sensitivity: float | None, blind: Variation | None) -> OutputAccuracy:
        cosines = np.concatenate(self.cosines) if self.cosines else np.zeros(0)
        return OutputAccuracy(
            name=name,
            max_abs=self.max_abs,
            mean_abs=self.sum_abs / self.count if self.count else 0.0,
            cosine_mean=float(cosines.mean()) if self.finite else 0.0,
            cosine_min=float(cosines.min()) if self.finite else 0.0,
            top1=(self.agree / self.rows if self.rows else float("nan")) if self.top1 else None,
            finite=self.finite,
            beyond_tolerance=self.beyond / self.count if self.tol.rtol is not None and self.count else None,
            input_sensitivity=sensitivity,
            equal_share=self.equal / self.count if self.discrete and self.count else None,
            explained=blind.explained if blind else None, constant_cosine=blind.constant_cosine if blind else None,
        )


def shared_infinities_zeroed(c: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """±inf at the same place in both (masked logits: a model that means -inf) compare equal: zeroed in both, they
    count as no error and leave the cosine to the finite values. An infinity in one only stays an infinite error."""
    shared = np.isinf(r) & (c == r)
    if not shared.any():
        return c, r
    return np.where(shared, 0.0, c), np.where(shared, 0.0, r)


def _shape_violation(name: str, shape: list[int], reference: list[int]) -> str:
    """One length apart: it depends on the data (scores past a threshold); else the layout changed (OpenVINO: [32, 17, 1])."""
    one = len(shape) == len(reference) and sum(a != b for a, b in zip(shape, reference)) == 1
    return f"output '{name}' has shape {shape} where the reference's is {reference}: " + (
        "its size depends on the data (a threshold, a filter, NMS) and this stage changed which values pass it" if one
        else "this stage changed the output's layout (a dim added, dropped or moved)")


def _violations(outputs: list[OutputAccuracy], stage_tol: Tolerance, only_explicit: bool = False) -> list[str]:
    """Tolerance breaches per output; `only_explicit`: the keys the recipe wrote (beside a task metric)."""
    found = []
    for out in outputs:
        tol = stage_tol.for_output(out.name)
        if only_explicit:
            given = stage_tol.model_fields_set | set(getattr(stage_tol.outputs.get(out.name), "model_fields_set", ()))
            tol = tol.model_copy(update={k: None for k in ("cosine_min", "max_abs", "rtol", "top1_min") if k not in given})
        if out.shapes:  # named whatever the tolerance: no figure of the output means anything
            found.append(_shape_violation(out.name, *out.shapes))
            continue
        if not out.finite:
            if not only_explicit:
                found.append(f"output '{out.name}' has NaN or Inf values unlike the reference's")
            continue
        equality = _held_by_equality(out, tol)
        if tol.cosine_min is not None and out.cosine_mean < tol.cosine_min and not equality:
            found.append(f"output '{out.name}' cosine {out.cosine_mean:.4f} < {tol.cosine_min}")
        if out.explained is not None and tol.cosine_min is not None and out.explained < explained_bound(tol.cosine_min):
            found.append(explained_violation(out.name, out.explained, out.constant_cosine, tol.cosine_min))
        found += _unequal_integers(out, tol) if equality else []
        if tol.rtol is not None:
            if out.beyond_tolerance:
                found.append(f"output '{out.name}': {out.beyond_tolerance:.1%} of elements beyond max_abs {tol.max_abs or 0} "
                             f"+ rtol {tol.rtol} x |reference|")
        elif tol.max_abs is not None and out.max_abs > tol.max_abs:
            found.append(f"output '{out.name}' max abs error {out.max_abs:.3g} > {tol.max_abs}")
        if tol.top1_min is not None and out.top1 is not None and out.top1 < tol.top1_min:
            found.append(f"output '{out.name}' top-1 agreement {out.top1:.3f} < {tol.top1_min}")
    return found


def _held_by_equality(out: OutputAccuracy, tol: Tolerance) -> bool:
    """An integer or boolean output, unless the recipe asks for numeric closeness on it (max_abs, rtol)."""
    return out.equal_share is not None and tol.max_abs is None and tol.rtol is None


def _unequal_integers(out: OutputAccuracy, tol: Tolerance) -> list[str]:
    """An integer output is held by equality: the cosine of class ids [3, 7, 2] and [3, 7, 5] is
    0.97, so ids that flip on one sample in a hundred read as cosine 0.9997. Its share of equal
    elements must reach the cosine bound (or top1_min, where set), unless the recipe asks for
    numeric closeness on it (max_abs, rtol: e.g. integer pixel values)."""
    bound = tol.top1_min if tol.top1_min is not None else tol.cosine_min
    if bound is None or out.equal_share >= bound:
        return []
    return [f"output '{out.name}' (integers) equals the reference in {out.equal_share:.1%} of its elements < {bound:g}"
            " (an integer output is held by equality, not cosine)"]


def _polygraphy_match(pairs, tol: Tolerance) -> bool | None:
    """Polygraphy's own elementwise check (atol, rtol per output), where the recipe sets one."""
    per_output = {name: tol.for_output(name) for name, _, _ in pairs}
    if all(t.max_abs is None and t.rtol is None for t in per_output.values()):
        return None
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.comparator.struct import IterationResult

    try:
        from polygraphy.comparator import SimpleCompareFunc as simple
    except ImportError:  # Polygraphy < 0.50
        from polygraphy.comparator import CompareFunc

        simple = CompareFunc.simple
    quiet_polygraphy()
    atol = {name: t.max_abs if t.max_abs is not None else (0.0 if t.rtol is not None else np.inf) for name, t in per_output.items()}
    rtol = {name: t.rtol or 0.0 for name, t in per_output.items()}
    compare_func = simple(atol=atol, rtol=rtol)
    verdicts = []
    for name, cand, ref in pairs:
        # One output at a time, its rows in slices as Polygraphy's iterations (views: its elementwise rule is the
        # same on them): whole, a 262k-vocabulary LM's logits took Polygraphy's comparison 0.74 GB (measured).
        rows_c, rows_r = _row_view(np.asarray(cand), None)[0], _row_view(np.asarray(ref), None)[0]
        step = max(SLICE_ELEMENTS // max(rows_r.shape[1], 1), 1)
        parts = range(0, max(len(rows_r), 1), step)  # an empty output: one (empty) iteration, as whole
        results = RunResults()
        sliced = [shared_infinities_zeroed(rows_c[i:i + step], rows_r[i:i + step]) for i in parts]  # inf - inf is NaN to it
        results.append(("candidate", [IterationResult({name: c}, runner_name="candidate") for c, _ in sliced]))
        results.append(("reference", [IterationResult({name: r}, runner_name="reference") for _, r in sliced]))
        verdicts.append(bool(Comparator.compare_accuracy(results, compare_func=compare_func)))
    return all(verdicts)
