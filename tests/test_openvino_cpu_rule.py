"""Issue 17 on hand-built graphs: OpenVINO int8 only where it can pay (injected CPU features, both
outcomes), the int8 guard's repair bounded by its time budget and shown as progress lines."""
from __future__ import annotations

import io

import pytest

from helpers_passes import context
from optpipe.cli.failures import failure_lines
from optpipe.core.results import RunReport, StageResult
from optpipe.pass_infra.instruments import ConsoleProgress, StepRecorder
from optpipe.passes import _openvino_guard as guard_module
from optpipe.hardware.cpu_features import parse_features, restrict
from optpipe.passes._openvino_isa import AMX_SYMMETRIC, NO_BF16, SLOW_INT8, bf16_skip_reason, int8_preset, int8_skip_reason
from optpipe.passes.openvino import OpenVinoParams, OpenVinoPass
from test_openvino import attention, mlp, run_pass


AVX2 = "avx2,fma"
AVX2_VNNI = "avx2,fma,avx_vnni"
AVX512 = "avx2,fma,avx512f,avx512bw"
VNNI = AVX512 + ",avx512_vnni,avx512_bf16"
AMX = VNNI + ",avx_vnni,amx_tile,amx_int8,amx_bf16"


def test_int8_is_not_run_on_the_avx2_class_without_vnni():
    reason = int8_skip_reason(parse_features(AVX2))
    assert reason.startswith(SLOW_INT8) and "x86-avx2" in reason


@pytest.mark.parametrize("features", [AVX2_VNNI, AVX512, VNNI, AMX, "arm64:asimd,asimddp"])
def test_int8_runs_where_vnni_or_avx512_is(features):
    # AVX-512 without VNNI: measured 1.6x faster than FP32 (oneDNN held to AVX512_CORE), so it runs; Arm: not measured.
    assert int8_skip_reason(parse_features(features)) is None


@pytest.mark.parametrize("cap, runs", [("AVX2", False), ("sse41", False), ("avx512_core", True), ("AVX2_VNNI", True),
                                       ("AVX512_CORE_VNNI", True)])
def test_onednn_isa_cap_is_the_isa_openvino_runs_at(cap, runs):
    reason = int8_skip_reason(restrict(parse_features(AMX), cap))
    assert (reason is None) == runs
    if not runs:
        assert f"ONEDNN_MAX_CPU_ISA={cap.upper()}" in reason


@pytest.mark.parametrize("features, runs", [(AMX, True), (VNNI, True), (AVX512, False), (AVX2_VNNI, False), (AVX2, False),
                                            ("arm64:asimd,bf16", True)])
def test_bf16_runs_only_with_bf16_instructions(features, runs):
    # VNNI here has avx512_bf16 (Zen 4's class): measured 1.78x FP32 on MiniLM, 1.93x on ResNet-50.
    reason = bf16_skip_reason(parse_features(features))
    assert (reason is None) == runs
    if not runs:
        assert reason.startswith(NO_BF16)


@pytest.mark.parametrize("cap, runs", [("AVX512_CORE_BF16", True), ("AVX512_CORE_VNNI", False), ("AVX2", False)])
def test_bf16_follows_the_onednn_cap(cap, runs):
    reason = bf16_skip_reason(restrict(parse_features(AMX), cap))
    assert (reason is None) == runs
    if not runs:
        assert f"ONEDNN_MAX_CPU_ISA={cap}" in reason


def test_the_pass_skips_itself_by_the_rule_and_only_for_int8(tmp_path, monkeypatch):
    _, recipe, arrays = mlp(tmp_path)
    ctx = context(recipe, tmp_path / "w", arrays)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", AVX2)
    assert SLOW_INT8 in OpenVinoPass(OpenVinoParams(precision="int8")).skip_reason(ctx)
    assert OpenVinoPass(OpenVinoParams(precision="fp32")).skip_reason(ctx) is None
    assert OpenVinoPass(OpenVinoParams(precision="int8", skip_slow=False)).skip_reason(ctx) is None
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", VNNI)
    assert OpenVinoPass(OpenVinoParams(precision="int8")).skip_reason(ctx) is None
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # OpenVINO held to AVX2 on a VNNI CPU: skipped
    assert SLOW_INT8 in OpenVinoPass(OpenVinoParams(precision="int8")).skip_reason(ctx)
    assert NO_BF16 in OpenVinoPass(OpenVinoParams(precision="bf16")).skip_reason(ctx)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", AMX)
    assert OpenVinoPass(OpenVinoParams(precision="bf16")).skip_reason(ctx) is None


def test_a_stage_skipped_by_the_rule_is_no_failure_and_its_children_follow_it():
    skipped = StageResult(name="ov-int8", pass_name="openvino", parent="simplify", status="skipped", reason=SLOW_INT8, not_run=True)
    child = StageResult(name="after", pass_name="openvino", parent="ov-int8", status="skipped", reason="parent", not_run=True)
    failed = StageResult(name="fuse", pass_name="fuse", status="failed", reason="boom")
    report = RunReport.model_construct(stages=[StageResult(name="simplify", pass_name="simplify", status="ok"), skipped, child],
                                       targets=[])
    assert report.failed == [] and failure_lines(report.failed, []) == ([], 0)
    report = RunReport.model_construct(stages=[skipped, failed], targets=[])
    assert [s.name for s in report.failed] == ["fuse"] and failure_lines(report.failed, [])[1] == 1


# --- the guard's budget -----------------------------------------------------------------------


class Ticking:
    """A clock that moves `step` seconds each time it is read: the budget runs out after a known number of reads."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_tiny_budget_ends_the_guard_and_the_stage_says_what_it_gave_up(tmp_path, monkeypatch):
    # The outlier channel breaks plain int8 (cosine ~0); a budget spent at once keeps plain int8, said so.
    source, recipe, arrays = mlp(tmp_path, outlier=True)
    monkeypatch.setattr(guard_module, "CLOCK", Ticking(1.0))
    out = run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8", guard_budget_s=1.0)
    guard = out.info["int8"]["guard"]
    assert not guard["held"] and guard["budget_s"] == 1.0
    assert "guard_budget_s 1 s spent during 'int8 guard: layer-wise error attribution'" in guard["gave_up"]
    assert "kept the best result so far (nncf.quantize)" in guard["gave_up"]
    assert [s["method"] for s in guard["steps"]] == ["nncf.quantize"]
    from optpipe.evaluation.verdict import guard_gave_up_warning

    assert guard_gave_up_warning(out.info).startswith("int8 guard stopped: guard_budget_s 1 s")


def test_the_budget_stops_nncf_accuracy_control_midway_and_keeps_the_best_try(tmp_path, monkeypatch):
    # No cheap fix left (attribution names nothing, the recipe chose the preset): accuracy control runs, and the
    # budget stops it inside NNCF (through the data it reads), without an exception reaching the stage.
    source, recipe, arrays = mlp(tmp_path, outlier=True)
    monkeypatch.setattr(guard_module, "blamed_layers", lambda *a: [])
    monkeypatch.setattr(guard_module, "CLOCK", Ticking(0.5))
    events = StepRecorder()
    ctx = context(recipe, tmp_path / "ov", arrays)
    ctx.progress = events.step
    OpenVinoPass(OpenVinoParams(precision="int8", preset="mixed", guard_budget_s=20.0)).run(source, ctx)
    from optpipe.core.artifact import ModelArtifact

    guard = ModelArtifact.open(tmp_path / "ov").info["int8"]["guard"]
    assert guard["gave_up"] and "nncf" in guard["gave_up"]
    tasks = {e[1] for e in events.events if e[0] == "step"}
    assert "int8 guard: nncf.quantize_with_accuracy_control (ranks every quantizer) (s of budget)" in tasks
    # progress in budget seconds, never past the budget
    assert max(e[2] for e in events.events if e[0] == "step" and "guard" in e[1]) <= 20


def test_without_a_budget_problem_the_cheap_fix_holds_and_nothing_is_given_up(tmp_path):
    source, recipe, arrays = mlp(tmp_path, outlier=True)
    out = run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8")
    guard = out.info["int8"]["guard"]
    assert guard["held"] and guard["gave_up"] is None
    assert "MatMul" in guard["steps"][1]["method"] and guard["steps"][1]["excluded"]


# --- progress on a console that is no terminal ------------------------------------------------


def test_progress_lines_on_a_console_without_a_terminal(monkeypatch):
    stream = io.StringIO()
    console = ConsoleProgress(stream)
    console.HEARTBEAT_S = 0.0  # every step a line (the default: one every 8 s)

    class Info:
        name, pass_ = "ov-int8", type("P", (), {"name": "openvino"})()

    console.before_stage(Info())
    console.step("int8 guard: nncf.quantize (s of budget)", 3, 120)
    console.step("NNCF calibration", 64, 64)
    console.stage_done(StageResult(name="ov-int8", pass_name="openvino", status="ok"))
    lines = stream.getvalue().splitlines()
    assert any("ov-int8: openvino — int8 guard: nncf.quantize (s of budget) 3/120" in line for line in lines)
    assert any("NNCF calibration 64/64" in line for line in lines)
    assert "ok ov-int8" in lines[-1]


def test_no_progress_line_before_the_heartbeat_interval():
    stream = io.StringIO()
    console = ConsoleProgress(stream)

    class Info:
        name, pass_ = "s", type("P", (), {"name": "p"})()

    console.before_stage(Info())
    console.step("task", 1, 2)  # right after the start: the spinner's text only
    assert "task 1/2" not in stream.getvalue()


def test_a_layer_onednn_refuses_under_a_restricted_isa_blames_the_restriction(monkeypatch):
    # OpenVINO 2026.4's compressed-weight layers fail under ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 host
    # (they run on an emulated AVX2 CPU): the line names the variable to unset.
    from optpipe.evaluation.openvino_runtime import _blamed_on_restriction

    refusal = RuntimeError("[CPU] FullyConnectedCompressed node with name 'mm' could not create a primitive descriptor")
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", AMX)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert _blamed_on_restriction(refusal) is refusal  # no restriction: OpenVINO's own words
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    blamed = _blamed_on_restriction(refusal)
    assert "under ONEDNN_MAX_CPU_ISA=AVX2" in str(blamed) and "unset ONEDNN_MAX_CPU_ISA" in str(blamed)
    other = RuntimeError("Exception from src/inference: input shape mismatch")
    assert _blamed_on_restriction(other) is other


def test_all_outputs_emptied_under_a_restricted_isa_is_one_line(monkeypatch):
    import numpy as np

    from optpipe.evaluation.openvino_runtime import check_not_emptied

    feeds = {"x": np.ones((4, 8), np.float32)}
    emptied = {"y": np.zeros((0, 64), np.float32), "scores": np.zeros((0, 0), np.float32)}
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", AMX)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    check_not_emptied(emptied, feeds)  # unrestricted: an empty result is the model's (no detections)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    check_not_emptied({"boxes": np.zeros((0, 6)), "count": np.array([0])}, feeds)  # one output not empty
    with pytest.raises(RuntimeError, match="unset ONEDNN_MAX_CPU_ISA"):
        check_not_emptied(emptied, feeds)


# --- NNCF's preset per CPU class ----------------------------------------------------------------


@pytest.mark.parametrize("features, transformer, preset", [(AMX, True, "performance"), (AMX, False, None), (VNNI, True, None),
                                                           (AVX2_VNNI, True, None), (AVX2, True, None),
                                                           ("arm64:asimd,asimddp,i8mm", True, None)])
def test_a_transformer_takes_symmetric_activations_only_on_amx(features, transformer, preset):
    # AMX: performance measured 8-9% faster than mixed at batch 1; VNNI (u8 x s8 dot products): 5% slower.
    choice = int8_preset(transformer, parse_features(features))
    assert (choice and choice[0]) == preset
    if preset:
        assert choice[1] == AMX_SYMMETRIC


def test_the_preset_follows_the_onednn_cap():
    # An AMX CPU held to AVX512_CORE_VNNI runs VNNI's kernels: NNCF's default (mixed) again.
    assert int8_preset(True, restrict(parse_features(AMX), "AVX512_CORE_VNNI")) is None
    assert int8_preset(True, restrict(parse_features(AMX), "AVX512_CORE_AMX"))[0] == "performance"


@pytest.mark.parametrize("features, preset, chosen_by", [
    (AMX, "performance", "this CPU class (x86-amx): symmetric int8 activations"),
    (VNNI, "mixed", "NNCF's default for the model type"),
])
def test_the_stage_records_the_preset_it_quantized_with_and_who_chose_it(tmp_path, monkeypatch, features, preset, chosen_by):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", features)
    source, recipe, arrays = attention(tmp_path)
    out = run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8", guard=False)
    record = out.info["int8"]["preset"]
    assert record["preset"] == preset and record["chosen_by"].startswith(chosen_by)
    assert out.info["int8"]["options"].get("preset", "mixed") == preset  # what NNCF was given (str of its enum)
    assert out.info["int8_layers"] > 0


def test_the_recipes_preset_wins_over_the_cpu_class(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", AMX)
    source, recipe, arrays = attention(tmp_path)
    out = run_pass(source, recipe, arrays, tmp_path / "ov", precision="int8", preset="mixed", guard=False)
    assert out.info["int8"]["preset"] == {"preset": "mixed", "chosen_by": "the recipe"}


@pytest.mark.parametrize("features, tried, other", [(VNNI, "MIXED", "PERFORMANCE"), (AMX, "PERFORMANCE", "MIXED")])
def test_the_guards_other_preset_is_the_one_not_tried(monkeypatch, features, tried, other):
    # The preset optpipe chose for a transformer (NNCF's mixed on VNNI, performance on AMX) is in the options NNCF got.
    from optpipe.evaluation import openvino_runtime as ovr
    from optpipe.passes._openvino_nncf import preset_choice

    nncf = ovr.nncf()
    monkeypatch.setenv("OPTPIPE_CPU_FEATURES", features)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    left_to_optpipe = OpenVinoParams(precision="int8")
    options = {"model_type": nncf.ModelType.TRANSFORMER,
               "preset": nncf.QuantizationPreset(preset_choice(left_to_optpipe, transformer=True)["preset"])}
    assert options["preset"] == nncf.QuantizationPreset[tried]
    assert guard_module._other_preset(options, left_to_optpipe) == nncf.QuantizationPreset[other]
    assert guard_module._other_preset(options, OpenVinoParams(precision="int8", preset="mixed")) is None
