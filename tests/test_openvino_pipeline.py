"""OpenVINO through the whole tool on the tiny MLP recipe: IR stages in the same report (runtime
label, precision recorded, same reference), the openvino target and Triton's openvino backend,
`optpipe.load`, `optpipe export --format openvino`, and the refusal of ONNX targets for an IR stage.
One compile, shared by every test."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from google.protobuf import text_format

import optpipe
from optpipe.cli import cli
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import parse_recipe
from optpipe.core.runtime import ort_runner, ort_session

from conftest import TINY_RECIPE
from optpipe.evaluation import openvino_runtime as ovr
from optpipe.hardware.cpu_features import engine_target, int8_sums_saturate
from optpipe.passes._openvino_isa import int8_skip_reason


RECIPES: dict = {}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ov")
    data = json.loads(json.dumps(TINY_RECIPE))
    data["data"]["calibration"] = {"source": "synthetic", "samples": 16, "seed": 1}
    data["stages"].update({
        "ov-fp32": {"pass": "openvino", "after": "simplify"},
        # skip_slow off: this module tests the int8 IR's mechanics and targets on every CPU class (the CPU rule
        # that skips it without VNNI: tests/test_openvino_cpu_rule.py).
        "ov-int8": {"pass": "openvino", "after": "simplify", "params": {"precision": "int8", "skip_slow": False},
                    "tolerance": {"cosine_min": 0.99}},
        "ort-int8": {"pass": "int8", "after": "simplify", "params": {"mode": "static"}, "tolerance": {"cosine_min": 0.99}},
    })
    data["evaluate"]["batch_sizes"] = [1, 4]
    data["targets"] = [
        {"kind": "openvino", "stages": ["ov-int8", "simplify", "ort-int8"]},
        {"kind": "triton", "stages": ["ov-int8", "simplify"], "params": {"platform": "openvino"}},
        {"kind": "ort", "stages": ["ov-fp32"]},
    ]
    recipe = parse_recipe(data, base_dir=root)
    run_dir = root / "run"
    report = compile_recipe(recipe, RunOptions(output=run_dir, cache_dir=root / "cache"))
    RECIPES[run_dir] = recipe  # the bench test needs it
    return run_dir, report


def feeds(batch: int = 3):
    return {"x": np.random.default_rng(2).standard_normal((batch, 32)).astype(np.float32)}


def target(report, kind, stage):
    found = next(t for t in report.targets if t.kind == kind and t.stage == stage)
    return found.model_dump(mode="json")


def test_ir_stages_are_rows_of_the_same_report_labelled_with_their_runtime(run):
    run_dir, report = run
    fp32, int8, simplify = report.stage("ov-fp32"), report.stage("ov-int8"), report.stage("simplify")
    assert fp32.status == int8.status == "ok"
    assert [lat.provider for lat in fp32.latency] == ["openvino-cpu", "openvino-cpu"]
    assert {lat.provider for lat in simplify.latency} == {"CPUExecutionProvider"}
    # Same reference, same inputs: FP32 OpenVINO agrees with the ORT reference to float rounding.
    assert fp32.accuracy.reference == simplify.accuracy.reference == "export"
    assert fp32.accuracy.worst_cosine > 0.99999 and int8.accuracy.within_tolerance
    assert fp32.info["inference_precision"] == int8.info["inference_precision"] == "f32"
    # Where OpenVINO has neither VNNI nor AVX-512 (the class the stage is skipped on by default) the CPU plugin may run
    # this tiny graph's MatMuls in f32 (0 int8 layers): the stage warns, from the runtime's count.
    avx2_class = int8_skip_reason() is not None
    assert (int8.info["int8_layers"] > 0 or avx2_class) and fp32.info["int8_layers"] == 0
    assert (run_dir / "stages" / "ov-int8" / "model.xml").is_file()
    table = (run_dir / "report.md").read_text()
    assert "| runtime |" in table
    from optpipe.reporting.rows import headers

    column = headers().index("runtime")
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")]
    cells = {row[0].strip("| "): row[column] for row in rows if len(row) == len(headers())}
    # A row timed on another CPU class than the machine's (OpenVINO held lower by ONEDNN_MAX_CPU_ISA) names it.
    ov_class, machine_class = engine_target("openvino").cpu_class, engine_target("onnxruntime").cpu_class
    assert int8.headline.cpu_class == ov_class and simplify.headline.cpu_class == machine_class
    assert cells["ov-int8"] == "openvino-cpu f32" + (f" [{ov_class}]" if ov_class != machine_class else "")
    assert cells["simplify"] == "ort-cpu" and cells["pytorch-eager"] == "pytorch"
    # The precision column: an IR has no ONNX to count MACs on; the runtime's compute layers per precision.
    precision = {row[0].strip("| "): row[headers().index("precision (MACs)")] for row in rows if len(row) == len(headers())}
    layers = sum(int8.info["compute_layer_precisions"].values())
    expected = f"int8 {int8.info['int8_layers']}/{layers} layers" if int8.info["int8_layers"] else f"fp32 {layers}/{layers} layers"
    assert precision["ov-int8"].removesuffix(" ⚠") == expected, precision
    assert precision["ov-fp32"] == f"fp32 {layers}/{layers} layers", precision
    # This module calibrates on synthetic data: the one warning an int8 stage carries here (verdict.py) says so.
    assert all("calibrated on synthetic data" in w or (avx2_class and "compute layers run int8" in w) for w in int8.warnings)
    assert not fp32.warnings


def test_an_openvino_int8_stage_that_runs_no_int8_layer_says_so():
    from optpipe.evaluation.verdict import openvino_int8_warning

    ran = {"precision": "int8", "compute_layer_precisions": {"u8": 3, "f32": 1}, "int8_layers": 3, "int8": {"quantizers": 6}}
    assert openvino_int8_warning(ran) is None
    assert openvino_int8_warning({**ran, "precision": "fp32", "int8_layers": 0}) is None  # fp32 asked: nothing to say
    excluded = {**ran, "compute_layer_precisions": {"f32": 4}, "int8_layers": 0, "int8": {"quantizers": 0}}
    assert openvino_int8_warning(excluded) == ("asked for int8, but only 0 of 4 compute layers run int8 (NNCF placed 0 "
                                               "quantizers); the rest run in f32")
    nothing = {**excluded, "compute_layer_precisions": {}}
    assert "the model has no MatMul or Convolution layer: nothing was quantized" in openvino_int8_warning(nothing)


def test_openvino_target_copies_an_ir_stage_and_measures_a_converted_onnx_stage(run):
    run_dir, report = run
    ir = target(report, "openvino", "ov-int8")
    assert ir["status"] == "ok" and ir["provider"] == "openvino-cpu" and ir["precision"] == "int8"
    assert ir["latency"] == [lat.model_dump(mode="json") for lat in report.stage("ov-int8").latency]
    converted = target(report, "openvino", "simplify")
    assert converted["status"] == "ok" and converted["details"]["converted_from_onnx"], converted["reason"]
    # Converted here: measured here, on OpenVINO, not the stage's ORT numbers.
    assert converted["latency"] and {lat["provider"] for lat in converted["latency"]} == {"openvino-cpu"}
    assert converted["accuracy"]["outputs"][0]["cosine_mean"] > 0.99999


def test_load_compiles_the_ir_with_the_measured_settings(run):
    run_dir, report = run
    folder = run_dir / target(report, "openvino", "simplify")["path"]
    compiled = optpipe.load(folder)
    assert int(compiled.get_property("INFERENCE_NUM_THREADS")) == 1  # the tiny recipe's threads
    assert str(compiled.get_property("PERFORMANCE_HINT")) in ("LATENCY", "PerformanceMode.LATENCY")
    got = compiled(feeds())[0]
    expected = ort_runner(ort_session(run_dir / "stages" / "simplify" / "model.onnx", threads=1))(feeds())["logits"]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert int(optpipe.load(folder, threads=2).get_property("INFERENCE_NUM_THREADS")) == 2
    with pytest.raises(optpipe.core.errors.TargetError, match="takes `threads` only; got providers"):
        optpipe.load(folder, providers="cpu")


def test_triton_openvino_model_parses_and_matches_the_ir(run):
    from tritonclient.grpc import model_config_pb2 as pb

    run_dir, report = run
    result = target(report, "triton", "ov-int8")
    assert result["status"] == "ok"
    folder = run_dir / result["path"]
    config = text_format.Parse((folder / "config.pbtxt").read_text(), pb.ModelConfig())
    assert config.backend == "openvino" and not config.platform
    assert (folder / "1" / "model.xml").is_file() and (folder / "1" / "model.bin").is_file()
    assert config.max_batch_size == 16 and list(config.input[0].dims) == [32]
    assert [(t.name, t.data_type) for t in config.output] == [("logits", pb.TYPE_FP32)]
    assert config.instance_group[0].kind == pb.ModelInstanceGroup.KIND_CPU
    assert config.parameters["INFERENCE_NUM_THREADS"].string_value == "1"
    assert config.parameters["NUM_STREAMS"].string_value == "1"
    # The backend takes HINT_BF16 = YES only (NO fails the model's load); an f32 IR cannot be pinned at f32
    # there, so the result says at what precision it will be served on this CPU.
    assert "HINT_BF16" not in config.parameters
    served = result["details"]["served_inference_precision"]
    assert served == ovr.default_inference_precision()
    assert ("warning" in result["details"]) == (served != "f32")


def test_onnx_targets_refuse_an_ir_stage_in_one_line(run):
    _, report = run
    refused = target(report, "ort", "ov-fp32")
    assert refused["status"] == "skipped" and refused["reason"].startswith("stage 'ov-fp32' is an OpenVINO IR")


def test_export_format_openvino_writes_a_loadable_ir(run, tmp_path):
    run_dir, _ = run
    result = CliRunner().invoke(cli, ["export", str(run_dir), "--stage", "ov-fp32", "--format", "openvino", "--to", str(tmp_path)])
    assert result.exit_code == 0, result.output
    entry = json.loads((tmp_path / "manifest.json").read_text())["artifacts"][0]
    assert entry["target"] == "openvino" and entry["stage"] == "ov-fp32"
    folder = tmp_path / entry["path"]
    settings = json.loads((folder / "openvino.json").read_text())
    assert settings["config"]["INFERENCE_PRECISION_HINT"] == "f32" and settings["inference_precision"] == "f32"
    compiled = optpipe.load(folder)
    assert compiled(feeds())[0].shape == (3, 10)


def test_bench_runs_ir_stages_on_openvino_beside_plain_openvino(run):
    from test_bench import load_bench

    from optpipe.hardware.cpu_features import engine_target, native_bf16

    run_dir, report = run
    bench = load_bench()
    candidates, rows = bench.build_candidates(RECIPES[run_dir], report, run_dir, 1, bench.ReferenceOutputs(RECIPES[run_dir], report, run_dir, 1))
    assert bench.PLAIN_OV in candidates and "optpipe:ov-int8" in candidates
    # Plain OpenVINO's row names the precision OpenVINO chose and carries its own accuracy, not the export's.
    plain = next(r for r in rows if r["candidate"] == bench.PLAIN_OV)
    assert plain["what"].endswith("(runs at bf16)" if native_bf16(engine_target("openvino")) else "(runs at f32)")
    assert plain["cosine"] > 0.99 and plain["within_tolerance"] is not None and plain["max_abs"] >= 0
    what = next(r["what"] for r in rows if r["candidate"] == "optpipe:ov-int8")
    assert "OpenVINO, int8, runs at f32" in what
    expected = ort_runner(ort_session(run_dir / "stages" / "simplify" / "model.onnx", threads=1))(feeds())["logits"]
    np.testing.assert_allclose(candidates["optpipe:ov-fp32"](feeds())["logits"], expected, rtol=1e-4, atol=1e-4)
    # Plain OpenVINO takes the CPU's default precision hint (bf16 where the CPU has it): close, not exact.
    np.testing.assert_allclose(candidates[bench.PLAIN_OV](feeds())["logits"], expected, rtol=5e-2, atol=5e-2)


def test_openvino_target_labels_a_converted_qdq_stage_by_what_the_runtime_runs(run):
    # The int8 pass's QDQ ONNX converts to FakeQuantize ops the CPU plugin runs as int8 kernels: the
    # label is int8 (it said fp32, the converter's default), from the runtime's own layer count.
    run_dir, report = run
    converted = target(report, "openvino", "ort-int8")
    if converted["status"] != "ok" and int8_sums_saturate(engine_target("openvino")):
        # Without VNNI oneDNN sums u8 x s8 in saturating int16: the full-range s8 weights of the TensorRT-form
        # QDQ stage lose accuracy there (cosine 0.963 under ONEDNN_MAX_CPU_ISA=AVX2), and the target says so.
        assert "breaks the tolerance the stage held in ONNX Runtime" in converted["reason"]
        return
    assert converted["status"] == "ok" and converted["details"]["converted_from_onnx"], converted["reason"]
    settings = json.loads((run_dir / converted["path"] / "openvino.json").read_text())
    assert settings["int8_layers"] > 0 and converted["precision"] == settings["precision"] == "int8"
    assert target(report, "openvino", "simplify")["precision"] == "fp32"


def test_export_of_an_ir_stage_in_an_onnx_format_exits_2_in_one_line(run, tmp_path):
    run_dir, _ = run
    result = CliRunner().invoke(cli, ["export", str(run_dir), "--stage", "ov-int8", "--format", "ort", "--to", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "error: --format ort: stage 'ov-int8' is an OpenVINO IR (no ONNX); export it with the openvino target "
        "or Triton's openvino platform"]


def test_export_triton_of_an_ir_stage_picks_the_openvino_backend(run, tmp_path):
    # The recipe's triton target names its platform; a fresh one (none named) serves the IR with openvino.
    from optpipe.targets import export_stage
    from optpipe.targets.loading import load

    run_dir, _ = run
    recipe = json.loads((run_dir / "recipe.json").read_text())
    bare = run_dir.parent / "bare-run"
    if not bare.exists():
        import shutil

        shutil.copytree(run_dir, bare, symlinks=True)
        recipe["recipe"]["targets"] = []
        (bare / "recipe.json").write_text(json.dumps(recipe))
    result = export_stage(bare, "ov-fp32", "triton", tmp_path)
    assert result.status == "ok", result.reason
    assert 'backend: "openvino"' in (tmp_path / result.path / "config.pbtxt").read_text()
    with pytest.raises(optpipe.core.errors.TargetError, match="does not exist"):
        load(tmp_path / "no-such-folder")


def test_an_ir_converted_from_a_stage_within_tolerance_that_breaks_it_fails_and_is_removed(run, tmp_path, monkeypatch):
    # A BERT's fuse stage (ORT contrib ops) converted to an IR at cosine 0.69: the target read 'ok'.
    from optpipe.targets import export_stage
    from optpipe.targets import openvino as ov_target

    run_dir, report = run
    held = report.stage("simplify").accuracy
    broken = held.model_copy(update={"within_tolerance": False, "violations": ["output 'logits' cosine 0.6933 < 0.999"]})
    monkeypatch.setattr(ov_target, "measure_ir", lambda job, folder, settings: (broken, []))
    result = export_stage(run_dir, "simplify", "openvino", tmp_path)
    assert result.status == "failed"
    assert result.reason == ("OpenVINO's conversion of stage 'simplify' breaks the tolerance the stage held in ONNX Runtime "
                             "(output 'logits' cosine 0.6933 < 0.999)")  # no ORT-only op in it: no cause named
    assert not list(tmp_path.rglob("model.xml"))


def test_triton_openvino_measures_the_accuracy_of_an_ir_it_converted(run):
    # The stage's accuracy is ONNX Runtime's; the IR converted for Triton is measured itself (a conversion
    # that changes the numbers fails the target, test above).
    _, report = run
    converted = target(report, "triton", "simplify")
    assert converted["status"] == "ok" and converted["provider"] == "openvino-cpu"
    assert converted["accuracy"]["within_tolerance"] and converted["accuracy"]["outputs"][0]["cosine_mean"] > 0.99999


def test_ir_stages_are_timed_interleaved_with_eager_as_the_ort_rows_are(run):
    """The report's 'vs eager' is against eager timed beside the stage: for an IR stage too, not eager's own
    figure from minutes before."""
    _, report = run
    eager = report.stage("pytorch-eager")
    assert eager is not None and eager.status == "ok"
    for name in ("ov-fp32", "ov-int8", "simplify"):
        headline = report.stage(name).headline
        assert headline.eager_p50_ms and headline.eager_p50_ms > 0, name
