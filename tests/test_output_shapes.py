"""Outputs that are not one row per sample: a 0-d output (a loss, a score of the whole batch), a mean over the
batch, and a length that depends on the data (the scores past a threshold, as a detector's NMS keeps boxes).
Each compiled with every stage failing as "internal error", or was served by Triton as if it were per sample."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("torch")

from helpers_recipes import compile_recipe, small_recipe  # noqa: E402
from optpipe.core.runtime import join_batches  # noqa: E402
from optpipe.evaluation.accuracy import compare  # noqa: E402
from optpipe.recipe.schema import Tolerance  # noqa: E402

MODELS = '''import torch


class Loss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x).pow(2).mean()


class PastThreshold(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 1024)

    def forward(self, x):
        s = self.fc(x).flatten()
        return s[s > 0.0]


class BatchMean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.fc(x).mean(0), self.fc(x)


class AcrossBatch(torch.nn.Module):  # nn.MultiheadAttention on a 2-d input: the first dim is its sequence
    def __init__(self):
        super().__init__()
        self.att, self.fc = torch.nn.MultiheadAttention(16, 2), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.att(x, x, x)[0])


def across_batch():
    torch.manual_seed(0)
    return AcrossBatch().eval()


def batch_mean():
    torch.manual_seed(0)
    return BatchMean().eval()


def loss():
    torch.manual_seed(0)
    return Loss().eval()


def past_threshold():
    torch.manual_seed(0)
    return PastThreshold().eval()
'''


def _compile(tmp_path, cli_run, factory: str, stages: dict, module: str = "", **top):
    module = f"shapes_{module or factory}"  # one module name per test: a factory is imported from its recipe's folder only
    (tmp_path / f"{module}.py").write_text(MODELS)
    recipe = small_recipe({"factory": f"{module}:{factory}", "path": "."}, stages=stages, samples=16)
    result = compile_recipe(tmp_path, cli_run, {**recipe, **top})
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    return result, {s["name"]: s for s in report["stages"]}


def test_a_0d_output_is_one_value_per_batch_through_every_runtime(tmp_path, cli_run):
    stages = {"export": {"pass": "export"}, "simplify": {"pass": "simplify", "after": "export"},
              "int8": {"pass": "int8", "after": "simplify", "params": {"mode": "dynamic"}},
              "ov-fp32": {"pass": "openvino", "after": "simplify", "params": {"precision": "fp32"}}}
    result, rows = _compile(tmp_path, cli_run, "loss", stages)
    assert result.exit_code == 0, result.output
    assert "internal error" not in result.output
    for name in ("pytorch-eager", "export", "simplify", "int8", "ov-fp32"):
        assert rows[name]["status"] == "ok", (name, rows[name].get("reason"))
    assert rows["ov-fp32"]["accuracy"]["outputs"][0]["cosine_min"] > 0.9999


def test_a_stage_that_changes_a_data_dependent_length_is_out_of_tolerance_not_an_error(tmp_path, cli_run):
    """Unguarded dynamic int8 moves thousands of scores by ~1e-2: some cross the threshold, and the output's length
    changes. That is the stage's verdict (both shapes named), and report.json reads back (its errors are infinite)."""
    stages = {"export": {"pass": "export"},
              "int8": {"pass": "int8", "after": "export", "params": {"mode": "dynamic", "guard": False}}}
    result, rows = _compile(tmp_path, cli_run, "past_threshold", stages,
                            targets=[{"kind": "triton", "stages": ["export"]}])
    assert result.exit_code == 0, result.output
    assert rows["export"]["status"] == "ok"
    int8 = rows["int8"]
    assert int8["verdict"] == "out-of-tolerance", int8["accuracy"]
    violation = int8["accuracy"]["violations"][0]  # and the guard's record of the same
    assert "has shape [" in violation and "where the reference's is [" in violation and "depends on the data" in violation
    assert int8["accuracy"]["outputs"][0]["max_abs"] == "Infinity"
    assert cli_run("report", str(tmp_path / "run")).exit_code == 0
    # Triton would split the joined requests' output as if it were one row per sample: served unbatched.
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    (triton,) = [t for t in report["targets"] if t["kind"] == "triton"]
    assert triton["details"]["max_batch_size"] == 0 and "not the batch dim 'batch'" in triton["details"]["unbatched"]
    config = next((tmp_path / "run").rglob("config.pbtxt")).read_text()
    assert "max_batch_size: 0" in config and "dynamic_batching" not in config


def test_outputs_of_unlike_shapes_name_both_and_leave_the_others_compared():
    ref = {"kept": np.arange(11, dtype=np.float32), "logits": np.ones((4, 3), np.float32)}
    cand = {"kept": np.arange(10, dtype=np.float32), "logits": np.ones((4, 3), np.float32)}
    accuracy = compare(cand, ref, {}, Tolerance(cosine_min=0.99, max_abs=1e-3), "export")
    assert not accuracy.within_tolerance
    assert accuracy.violations == ["output 'kept' has shape [10] where the reference's is [11]: its size depends on the data "
                                   "(a threshold, a filter, NMS) and this stage changed which values pass it"]
    assert accuracy.outputs[1].cosine_min == pytest.approx(1.0) and accuracy.outputs[1].shapes is None


def test_an_output_of_another_rank_is_a_changed_layout_not_a_length_of_the_data():
    """OpenVINO converted an FFT's magnitude ([32, 17]) to [32, 17, 1]: no threshold moved there."""
    ref, cand = {"mag": np.ones((32, 17), np.float32)}, {"mag": np.ones((32, 17, 1), np.float32)}
    (violation,) = compare(cand, ref, {}, Tolerance(cosine_min=0.99), "simplify").violations
    assert violation == ("output 'mag' has shape [32, 17, 1] where the reference's is [32, 17]: this stage changed the output's "
                         "layout (a dim added, dropped or moved)")
    two = compare({"mag": np.ones((8, 16), np.float32)}, ref, {}, Tolerance(cosine_min=0.99), "simplify").violations[0]
    assert "changed the output's layout" in two  # two dims apart: no single length that the data decides


def test_a_complex_output_is_refused_by_the_export_in_one_line(tmp_path, cli_run):
    """ONNX holds no complex tensor: dynamo wrote it as a last dim of 2 and the check blamed "a size that depends on
    the data", then the TorchScript exporter refused the FFT, its Torch IR graph printed on the terminal from C++."""
    module = "shapes_complex"
    (tmp_path / f"{module}.py").write_text(
        "import torch\n\n\nclass Spectrum(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = torch.nn.Linear(16, 16)\n\n    def forward(self, x):\n        return torch.fft.rfft(self.fc(x))\n\n\n"
        "def spectrum():\n    return Spectrum().eval()\n")
    recipe = small_recipe({"factory": f"{module}:spectrum", "path": "."}, stages={"export": {"pass": "export"}})
    result = compile_recipe(tmp_path, cli_run, recipe)
    assert result.exit_code == 2, result.output
    assert "output 'output' of forward() is complex (complex64)" in result.output and "view_as_real" in result.output
    assert "Torch IR graph" not in result.output and "def forward" not in result.output


def test_the_torchscript_exporters_native_prints_go_to_the_stage_log(tmp_path, cli_run):
    """Its C++ log writes the whole Torch IR graph on file descriptor 1 when an op does not convert (aten::fft_rfft)."""
    module = "shapes_magnitude"
    (tmp_path / f"{module}.py").write_text(
        "import torch\n\n\ndef magnitude():\n    torch.manual_seed(0)\n    fc = torch.nn.Linear(16, 16)\n"
        "    return Magnitude(fc).eval()\n\n\n"
        "class Magnitude(torch.nn.Module):\n    def __init__(self, fc):\n        super().__init__()\n        self.fc = fc\n\n"
        "    def forward(self, x):\n        return torch.fft.rfft(self.fc(x)).abs()\n")
    stages = {"export": {"pass": "export", "params": {"exporter": "torchscript"}}}
    result = compile_recipe(tmp_path, cli_run, small_recipe({"factory": f"{module}:magnitude", "path": "."}, stages=stages))
    assert result.exit_code == 1 and "aten::fft_rfft" in result.output, result.output
    assert "Torch IR graph" not in result.output
    assert "Torch IR graph at exception" in (tmp_path / "run" / "logs" / "export.log").read_text()


def test_join_batches_keeps_one_element_per_batch_of_a_0d_output():
    joined = join_batches([{"loss": np.float32(1.5), "y": np.ones((2, 3))}, {"loss": np.float32(2.5), "y": np.ones((1, 3))}])
    assert joined["loss"].tolist() == [1.5, 2.5] and joined["y"].shape == (3, 3)


def test_the_openvino_guards_subset_of_batches_reads_the_reference_batch_by_batch_for_unbatched_outputs():
    from optpipe.calibration.dataset import SampleSet
    from passes._openvino_guard import subset_accuracy

    batches = [{"x": np.full((2, 1), float(i), np.float32)} for i in range(3)]
    per_batch = [{"loss": np.float32(i + 1.0), "y": b["x"] * 2} for i, b in enumerate(batches)]
    eval_set = SampleSet({"x": np.concatenate([b["x"] for b in batches])}, key="three batches")
    ctx = SimpleNamespace(eval_set=lambda: eval_set, stage="ov-int8",
                          tolerance=Tolerance(cosine_min=0.99), evaluate=SimpleNamespace(top1=None, task=None))
    check = SimpleNamespace(batch_size=2, batches=batches, ctx=ctx, reference=lambda: join_batches(per_batch),
                            reference_batches=lambda: per_batch)
    picked = [2, 0]
    same = subset_accuracy(check, picked, [per_batch[i] for i in picked])
    assert same.within_tolerance and [o.max_abs for o in same.outputs] == [0.0, 0.0]
    off = subset_accuracy(check, picked, [{**per_batch[i], "loss": np.float32(-1.0)} for i in picked])
    assert not off.within_tolerance and "loss" in off.violations[0]


def test_the_torchscript_export_labels_only_per_sample_outputs_with_the_batch_dim(tmp_path, cli_run):
    """The tracer's outputs were all labelled [batch, ...]: a mean over the batch ([8]) too, which Triton then batched."""
    import onnx

    stages = {"export": {"pass": "export", "params": {"exporter": "torchscript"}}}
    result, rows = _compile(tmp_path, cli_run, "batch_mean", stages, targets=[{"kind": "triton", "stages": ["export"]}])
    assert result.exit_code == 0, result.output
    assert rows["export"]["status"] == "ok"
    graph = onnx.load(str(next((tmp_path / "run" / "stages" / "export").glob("*.onnx"))), load_external_data=False).graph
    dims = [[d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in graph.output]
    assert dims == [[8], ["batch", 8]]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    (triton,) = report["targets"]
    assert triton["details"]["max_batch_size"] == 0
    assert triton["details"]["unbatched"] == "output 'output_0' leads with 8, not the batch dim 'batch': served unbatched (max_batch_size 0)"


def test_a_batch_size_asked_for_an_output_that_is_not_per_sample_is_refused_in_one_line(tmp_path, cli_run):
    stages = {"export": {"pass": "export"}}
    targets = [{"kind": "triton", "stages": ["export"], "params": {"max_batch_size": 4}}]
    result, rows = _compile(tmp_path, cli_run, "past_threshold", stages, module="asked_batch", targets=targets)
    assert rows["export"]["status"] == "ok"
    assert result.exit_code == 1, result.output
    assert ("targets (triton): max_batch_size 4 cannot be served: output 'output' leads with 'u0', not the batch dim "
            "'batch'; set max_batch_size: 0") in result.output


def test_a_model_that_mixes_the_samples_of_a_batch_is_said_and_served_unbatched(tmp_path, cli_run):
    """Rows of [batch, 4] that attend to each other read "ok" with no word: figures "at batch 8" were 8 samples computed
    together, and Triton's dynamic batching would have joined users' requests into one attention."""
    stages = {"export": {"pass": "export"}}
    result, rows = _compile(tmp_path, cli_run, "across_batch", stages, targets=[{"kind": "triton", "stages": ["export"]}])
    assert result.exit_code == 0, result.output
    mixed = rows["export"]["info"]["samples_mixed"]
    assert mixed["output"] == "output" and "output 'output' of sample 0 differs by" in mixed["why"]
    assert any("not a batch of independent samples" in w for w in rows["export"]["warnings"])
    (triton,) = json.loads((tmp_path / "run" / "report.json").read_text())["targets"]
    assert triton["details"]["max_batch_size"] == 0 and "mixes the samples of a batch" in triton["details"]["unbatched"]


def test_per_sample_models_read_no_mixing(tmp_path, cli_run):
    result, rows = _compile(tmp_path, cli_run, "batch_mean", {"export": {"pass": "export"}}, module="per_sample")
    assert result.exit_code == 0, result.output
    assert "samples_mixed" not in rows["export"]["info"]  # its per-sample output matches; the mean over the batch is [8]


def test_a_batch_dim_behind_the_first_is_refused_with_the_recipe(tmp_path, cli_run):
    """[sequence, batch] (nn.LSTM without batch_first): the sequence was taken for the batch, silently."""
    (tmp_path / "seq_first.py").write_text(MODELS)
    recipe = small_recipe({"factory": "seq_first:loss", "path": "."}, inputs=[{"name": "x", "dtype": "float32", "shape": ["sequence", "batch"]}],
                          dims={"sequence": {"min": 1, "opt": 4, "max": 8}, "batch": {"min": 1, "opt": 1, "max": 4}})
    result = compile_recipe(tmp_path, cli_run, recipe)
    assert result.exit_code == 2, result.output
    assert "inputs.0 ('x') has the dim 'batch' at position 1: optpipe takes every input's first dim as the batch" in result.output


@pytest.mark.parametrize("forward,said", [
    (lambda fc, x: fc(x), None),
    (lambda fc, x: fc(x).squeeze(), "output 'y' is [4] for one sample and [2, 4] for 2 (a squeeze() of the batch dim?)"),
    (lambda fc, x: fc(x) - fc(x).mean(0), "output 'y' of sample 0 differs by"),
    (lambda fc, x: fc(x) @ fc(x).T, "output 'y' per sample is [1] alone and [2] in a batch of 2"),
])
def test_samples_mixed_tells_each_way_a_batch_is_not_independent(forward, said):
    import numpy as np
    import torch

    from optpipe.passes._batch_independence import samples_mixed
    from optpipe.passes._eager_reference import eager_as_exported
    from optpipe.source.model_source import TorchModel

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 4)

        def forward(self, x):
            return forward(self.fc, x)

    torch.manual_seed(0)
    model = TorchModel(Net().eval(), ["x"], ["y"], "net")
    feeds = {"x": np.random.default_rng(0).normal(size=(2, 16)).astype(np.float32)}
    with torch.no_grad():
        together = {"y": model.module(torch.from_numpy(feeds["x"])).numpy()}
    mixed = samples_mixed(eager_as_exported(model, threads=1), feeds, together, atol=1e-3, rtol=1e-3)
    assert (mixed is None) if said is None else said in mixed["why"], mixed


def test_an_onnx_source_that_mixes_the_samples_of_a_batch_is_said_and_served_unbatched(tmp_path, cli_run):
    """The same check with ONNX Runtime as the model: a graph whose rows attend to each other (a softmax over the batch)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Softmax", ["h"], ["y"], axis=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), tmp_path / "mixing.onnx")
    recipe = small_recipe({"onnx": "mixing.onnx"}, samples=8)
    result = compile_recipe(tmp_path, cli_run, {**recipe, "targets": [{"kind": "triton", "stages": ["export"]}]})
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    export = next(s for s in report["stages"] if s["name"] == "export")
    assert "output 'y' of sample 0 differs by" in export["info"]["samples_mixed"]["why"]
    assert report["targets"][0]["details"]["max_batch_size"] == 0


def test_inputs_with_a_fixed_first_dim_the_model_refuses_one_row_of_are_refused_as_no_batch(tmp_path, cli_run):
    """`shape: [16]` for a Linear(16) (the batch dim left out): optpipe took 16 samples of one value, its figures read
    "@ batch 16" and NNCF's calibration failed ("iteration over a 0-d tensor")."""
    (tmp_path / "no_batch.py").write_text(MODELS)
    recipe = small_recipe({"factory": "no_batch:loss", "path": "."}, inputs=[{"name": "x", "dtype": "float32", "shape": [16]}], dims={})
    result = compile_recipe(tmp_path, cli_run, recipe)
    assert result.exit_code == 2, result.output
    assert ("inputs: 'x' [16] leads with a fixed 16 and no batch dim, and the model refuses one row of it alone" in result.output
            and "give each input a leading batch dim (shape: [batch, ...] with dims.batch)" in result.output)


def test_a_fixed_batch_is_checked_as_a_batch(tmp_path, cli_run):
    """[4, 16] with no dim named: a fixed batch. Taken as it is where samples are independent; said where they mix."""
    (tmp_path / "fixed_batch.py").write_text(MODELS)
    for factory, mixes in (("batch_mean", False), ("across_batch", True)):
        recipe = small_recipe({"factory": f"fixed_batch:{factory}", "path": "."}, inputs=[{"name": "x", "dtype": "float32", "shape": [4, 16]}],
                              dims={}, stages={"export": {"pass": "export"}})
        result = compile_recipe(tmp_path, cli_run, recipe)
        assert result.exit_code == 0, result.output
        export = next(s for s in json.loads((tmp_path / "run" / "report.json").read_text())["stages"] if s["name"] == "export")
        assert ("samples_mixed" in export["info"]) is mixes
