"""The precision a checkpoint comes in. Stored in half precision (bfloat16, float16: how most hub decoders and many encoders ship) load,
export and compile from float32, the precision every pass starts from, and the stage record says so.

They used to fail in the export and the eager row alike with "Got unsupported ScalarType BFloat16; make `inputs`
match what its forward() takes": numpy has no bfloat16, and the advice named the wrong thing. A checkpoint
quantized already (GPTQ, AWQ..., or a torch.ao quantized module) has no float weights to start from: refused in one
line, by compile and init. An ONNX source in bfloat16, which ORT's CPU kernels cannot load, says that, not "export
the model again"."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from helpers_recipes import compile_recipe, small_recipe  # noqa: E402
from optpipe.recipe.schema import DimRange, FactoryModel, HFConfigModel, HFModel, InputSpec, ModelSource  # noqa: E402
from optpipe.source.checkpoint_precision import as_float32  # noqa: E402
from optpipe.source.model_source import load_torch_model  # noqa: E402

SMALL_BERT = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=100)
INPUTS = (InputSpec(name="input_ids", dtype="int64", shape=["batch", "sequence"], range=(0, 100)),)
DIMS = {"batch": DimRange(min=1, opt=1, max=4), "sequence": DimRange(min=1, opt=8, max=16)}


def _folder(tmp_path: Path, dtype) -> tuple[Path, object]:
    """A tiny BERT classifier saved in `dtype`; returns its folder and the same weights widened by hand."""
    torch.manual_seed(0)
    config = transformers.BertConfig(**SMALL_BERT, architectures=["BertForSequenceClassification"])
    model = transformers.BertForSequenceClassification(config).to(dtype).eval()
    folder = tmp_path / f"bert-{str(dtype).removeprefix('torch.')}"
    model.save_pretrained(folder)
    return folder, model.float()


def _source(tmp_path: Path, model) -> ModelSource:
    return ModelSource(INPUTS, DIMS, model, tmp_path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_folder_loads_as_float32_with_the_same_values(tmp_path, dtype):
    folder, widened_by_hand = _folder(tmp_path, getattr(torch, dtype))
    loaded = load_torch_model(_source(tmp_path, HFModel(hf=str(folder), task="sequence-classification")))
    assert {p.dtype for p in loaded.module.parameters()} == {torch.float32}
    assert f"weights stored in {dtype}, widened to float32: exact" in loaded.description
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.no_grad():
        ours, theirs = loaded.module(ids)[0], widened_by_hand(input_ids=ids).logits
    assert torch.equal(ours, theirs)  # widening is exact: not close, equal


def test_a_config_asking_for_bfloat16_builds_a_float32_model(tmp_path):
    loaded = load_torch_model(_source(tmp_path, HFConfigModel(
        hf_config={"model_type": "bert", "dtype": "bfloat16", **SMALL_BERT}, task="sequence-classification")))
    assert {p.dtype for p in loaded.module.parameters()} == {torch.float32}
    assert "weights stored in bfloat16" in loaded.description


def test_a_factory_returning_a_half_module_is_widened_and_a_float32_one_left_alone():
    half = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).half()
    half[1].bias.data = half[1].bias.data.bfloat16()
    assert as_float32(half) == "bfloat16/float16"
    assert {p.dtype for p in half.parameters()} == {torch.float32}
    plain = torch.nn.Linear(4, 3)
    plain.register_buffer("steps", torch.zeros(2, dtype=torch.float64))
    assert as_float32(plain) is None and plain.steps.dtype == torch.float64  # no half weight: untouched
    double = torch.nn.Linear(4, 3).double()
    assert as_float32(double) == "float64" and {p.dtype for p in double.parameters()} == {torch.float32}


DOUBLE_MODEL = '''import torch


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).double().eval()
'''


def test_a_float64_module_is_narrowed_by_init_and_compile_and_both_say_so(tmp_path, cli_run, monkeypatch):
    """A `.double()` module: init inferred no input (float32 data against float64 weights) and the recipe schema takes
    no float64 input, so nothing could compile it. Now its weights are narrowed to float32, and both say it."""
    (tmp_path / "double_model.py").write_text(DOUBLE_MODEL)
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "double_model:build", "-o", "recipe.yaml")
    assert result.exit_code == 0, result.output
    assert "its weights are float64: the compile narrows them to float32 (rounded)" in result.output
    (spec,) = yaml.safe_load(Path("recipe.yaml").read_text())["inputs"]
    assert spec["dtype"] == "float32" and spec["shape"][1:] == [16], spec
    compiled = compile_recipe(tmp_path, cli_run, small_recipe({"factory": "double_model:build", "path": "."}))
    assert compiled.exit_code == 0, compiled.output
    report = yaml.safe_load((tmp_path / "run" / "report.json").read_text())
    export = {s["name"]: s for s in report["stages"]}["export"]
    assert export["status"] == "ok" and "narrowed to float32: rounded" in json.dumps(export["info"])


def test_a_bfloat16_folder_compiles_and_init_says_it_is_widened(tmp_path, cli_run, monkeypatch):
    folder, _ = _folder(tmp_path, torch.bfloat16)
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", folder.name, "-o", "recipe.yaml")
    assert result.exit_code == 0, result.output
    assert "its weights are bfloat16: the compile widens them to float32" in result.output
    recipe = yaml.safe_load(Path("recipe.yaml").read_text())
    ids = np.random.default_rng(0).integers(0, 100, (4, 8))
    np.savez("ids.npz", **{entry["name"]: ids if entry["name"] == "input_ids" else np.zeros_like(ids) + (entry["name"] == "attention_mask")
                          for entry in recipe["inputs"]})
    recipe.update(data={"eval": {"source": "npz", "path": "ids.npz", "samples": 4}},
                  stages={"export": {"pass": "export"}, "fp16": {"pass": "fp16", "after": "export"}},
                  evaluate={"batch_sizes": [1], "warmup": 1, "iterations": 2, "tolerance": {"cosine_min": 0.99}})
    Path("recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    compiled = cli_run("compile", "recipe.yaml")
    assert compiled.exit_code == 0, compiled.output
    assert "Loading weights" not in compiled.output  # transformers' tqdm bar stays out of the console's lines
    report = yaml.safe_load((tmp_path / recipe["output"] / "report.json").read_text())  # JSON is YAML
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["pytorch-eager"]["status"] == "ok" and stages["export"]["status"] == "ok"
    assert "widened to float32" in stages["export"]["info"]["source"]


AUTOCAST_MODEL = '''import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.a(x)


def build():
    torch.manual_seed(0)
    return Net().eval()
'''


def test_a_model_computing_in_bfloat16_is_measured_and_its_export_refusal_names_the_cast(tmp_path, cli_run):
    """Float32 weights, an autocast region in forward: eager's bfloat16 outputs are read (widened; numpy has no
    bfloat16), and the export's failure (ONNX Runtime has no bfloat16 Gemm on CPU) says why and what to change,
    not 'raise check_atol' or 'make the dims fixed'."""
    (tmp_path / "autocast_model.py").write_text(AUTOCAST_MODEL)
    result = compile_recipe(tmp_path, cli_run, small_recipe({"factory": "autocast_model:build", "path": "."}))
    assert result.exit_code == 1, result.output
    assert "the model computes in bfloat16 (autocast or a cast in forward)" in result.output
    assert "take the autocast or the cast out of forward" in result.output and "check_atol" not in result.output
    report = yaml.safe_load((tmp_path / "run" / "report.json").read_text())
    assert {s["name"]: s["status"] for s in report["stages"]}["pytorch-eager"] == "ok"


def test_a_checkpoint_quantized_already_is_refused_by_compile_and_init(tmp_path, cli_run, monkeypatch):
    import json

    folder, _ = _folder(tmp_path, torch.float16)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"quantized already \(awq, 4 bits.*give the float checkpoint"):
        load_torch_model(_source(tmp_path, HFModel(hf=str(folder), task="sequence-classification")))
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", folder.name, "-o", "recipe.yaml")
    assert result.exit_code == 2 and "quantized already (awq, 4 bits" in result.output, result.output
    assert not Path("recipe.yaml").exists()


QUANTIZED_MODULE = '''import torch


def build():
    net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    return torch.ao.quantization.quantize_dynamic(net, {torch.nn.Linear}, dtype=torch.qint8)
'''


def test_a_module_quantized_by_torch_ao_is_refused_naming_its_quantized_layers(tmp_path):
    (tmp_path / "ao_quantized.py").write_text(QUANTIZED_MODULE)
    inputs = (InputSpec(name="x", dtype="float32", shape=["batch", 16]),)
    source = ModelSource(inputs, {"batch": DimRange(min=1, opt=1, max=2)},
                         FactoryModel(factory="ao_quantized:build", path="."), tmp_path)
    with pytest.raises(Exception, match=r"quantized in PyTorch already \(torch\.ao\.nn\.quantized.*Linear"):
        load_torch_model(source)


def test_an_onnx_source_in_bfloat16_is_refused_with_its_cause(tmp_path, cli_run):
    import onnx
    from onnx import TensorProto, helper

    weight = helper.make_tensor("w", TensorProto.BFLOAT16, [16, 8], vals=np.ones(128, np.float32).tolist())
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16), helper.make_node("MatMul", ["xb", "w"], ["yb"]),
         helper.make_node("Cast", ["yb"], ["y"], to=TensorProto.FLOAT)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), tmp_path / "bf16.onnx")
    result = compile_recipe(tmp_path, cli_run, small_recipe({"onnx": "bf16.onnx"}))
    assert result.exit_code == 2, result.output
    assert "it computes in bfloat16" in result.output and "export it in float32" in result.output
    assert "export the model again" not in result.output
