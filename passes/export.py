"""export: PyTorch -> ONNX, checked against PyTorch eager; or import an existing ONNX file."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, model_validator

from optpipe.core.artifact import ModelArtifact, save_model, write_info
from optpipe.core.process_memory import release_freed_memory
from optpipe.core.results import EAGER
from optpipe.evaluation.self_check import SelfCheckParams, hand_over_eager, load_session, numeric_check, onnx_outputs
from optpipe.source.position_limit import check_sequence_dims, hold_sequence_dims, onnx_position_limit
from optpipe.core.errors import PassError, RecipeError, UserInputError, first_line, root_first_line
from optpipe.recipe.example_inputs import trace_inputs
from optpipe.graph.stats import graph_stats
from optpipe.source.model_source import TorchModel, onnx_source_path, source_fingerprint
from optpipe.pass_infra.pass_base import Pass, PassContext
from optpipe.pass_infra.progress import Steps
from optpipe.recipe.schema import ModelInputs, OnnxModel
from optpipe.passes import _torch_export as exporters
from optpipe.passes._batch_independence import checked_batch, onnx_samples_mixed, samples_mixed
from optpipe.passes._eager_reference import eager_as_exported, eager_outputs
from optpipe.source.module_forms import is_scripted
from optpipe.passes._torch_export import DYNAMO_MIN_OPSET


EXPORTERS = ("dynamo", "torchscript")  # `auto`'s order

#: From this much FP32 weight the dynamo export runs in a worker process of its own. onnxscript 0.7's rewriter,
#: which torch.onnx runs on every dynamo export, keeps the last graph each of its module-level rules matched
#: (`SimplePatternMatcher._graph`), and that graph's initializers wrap the torch model's Parameters: after the
#: export of Gemma 3 270M in the compile's process its 1.1 GB of weights stayed alive under every later stage,
#: the torch model released or not (found with objgraph's back-reference chain; docs/memory.md, fourth round).
#: The worker's exit gives them back. Below this (MiniLM, 90 MB) a worker's start would cost more than it frees.
WORKER_MIN_BYTES = 256 << 20


class ExportParams(SelfCheckParams):
    exporter: Literal["auto", "dynamo", "torchscript"] = Field(
        "auto", description="torch.onnx exporter; auto = dynamo, and TorchScript when dynamo fails (the stage info says why)"
    )
    opset: int = Field(20, ge=17, le=23, description="ONNX opset (dynamo needs >= 18)")
    attention: Optional[Literal["eager", "sdpa"]] = Field(
        None,
        description="Hugging Face models: the attention implementation to export (transformers' attn_implementation); "
        "eager writes the plain MatMul/Softmax pattern that ORT's `fuse` turns into Attention and int8 into QAttention; "
        "default: the model's own",
    )

    @model_validator(mode="after")
    def _opset_fits_exporter(self):
        # Refused with the recipe, before any export: `auto` instead moves on to TorchScript (run()).
        if self.exporter == "dynamo" and self.opset < DYNAMO_MIN_OPSET:
            raise ValueError(f"the dynamo exporter needs opset >= {DYNAMO_MIN_OPSET}; set `opset: {DYNAMO_MIN_OPSET}` "
                             "or higher, or `exporter: torchscript` (or `auto`)")
        return self


class ExportPass(Pass[ExportParams]):
    """Export the recipe's PyTorch model to ONNX with the recipe's dynamic dims, checked against eager."""

    name = "export"
    version = "5"  # 3: source_warnings (checkpoint weights left out or made up) in the info; 4: samples_mixed;
    # 5: a fixed first dim checked as a batch too, refused where the model refuses one row (refuse_no_batch)
    Params = ExportParams
    needs_input = False
    libraries = ("torch", "onnx", "onnxscript", "transformers")

    def fingerprint(self, ctx: PassContext) -> dict:
        source = ctx.model_source
        return {
            "source": source_fingerprint(source),
            "inputs": [spec.model_dump() for spec in source.inputs],
            "dims": {name: dim.model_dump() for name, dim in source.dims.items()},
            # with evaluate.generation the graph carries the KV cache, sized by these settings
            **({"kv_cache": _kv_settings(ctx)} if ctx.evaluate.generation is not None else {}),
        }

    def own_process(self, ctx: PassContext) -> str | None:
        """The dynamo export of a model of >= WORKER_MIN_BYTES whose weights a reload reproduces (a source that
        tells its size: hf folders, seeded hf_config, safetensors factories), so that the worker's model and the
        one the compile loads for eager are the same."""
        from optpipe.source.torch_weights import fp32_weight_bytes

        dynamo = ctx.evaluate.generation is not None or self.params.exporter != "torchscript"
        if isinstance(ctx.model_source.model, OnnxModel) or not dynamo:
            return None
        size = fp32_weight_bytes(ctx.model_source)
        if size is None or size < WORKER_MIN_BYTES:
            return None
        return (f"the dynamo exporter's graph rewriter (onnxscript) keeps the model's {size / 1e9:.2f} GB of weights "
                "alive after the export; a worker's exit gives them back")

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        if isinstance(ctx.model_source.model, OnnxModel):
            return import_onnx(ctx)
        # Each step is a progress line (issue 17): the TorchScript tracer has no hook inside, the
        # dynamo exporter prints its phases (passes/_torch_export.py).
        decoder = ctx.evaluate.generation is not None  # a decoder measured by generation: the graph with its KV cache
        steps = Steps(ctx.progress, "export", 5 if decoder else 6)
        steps("load the PyTorch model")
        torch_model = ctx.torch_model()
        check_sequence_dims(torch_model.module, ctx.inputs)  # the checks below never reach a dim's max
        attention = set_attention(torch_model, self.params.attention)
        feeds = trace_inputs(ctx.inputs)
        steps("PyTorch eager on the trace inputs")
        expected = eager_outputs(torch_model, feeds, ctx.evaluate.threads)
        mixed = samples_mixed(eager_as_exported(torch_model, ctx.evaluate.threads), feeds, expected, *_mixing_tolerance(self.params),
                              ctx.inputs) if checked_batch(ctx.inputs) and not decoder else None
        if decoder:
            from optpipe.passes._decoder_export import export_with_cache

            return export_with_cache(torch_model, ctx, steps, (feeds, expected), self.params.opset, attention)
        params = self.params
        exporters = EXPORTERS if params.exporter == "auto" else (params.exporter,)
        if is_scripted(torch_model.module):  # a TorchScript module: only the TorchScript exporter takes one
            if params.exporter == "dynamo":
                raise UserInputError("stages.export.params.exporter: dynamo cannot export a TorchScript module "
                                     "(torch.jit.script or torch.jit.load); use `torchscript` or `auto`")
            exporters = ("torchscript",)
        failures: dict[str, str] = {}
        for exporter in exporters:
            raw = ctx.workdir / f"raw-{exporter}"
            try:
                checked = _export_checked(exporter, torch_model, feeds, expected, ctx.inputs, ctx.evaluate.threads, params, raw,
                                          steps, ctx.log)
            except _ExportFailed as exc:
                ctx.log.warning("%s export failed: %s", exporter, exc)
                failures[exporter] = str(exc)
                shutil.rmtree(raw, ignore_errors=True)
                continue
            break
        else:
            raise PassError(_failure_message(failures, bool(ctx.inputs.dims)))
        import onnx

        steps("save the model")
        # The checks' session is gone: its freed pages go back before the whole model is read (BERT-large's
        # TorchScript export, 1.34 GB: the save started 2.1 GB above the torch model and peaked at 5.1 GB).
        release_freed_memory()
        exported = onnx.load(str(raw / "model.onnx"))
        opset = next((o.version for o in exported.opset_import if o.domain in ("", "ai.onnx")), params.opset)
        if opset != params.opset:
            ctx.log.warning("the %s exporter wrote opset %d (asked: %d)", exporter, opset, params.opset)
        artifact = save_model(exported, ctx.workdir)
        shutil.rmtree(raw, ignore_errors=True)
        hand_over_eager(ctx.workdir, feeds, expected)  # the self-check's reference: it need not load the model again
        # `opset`: the one the model has (TorchScript writes at most 20), beside the one asked for.
        info = {"exporter": exporter, "exporter_requested": params.exporter, "opset": opset, "opset_requested": params.opset,
                "source": torch_model.description, "outputs": torch_model.output_names, "attention": attention, **checked,
                **({"source_warnings": torch_model.warnings} if torch_model.warnings else {}),
                **({"samples_mixed": mixed} if mixed else {})}
        if failures:
            info["fallback"] = {"from": list(failures), "reasons": failures}
            ctx.log.warning("exported with %s after %s", exporter, "; ".join(f"{k} failed: {v}" for k, v in failures.items()))
        info["graph"] = graph_stats(artifact.load(with_weights=False))
        return write_info(ctx.workdir, info)


def _mixing_tolerance(params: ExportParams) -> tuple[float, float]:
    """One sample alone against its row in a batch: the export's own check rule, its defaults where left unset (batch 1
    and batch 2 take other kernels, which round apart by ~1e-6)."""
    return (params.check_atol if params.check_atol is not None else 1e-3,
            params.check_rtol if params.check_rtol is not None else 1e-3)


def _kv_settings(ctx: PassContext) -> dict:
    from optpipe.recipe.generation_spec import decoder_dims

    task = ctx.evaluate.task
    return {"dims": decoder_dims(ctx.evaluate.generation, ctx.inputs.inputs, ctx.inputs.dims, task.tokens if task else "input_ids")}


def set_attention(torch_model: TorchModel, implementation: str | None) -> str | None:
    """Switch a Hugging Face model to `implementation` (transformers' public `set_attn_implementation`)
    for this export; returns the implementation the export used (None: not a Hugging Face model).

    Why: transformers 5 defaults to SDPA, which exports as a pattern no ORT fuser turns into
    `Attention`; eager attention exports as MatMul/Softmax/MatMul, which ORT's BERT fuser does fuse,
    and dynamic int8 then runs it as QAttention (docs/int8.md). The module is freshly loaded for
    this pass (load_torch_model), so the eager baseline keeps the model's own implementation."""
    model = next((m for m in torch_model.module.modules() if hasattr(m, "set_attn_implementation")), None)
    if model is None:
        if implementation is not None:
            raise RecipeError("`attention` applies to Hugging Face models only; remove it from this export stage")
        return None
    if implementation is not None:
        try:
            model.set_attn_implementation(implementation)
        except (ValueError, ImportError) as exc:  # an architecture without that implementation
            raise RecipeError(f"attention: {type(model).__name__} cannot use '{implementation}' attention ({first_line(exc)}); "
                            "remove `attention` or pick the other one") from None
    return getattr(model.config, "_attn_implementation", None)


class _ExportFailed(Exception):
    """One exporter could not produce a model that matches eager; the message says why. The next
    exporter may not share the failure: `auto` moves on to it."""


def _export_checked(exporter: str, torch_model: TorchModel, feeds, expected, shapes: ModelInputs, threads: int, params: ExportParams,
                    raw: Path, steps: Steps | None = None, log: logging.Logger | None = None) -> dict:
    """Export with one exporter into `raw`, then check the result against eager at the trace shape and
    at other shapes of the dynamic dims (the same rule for every exporter and every `exporter:` mode,
    so `auto` moves on exactly when the stage would be wrong). Returns what the check saw."""
    steps = steps or Steps(lambda *_: None, "export", 0)
    raw.mkdir()
    path = raw / "model.onnx"
    branches: list[str] = []
    try:
        if exporter == "dynamo":
            if params.opset < DYNAMO_MIN_OPSET:  # only `auto` gets here (ExportParams refuses it for `exporter: dynamo`)
                raise _ExportFailed(f"the dynamo exporter needs opset >= {DYNAMO_MIN_OPSET} (asked: {params.opset})")
            steps("torch.onnx.export (dynamo)")
            exporters.export_dynamo(torch_model, feeds, shapes, params.opset, path, steps.progress, log)
        else:
            steps("torch.onnx.export (TorchScript trace, no progress inside)")
            branches = exporters.export_torchscript(torch_model, feeds, shapes, params.opset, path, log)
    except (_ExportFailed, MemoryError, UserInputError):
        # MemoryError: the machine's limit, not this exporter's; a user-input error (the model or
        # recipe itself) the next exporter would share. Ctrl-C is no Exception: it is never caught.
        raise
    except Exception as exc:  # exporters raise anything (PassError too); the stage log has the traceback
        _reraise_interrupt(exc)
        logging.getLogger("optpipe.export").debug("%s export traceback", exporter, exc_info=True)
        raise _ExportFailed(f"torch.onnx.export ({exporter}): {root_first_line(exc)}") from None
    steps(f"check the {exporter} export against eager")
    release_freed_memory()  # the exporter's copies (its folded weights, the serialized graph), before a session reads it
    try:
        # One session for the trace shape and every check_shapes() corner: a session per shape built the
        # same 90 MB MiniLM graph five times (~0.3 s each on 2 loaded cores); ORT's outputs do not depend on
        # the runs before (no state), so the figures are the same.
        session = load_session(path, threads)
    except PassError as exc:  # the exporter wrote a graph ORT refuses to load: not a mismatch with eager
        raise _ExportFailed(f"the {exporter} export: {exc}") from None
    try:
        numeric_check(onnx_outputs(path, feeds, threads, session), expected, feeds, params, EAGER)
    except PassError as exc:
        raise _ExportFailed(f"the exported model does not match PyTorch eager ({exc})") from None
    except MemoryError:
        raise
    except Exception as exc:  # ORT refusing the exporter's graph at the very shape it was traced at (a Mamba's Tile)
        raise _ExportFailed(f"ONNX Runtime cannot run the {exporter} export ({root_first_line(exc)})") from None
    # A trace records one branch of any control flow on a tensor's values or shape (the tracer's
    # "Python boolean" warnings): such a warning alone proves nothing (T5 and Swin warn and are
    # right at every shape), so the export is judged by the other shapes, with other values.
    steps(f"check the {exporter} export at other shapes")
    checked = _check_shapes(exporter, torch_model, shapes, threads, params, path, branches,
                            steps.sub(f"check the {exporter} export at other shapes"), session)
    del session  # the export's session is not kept past its checks (its arena holds the weights)
    return {"checked_shapes": checked, **({"trace_branches": branches} if branches else {})}


def _reraise_interrupt(exc: BaseException) -> None:
    """A Ctrl-C that the exporter wrapped in its own error (torch.onnx does): the run stops, `auto`
    does not move on to the next exporter. A full or read-only disk is no exporter's fault either:
    raised as it is, the run names the folder (it was "No space left on device; set `exporter:
    dynamo`", advice that cannot help)."""
    from optpipe.safety.os_errors import chain, disk_error_in

    interrupt = next((link for link in chain(exc) if isinstance(link, KeyboardInterrupt)), None)
    if interrupt is not None:
        raise interrupt
    disk = disk_error_in(exc)
    if disk is not None:
        raise disk


def check_shapes(shapes: ModelInputs) -> list[dict[str, int]]:
    """The dim sizes the export is checked at besides the trace's: the corners of a low and a high
    size per dynamic dim (all low, all high, batch low with the rest high and the reverse), so a
    branch on batch or on a sequence length taken at the trace size shows up. `high` is bounded
    (at most twice the trace size) to keep eager's cost near the trace's."""
    batch = shapes.batch_dim()
    low = {name: dim.min for name, dim in shapes.dims.items()}
    high = {name: _high_size(dim) for name, dim in shapes.dims.items()}
    corners = [low, high]
    if batch and len(shapes.dims) > 1:
        corners += [{**high, batch: low[batch]}, {**low, batch: high[batch]}]
    trace = {name: trace_size(dim) for name, dim in shapes.dims.items()}
    unique: list[dict[str, int]] = []
    for corner in corners:
        if corner != trace and corner not in unique:
            unique.append(corner)
    return unique


def trace_size(dim) -> int:
    """The size trace_inputs gives a dim (never 1 where it may grow)."""
    return 2 if dim.opt == 1 and dim.max > 1 else dim.opt


def _high_size(dim) -> int:
    size = min(dim.max, max(trace_size(dim) * 2, dim.min))
    n = dim.multiple_of or 1
    return max(dim.min, size - size % n)


def _check_shapes(exporter: str, torch_model: TorchModel, shapes: ModelInputs, threads: int, params: ExportParams, path: Path,
                  branches: list[str], report=lambda done, total: None, session=None) -> list[dict]:
    """The export against eager at check_shapes() (fresh values, another seed); _ExportFailed naming
    the first shape where it is wrong. A model that caches a shape-dependent tensor (a detector's
    grid) or a trace that fixed a branch is right at the trace size and wrong there."""
    from optpipe.recipe.example_inputs import synthetic_inputs

    checked = []
    corners = check_shapes(shapes)
    for seed, sizes in enumerate(corners, start=1):
        report(seed, len(corners))
        feeds = synthetic_inputs(shapes, seed=seed, **sizes)
        try:
            expected = eager_as_exported(torch_model, threads)(feeds)
        except MemoryError:
            raise
        except Exception:  # eager itself refuses that size: nothing to compare against
            continue
        try:
            record = numeric_check(onnx_outputs(path, feeds, threads, session), expected, feeds, params, EAGER)
        except MemoryError:
            raise
        except Exception as exc:  # a PassError, or ORT refusing the shape outright
            raise _ExportFailed(_wrong_elsewhere(exporter, sizes, exc, branches)) from None
        checked.append({**sizes, "max_abs": record["max_abs"]})
    return checked


def _wrong_elsewhere(exporter: str, sizes: dict[str, int], exc: Exception, branches: list[str]) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
    cause = (f"the trace fixed a branch taken on a tensor's values or shape ({branches[0]})" if branches else
             "forward() computes something from the trace's sizes (a cached grid, a branch on a shape) that the export froze")
    return f"the {exporter} export is wrong at other sizes ({shown}: {root_first_line(exc)[:160]}): {cause}"


# Known failures -> the recipe change that is true for them (a recipe line, not the model's code:
# the user of a library model cannot edit its source). Matched on the root cause's message.
FIX_DIMS = "make those dims fixed in `inputs` (a number in place of the dim's name)"
_HINTS = (
    ("Inference tensors cannot be saved", "the model keeps tensors made under torch.inference_mode(); "
     "build them under torch.no_grad() (or lazily in forward) instead"),
    ("wrong at other sizes", FIX_DIMS),
    ("computes in bfloat16", "take the autocast or the cast out of forward: the passes start from float32, and a stage "
     "takes the lower precision (fp16, openvino `precision: bf16`)"),
    ("does not match PyTorch eager", "raise check_atol/check_rtol if the error is rounding on large outputs, else make the dims fixed in `inputs`"),
    *((marker, "the exporter wrote a graph ONNX Runtime refuses (the exporter's bug, not the model's); dynamic dims are "
       "where exporters go wrong most: " + FIX_DIMS + ", or try another `opset`")
      for marker in ("ONNX Runtime cannot run", "ONNX Runtime cannot load")),
    ("not supported", "the model uses an operator that ONNX export cannot convert"),
    ("Unsupported", "the model uses an operator that ONNX export cannot convert"),
    ("data-dependent", "forward() branches on tensor values or shapes, which dynamo cannot export with dynamic dims"),
    ("Cannot view a tensor", "dynamo cannot prove a view valid for every size of the dynamic dims"),
    ("Constraints violated", "the model's code fixes a dim that `dims` declares dynamic; make that dim fixed in `inputs`"),
    ("specialized", "the model's code fixes a dim that `dims` declares dynamic; make that dim fixed in `inputs`"),
)


def _failure_message(failures: dict[str, str], dynamic: bool) -> str:
    """Every exporter's reason, and the recipe change true for those reasons (never 'try the other
    one' once both were tried)."""
    text = "; ".join(failures.values())
    # The first exporter's failure picks the hint: it is the one the user asked for (or auto's first choice).
    hints = [hint for reason in failures.values() for marker, hint in _HINTS if marker in reason]
    untried = [e for e in EXPORTERS if e not in failures]
    if untried:
        # The other exporter is checked by the same rule (eager at several shapes), so naming it is safe advice.
        switch = f"set `exporter: {untried[0]}` (or `auto`, which tries both and checks each against eager at several shapes)"
        hint = f"{hints[0]}; {switch}" if hints else switch
    elif hints:  # both tried: what the trace needs is the change left to make
        traced = [hint for marker, hint in _HINTS if marker in failures.get("torchscript", "")]
        hint = (traced or hints)[0]
    else:
        hint = "both exporters failed; the stage log has the tracebacks"
    if untried and dynamic and "wrong at other sizes" not in text:
        hint += ", or make the dynamic dims fixed in `inputs`"
    return f"{text}; {hint}"


def import_onnx(ctx: PassContext) -> ModelArtifact:
    """An existing ONNX file becomes the root artifact; preflight ran the full checks (optpipe/safety/preflight.py)."""
    import onnx

    from optpipe.safety import onnx_guard

    path = onnx_source_path(ctx.model_source)
    graph = onnx_guard.check_named_parts(path, ctx.inputs, "model.onnx")  # the cheap ones again: a pass run on its own gets them too
    hold_sequence_dims(onnx_position_limit(graph.graph), ctx.inputs)
    model = onnx.load(str(path))
    info = {"imported": str(path), "graph": graph_stats(model)}
    mixed = onnx_samples_mixed(path, graph, ctx)
    return save_model(model, ctx.workdir, {**info, **({"samples_mixed": mixed} if mixed else {})})

