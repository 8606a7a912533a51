"""The typed parts layers take instead of the Recipe: built by hand, with no recipe, they give
what the recipe gives, and the layers run on them alone."""
from __future__ import annotations

import json

import numpy as np
import onnx.parser

from optpipe.recipe.example_inputs import synthetic_inputs
from optpipe.execution.stage_evaluation import EvaluationParts
from optpipe.plan.compile_plan import CompilePlan
from optpipe.recipe.schema import DimRange, EvaluateSpec, InputSpec, ModelInputs, Tolerance
from optpipe.safety.recipe_loading import parse_recipe

SHAPES = ModelInputs(
    inputs=(InputSpec(name="ids", dtype="int64", shape=["batch", "seq"], range=[0, 50]),
            InputSpec(name="mask", dtype="int64", shape=["batch", "seq"], fill=1)),
    dims={"batch": DimRange(min=1, opt=2, max=12), "seq": DimRange(min=8, opt=16, max=64, multiple_of=8)},
)


def test_hand_built_inputs_give_batch_dim_shapes_and_sweeps():
    assert SHAPES.batch_dim() == "batch"
    assert SHAPES.shape_at(SHAPES.inputs[0], "max", batch=3) == (3, 64)
    assert SHAPES.sweep_values("batch", "pow2") == [1, 2, 4, 8, 12]  # powers of two, then the max
    assert SHAPES.sweep_values("seq", "pow2") == [8, 16, 32, 64]  # 1, 2 and 4 are off the multiple-of-8 grid
    assert SHAPES.sweep_values("seq", [32, 8, 32]) == [8, 32]
    feeds = synthetic_inputs(SHAPES, seed=3, batch=5)
    assert feeds["ids"].shape == (5, 16) and feeds["ids"].max() < 50 and np.all(feeds["mask"] == 1)


def test_the_recipe_delegates_to_its_parts(tmp_path):
    recipe = parse_recipe({
        "model": {"onnx": "m.onnx"},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["n", 4]}],
        "dims": {"n": {"min": 1, "opt": 3, "max": 6}},
        "stages": {"root": {"pass": "export"},
                   "slim": {"pass": "simplify", "after": "root", "tolerance": {"max_abs": 0.5}}},
        "evaluate": {"sweep": {"n": "pow2"}, "tolerance": {"max_abs": 0.01}},
    }, base_dir=tmp_path)
    source = recipe.model_source()
    assert source.resolve("m.onnx") == tmp_path / "m.onnx" == recipe.resolve("m.onnx")
    assert recipe.sweep_values("n") == source.sweep_values("n", "pow2") == [1, 2, 4, 6]
    parts = EvaluationParts.of(CompilePlan.of(recipe))
    assert parts.parents == {"root": None, "slim": "root"}
    assert parts.tolerance_for("slim").max_abs == 0.5 and parts.tolerance_for("root").max_abs == 0.01


def test_the_evaluator_runs_on_its_parts_alone(tmp_path):
    from optpipe.core.artifact import save_model
    from optpipe.cache.store import StageCache
    from optpipe.calibration.dataset import SampleSet
    from optpipe.evaluation.evaluator import Evaluator

    shapes = ModelInputs((InputSpec(name="x", dtype="float32", shape=["n", 4]),), {"n": DimRange(min=1, opt=2, max=8)})
    graph = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
        g (float[n, 4] x) => (float[n, 4] y) { y = Relu(x) }""")
    artifact = save_model(graph, tmp_path / "stage")
    samples = SampleSet({"x": np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)}, key="k", cached=False)
    settings = EvaluateSpec(batch_sizes=[1, 4], iterations=3, warmup=1, threads=1, adaptive=False)
    evaluator = Evaluator(settings, shapes, StageCache(tmp_path / "cache"), lambda: samples, providers="cpu")
    evaluator.set_reference("stage", artifact.content_hash(), lambda: evaluator.onnx_outputs(artifact))
    accuracy, latency, _, cached = evaluator.evaluate_onnx(artifact, Tolerance())
    assert not cached and accuracy.within_tolerance and accuracy.samples == 8
    assert [o.max_abs for o in accuracy.outputs] == [0.0]  # the stage is its own reference
    assert [lat.batch_size for lat in latency] == [1, 4]


def test_the_compile_plan_resolves_the_recipe_once_and_survives_a_worker_round_trip(tmp_path):
    recipe = parse_recipe({
        "name": "plan",
        "model": {"factory": "m:build", "path": ".", "kwargs": {"width": 3}},
        "inputs": [{"name": "ids", "dtype": "int64", "shape": ["b", "s"], "range": [0, 50]}],
        "dims": {"b": {"min": 1, "opt": 2, "max": 4}, "s": {"min": 8, "opt": 16, "max": 64, "multiple_of": 8}},
        "data": {"calibration": {"source": "synthetic", "samples": 4}},
        "stages": {"export": {"pass": "export", "timeout_s": 30},
                   "q": {"pass": "int8", "after": "export", "tolerance": {"cosine_min": 0.9}}},
        "evaluate": {"threads": 1, "tolerance": {"cosine_min": 0.995}, "task": {"kind": "language-model"}},
        "targets": [{"kind": "openvino"}, {"kind": "ort", "stages": ["q"]}],
    }, base_dir=tmp_path)
    plan = CompilePlan.of(recipe)
    assert plan.stages["q"].parent == "export" and plan.stages["export"].timeout_s == 30
    assert plan.stages["q"].tolerance.cosine_min == 0.9 and plan.stages["export"].tolerance.cosine_min == 0.995
    assert plan.target_kinds() == ("openvino", "ort")
    assert plan.model_source() == recipe.model_source() and plan.model_inputs() == recipe.model_inputs()
    again = CompilePlan.from_document(json.loads(json.dumps(plan.to_document())))  # what a stage's worker reads
    assert again == plan and again.model_source().resolve("x") == tmp_path / "x"
    scoped = plan.with_evaluate(reference="q", eager_baseline=False)
    assert scoped.evaluate.reference == "q" and plan.evaluate.reference is None and scoped.stages == plan.stages


def test_a_pass_context_holds_the_typed_parts_not_the_recipe(tmp_path):
    import logging

    from optpipe.cache.store import StageCache
    from optpipe.execution.services import RunServices, make_pass_context

    recipe = parse_recipe({
        "model": {"onnx": "m.onnx"}, "inputs": [{"name": "x", "shape": ["n", 4]}], "dims": {"n": {"min": 1, "opt": 2, "max": 8}},
        "stages": {"root": {"pass": "export"}, "cut": {"pass": "prune", "after": "root", "tolerance": {"max_abs": 0.5}}},
        "evaluate": {"threads": 1, "top1": True}, "targets": [{"kind": "tensorrt"}],
    }, base_dir=tmp_path)
    plan = CompilePlan.of(recipe)
    cache = StageCache(tmp_path / "cache")
    ctx = make_pass_context(plan, RunServices(plan.model_source(), plan.data, cache), "cut", tmp_path, logging.getLogger("t"))
    assert not hasattr(ctx, "recipe")
    assert ctx.model_source.model == recipe.model and ctx.inputs == recipe.model_inputs() and ctx.inputs.batch_dim() == "n"
    assert ctx.evaluate.threads == 1 and ctx.evaluate.top1 and ctx.target_kinds == ("tensorrt",) and ctx.tolerance.max_abs == 0.5


def test_a_compile_hands_passes_evaluation_targets_and_reports_no_recipe(tmp_path):
    """Under a profiler hook (.ci/recipe_crossings.py), no call into these packages gets a Recipe,
    directly or one attribute deep (as PassContext.recipe once carried it)."""
    import importlib.util
    from pathlib import Path

    from helpers_passes import artifact_of, small_mlp
    from optpipe.execution.pipeline import RunOptions, compile_recipe

    spec = importlib.util.spec_from_file_location("recipe_crossings", Path(__file__).parents[1] / ".ci" / "recipe_crossings.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    artifact_of(small_mlp(np.random.default_rng(0)), tmp_path / "model")
    recipe = parse_recipe({
        "name": "crossings", "model": {"onnx": "model/model.onnx"},
        "inputs": [{"name": "x", "shape": ["batch", 16]}], "dims": {"batch": {"min": 1, "opt": 2, "max": 8}},
        "data": {"eval": {"source": "synthetic", "samples": 8}, "calibration": {"source": "synthetic", "samples": 8, "seed": 1}},
        "stages": {"import": {"pass": "export"}, "q": {"pass": "int8", "after": "import", "tolerance": {"cosine_min": 0.9}},
                   "half": {"pass": "fp16", "after": "import"}},
        "evaluate": {"threads": 1, "warmup": 0, "iterations": 2, "eager_baseline": False},
        "targets": [{"kind": "ort"}],
    }, base_dir=tmp_path)
    report, seen = tool.crossings(lambda: compile_recipe(recipe, RunOptions(output=tmp_path / "run", cache_dir=tmp_path / "cache")))
    assert [s.status for s in report.stages] == ["ok", "ok", "ok"] and report.targets
    entered = {tool.package_of(callee.rsplit(".", 1)[0]) for _, callee in seen}
    assert "plan" in entered, seen  # the hook sees crossings: validation checks the Recipe itself
    assert not entered & {"passes", "pass_infra", "evaluation", "calibration", "source", "targets", "reporting"}, seen
