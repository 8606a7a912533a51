"""A forward that draws random numbers is refused by the export, saying so (passes/export.py).

Every stage is measured against eager, which such a model cannot match even against itself; the export's
check used to fail with 'raise check_atol/check_rtol only if this is rounding', which cannot help."""
from __future__ import annotations

import json

import pytest

from helpers_recipes import compile_recipe, small_recipe

MODELS = '''import torch


class Noisy(torch.nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.a, self.b, self.dropout = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4), dropout

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.dropout:
            return self.b(torch.nn.functional.dropout(h, 0.3, training=True))  # MC dropout: on in eval mode
        return self.b(h + 0.5 * torch.randn_like(h))


def noise():
    torch.manual_seed(0)
    return Noisy(False).eval()


def dropout():
    torch.manual_seed(0)
    return Noisy(True).eval()


class Counter(torch.nn.Module):  # streaming state kept between calls: a call counter in a buffer
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * self.calls


def counter():
    return Counter().eval()


class Doubling(torch.nn.Module):  # writes into its input in place: deterministic all the same
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        x.mul_(2.0)
        return self.fc(x)


def doubling():
    torch.manual_seed(0)
    return Doubling().eval()
'''


@pytest.mark.parametrize("factory", ["noise", "dropout"])
def test_a_random_forward_is_refused_naming_the_output_and_the_cause(tmp_path, cli_run, factory):
    (tmp_path / f"noisy_{factory}.py").write_text(MODELS)  # a module per test: an imported one is held to its folder
    result = compile_recipe(tmp_path, cli_run, small_recipe({"factory": f"noisy_{factory}:{factory}", "path": "."}))
    assert result.exit_code == 2, result.output
    assert "forward() gives different outputs on the same inputs (output 'output' differs by" in result.output
    assert "make forward deterministic" in result.output and "check_atol" not in result.output


def test_a_forward_that_updates_its_state_is_refused_naming_the_buffer_not_randomness(tmp_path, cli_run):
    (tmp_path / "stateful_counter.py").write_text(MODELS)
    result = compile_recipe(tmp_path, cli_run, small_recipe({"factory": "stateful_counter:counter", "path": "."}))
    assert result.exit_code == 2, result.output
    assert "it updates state it keeps between calls (buffer 'model.calls')" in result.output
    assert "random numbers" not in result.output


def test_an_onnx_source_that_samples_is_refused_by_compile_and_init(tmp_path, cli_run, monkeypatch):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.ones((16, 8), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("RandomNormalLike", ["h"], ["noise"], scale=0.5),
             helper.make_node("Add", ["h", "noise"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), tmp_path / "noisy.onnx")
    result = compile_recipe(tmp_path, cli_run, small_recipe(
        {"onnx": "noisy.onnx"}, stages={"export": {"pass": "export"}, "simplify": {"pass": "simplify", "after": "export"}}))
    assert result.exit_code == 2 and "'noisy.onnx' draws random numbers (RandomNormalLike)" in result.output, result.output
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "noisy.onnx", "-o", "init.yaml")
    assert result.exit_code == 2 and "draws random numbers" in result.output, result.output
    assert not (tmp_path / "init.yaml").exists()


def test_a_forward_writing_into_its_input_is_measured_on_the_data_as_given(tmp_path, cli_run):
    """torch.from_numpy shares memory: `x.mul_(2)` wrote into the evaluation data, its second run read 2x, and the export
    refused the model as one that "draws random numbers"."""
    (tmp_path / "inplace_doubling.py").write_text(MODELS)
    stages = {"export": {"pass": "export"}, "int8": {"pass": "int8", "after": "export", "params": {"mode": "dynamic"}}}
    result = compile_recipe(tmp_path, cli_run, small_recipe({"factory": "inplace_doubling:doubling", "path": "."}, stages=stages))
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads((tmp_path / "run" / "report.json").read_text())["stages"]}
    eager = rows["pytorch-eager"]["accuracy"]  # eager against the export, on the same (unwritten) data
    assert eager["outputs"][0]["cosine_min"] > 0.99999 and eager["export_mismatch"] is None
    assert rows["int8"]["status"] == "ok"


def test_the_eager_runner_leaves_the_callers_arrays_as_they_were(tmp_path, monkeypatch):
    import numpy as np
    import torch

    from optpipe.core.runtime import eager_runner
    from optpipe.source.model_source import TorchModel

    (tmp_path / "inplace_runner.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import inplace_runner

    model = inplace_runner.doubling()
    run = eager_runner(TorchModel(model, ["x"], ["y"], "doubling"), threads=1)
    x = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    given = x.copy()
    with torch.no_grad():
        expected = model.fc(torch.from_numpy(2 * given)).numpy()
    for _ in range(3):  # the first call finds out, the later ones run on copies
        np.testing.assert_allclose(run({"x": x})["y"], expected, rtol=1e-6)
        assert np.array_equal(x, given)
