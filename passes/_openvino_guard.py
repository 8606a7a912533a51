"""The openvino int8 guard's repair, bounded in time and shown as it goes (passes/_openvino_nncf.py calls it).

A plain NNCF INT8 result that breaks the stage's tolerance is repaired cheapest first, each try
one `nncf.quantize` and one check:
1. the layers (MatMuls, convolutions) that add the most error kept in float (NNCF's ignored scope), named by a
   layer-wise attribution of the quantized model against the FP32 one (optpipe.evaluation.error_attribution's
   rule: the relative error a layer adds over its inputs'): the worst 1, then 2, 4, ... up to `max_excluded`;
2. NNCF's other preset (mixed <-> performance), where the recipe did not choose one;
3. only then `nncf.quantize_with_accuracy_control`, which ranks every quantizer (20 minutes on
   MiniLM on two busy AVX2 cores, issue 17) with what is left of the budget.
(Per-channel is no step: NNCF's OpenVINO INT8 weights are per-channel already.)
`guard_budget_s` bounds the whole repair: when it is spent, the step running is stopped (through
the data NNCF reads), the best result so far is kept, and the stage info says what was given up.
Every step reports progress (seconds of the budget used) to the console.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from optpipe.core.errors import PassError, first_line
from optpipe.evaluation import openvino_runtime as ovr
from optpipe.evaluation.guard_types import attempt_score

if TYPE_CHECKING:
    from optpipe.core.results import Accuracy
    from optpipe.pass_infra.pass_base import PassContext
    from optpipe.passes.openvino import InputCheck, OpenVinoParams

#: The guard's clock (tests replace it: no test waits for a budget to pass in real time).
CLOCK: Callable[[], float] = time.monotonic
#: Samples of the evaluation set the layer-wise attribution runs (a few suffice to rank layers).
ATTRIBUTION_SAMPLES = 8


class BudgetSpent(BaseException):
    """Raised inside NNCF's loops when the guard's time is up. A BaseException: NNCF catches
    Exception in places (its validation-mode probe) and would swallow it."""


class Budget:
    """The guard's clock: seconds left, progress lines, and a stop NNCF meets in the data it reads."""

    def __init__(self, seconds: float, ctx: PassContext, clock: Callable[[], float] | None = None):
        self.seconds, self.ctx, self.clock = seconds, ctx, clock or CLOCK
        self.started = self.clock()
        self.task = "int8 guard"

    @property
    def used(self) -> float:
        return self.clock() - self.started

    @property
    def spent(self) -> bool:
        return self.used >= self.seconds

    def step(self, task: str | None = None) -> None:
        """Progress as seconds of the budget (the console shows `task used/budget`); stop when spent."""
        if task:
            self.task = task
        self.ctx.progress(f"{self.task} (s of budget)", min(int(self.used), int(self.seconds)), int(self.seconds))
        if self.spent:
            raise BudgetSpent()


class Attempts:
    """Every try's result; the best is the first one held, else the nearest to holding (guard_types.attempt_score)."""

    def __init__(self, quantized, accuracy: Accuracy, label: str):
        self.best = (quantized, accuracy, label)
        self.steps: list[dict[str, Any]] = []

    def add(self, quantized, accuracy: Accuracy, label: str, **extra) -> bool:

        self.steps.append({"method": label, "cosine": accuracy.worst_cosine, "held": accuracy.within_tolerance,
                           "quantizers": fake_quantize_count(quantized), **extra})
        _, best, _ = self.best
        if not best.within_tolerance and attempt_score(accuracy) > attempt_score(best):
            self.best = (quantized, accuracy, label)
        return accuracy.within_tolerance


def repair(converted, plain, accuracy: Accuracy, calibration, options: dict, params: OpenVinoParams,
           ctx: PassContext, check: InputCheck):
    """(model, accuracy, steps, gave_up): the first repair that holds the tolerance, else the best one."""
    budget = Budget(params.guard_budget_s, ctx)
    attempts = Attempts(plain, accuracy, "nncf.quantize")
    gave_up = None
    try:
        budget.step("int8 guard: layer-wise error attribution")
        for blamed in _exclusion_ladder(converted, plain, check, params.max_excluded, budget):
            names = [name for name, _ in blamed]
            label = f"nncf.quantize, the {_layers(blamed)} adding the most error in float"
            if _try(attempts, label, converted, calibration, _with_ignored(options, names), ctx, check, budget, excluded=names):
                break
        else:
            other = _other_preset(options, params)
            if other is None or not _try(attempts, f"nncf.quantize, preset {other.value}", converted, calibration,
                                         options | {"preset": other}, ctx, check, budget):
                _accuracy_control(attempts, converted, calibration, options, params, ctx, check, budget)
    except BudgetSpent:
        gave_up = (f"guard_budget_s {params.guard_budget_s:g} s spent during '{budget.task}'; kept the best result so far "
                   f"({attempts.best[2]})")
        ctx.log.warning("openvino int8 guard stopped: %s", gave_up)
    quantized, accuracy, _ = attempts.best
    return quantized, accuracy, attempts.steps, gave_up


def _try(attempts: Attempts, label: str, converted, calibration, options, ctx, check, budget: Budget, **extra) -> bool:
    nncf = ovr.nncf()


    budget.step(f"int8 guard: {label}")
    ctx.log.info("int8 guard: %s", label)
    with nncf_logs_to(ctx.log):
        try:
            quantized = nncf.quantize(converted, nncf.Dataset(calibration, _stopping(budget)), **options)
        except BudgetSpent:
            raise
        except Exception as exc:
            ctx.log.warning("int8 guard: %s failed: %s", label, first_line(exc))
            return False
    budget.step()
    return attempts.add(quantized, check(quantized), label, **extra)


def _stopping(budget: Budget) -> Callable:
    """NNCF's data transform: each item it reads is a progress tick and the point where a spent budget stops it."""
    def transform(item):
        budget.step()
        return item

    return transform


def _with_ignored(options: dict, names: list[str]) -> dict:
    nncf = ovr.nncf()

    scope = options.get("ignored_scope")
    merged = nncf.IgnoredScope(names=sorted(set(names) | set(scope.names if scope else [])),
                               types=list(scope.types) if scope else [], validate=False)
    return options | {"ignored_scope": merged}


def _other_preset(options: dict, params: OpenVinoParams):
    """NNCF's other preset than the one in `options`, where the recipe left the choice to optpipe."""
    nncf = ovr.nncf()

    if params.preset is not None:
        return None
    performance = nncf.QuantizationPreset.PERFORMANCE
    return nncf.QuantizationPreset.MIXED if options["preset"] == performance else performance


def _layers(blamed: list[tuple[str, str]]) -> str:
    """`1 MatMul`, `4 Convolutions`, `2 layers (Convolution, MatMul)`."""
    kinds = sorted({kind for _, kind in blamed})
    plural = "s" if len(blamed) > 1 else ""
    return f"{len(blamed)} {kinds[0]}{plural}" if len(kinds) == 1 else f"{len(blamed)} layers ({', '.join(kinds)})"


def _exclusion_ladder(converted, quantized, check: InputCheck, max_excluded: int, budget: Budget):
    """The worst 1, 2, 4 ... layers (at most max_excluded), each list a try."""
    ranked = blamed_layers(converted, quantized, check)
    budget.step()
    k = 1
    while max_excluded and ranked:
        yield ranked[:min(k, max_excluded)]
        if k >= max_excluded or k >= len(ranked):
            return
        k *= 2


#: The layers NNCF quantizes whose weights the attribution may keep in float. Convolutions too: with MatMuls alone, a
#: CNN (a tiny ResNet out of tolerance) had no cheap fix and went straight to accuracy control, which ranks every
#: quantizer (the step issue 17 bounds).
BLAMED_TYPES = ("MatMul", "Convolution", "GroupConvolution")


def blamed_layers(converted, quantized, check: InputCheck) -> list[tuple[str, str]]:
    """(op name, op type) of the quantized layers, the one adding the most relative error first (quantized vs FP32,
    same inputs).

    A layer's inputs are read before its FakeQuantize (the tensor the FP32 model has too), so the
    error it adds is its quantization's and its own, not what reaches it from upstream."""
    from optpipe.evaluation.error_attribution import NodeBlame, relative_error

    layers = [op for op in quantized.get_ops() if op.get_type_name() in BLAMED_TYPES]
    if not layers:
        return []
    sources = {op.get_friendly_name(): (op.get_type_name(), [_before_fake_quantize(op.input_value(i))
                                                             for i in range(op.get_input_size())]) for op in layers}
    wanted = {(name, 0) for name in sources} | {s for _, ins in sources.values() for s in ins}
    feeds = check.batches[:max(1, ATTRIBUTION_SAMPLES // check.batch_size)]
    fp32, q = _tensors(converted, wanted, feeds, check), _tensors(quantized, wanted, feeds, check)
    blames = []
    for name, (kind, inputs) in sources.items():
        if (name, 0) not in fp32 or (name, 0) not in q:
            continue
        errors = [relative_error(q[s], fp32[s]) for s in inputs if s in fp32 and s in q]
        blames.append(NodeBlame(name, kind, max(errors, default=0.0), relative_error(q[(name, 0)], fp32[(name, 0)])))
    blames.sort(key=lambda b: b.added_error, reverse=True)
    return [(b.node, b.op) for b in blames if b.added_error > 0]


def _before_fake_quantize(value) -> tuple[str, int]:
    node = value.get_node()
    if node.get_type_name() == "FakeQuantize":
        value = node.input_value(0)
        node = value.get_node()
    return node.get_friendly_name(), value.get_index()


def _tensors(ov_model, wanted: set[tuple[str, int]], feeds, check: InputCheck) -> dict[tuple[str, int], np.ndarray]:
    """The named op outputs (friendly name, port) on `feeds`, concatenated over batches."""
    model = ov_model.clone()
    ops = {op.get_friendly_name(): op for op in model.get_ops()}
    outputs = [(key, ops[key[0]].output(key[1])) for key in sorted(wanted) if key[0] in ops
               and ops[key[0]].get_type_name() not in ("Constant", "Parameter")]
    model.add_outputs([out for _, out in outputs])
    compiled = ovr.compile_model(model, check.ctx.evaluate.threads)
    request = compiled.create_infer_request()
    ports = compiled.outputs[-len(outputs):]
    inputs = {port.get_any_name() for port in compiled.inputs}
    got: dict[tuple[str, int], list[np.ndarray]] = {}
    for batch in feeds:
        request.infer({k: v for k, v in batch.items() if k in inputs})
        for (key, _), port in zip(outputs, ports):
            got.setdefault(key, []).append(np.array(request.get_tensor(port).data, copy=True))
    from optpipe.core.runtime import join_arrays

    return {key: join_arrays(parts) for key, parts in got.items()}


def _accuracy_controlled_call(converted, calibration, options, params: OpenVinoParams, ctx: PassContext, check: InputCheck,
                              budget: Budget):
    """NNCF ranks the quantizers by the error they add and reverts the worst until the metric
    (optpipe's own: the worst per-output mean cosine against the input) drops at most 1 - cosine_min."""
    nncf = ovr.nncf()


    indexed = list(enumerate(check.batches))

    def validate(compiled, items) -> float:
        run = ovr.runner(compiled, check.names)
        outs = [run(model_feeds(feeds, converted)) for _, feeds in items]
        # Samples NNCF passes may be a subset: compare them with the matching reference rows.
        picked = [i for i, _ in items]
        return guard_metric(subset_accuracy(check, picked, outs), ctx.tolerance.cosine_min)

    def feeds_of(item):
        budget.step()
        return model_feeds(item[1], converted)

    validation = nncf.Dataset(indexed, feeds_of)
    restorer = nncf.AdvancedAccuracyRestorerParameters(max_num_iterations=params.max_excluded)
    ctx.log.info("int8 guard: nncf.quantize_with_accuracy_control, max_drop %.4f", 1 - ctx.tolerance.cosine_min)
    return nncf.quantize_with_accuracy_control(
        converted, nncf.Dataset(calibration, _stopping(budget)), validation, validate, max_drop=1.0 - ctx.tolerance.cosine_min,
        drop_type=nncf.DropType.ABSOLUTE, advanced_accuracy_restorer_parameters=restorer,
        **{("advanced_quantization_parameters" if k == "advanced_parameters" else k): v for k, v in options.items()},
    )


def _accuracy_control(attempts: Attempts, converted, calibration, options, params, ctx, check, budget: Budget) -> None:

    budget.step("int8 guard: nncf.quantize_with_accuracy_control (ranks every quantizer)")
    with nncf_logs_to(ctx.log, budget):
        try:
            quantized = _accuracy_controlled_call(converted, calibration, options, params, ctx, check, budget)
        except BudgetSpent:
            raise
        except Exception as exc:
            raise PassError(f"NNCF accuracy-controlled quantization failed: {first_line(exc)}; "
                            "set guard: false to keep plain INT8") from None
    attempts.add(quantized, check(quantized), "nncf.quantize_with_accuracy_control")


# --- shared with passes/_openvino_nncf.py ---------------------------------------------------


def guard_metric(accuracy: Accuracy, cosine_min: float) -> float:
    """The one number NNCF's accuracy control holds (its drop from 1.0 at most 1 - cosine_min): the worst
    cosine, pushed below cosine_min while any other bound of the tolerance breaks. On cosine alone the
    guard stopped with the cosine held and top-1 agreement (or max_abs) still out of tolerance."""
    if accuracy.within_tolerance:
        return accuracy.worst_cosine
    return min(accuracy.worst_cosine, cosine_min - 1e-6)


def subset_accuracy(check: InputCheck, picked: list[int], outs: list[dict]) -> Accuracy:
    """The candidate's outputs on the batches `picked` against the reference's for them: its rows, where every
    output is one row per sample; else the input's outputs batch by batch (a 0-d loss, a mean over the batch, a
    length that depends on the data have no rows to pick)."""
    from optpipe.core.runtime import join_batches

    size, batches = check.batch_size, check.batches
    rows = np.concatenate([np.arange(i * size, i * size + len(next(iter(batches[i].values())))) for i in picked])
    reference, samples = check.reference(), len(check.ctx.eval_set())
    if all(len(array) == samples for array in reference.values()):
        expected = {name: array[rows] for name, array in reference.items()}
    else:
        parts = check.reference_batches()
        expected = join_batches([parts[i] for i in picked])
    return against_input(check.ctx, join_batches(outs), expected, rows)


def against_input(ctx: PassContext, outputs: dict, reference: dict, rows: np.ndarray | None = None) -> Accuracy:
    """`outputs` against the pass input's (`reference`) as the stage's verdict reads them: the tolerance, top-1, and the
    recipe's task with the labels (judged by the cosine alone, a tiny Swin's int8 read 0.9966, no repair was tried, and
    its top-1 agreement 0.938 failed the stage). `rows`: the evaluation samples they are of (default: all). The check
    of every try (InputCheck) and NNCF's accuracy control both read it."""
    from optpipe.evaluation.accuracy import compare

    samples = ctx.eval_set()
    inputs, labels = samples.arrays, samples.labels
    if rows is not None:
        inputs = {name: array[rows] for name, array in inputs.items()}
        labels = None if labels is None else labels[rows]
    return compare(outputs, reference, inputs, ctx.tolerance, ctx.stage + " input", ctx.evaluate.top1,
                   task=ctx.evaluate.task, labels=labels)


def model_feeds(feeds: dict[str, np.ndarray], ov_model) -> dict[str, np.ndarray]:
    """Only the arrays the model takes (a data set may carry more, e.g. labels)."""
    names = {port.get_any_name() for port in ov_model.inputs}
    return {k: v for k, v in feeds.items() if k in names}


def fake_quantize_count(ov_model) -> int:
    return sum(op.get_type_name() == "FakeQuantize" for op in ov_model.get_ops())


class nncf_logs_to:
    """NNCF logs (and prints progress) on its own logger: keep them in the stage log; with the guard's
    budget, NNCF's last message names the step on the console ("Calculating ranking scores", ...)."""

    def __init__(self, log: logging.Logger, budget=None):
        self.log = log
        self.handler = logging.Handler()

        def emit(record):
            log.log(record.levelno, "nncf: %s", record.getMessage())
            if budget is not None:
                budget.task = f"int8 guard: nncf: {record.getMessage()[:60]}"

        self.handler.emit = emit  # type: ignore[method-assign]

    def __enter__(self):
        nncf_log = logging.getLogger("nncf")
        self.saved = nncf_log.propagate, list(nncf_log.handlers)
        nncf_log.handlers = [self.handler]
        nncf_log.propagate = False
        return self

    def __exit__(self, *exc):
        nncf_log = logging.getLogger("nncf")
        nncf_log.propagate, nncf_log.handlers = self.saved[0], self.saved[1]
        return False
