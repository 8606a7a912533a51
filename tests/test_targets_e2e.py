"""Targets end to end on the tiny MLP recipe: ORT bundle, TensorRT (skipped without a GPU), Triton
repository, manifest, `optpipe.load` and `optpipe export`. One compile, shared by every test."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from google.protobuf import text_format

import optpipe
from optpipe.core.artifact import sha256_file
from optpipe.cli import cli
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import load_recipe
from optpipe.core.runtime import ort_runner, ort_session
from optpipe.targets.model_facts import io_specs
from optpipe.targets.tensorrt import tensorrt_missing
from optpipe.targets.triton import TRITON_TYPES

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-deploy.yaml"


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tiny-deploy")
    report = compile_recipe(load_recipe(RECIPE), RunOptions(output=run_dir))
    return run_dir, report


def targets_by(report, kind):
    return [t.model_dump(mode="json") for t in report.targets if t.kind == kind]


def ort_bundle(report):
    """An ORT bundle of a frontier stage: the recipe gives the ORT target no stages, so it bundles the
    Pareto frontier (latency vs accuracy error). export and simplify are the same model up to noise,
    so which of them the frontier holds is the timing's call: take whichever it is."""
    bundles = targets_by(report, "ort")
    assert bundles and {b["stage"] for b in bundles} == set(report.pareto)
    return bundles[0]


def stage_outputs(run_dir: Path, stage: str, feeds):
    return ort_runner(ort_session(run_dir / "stages" / stage / "model.onnx", threads=2))(feeds)


def feeds(batch: int = 5):
    return {"x": np.random.default_rng(1).standard_normal((batch, 32)).astype(np.float32)}


def test_every_target_is_recorded(run):
    run_dir, report = run
    statuses = {(t.kind, t.stage): t.status for t in report.targets}
    assert report.pareto and all(statuses[("ort", stage)] == "ok" for stage in report.pareto)  # the default: the frontier
    assert statuses[("triton", "export")] == statuses[("triton", "simplify")] == "ok"
    saved = json.loads((run_dir / "report.json").read_text())["targets"]
    assert [(t["kind"], t["stage"], t["status"], t["reason"]) for t in saved] == [(t.kind, t.stage, t.status, t.reason) for t in report.targets]
    assert "## Targets" in (run_dir / "report.md").read_text()


@pytest.mark.skipif(tensorrt_missing() is None, reason="TensorRT and a GPU are here: the gpu tests cover the build")
def test_tensorrt_is_skipped_with_one_line_and_its_build_command(run):
    run_dir, report = run
    (trt,) = targets_by(report, "tensorrt")
    assert trt["status"] == "skipped" and "\n" not in trt["reason"]
    assert "build_engine.sh" in trt["reason"]
    folder = run_dir / trt["path"]
    script = (folder / "build_engine.sh").read_text()
    # The profile is the recipe's batch dim: min 1, opt 4, max 16.
    for option in ("--trt-min-shapes 'x:[1,32]'", "--trt-opt-shapes 'x:[4,32]'", "--trt-max-shapes 'x:[16,32]'",
                   "--minShapes=x:1x32", "--optShapes=x:4x32", "--maxShapes=x:16x32"):
        assert option in script
    assert (folder / "model.onnx").is_file() and (folder / "model.onnx.data").is_file()


def test_load_round_trips_the_bundle(run):
    run_dir, report = run
    bundle = ort_bundle(report)
    folder = run_dir / bundle["path"]
    expected = stage_outputs(run_dir, bundle["stage"], feeds())
    session = optpipe.load(folder)
    assert session.get_providers() == ["CPUExecutionProvider"]
    got = session.run(None, feeds())[0]
    np.testing.assert_array_equal(got, expected["logits"])  # same model, same settings
    ort_format = optpipe.load(folder, format="ort")
    assert ort_format._model_path.endswith("model.ort")
    # Offline-optimized graph: same kernels, measured 0.0 difference on this model.
    np.testing.assert_allclose(ort_format.run(None, feeds())[0], expected["logits"], atol=1e-5)


def test_bundle_records_the_measured_settings(run):
    run_dir, report = run
    bundle = ort_bundle(report)
    settings = json.loads((run_dir / bundle["path"] / "session.json").read_text())
    assert settings["providers"] == ["CPUExecutionProvider"]
    assert settings["intra_op_num_threads"] == 2 and settings["graph_optimization_level"] == "all"
    assert settings["precision"] == "fp32" and settings["ort_format"]["status"] == "ok"
    stage = report.stage(bundle["stage"])
    assert bundle["latency"][0]["provider"] == stage.latency[0].provider == "CPUExecutionProvider"


def test_triton_configs_match_their_onnx_models(run):
    from tritonclient.grpc import model_config_pb2 as pb

    run_dir, report = run
    configs = sorted((run_dir / "targets" / "triton").glob("*/config.pbtxt"))
    assert [c.parent.name for c in configs] == ["tiny_export", "tiny_simplify"]
    for path in configs:
        config = text_format.Parse(path.read_text(), pb.ModelConfig())
        assert config.name == path.parent.name and config.platform == "onnxruntime_onnx"
        assert config.max_batch_size == 16 and config.dynamic_batching.max_queue_delay_microseconds == 100
        model = onnx.load(str(path.parent / "1" / "model.onnx"), load_external_data=False)
        assert (path.parent / "1" / "model.onnx.data").is_file()
        inputs, outputs = io_specs(model)
        for written, tensors in ((config.input, inputs), (config.output, outputs)):
            assert [t.name for t in written] == [t.name for t in tensors]
            for entry, tensor in zip(written, tensors):
                assert pb.DataType.Name(entry.data_type) == TRITON_TYPES[tensor.dtype]
                assert list(entry.dims) == [d if isinstance(d, int) else -1 for d in tensor.dims[1:]]


def test_manifest_lists_every_artifact_with_its_hashes(run):
    run_dir, report = run
    manifest = json.loads((run_dir / "manifest.json").read_text())
    entries = manifest["artifacts"]
    assert [(e["target"], e["stage"]) for e in entries] == [(t.kind, t.stage) for t in report.targets]
    for entry in entries:
        assert entry["precision"] == "fp32" and entry["hash"]
        for name, digest in entry["files"].items():
            assert sha256_file(run_dir / entry["path"] / name) == digest
        if entry["status"] == "ok":
            assert entry["accuracy"]["within_tolerance"] and entry["latency"][0]["provider"] == "CPUExecutionProvider"


@pytest.mark.parametrize("kind", ["ort", "triton", "tensorrt"])
def test_export_writes_a_finished_stage_later(run, tmp_path, kind):
    run_dir, _ = run
    result = CliRunner().invoke(cli, ["export", str(run_dir), "--stage", "export", "--format", kind, "--to", str(tmp_path)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    (entry,) = manifest["artifacts"]
    assert entry["stage"] == "export" and entry["target"] == kind
    for name, digest in entry["files"].items():
        assert sha256_file(tmp_path / entry["path"] / name) == digest
    if kind == "ort":
        np.testing.assert_array_equal(optpipe.load(tmp_path).run(None, feeds())[0], stage_outputs(run_dir, "export", feeds())["logits"])
    if kind == "triton":
        assert (tmp_path / "tiny_export" / "config.pbtxt").is_file()


def test_export_errors_are_one_line(run, tmp_path):
    run_dir, _ = run
    runner = CliRunner()
    unknown = runner.invoke(cli, ["export", str(run_dir), "--stage", "simplfy", "--format", "ort", "--to", str(tmp_path)])
    assert unknown.exit_code == 2 and "stage 'simplfy' is not in this run" in unknown.output
    not_a_run = runner.invoke(cli, ["export", str(tmp_path), "--stage", "export", "--format", "ort", "--to", str(tmp_path / "o")])
    assert not_a_run.exit_code == 2 and "is not an optpipe run folder" in not_a_run.output
    baseline = runner.invoke(cli, ["export", str(run_dir), "--stage", "pytorch-eager", "--format", "ort", "--to", str(tmp_path)])
    assert baseline.exit_code == 2 and "has no model" in baseline.output
