"""fuse: operator fusion for ONNX Runtime, checked numerically against the input model.

Two kinds of fusion, each optional:
- transformer fusions (Attention, SkipLayerNormalization, BiasGelu, ...): onnxscript's
  `optimize_for_ort` fuses graphs from the dynamo exporter, ORT's transformer optimizer
  those from the TorchScript exporter. `auto` runs both and keeps the one that fused more.
- ORT's generic graph optimizations (Conv+BatchNorm/activation, Gemm+activation, ...)
  run at the EXTENDED level and saved offline. Not ALL: that level adds layout
  transforms specific to the CPU it runs on, which would not travel with the model.
Fused ops live in the `com.microsoft` domain: ORT CPU/CUDA run them, TensorRT does not.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

import onnx
from pydantic import Field, field_validator

from optpipe.core.artifact import DATA_FILE, MODEL_FILE, ModelArtifact, adopt_model, copy_file, save_model, write_info
from optpipe.evaluation.self_check import SelfCheckParams
from optpipe.core.errors import PassError, RecipeError, UserInputError, first_line
from optpipe.graph.stats import fused_ops as graph_stats_fused_ops
from optpipe.graph.stats import graph_stats, op_changes, op_histogram
from optpipe.pass_infra.pass_base import Pass, PassContext

ATTENTION_OPS = ("Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention")
#: Tensors under this many bytes stay inside the graph when a fuser's result is written: below save_model's
#: 1024 bytes with the bytes object's own overhead, so adopt_model takes the files as written, weights unread.
INLINE_BYTES = 512


class FuseParams(SelfCheckParams):
    transformer: Literal["auto", "onnxscript", "ort", "off"] = Field(
        "auto", description="transformer fusion: onnxscript (dynamo exports), ort (TorchScript exports), auto = both, keep the better"
    )
    attention: Literal["packed", "separate"] = Field(
        "separate",
        description="onnxscript: packed = one Attention op with Q/K/V weights concatenated; separate = "
        "MultiHeadAttention after three MatMuls, which int8 can quantize",
    )
    model_type: str = Field("bert", description="ORT transformer optimizer's model type")
    num_heads: int = Field(0, ge=0, description="ORT transformer optimizer: attention heads (0 = the Hugging Face config's, else detect)")
    hidden_size: int = Field(0, ge=0, description="ORT transformer optimizer: hidden size (0 = the Hugging Face config's, else detect)")
    generic: bool = Field(True, description="also apply ORT's generic fusions (EXTENDED level), saved offline")

    @field_validator("model_type")
    @classmethod
    def _known_to_ort(cls, value: str) -> str:
        """Checked when the recipe is read: ORT's optimizer fails on an unknown type only inside the pass."""
        from onnxruntime.transformers.optimizer import MODEL_TYPES

        if value not in MODEL_TYPES:
            raise ValueError(f"ORT's transformer optimizer has no model type '{value}'; use one of {', '.join(sorted(MODEL_TYPES))}")
        return value


class FusePass(Pass[FuseParams]):
    """Fuse operators for ONNX Runtime (attention, layer norms, GELU, conv+bn), checked against the input."""

    name = "fuse"
    version = "3"  # 3: ORT's fuser gets num_heads/hidden_size from the Hugging Face config
    Params = FuseParams
    libraries = ("onnx", "onnxscript", "onnx-ir", "onnxruntime", "onnxruntime-gpu")
    check_hint = "set `transformer: off` or the other fuser (`onnxscript` / `ort`) and compare"

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        params = self.params
        before = op_histogram(model.load(with_weights=False))
        artifact, transformer_info = transformer_fusion(model, params, ctx)
        generic_info = None
        if params.generic:
            generic_info = apply_generic_fusions(artifact, ctx.workdir)
        after = graph_stats(artifact.load(with_weights=False))
        changes = op_changes(before, after["ops"])
        info = {
            "transformer": transformer_info,
            "generic": generic_info,
            "fused_ops": fused_ops(changes),
            "op_changes": changes,
            "nodes_before": sum(before.values()),
            "nodes_after": after["nodes"],
            "graph": after,
        }
        ctx.log.info("fused ops: %s", info["fused_ops"])
        return write_info(ctx.workdir, info)


def fused_ops(changes: dict[str, int]) -> dict[str, int]:
    """The fused ops the pass made, and how many: the com.microsoft ops that appeared."""
    return {op: n for op, n in graph_stats_fused_ops(changes).items() if n > 0}


# --- transformer fusion ----------------------------------------------------------------------


def transformer_fusion(model: ModelArtifact, params: FuseParams, ctx: PassContext) -> tuple[ModelArtifact, dict]:
    """The stage's artifact in ctx.workdir: the input with transformer fusions applied by the chosen (or the
    better) fuser. Each fuser writes its result to disk and only the graphs are compared; the better one's files
    are moved into the workdir, its weights never read (BERT-large's `auto` held both fusers' models, 1.3 GB each)."""
    if params.transformer == "off":
        return _copied(model, ctx.workdir), {"fuser": None}
    fusers = ["onnxscript", "ort"] if params.transformer == "auto" else [params.transformer]
    candidates: dict[str, tuple[Path, dict]] = {}
    errors: dict[str, str] = {}
    before = op_histogram(model.load(with_weights=False))
    with tempfile.TemporaryDirectory(dir=ctx.workdir) as scratch:
        for fuser in fusers:
            try:
                fused, detail = FUSERS[fuser](model, params, ctx, Path(scratch) / fuser)
            except UserInputError:  # the recipe's values (attention_shape): no other fuser makes them right
                raise
            except Exception as exc:  # a fuser that cannot handle a graph is a finding, not a crash, under auto
                ctx.log.warning("%s fusion failed", fuser, exc_info=True)
                errors[fuser] = library_failure(exc)
                continue
            ops = op_histogram(onnx.load(str(fused), load_external_data=False))
            candidates[fuser] = (fused, {**detail, "fused_ops": fused_ops(op_changes(before, ops))})
        if not candidates:
            untried = [f for f in FUSERS if f not in errors]
            hint = f"try `transformer: {untried[0]}`, or set `transformer: off`" if untried else "set `transformer: off`"
            raise PassError(f"transformer fusion failed ({'; '.join(f'{k}: {v}' for k, v in errors.items())}); {hint}")
        best = max(candidates, key=lambda name: fusion_score(candidates[name][1]["fused_ops"]))
        summary = {name: detail for name, (_, detail) in candidates.items()}
        if fusion_score(candidates[best][1]["fused_ops"]) == (0, 0):
            best, artifact = None, _copied(model, ctx.workdir)  # nothing fused: keep the input graph untouched
        else:
            artifact = adopt_model(candidates[best][0], ctx.workdir)
    return artifact, {"fuser": best, "candidates": summary, "errors": errors}


def _copied(model: ModelArtifact, folder: Path) -> ModelArtifact:
    """The input artifact's model and weights, copied file to file."""
    for name in (MODEL_FILE, DATA_FILE):
        if (model.folder / name).is_file():
            copy_file(model.folder / name, folder / name)
    return write_info(folder, {})


def library_failure(exc: BaseException) -> str:
    """A fuser's exception as one true line: its type and the library function that raised it, since
    messages such as "list index out of range" say nothing alone."""
    import traceback

    from optpipe.passes._disk_worker import DiskWorkerFailed

    if isinstance(exc, DiskWorkerFailed):  # the worker's line already names the type and where
        return str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" in {Path(frames[-1].filename).stem}.{frames[-1].name}" if frames else ""
    return f"{type(exc).__name__}{where}: {first_line(exc)}"


def fusion_score(ops: dict[str, int]) -> tuple[int, int]:
    """Attention fusions first (they buy the most), then the count of all fused ops."""
    attention = sum(n for op, n in ops.items() if op in ATTENTION_OPS)
    return attention, sum(ops.values())


def fuse_with_onnxscript(model: ModelArtifact, params: FuseParams, ctx: PassContext, out: Path) -> tuple[Path, dict]:
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    from optpipe.graph.attention_rank import restore_flattened_attention

    ir_model = ir.load(str(model.path))
    if params.attention == "separate":
        fused, counts = fuse_up_to_multihead_attention(ir_model)
    else:
        fused, counts = optimize_for_ort(ir_model)
    counts = dict(counts)
    counts["attention_output_reshape_restored"] = restore_flattened_attention(fused)
    # Streamed to a data file of its own, a tensor at a time (the input's weights are read from its mapped file).
    out.mkdir(parents=True)
    ir.save(fused, out / MODEL_FILE, external_data=DATA_FILE, size_threshold_bytes=INLINE_BYTES)
    return out / MODEL_FILE, {"fusions": {name: n for name, n in counts.items() if n}}


def fuse_up_to_multihead_attention(model):
    """onnxscript's `optimize_for_ort`, stopping at MultiHeadAttention.

    Packing Q/K/V into one Attention op concatenates their weights through a Concat node,
    which ORT's quantizers cannot quantize (measured: dynamic int8 left every packed
    Attention in FP32), and onnxscript has no switch for it. So the same steps, in the same
    order as onnxscript 0.7's ort_fusions/_core.py, are composed here from its public rule
    modules, without `attention.fuse_attention`. pyproject.toml bounds onnxscript to the
    versions this order was read from, and tests/test_fuse.py fails if attention stops fusing.
    """
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes
    from onnxscript.optimizer import optimize
    from onnxscript.rewriter import rewrite
    from onnxscript.rewriter.ort_fusions import ORT_PATTERN_REWRITE_RULES, shape_optimization
    from onnxscript.rewriter.ort_fusions import (
        bias_gelu, cos_sin_cache, erfgelu, gelu, gqa, gqa_packed_qkv, mha, mha_bias, mha_scale,
        rms_normalization, rotary_embedding, sdpa, sdpa_via_mha, skip_normalization,
    )
    from onnxscript.rewriter.rules.common import gemm_to_matmul_add_rule

    rewrite(model, [gemm_to_matmul_add_rule])
    common_passes.ShapeInferencePass()(model)
    optimize(model)
    shape_optimization.rules.apply_to_model(model)
    optimize(model)
    counts: dict[str, int] = {}
    steps = [
        ("erf_gelu", erfgelu.fuse_erfgelu), ("rms_normalization", rms_normalization.fuse_rms_normalization),
        ("skip_layer_normalization", skip_normalization.fuse_skip_layer_normalization),
        ("skip_rms_normalization", skip_normalization.fuse_skip_rms_normalization),
        ("rotary_embedding", rotary_embedding.fuse_rotary_embedding), ("cos_sin_cache", cos_sin_cache.fuse_cos_sin_cache),
    ]
    for name, fuse in steps:
        counts[name] = fuse(model)
    common_passes.CommonSubexpressionEliminationPass()(model)
    counts["partial_rotary_embedding"] = rotary_embedding.fuse_partial_rotary_embedding(model)
    counts["sdpa"] = sdpa.fuse_sdpa(model, apply_shape_inference=True)  # adds nodes that need shapes
    steps = [
        ("gqa", gqa.fuse_gqa), ("packed_qkv_for_gqa", gqa_packed_qkv.fuse_qkv_gqa), ("mha1", mha.fuse_mha1),
        ("mha2", mha.fuse_mha2), ("mha_scale", mha_scale.fuse_mha_scale), ("mha_bias", mha_bias.fuse_mha_bias),
        ("gelu", gelu.fuse_gelu), ("bias_gelu", bias_gelu.fuse_bias_gelu), ("sdpa_via_mha", sdpa_via_mha.replace_sdpa_by_mha),
    ]
    for name, fuse in steps:
        counts[name] = fuse(model)
    optimize(model)
    rewrite(model, ORT_PATTERN_REWRITE_RULES)
    ir.passes.Sequential(
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=1),
        common_passes.RemoveInitializersFromInputsPass(),
        common_passes.ShapeInferencePass(),
    )(model)
    return model, counts


def fuse_with_ort(model: ModelArtifact, params: FuseParams, ctx: PassContext, out: Path) -> tuple[Path, dict]:
    from onnxruntime.transformers.optimizer import optimize_model

    from optpipe.passes import _ort_fuser

    shape = attention_shape(params, ctx)
    options = {"model_type": params.model_type, "num_heads": shape["num_heads"], "hidden_size": shape["hidden_size"]}
    if model.size_bytes() >= _ort_fuser.WORKER_MIN_BYTES:  # weights on disk, in a worker (passes/_ort_fuser.py)
        fused, fusions = _ort_fuser.fuse_on_disk(model.path, options, out)
        return fused, {"fusions": fusions, **shape, "weights": "on disk (worker)"}
    # the Python fusions only (opt_level 0); ORT's own graph optimizations are `generic`
    optimized = optimize_model(str(model.path), opt_level=0, use_gpu=False, **options)
    stats = optimized.get_fused_operator_statistics() or {}
    return save_model(optimized.model, out).path, {"fusions": {name: n for name, n in stats.items() if n}, **shape,
                                                   "weights": "in memory"}


def attention_shape(params: FuseParams, ctx: PassContext) -> dict:
    """num_heads and hidden_size for ORT's fuser: the params where set, else the Hugging Face config's.

    Why: ORT's BERT fuser detects them from the graph's reshape constants, and that detection fails on
    transformers 5's exports (its mask subgraph): no Attention fusion then, hence no QAttention in int8
    (docs/int8.md). The config states them; 0 (ORT's own detection) when the model has none."""
    config = hf_config(ctx)
    found = {"num_heads": int(getattr(config, "num_attention_heads", 0) or 0), "hidden_size": int(getattr(config, "hidden_size", 0) or 0)}
    given = {"num_heads": params.num_heads, "hidden_size": params.hidden_size}
    shape = {key: given[key] or found[key] for key in given}
    heads, hidden = shape["num_heads"], shape["hidden_size"]
    if heads and hidden and hidden % heads and any(given.values()):
        # ORT's fuser asserts it and fails with a bare AssertionError: the recipe's values to fix.
        named = " and ".join(f"stages.{ctx.stage}.params.{key}" for key, value in given.items() if value)
        raise RecipeError(f"{named}: {heads} attention heads do not divide the hidden size {hidden}; set the model's own "
                          f"values, or 0 to take them from its config ({found['num_heads']} heads, hidden size {found['hidden_size']})")
    shape["from"] = "params" if all(given.values()) else "config" if any(found.values()) else "detected"
    return shape


def hf_config(ctx: PassContext):
    """The recipe model's transformers config (its folder's config.json, or the recipe's `hf_config`); None for
    other models. transformers' own reader, so architectures that name the fields otherwise (DistilBERT's
    n_heads/dim) map onto num_attention_heads/hidden_size."""
    from optpipe.recipe.schema import HFConfigModel, HFModel

    spec = ctx.model_source.model
    if not isinstance(spec, (HFModel, HFConfigModel)):
        return None
    from transformers import AutoConfig

    from optpipe.source.model_source import hf_folder

    try:
        if isinstance(spec, HFConfigModel):
            return AutoConfig.for_model(**spec.hf_config)
        return AutoConfig.from_pretrained(str(hf_folder(ctx.model_source)), local_files_only=True,
                                          trust_remote_code=spec.trust_remote_code)
    except Exception as exc:  # a config transformers cannot read: the fuser detects the shape itself, as before
        ctx.log.warning("fuse: no Hugging Face config for num_heads/hidden_size (%s); ORT's fuser detects them", first_line(exc))
        return None


FUSERS = {"onnxscript": fuse_with_onnxscript, "ort": fuse_with_ort}


# --- ORT generic graph optimizations, saved offline ------------------------------------------


def apply_generic_fusions(artifact: ModelArtifact, workdir: Path) -> dict:
    """Run ORT's EXTENDED-level graph optimizations once and save the optimized graph in place."""
    import onnxruntime as ort

    before = op_histogram(artifact.load(with_weights=False))
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(optimized)
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.onnx.data")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", str(INLINE_BYTES))
        options.log_severity_level = 4  # FATAL only: a failure raises, and optpipe reports its message
        try:
            ort.InferenceSession(str(artifact.path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT refusing the graph: say so rather than crash
            raise PassError(f"ONNX Runtime cannot optimize the model: {first_line(exc)}; set `generic: false`") from None
        result = adopt_model(optimized, workdir)  # its files moved in, the weights never read
    changes = op_changes(before, op_histogram(result.load(with_weights=False)))
    return {"level": "extended", "op_changes": changes}
