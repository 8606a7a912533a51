"""inspect / diff / layer-wise view on a tiny run, plus the sweeps, peak memory and progress it records."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from inspect_models import mlp_model, mlp_recipe, save
from optpipe.cli import cli
from optpipe.core.errors import RecipeError, RunFolderError
from optpipe.core.runtime import resize_dim
from optpipe.graph.stats import describe_graph, graph_diff
from optpipe.reporting.inspection import diff_stages, open_run, parse_stage_ref, stage_handle
from optpipe.pass_infra.instruments import StepRecorder
from optpipe.evaluation.layerwise import compare_layers
from optpipe.evaluation.memory import PeakMemory
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.recipe.schema import Tolerance
from optpipe.safety.recipe_loading import parse_recipe


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A compiled run of the tiny MLP (export imports it, simplify removes an Identity and folds an Add)."""
    root = tmp_path_factory.mktemp("tiny")
    model_path = save(mlp_model(), root / "mlp.onnx")
    recorder = StepRecorder()
    recipe = parse_recipe(mlp_recipe(model_path, root / "run", sweep_stages="all"))  # curves for every stage
    report = compile_recipe(recipe, RunOptions(cache_dir=root / "cache", instruments=[recorder]))
    assert not report.failed, [s.reason for s in report.failed]
    return root / "run", report, recorder


def invoke(*args: str):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=True)
    return result


# --- graph facts ---------------------------------------------------------------------------


def test_describe_graph_counts_fused_ops_precision_and_io():
    weight = numpy_helper.from_array(np.ones((64, 64), np.int8), "w_q")
    scale = numpy_helper.from_array(np.ones(64, np.float32), "scale")
    nodes = [
        helper.make_node("DequantizeLinear", ["w_q", "scale"], ["w"], axis=0),
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Gelu", ["h"], ["y"], domain="com.microsoft"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])], initializer=[weight, scale])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    described = describe_graph(model)
    assert described["fused_ops"] == {"Gelu": 1}
    assert described["bytes_by_dtype"] == {"float": 256, "int8": 4096}
    assert described["precision_mix"]["int8"] == pytest.approx(4096 / 4352)
    assert described["precision_ops"] == {"DequantizeLinear": 1}
    assert described["inputs"] == [{"name": "x", "dtype": "float", "shape": ["batch", 64]}]


def test_graph_diff_lists_added_and_removed_ops():
    before = describe_graph(mlp_model())
    after = describe_graph(mlp_model())
    after["ops"] = {**after["ops"], "Identity": 0, "com.microsoft.FusedMatMul": 2}
    after["fused_ops"] = {"FusedMatMul": 2}
    diff = graph_diff(before, after)
    assert diff["ops_added"] == {"com.microsoft.FusedMatMul": 2}
    assert diff["ops_removed"] == {"Identity": 1}
    assert diff["fused_ops"] == ({}, {"FusedMatMul": 2})


# --- inspect and diff on a run -------------------------------------------------------------


def test_inspect_run_lists_every_stage(tiny_run):
    run_dir, _, _ = tiny_run
    result = invoke("inspect", str(run_dir))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:3] == ["stage", "pass", "after"]
    assert [line.split()[0] for line in lines[2:]] == ["export", "simplify"]


def test_inspect_stage_shows_graph_and_metrics(tiny_run):
    run_dir, _, _ = tiny_run
    result = invoke("inspect", str(run_dir), "simplify")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "input  x: float [batch, sequence, 16]" in out
    assert "output y: float [batch, sequence, 8]" in out
    assert "MatMul 2" in out and "Identity" not in out
    assert "fused ops (com.microsoft): none" in out
    assert "[sequence sweep]" in out and "peak memory of the session" in out


def test_diff_lists_op_changes_and_deltas(tiny_run):
    run_dir, _, _ = tiny_run
    result = invoke("diff", str(run_dir), "export", "simplify")
    assert result.exit_code == 0, result.output
    assert "ops removed:  Add -1, Identity -1" in result.output
    assert "nodes                    8 ->            6" in result.output
    assert "cosine 1.00000 -> 1.00000" in result.output
    assert "speed-up" in result.output


def test_diff_data_pairs_latency_by_batch_and_sweep(tiny_run):
    run_dir, report, _ = tiny_run
    diff = diff_stages(stage_handle(run_dir, "export"), stage_handle(run_dir, "simplify"))
    keys = [(row["sweep"], row["batch_size"], row["shape"]) for row in diff.latency]
    assert len(keys) == len(set(keys)) == len(report.stage("simplify").latency)
    assert diff.graph["parameters"] == (8 * 0 + 16 * 32 + 32 + 32 * 8 + 64, 16 * 32 + 32 + 32 * 8 + 32)


def test_diff_across_runs_with_run_colon_stage(tiny_run):
    run_dir, _, _ = tiny_run
    result = invoke("diff", f"{run_dir}:export", f"{run_dir}:simplify", "--json")
    assert result.exit_code == 0, result.output
    assert '"ops_removed"' in result.output and f"{run_dir}:simplify" in result.output


def test_diff_layers_on_a_run_finds_nothing_for_an_exact_pass(tiny_run):
    run_dir, _, _ = tiny_run
    result = invoke("diff", str(run_dir), "export", "simplify", "--layers")
    assert result.exit_code == 0, result.output
    assert "no intermediate tensor made by the same op in both graphs leaves the tolerance" in result.output


def test_unknown_stage_and_missing_run_are_one_line_errors(tiny_run, tmp_path):
    run_dir, _, _ = tiny_run
    with pytest.raises(RunFolderError, match="has no stage 'simplfy' \\(did you mean 'simplify'\\?\\)"):
        stage_handle(run_dir, "simplfy")
    with pytest.raises(RunFolderError, match="is not a run folder"):
        open_run(tmp_path)
    with pytest.raises(RunFolderError, match="RUN:STAGE"):
        parse_stage_ref("simplify", None)
    result = invoke("inspect", str(run_dir), "export", "--layers")
    assert result.exit_code == 2 and "no parent stage" in result.output and "Traceback" not in result.output


# --- layer-wise ----------------------------------------------------------------------------


def test_layerwise_finds_where_the_error_starts(tmp_path):
    reference = save(mlp_model(), tmp_path / "a" / "model.onnx")
    candidate = save(mlp_model(second_layer_noise=0.5), tmp_path / "b" / "model.onnx")
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 4, 16)).astype(np.float32)}
    comparison = compare_layers(reference, candidate, feeds, Tolerance(cosine_min=0.99))
    assert [t.name for t in comparison.tensors] == ["x_copy", "hidden", "bias_extra", "hidden_b", "hidden_bb", "act", "pre"]
    assert [t.name for t in comparison.first_exceeding()] == ["pre"]
    first = comparison.first_exceeding()[0]
    assert first.op == "MatMul" and first.cosine < 0.99
    assert all(t.cosine > 0.999999 for t in comparison.tensors if t.name != "pre")
    assert "1 tensors past the tolerance" in comparison.render()


def test_layerwise_skips_tensors_not_in_both_graphs(tmp_path):
    renamed = mlp_model()
    for node in renamed.graph.node:
        node.output[:] = ["act_renamed" if o == "act" else o for o in node.output]
        node.input[:] = ["act_renamed" if i == "act" else i for i in node.input]
    reference = save(mlp_model(), tmp_path / "a" / "model.onnx")
    candidate = save(renamed, tmp_path / "b" / "model.onnx")
    feeds = {"x": np.ones((1, 2, 16), np.float32)}
    comparison = compare_layers(reference, candidate, feeds, Tolerance())
    assert comparison.skipped["not in both graphs"] == 1
    assert "act" not in [t.name for t in comparison.tensors] and comparison.compared == 6


# --- sweeps, memory, progress --------------------------------------------------------------


def test_sweeps_give_one_latency_per_value(tiny_run):
    _, report, _ = tiny_run
    for stage in report.stages:
        assert [lat.batch_size for lat in stage.latency if lat.sweep is None] == [1, 4]
        batch = stage.sweep("batch")
        assert [lat.sweep_value for lat in batch] == [1, 2, 4, 8]
        assert [lat.shape["x"] for lat in batch] == [[b, 4, 16] for b in (1, 2, 4, 8)]
        sequence = stage.sweep("sequence")
        assert [lat.shape["x"] for lat in sequence] == [[1, s, 16] for s in (2, 8, 16)]
        # A point on the very inputs of a headline figure is that figure; the others are timed 2 times.
        headline = {str(lat.shape) for lat in stage.latency if lat.sweep is None}
        assert all(lat.throughput > 0 for lat in batch + sequence)
        assert all(lat.iterations == 2 for lat in batch + sequence if str(lat.shape) not in headline)
        assert any(str(lat.shape) in headline for lat in batch)


def test_sweep_must_name_a_dim_and_stay_in_its_range(tmp_path):
    base = mlp_recipe(tmp_path / "m.onnx", tmp_path / "run")
    with pytest.raises(RecipeError, match="evaluate.sweep names dim 'sequnce'.*did you mean 'sequence'"):
        parse_recipe({**base, "evaluate": {"sweep": {"sequnce": [2]}}})
    with pytest.raises(RecipeError, match=r"evaluate.sweep.sequence: \[32\] outside the dim's range 2..16"):
        parse_recipe({**base, "evaluate": {"sweep": {"sequence": [4, 32]}}})
    assert parse_recipe({**base, "evaluate": {"sweep": {"batch": "pow2"}}}).sweep_values("batch") == [1, 2, 4, 8]


def test_resize_dim_cuts_or_repeats_real_values():
    array = np.arange(6).reshape(1, 3, 2)
    assert resize_dim(array, [1], 2).tolist() == [[[0, 1], [2, 3]]]
    assert resize_dim(array, [1], 5)[0, :, 0].tolist() == [0, 2, 4, 0, 2]


def test_peak_memory_sees_an_allocation():
    with PeakMemory() as peak:
        block = np.ones(64 * 1024 * 1024 // 8)  # 64 MiB, touched
        del block
    assert peak.result().host_rss_bytes >= 48 * 1024 * 1024
    assert peak.result().device_bytes is None


def test_every_stage_reports_peak_memory_and_progress(tiny_run):
    _, report, recorder = tiny_run
    assert all(s.memory is not None and s.memory.host_rss_bytes is not None for s in report.stages)
    steps = [e for e in recorder.events if e[0] == "step"]
    assert ("step", "latency batch 4", 3, 3) in steps
    assert any(task.startswith("sequence sweep 1x16x16") for _, task, _, _ in steps)


def test_int8_stage_diff_and_layers_on_a_qdq_model(tmp_path):
    """A QDQ INT8 model (ORT quantize_static): int8 weight bytes, Q/DQ ops added, and the layer-wise
    view matches the float tensors both graphs share while skipping the Q/DQ tensors."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    reference = save(mlp_model(), tmp_path / "fp32" / "model.onnx")
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((2, 4, 16)).astype(np.float32)} for _ in range(8)]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(batches)

        def get_next(self):
            return next(self.items, None)

    int8_path = tmp_path / "int8" / "model.onnx"
    int8_path.parent.mkdir()
    quantize_static(str(reference), str(int8_path), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    before, after = describe_graph(onnx.load(str(reference))), describe_graph(onnx.load(str(int8_path)))
    diff = graph_diff(before, after)
    assert diff["ops_added"]["QuantizeLinear"] > 0 and diff["ops_added"]["DequantizeLinear"] > 0
    assert diff["bytes_by_dtype"]["int8"][1] >= (16 * 32 + 32 * 8)  # both MatMul weights stored as int8
    assert after["precision_mix"]["int8"] > 0.5
    comparison = compare_layers(reference, int8_path, batches[0], Tolerance(cosine_min=0.99))
    assert comparison.skipped["not in both graphs"] > 0  # the Q/DQ outputs exist only in the INT8 graph
    assert {"hidden", "act", "pre"} <= {t.name for t in comparison.tensors}
    by_name = {t.name: t for t in comparison.tensors}
    assert 0.999 < by_name["pre"].cosine < 0.99999  # quantization error: visible, small (0.99969 measured)
    assert not comparison.exceeding
    # The quantizer folded the Relu into the next QuantizeLinear and gave its name to the Add before it:
    # same name, another value. It is listed apart, never as where the error starts.
    assert (by_name["act"].reference_op, by_name["act"].op) == ("Relu", "Add")
    assert comparison.exceeding_other_producer == [by_name["act"]]
    assert "Relu->Add" in comparison.render()
