"""Export on the model families users bring: structured outputs, tensor-caching heads, decoders with
an LM head (issue 12 point 3). Each model is made here or in tests/family_models.py."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from optpipe.core.errors import ModelSourceError
from optpipe.evaluation.self_check import onnx_outputs
from optpipe.source.model_source import load_torch_model
from optpipe.execution.stage_runner import run_checked
from optpipe.pass_infra.pass_base import PassContext
from optpipe.passes.export import ExportParams, ExportPass
from optpipe.safety.recipe_loading import parse_recipe
from optpipe.core.runtime import eager_runner

TESTS = Path(__file__).resolve().parent
TINY_GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 32}


def _recipe(model: dict, inputs: list[dict], dims: dict | None = None, **extra):
    return parse_recipe({"model": model, "inputs": inputs, "dims": dims or {"batch": {"min": 1, "opt": 2, "max": 4}},
                         "stages": {"export": {"pass": "export"}}, **extra})


def _export(recipe, tmp_path, **params):
    workdir = tmp_path / "export"
    workdir.mkdir()
    ctx = PassContext(model_source=recipe.model_source(), evaluate=recipe.evaluate, stage="export", workdir=workdir, log=logging.getLogger("test"), cache_dir=tmp_path,
                      torch_model=lambda: load_torch_model(recipe.model_source()), eval_set=None, calibration_set=None,
                      tolerance=recipe.evaluate.tolerance)
    return run_checked(ExportPass(ExportParams(**params)), None, ctx)


def _factory(name: str, **kwargs) -> dict:
    return {"factory": f"family_models:{name}", "path": str(TESTS), "kwargs": kwargs}


IMAGE = [{"name": "image", "dtype": "float32", "shape": ["batch", 3, 16, 16]}]
VECTOR = [{"name": "x", "dtype": "float32", "shape": ["batch", 8]}]


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_head_that_caches_tensors_in_forward_exports(tmp_path, exporter):
    """The eager reference runs before export; under inference_mode the cached grid could not be traced."""
    recipe = _recipe(_factory("grid_head"), IMAGE)
    artifact = _export(recipe, tmp_path, exporter=exporter)
    assert artifact.info["exporter"] == exporter
    assert artifact.info["self_check"]["max_abs"] < 1e-4
    feeds = {"image": np.random.default_rng(3).normal(size=(3, 3, 16, 16)).astype(np.float32)}
    got = list(onnx_outputs(artifact.path, feeds).values())[0]
    want = eager_runner(load_torch_model(recipe.model_source()), threads=1)(feeds)["output"]
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_the_eager_reference_leaves_no_inference_tensors_behind():
    model = load_torch_model(_recipe(_factory("grid_head"), IMAGE).model_source())
    eager_runner(model, threads=1)({"image": np.zeros((1, 3, 16, 16), np.float32)})
    assert not model.module.model.grid.is_inference()


def test_dataclass_outputs_are_named_by_field_and_none_is_left_out():
    model = load_torch_model(_recipe(_factory("structured"), VECTOR).model_source())
    assert model.output_names == ["boxes", "scores"]
    out = eager_runner(model, threads=1)({"x": np.ones((2, 8), np.float32)})
    assert out["boxes"].shape == (2, 4) and np.allclose(out["scores"].sum(-1), 1, atol=1e-6)


def test_namedtuple_outputs_are_named_by_field(tmp_path):
    """They were output_0, output_1: `model.outputs: [logits]` failed, and the logits' top-1 was not counted."""
    recipe = _recipe(_factory("structured", named_tuple=True), VECTOR)
    assert load_torch_model(recipe.model_source()).output_names == ["logits", "features"]
    artifact = _export(recipe, tmp_path)
    assert [o.name for o in artifact.load(with_weights=False).graph.output] == ["logits", "features"]


def test_nested_outputs_are_named_by_path_and_chosen_by_name(tmp_path):
    model = load_torch_model(_recipe(_factory("structured", nested=True), VECTOR).model_source())
    assert model.output_names == ["output_0", "output_1.aux"]  # the int leaf is not a tensor
    chosen = _recipe({**_factory("structured", nested=True), "outputs": ["output_1.aux"]}, VECTOR)
    artifact = _export(chosen, tmp_path)
    assert [o.name for o in artifact.load(with_weights=False).graph.output] == ["output_1.aux"]
    assert artifact.info["outputs"] == ["output_1.aux"]


def test_an_unknown_output_name_lists_the_real_ones():
    with pytest.raises(ModelSourceError, match=r"model.outputs: the model has no output 'logits'; its outputs are boxes, scores"):
        load_torch_model(_recipe({**_factory("structured"), "outputs": ["logits"]}, VECTOR).model_source())


TOKENS = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 128]}]
SEQ_DIMS = {"batch": {"min": 1, "opt": 2, "max": 4}, "sequence": {"min": 2, "opt": 8, "max": 32}}


def test_a_decoder_lm_returning_a_model_output_exports_its_logits(tmp_path):
    recipe = _recipe({"hf_config": TINY_GPT2, "task": "causal-lm", "outputs": ["logits"]}, TOKENS, SEQ_DIMS)
    model = load_torch_model(recipe.model_source())
    assert "GPT2LMHeadModel" in model.description and model.output_names == ["logits"]
    artifact = _export(recipe, tmp_path)
    assert artifact.info["exporter"] in ("dynamo", "torchscript") and artifact.info["self_check"]["max_abs"] < 1e-4
    feeds = {"input_ids": np.random.default_rng(0).integers(0, 128, (3, 20)).astype(np.int64)}
    got = onnx_outputs(artifact.path, feeds)["logits"]
    assert got.shape == (3, 20, 128)
    np.testing.assert_allclose(got, eager_runner(model, threads=1)(feeds)["logits"], atol=1e-4)


def test_default_outputs_of_a_causal_lm_have_no_cache():
    model = load_torch_model(_recipe({"hf_config": TINY_GPT2, "task": "causal-lm"}, TOKENS, SEQ_DIMS).model_source())
    assert model.output_names == ["logits"]  # use_cache off: no past_key_values to export


def test_a_task_the_architecture_lacks_is_one_sentence():
    with pytest.raises(ModelSourceError, match="model.task: 'gpt2' has no object-detection head"):
        load_torch_model(_recipe({"hf_config": TINY_GPT2, "task": "object-detection"}, TOKENS, SEQ_DIMS).model_source())


TINY_LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "max_position_embeddings": 32}


@pytest.mark.parametrize("config, said", [
    ({**TINY_LLAMA, "pad_token_id": 500}, "'llama' model .*Padding_idx must be within num_embeddings"),  # nn.Embedding asserts
    ({**TINY_GPT2, "n_head": 3}, "'gpt2' model .*divisible"),  # a ValueError that is not about the task's head
])
def test_a_config_the_architecture_refuses_names_hf_config(config, said):
    """Not an internal error, and not "pick another task": the config's values are what to fix."""
    with pytest.raises(ModelSourceError, match=f"model.hf_config: transformers cannot build a {said}"):
        load_torch_model(_recipe({"hf_config": config, "task": "causal-lm"}, TOKENS, SEQ_DIMS).model_source())


def test_auto_falls_back_to_torchscript_and_says_why(tmp_path, monkeypatch):
    """When dynamo fails, auto exports with TorchScript and records the first failure."""
    from optpipe.passes import export as export_module

    def broken(*args, **kwargs):
        raise RuntimeError("Cannot view a tensor with shape [2, 4] and strides [1, 2] as a tensor with shape [8]")

    monkeypatch.setattr(export_module.exporters, "export_dynamo", broken)
    artifact = _export(_recipe(_factory("structured"), VECTOR), tmp_path)
    assert artifact.info["exporter"] == "torchscript" and artifact.info["exporter_requested"] == "auto"
    assert artifact.info["fallback"]["from"] == ["dynamo"]
    assert "Cannot view a tensor" in artifact.info["fallback"]["reasons"]["dynamo"]


def test_a_gpt2_decoder_fuses_attention_and_keeps_its_size(tmp_path):
    """onnxscript's MHA rule drops GPT-2's flattening Reshape; fuse restores it, and the tied
    embedding (token embedding = LM head) stays one initializer."""
    from optpipe.calibration.dataset import SampleSet
    from optpipe.passes.fuse import FuseParams, FusePass

    recipe = _recipe({"hf_config": TINY_GPT2, "task": "causal-lm"}, TOKENS, SEQ_DIMS)
    exported = _export(recipe, tmp_path, exporter="dynamo")
    samples = SampleSet({"input_ids": np.random.default_rng(1).integers(0, 128, (4, 8)).astype(np.int64)}, "k")
    workdir = tmp_path / "fuse"
    workdir.mkdir()
    ctx = PassContext(model_source=recipe.model_source(), evaluate=recipe.evaluate, stage="fuse", workdir=workdir, log=logging.getLogger("test"), cache_dir=tmp_path,
                      torch_model=lambda: None, eval_set=lambda: samples, calibration_set=None, tolerance=recipe.evaluate.tolerance)
    fused = run_checked(FusePass(FuseParams(transformer="onnxscript")), exported, ctx)
    assert fused.info["fused_ops"].get("MultiHeadAttention") == 1, fused.info["fused_ops"]
    assert fused.info["self_check"]["max_abs"] < 1e-4
    weights = lambda a: sum(t.ByteSize() for t in a.load().graph.initializer)  # noqa: E731
    assert weights(fused) <= weights(exported) * 1.01


def test_a_grid_frozen_at_the_trace_size_is_caught_at_another_size(tmp_path):
    """The cached grid is a constant in the graph: right at the trace size, wrong at every other."""
    from optpipe.core.errors import PassError

    recipe = _recipe(_factory("grid_head"), [{"name": "image", "shape": [1, 3, "size", "size"]}],
                     {"size": {"min": 8, "opt": 16, "max": 32}})
    with pytest.raises(PassError, match=r"wrong at other sizes \(size=8"):
        _export(recipe, tmp_path, exporter="dynamo")


def test_the_report_says_which_exporter_succeeded_and_why_the_first_failed():
    from optpipe.reporting.run_report import export_fallbacks
    from optpipe.core.results import StageResult

    info = {"exporter": "torchscript", "fallback": {"from": ["dynamo"], "reasons": {"dynamo": "Cannot view a tensor"}}}
    stages = [StageResult(name="export", pass_name="export", status="ok", info=info),
              StageResult(name="simplify", pass_name="simplify", status="ok", info={"exporter": "x"})]
    assert export_fallbacks(stages) == ["`export` was exported with torchscript after dynamo: Cannot view a tensor"]
