"""export and simplify on tiny models: dynamic dims, numerics, both exporters, error paths."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import pytest

from optpipe.evaluation.self_check import onnx_outputs
from optpipe.core.errors import ModelSourceError, PassError
from optpipe.execution.stage_runner import run_checked
from optpipe.pass_infra.pass_base import PassContext
from optpipe.passes.export import ExportParams, ExportPass
from optpipe.passes.simplify import SimplifyParams, SimplifyPass
from optpipe.source.model_source import load_torch_model
from optpipe.safety.recipe_loading import load_recipe
from optpipe.core.runtime import eager_runner

TESTS = Path(__file__).resolve().parent

CNN = {
    "model": {"factory": "tiny:build_cnn"},
    "inputs": [{"name": "image", "dtype": "float32", "shape": ["batch", 3, 32, 32]}],
}


def _context(recipe, tmp_path, name="stage") -> PassContext:
    workdir = tmp_path / name
    workdir.mkdir()
    return PassContext(
        model_source=recipe.model_source(), evaluate=recipe.evaluate, stage=name, workdir=workdir, log=logging.getLogger("test"), cache_dir=tmp_path,
        torch_model=lambda: load_torch_model(recipe.model_source()), eval_set=None, calibration_set=None,
        tolerance=recipe.evaluate.tolerance,
    )


def _dims(model: onnx.ModelProto) -> dict[str, list]:
    return {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_export_keeps_dynamic_dims_and_matches_eager(tiny_recipe, tmp_path, exporter):
    recipe = load_recipe(tiny_recipe({"model": {"factory": "tiny:build_cnn"}, "inputs": CNN["inputs"]}))
    artifact = run_checked(ExportPass(ExportParams(exporter=exporter)), None, _context(recipe, tmp_path))
    proto = artifact.load(with_weights=False)
    assert _dims(proto) == {"image": ["batch", 3, 32, 32]}
    assert (artifact.folder / "model.onnx.data").stat().st_size > 10_000, "weights live in external data"
    # Any batch size in range runs and matches eager.
    feeds = {"image": np.random.default_rng(1).normal(size=(5, 3, 32, 32)).astype(np.float32)}
    got = onnx_outputs(artifact.path, feeds)
    want = eager_runner(load_torch_model(recipe.model_source()), threads=1)(feeds)
    np.testing.assert_allclose(list(got.values())[0], want["logits"], atol=1e-4)
    check = artifact.info["self_check"]
    assert check["against"] == "pytorch-eager" and check["passed"] and check["max_abs"] < 1e-4 and check["cosine"] > 0.9999
    assert artifact.info["exporter"] == exporter


def test_export_failure_is_one_sentence_with_a_hint(tiny_recipe, tmp_path):
    recipe = load_recipe(tiny_recipe({"model": {"factory": "failing_models:build_data_dependent", "path": str(TESTS)}}))
    with pytest.raises(PassError) as info:
        ExportPass(ExportParams(exporter="dynamo")).run(None, _context(recipe, tmp_path))
    message = str(info.value)
    assert message.startswith("torch.onnx.export (dynamo):")
    assert "forward() branches on tensor values or shapes" in message and "set `exporter: torchscript` (or `auto`" in message
    assert "model's code" not in message and "\n" not in message


def test_auto_export_that_fails_both_ways_gives_both_reasons_and_no_loop(tiny_recipe, tmp_path):
    """The trace of a data-dependent branch matches eager on the trace inputs only: auto refuses it."""
    recipe = load_recipe(tiny_recipe({"model": {"factory": "failing_models:build_data_dependent", "path": str(TESTS)}}))
    with pytest.raises(PassError) as info:
        ExportPass(ExportParams()).run(None, _context(recipe, tmp_path))
    message = str(info.value)
    assert "(dynamo)" in message and "wrong at other sizes (batch=8" in message and "the trace fixed a branch" in message
    assert "try `exporter" not in message and "set `exporter" not in message


SEQUENCE = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", "seq", 32]}],
    "dims": {"batch": {"min": 1, "opt": 2, "max": 8}, "seq": {"min": 1, "opt": 8, "max": 64}},
}


def _sequence_recipe(tiny_recipe, factory):
    return load_recipe(tiny_recipe({"model": {"factory": f"failing_models:{factory}", "path": str(TESTS)}, **SEQUENCE}))


@pytest.mark.parametrize("exporter", ["auto", "torchscript"])
def test_a_trace_that_matches_eager_at_other_shapes_is_taken_in_every_mode(tiny_recipe, tmp_path, exporter):
    """dynamo fails on the view (dynamic batch x seq); the trace warns of a Python boolean but is right at
    every shape: auto takes it (it used to refuse it for the warning), and both modes say where it was checked."""
    recipe = _sequence_recipe(tiny_recipe, "build_relative_heads")
    artifact = run_checked(ExportPass(ExportParams(exporter=exporter)), None, _context(recipe, tmp_path))
    info = artifact.info
    assert info["exporter"] == "torchscript" and info["trace_branches"], info
    if exporter == "auto":
        assert "Cannot view a tensor" in info["fallback"]["reasons"]["dynamo"]
    shapes = {(c["batch"], c["seq"]) for c in info["checked_shapes"]}
    assert shapes == {(1, 1), (4, 16), (1, 16), (4, 1)} and max(c["max_abs"] for c in info["checked_shapes"]) < 1e-4
    feeds = {"x": np.random.default_rng(5).standard_normal((3, 37, 32)).astype(np.float32)}  # a shape never checked
    want = eager_runner(load_torch_model(recipe.model_source()), threads=1)(feeds)["y"]
    np.testing.assert_allclose(onnx_outputs(artifact.path, feeds)["y"], want, atol=1e-4)


@pytest.mark.parametrize("exporter", ["auto", "torchscript"])
def test_a_trace_wrong_at_another_shape_is_refused_in_every_mode_naming_the_recipe_change(tiny_recipe, tmp_path, exporter):
    recipe = _sequence_recipe(tiny_recipe, "build_length_branch")
    with pytest.raises(PassError) as info:
        ExportPass(ExportParams(exporter=exporter)).run(None, _context(recipe, tmp_path))
    message = str(info.value)
    assert "the torchscript export is wrong at other sizes (batch=4, seq=16" in message, message
    assert "the trace fixed a branch" in message and "; make those dims fixed in `inputs` (a number in place of the dim's name)" in message
    assert "model's code" not in message and "\n" not in message


def _opset(artifact) -> int:
    return next(o.version for o in artifact.load(with_weights=False).opset_import if o.domain in ("", "ai.onnx"))


def test_auto_falls_back_to_torchscript_at_an_opset_dynamo_refuses(tiny_recipe, tmp_path):
    """opset 17 is below dynamo's 18: auto exports with TorchScript at 17 and says why, instead of stopping."""
    recipe = load_recipe(tiny_recipe())
    artifact = run_checked(ExportPass(ExportParams(opset=17)), None, _context(recipe, tmp_path))
    info = artifact.info
    assert info["exporter"] == "torchscript" and info["exporter_requested"] == "auto" and info["self_check"]["passed"]
    assert info["fallback"]["from"] == ["dynamo"] and "needs opset >= 18" in info["fallback"]["reasons"]["dynamo"]
    assert info["opset"] == info["opset_requested"] == 17 == _opset(artifact)


def test_auto_falls_back_when_dynamo_cannot_convert_the_model_and_records_the_opset_written(tiny_recipe, tmp_path):
    """torch.cdist: dynamo fails to convert it, TorchScript exports it, at most at opset 20 (asked: 21)."""
    recipe = load_recipe(tiny_recipe({"model": {"factory": "failing_models:build_pairwise_distances", "path": str(TESTS)}}))
    artifact = run_checked(ExportPass(ExportParams(opset=21)), None, _context(recipe, tmp_path))
    info = artifact.info
    assert info["exporter"] == "torchscript" and info["fallback"]["from"] == ["dynamo"], info.get("fallback")
    assert info["fallback"]["reasons"]["dynamo"].startswith("torch.onnx.export (dynamo):")
    assert info["opset_requested"] == 21 and info["opset"] == 20 == _opset(artifact)
    feeds = {"x": np.random.default_rng(3).standard_normal((5, 32)).astype(np.float32)}  # a batch the trace never saw
    expected = eager_runner(load_torch_model(recipe.model_source()), threads=1)(feeds)["d"]
    np.testing.assert_allclose(onnx_outputs(artifact.path, feeds)["d"], expected, atol=1e-4)


def test_dynamo_asked_for_below_its_opset_is_a_recipe_error(tiny_recipe, cli_run):
    path = tiny_recipe({"stages": {"export": {"pass": "export", "params": {"exporter": "dynamo", "opset": 17}}}})
    for command in ("validate", "compile"):
        result = cli_run(command, str(path))
        assert result.exit_code == 2, result.output
        [line] = result.output.strip().splitlines()
        assert "stages.export.params" in line and "needs opset >= 18" in line


def test_auto_does_not_swallow_memory_errors_or_model_errors(tiny_recipe, tmp_path, monkeypatch):
    from optpipe.passes import export as export_module

    recipe = load_recipe(tiny_recipe())
    wrapped = RuntimeError("torch.onnx.export failed")  # how torch.onnx reports a Ctrl-C during its export
    wrapped.__context__ = KeyboardInterrupt()
    for error in (MemoryError(), KeyboardInterrupt(), wrapped, ModelSourceError("the model's forward() refuses these inputs")):
        def failing(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(export_module.exporters, "export_dynamo", failing)
        with pytest.raises(KeyboardInterrupt if error is wrapped else type(error)):
            ExportPass(ExportParams()).run(None, _context(recipe, tmp_path, f"stage-{id(error)}"))


def test_onnx_source_is_imported(tiny_recipe, tmp_path):
    recipe = load_recipe(tiny_recipe())
    exported = ExportPass(ExportParams()).run(None, _context(recipe, tmp_path, "first"))
    onnx_recipe = load_recipe(tiny_recipe({"model": None}, model={"onnx": str(exported.path)}, name="onnx.yaml"))
    imported = ExportPass(ExportParams()).run(None, _context(onnx_recipe, tmp_path, "second"))
    assert imported.info["imported"] == str(exported.path)
    assert _dims(imported.load(with_weights=False)) == {"x": ["batch", 32]}
    feeds = {"x": np.ones((3, 32), np.float32)}
    np.testing.assert_array_equal(list(onnx_outputs(imported.path, feeds).values())[0],
                                  list(onnx_outputs(exported.path, feeds).values())[0])


def test_onnx_source_with_other_inputs_is_refused(tiny_recipe, tmp_path):
    recipe = load_recipe(tiny_recipe())
    exported = ExportPass(ExportParams()).run(None, _context(recipe, tmp_path, "first"))
    wrong = load_recipe(tiny_recipe(
        {"model": None}, model={"onnx": str(exported.path)},
        inputs=[{"name": "pixels", "dtype": "float32", "shape": ["batch", 32]}], name="wrong.yaml",
    ))
    with pytest.raises(ModelSourceError, match=r"the recipe declares \['pixels'\] but 'model.onnx' takes \['x'\]"):
        ExportPass(ExportParams()).run(None, _context(wrong, tmp_path, "second"))


def test_not_an_onnx_file_is_refused(tiny_recipe, tmp_path):
    bogus = tmp_path / "model.onnx"
    bogus.write_bytes(b"this is not protobuf")
    recipe = load_recipe(tiny_recipe({"model": None}, model={"onnx": str(bogus)}))
    with pytest.raises(ModelSourceError, match="is not an ONNX model or is truncated"):
        ExportPass(ExportParams()).run(None, _context(recipe, tmp_path, "x"))


@pytest.mark.parametrize("backend", ["onnxslim", "onnxsim"])
def test_simplify_removes_nodes_and_keeps_numerics(tiny_recipe, tmp_path, backend):
    recipe = load_recipe(tiny_recipe({"model": {"factory": "tiny:build_cnn"}, "inputs": CNN["inputs"]}))
    exported = ExportPass(ExportParams(exporter="torchscript")).run(None, _context(recipe, tmp_path, "export"))
    simplified = run_checked(SimplifyPass(SimplifyParams(backend=backend)), exported, _context(recipe, tmp_path, "simplify"))
    info = simplified.info
    assert info["nodes_after"] < info["nodes_before"], info
    assert info["self_check"]["against"] == "input" and info["self_check"]["max_abs"] < 1e-4
    assert _dims(simplified.load(with_weights=False)) == {"image": ["batch", 3, 32, 32]}
    assert exported.folder != simplified.folder and (exported.folder / "model.onnx").exists(), "input untouched"


def test_simplify_never_mutates_its_input(tiny_recipe, tmp_path):
    recipe = load_recipe(tiny_recipe())
    exported = ExportPass(ExportParams(exporter="torchscript")).run(None, _context(recipe, tmp_path, "export"))
    before = exported.content_hash()
    SimplifyPass(SimplifyParams()).run(exported, _context(recipe, tmp_path, "simplify"))
    assert exported.content_hash() == before


def test_missing_package_model_is_one_sentence(tiny_recipe, tmp_path):
    recipe = load_recipe(tiny_recipe({"model": None}, model={"package": "no_such_model_pkg", "subdir": "model"}))
    with pytest.raises(ModelSourceError, match="package 'no_such_model_pkg' is not installed"):
        ExportPass(ExportParams()).fingerprint(_context(recipe, tmp_path))


def test_export_checks_every_shape_in_one_ort_session(tiny_recipe, tmp_path, monkeypatch):
    """The trace check and each check_shapes() corner run one session of the export (it was one per shape),
    with every corner still checked against eager; the self-check of the saved result builds its own."""
    from optpipe.evaluation import self_check

    built, ort_session = [], self_check.ort_session
    monkeypatch.setattr(self_check, "ort_session", lambda path, *a, **k: built.append(Path(path)) or ort_session(path, *a, **k))
    recipe = load_recipe(tiny_recipe({"model": {"factory": "tiny:build_cnn"}, "inputs": CNN["inputs"]}))
    artifact = run_checked(ExportPass(ExportParams(exporter="torchscript")), None, _context(recipe, tmp_path))
    checked = artifact.info["checked_shapes"]
    assert len(checked) >= 2 and all(c["max_abs"] < 1e-4 for c in checked)
    raw = [p for p in built if p != artifact.path]
    assert len(raw) == 1, built  # the raw export: once for the trace shape and every corner
