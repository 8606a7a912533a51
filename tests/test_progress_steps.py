"""Issue 17: the long steps report progress from inside (export, simplify, int8, the evaluation), and
the console tells a heartbeat from progress. Tiny models, events recorded, no timing asserted."""
from __future__ import annotations

import io
import logging

import numpy as np
import pytest
from helpers_passes import artifact_of, context, graph_recipe
from test_core_passes import CNN, _context
from test_int8 import OUTLIER, with_weights

from optpipe.core.results import StageResult
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.execution.stage_runner import run_checked
from optpipe.pass_infra.instruments import ConsoleProgress, StepRecorder
from optpipe.pass_infra.progress import Steps, counted, logged_progress, printed_progress
from optpipe.passes.export import ExportParams, ExportPass
from optpipe.passes.int8 import Int8Params, Int8Pass
from optpipe.passes.simplify import SimplifyParams, SimplifyPass
from optpipe.safety.recipe_loading import load_recipe


def steps_of(recorder: StepRecorder) -> list[tuple[str, int, int]]:
    return [e[1:] for e in recorder.events if e[0] == "step"]


def tasks_of(recorder: StepRecorder) -> list[str]:
    return [task for task, _, _ in steps_of(recorder)]


# --- the adapters -------------------------------------------------------------------------------


def test_steps_count_and_grow_when_an_optional_step_is_taken():
    events = StepRecorder()
    steps = Steps(events.step, "job", 2)
    steps("a")
    steps("b")
    steps("c")  # one more than announced: the count stays true
    steps.sub("c")(3, 7)
    assert steps_of(events) == [("job: a", 1, 2), ("job: b", 2, 2), ("job: c", 3, 3), ("job: c", 3, 7)]


def test_printed_lines_with_the_prefix_are_steps_and_nothing_reaches_stdout(capsys):
    events, log = StepRecorder(), logging.getLogger("optpipe.test.printed")
    with printed_progress(events.step, "lib", "[lib]", log):
        print("[lib] Phase one...")
        print("an unrelated line")
        print("[lib] Phase two", end="")  # no newline: still taken when the block ends
    assert steps_of(events) == [("lib: Phase one...", 1, 0), ("lib: Phase two", 2, 0)]
    assert capsys.readouterr().out == ""


def test_a_libraries_log_records_are_steps_and_its_logger_is_put_back():
    events = StepRecorder()
    logger = logging.getLogger("optpipe.test.library")
    logger.setLevel(logging.ERROR)
    with logged_progress(events.step, "lib", "optpipe.test.library") as inside:
        inside.setLevel(logging.DEBUG)  # what a library's verbose switch does
        inside.debug("iter: %d", 3)
    assert steps_of(events) == [("lib: iter: 3", 1, 0)]
    assert logger.level == logging.ERROR and logger.propagate and not logger.handlers


def test_counted_reports_each_item_as_it_is_taken():
    seen = []
    items = counted([10, 20, 30], lambda n, total: seen.append((n, total)))
    assert len(items) == 3 and items[1] == 20
    assert [x for x in items] == [10, 20, 30] and seen == [(1, 3), (2, 3), (3, 3)]


# --- passes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_export_reports_its_steps_and_the_dynamo_exporters_phases(tiny_recipe, tmp_path, exporter, capsys):
    recipe = load_recipe(tiny_recipe({"model": {"factory": "tiny:build_cnn"}, "inputs": CNN["inputs"]}))
    ctx = _context(recipe, tmp_path)
    events = StepRecorder()
    ctx.progress = events.step
    run_checked(ExportPass(ExportParams(exporter=exporter)), None, ctx)
    tasks = tasks_of(events)
    assert tasks[:2] == ["export: load the PyTorch model", "export: PyTorch eager on the trace inputs"]
    assert f"export: check the {exporter} export against eager" in tasks
    shapes = [s for s in steps_of(events) if s[0] == f"export: check the {exporter} export at other shapes" and s[2] > 1]
    assert shapes and shapes[-1][1] == shapes[-1][2]  # every corner counted
    assert "export: save the model" in tasks
    # eager's outputs come from the pass, which computed them for its own check: the model is not run again
    assert tasks[-2:] == ["self-check: PyTorch eager outputs (handed over by the pass)", "self-check: the result's outputs (ONNX Runtime)"]
    if exporter == "dynamo":  # its own phases, from inside torch.onnx.export
        inside = [t for t in tasks if t.startswith("torch.onnx dynamo: ")]
        assert any("Translate the graph into ONNX" in t for t in inside), inside
        assert any("Obtain model graph" in t for t in inside), inside
        assert "[torch.onnx]" not in capsys.readouterr().out  # none of it on the terminal



def test_a_decoders_export_with_its_kv_cache_reports_its_steps(tmp_path):
    """The KV-cache export (minutes on a 270M decoder) is not one step: eager's references, export, save; its
    self-check then runs the graph's half of the generation check."""
    import yaml

    from helpers_decoders import SHAPE

    recipe = {"model": {"hf_config": {"model_type": "llama", "vocab_size": 256, **SHAPE}, "task": "causal-lm",
                        "outputs": ["logits"]},
              "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 256]}],
              "dims": {"batch": {"min": 1, "opt": 1, "max": 2}, "sequence": {"min": 2, "opt": 8, "max": 16}},
              "stages": {"export": {"pass": "export"}},
              "evaluate": {"task": {"kind": "language-model"}, "threads": 1,
                           "generation": {"new_tokens": 2, "batch_sizes": [1], "rounds": 1, "max_past": 24}}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    ctx = _context(load_recipe(path), tmp_path)
    events = StepRecorder()
    ctx.progress = events.step
    run_checked(ExportPass(ExportParams()), None, ctx)
    own = [s for s in steps_of(events) if s[0].startswith("export: ")]
    assert own == [("export: load the PyTorch model", 1, 5), ("export: PyTorch eager on the trace inputs", 2, 5),
                   ("export: PyTorch eager: greedy tokens for the self-check", 3, 5),
                   ("export: torch.onnx dynamo export with the KV cache", 4, 5), ("export: save the model", 5, 5)]
    check = [s for s in steps_of(events) if s[0].startswith("self-check: ")]
    assert check == [("self-check: PyTorch eager outputs (handed over by the pass)", 1, 3),
                     ("self-check: the result's outputs (ONNX Runtime)", 2, 3), ("self-check: greedy generation against eager", 3, 3)]

def test_simplify_reports_onnxslims_own_phases_and_leaves_its_logging_as_it_was(tiny_recipe, tmp_path, capsys):
    from onnxslim import utils as slim_utils

    recipe = load_recipe(tiny_recipe())
    exported = run_checked(ExportPass(ExportParams(exporter="torchscript")), None, _context(recipe, tmp_path, "export"))
    ctx = _context(recipe, tmp_path, "simplify")
    events = StepRecorder()
    ctx.progress = events.step
    severity = slim_utils.G_LOGGER.severity
    level = logging.getLogger("onnxslim").level
    run_checked(SimplifyPass(SimplifyParams()), exported, ctx)
    tasks = tasks_of(events)
    inside = [t for t in tasks if t.startswith("onnxslim: ")]
    assert any("iter" in t for t in inside), inside
    # The shapes are inferred on the graph alone before onnxslim runs (issue 20: memory), else by onnxslim itself.
    assert "simplify: shape inference on the graph" in tasks or any("shape inference" in t.lower() for t in inside), tasks
    assert tasks[0] == "simplify: load the model" and "simplify: save the model" in tasks
    assert tasks[-2:] == ["self-check: the input model's outputs (ONNX Runtime)", "self-check: the result's outputs (ONNX Runtime)"]
    assert slim_utils.G_LOGGER.severity == severity and logging.getLogger("onnxslim").level == level
    assert capsys.readouterr().out == ""  # graphsurgeon's debug prints went to the stage log


def _int8_case(tmp_path, cosine_min):
    recipe = graph_recipe([{"name": "x", "shape": ["N", 16]}], dims={"N": {"min": 1, "opt": 4, "max": 32}},
                          tolerance={"cosine_min": cosine_min})
    x = np.random.default_rng(3).uniform(-1, 1, (24, 16)).astype(np.float32)
    x[:, 0] = np.abs(x[:, 0])
    return artifact_of(with_weights(OUTLIER, outlier=True), tmp_path / "in"), recipe, {"x": x}


def test_dynamic_int8_reports_each_guard_conversion_and_the_batches_it_measures(tmp_path):
    source, recipe, arrays = _int8_case(tmp_path, cosine_min=0.999)  # the outlier breaks it: the guard works
    ctx = context(recipe, tmp_path / "q", arrays)
    events = StepRecorder()
    ctx.progress = events.step
    Int8Pass(Int8Params(mode="dynamic", per_channel=False)).run(source, ctx)
    tasks = tasks_of(events)
    assert tasks[0] == "int8: prepare the input for ORT's quantizer"
    reference = [s for s in steps_of(events) if s[0] == "guard: the input's outputs (batch)"]
    assert reference and reference[-1][1] == reference[-1][2] == 3  # 24 samples in batches of 8
    conversions = [t for t in tasks if t.startswith("guard: conversion ")]
    quantizations = [t for t in tasks if t.startswith("int8: ORT quantize_dynamic")]
    assert len(conversions) == len(quantizations) >= 2, tasks  # the first and at least one repair
    assert "guard: rank the nodes by the error each adds" in tasks
    assert any(t.startswith("guard: outputs of conversion 2") for t in tasks)
    assert tasks[-1] == "int8: save the model and count its int8 coverage"


def test_static_int8_reports_each_calibration_batch_ort_reads(tmp_path):
    source, recipe, arrays = _int8_case(tmp_path, cosine_min=0.5)
    ctx = context(recipe, tmp_path / "q", arrays)
    events = StepRecorder()
    ctx.progress = events.step
    Int8Pass(Int8Params(mode="static", calibration_batch=4)).run(source, ctx)
    batches = [s for s in steps_of(events) if s[0] == "int8: ORT calibration batch"]
    assert [done for _, done, _ in batches] == list(range(1, 7)) and {total for _, _, total in batches} == {6}
    after = tasks_of(events)[tasks_of(events).index("int8: ORT calibration batch") + 6]
    assert after == "int8: ORT computes the ranges and quantizes the weights"


# --- evaluation and the console -------------------------------------------------------------------


def test_a_compile_reports_warm_up_each_timed_call_each_accuracy_batch_and_the_sweeps(tiny_recipe, cache_dir):
    path = tiny_recipe({"evaluate": {"iterations": 12, "adaptive": False, "sweep": {"batch": [1, 2]}, "sweep_iterations": 3}})
    events = StepRecorder()
    compile_recipe(load_recipe(path), RunOptions(cache_dir=cache_dir, instruments=[events]))
    steps = steps_of(events)
    tasks = {task for task, _, _ in steps}
    assert {"ONNX Runtime session", "latency batch 1: warm-up", "latency batch 1: warm-up call", "accuracy batch",
            "PyTorch eager: load the model"} <= tasks, tasks
    timed = [done for task, done, total in steps if task == "latency batch 1" and total == 12]
    # the settled warm-up block is the first 5 timed runs; after it each call is told, not only each block
    assert {6, 7, 8, 9, 10, 11, 12} <= set(timed), timed
    accuracy = [(done, total) for task, done, total in steps if task == "accuracy batch"]
    assert (2, 2) in accuracy  # 16 samples in the default accuracy batches of 8
    phases = [e for e in events.events if e[0] in ("before_phase", "phase_done")]
    assert [e[0] for e in phases] == ["before_phase", "phase_done"] * 2 and phases[0][1].startswith("preflight: ")
    assert phases[2][1].startswith("report: ") and all(e[2] for e in phases if e[0] == "phase_done")
    swept = [e for e in events.events if e[0] in ("before_sweep", "sweep_done")]
    assert ("before_sweep", "pytorch-eager") in swept and any(e[0] == "sweep_done" and e[2] == 2 for e in swept), swept
    assert any(task.startswith("batch sweep") for task in tasks)


class _Info:
    name, pass_ = "export", type("P", (), {"name": "export"})()


def test_a_pass_in_a_worker_process_sends_its_steps_to_the_console(tiny_recipe, cache_dir):
    # `timeout_s` runs the pass in a worker: its steps used to stay there, the console showing only the clock.
    path = tiny_recipe({"stages": {"export": {"pass": "export", "timeout_s": 300}}, "evaluate": {"iterations": 3, "adaptive": False}})
    events = StepRecorder()
    compile_recipe(load_recipe(path), RunOptions(cache_dir=cache_dir, instruments=[events]))
    start = events.events.index(("before_stage", "export", "export"))
    end = events.events.index(("stage_done", "export", "ok"))
    during = [e[1] for e in events.events[start:end] if e[0] == "step"]
    assert any(task.startswith("export: ") for task in during), events.events[start:end]


def test_a_log_gets_a_heartbeat_line_marked_still_running_when_no_progress_came():
    stream = io.StringIO()
    console = ConsoleProgress(stream, ticker=False)
    console.before_stage(_Info())
    start = console._started = console._last_line  # as if the stage started as the console's last line was printed
    console.step("torch.onnx.export (TorchScript trace, no progress inside)", 3, 6)  # right after the start: no line
    console.tick(start + 4.0)  # under HEARTBEAT_S: nothing
    assert stream.getvalue() == ""
    console.tick(start + 8.5)  # progress came since the last line: a progress line
    console.tick(start + 17.0)  # nothing new: a heartbeat, said so
    console.stage_done(StageResult(name="export", pass_name="export", status="ok"))
    lines = stream.getvalue().splitlines()
    assert "export: export — torch.onnx.export (TorchScript trace, no progress inside) 3/6 (8s)" in lines[0]
    assert lines[1].endswith("3/6 (17s, still running)")
    assert "ok export" in lines[2]


def test_no_heartbeat_follows_the_end_of_a_run_that_was_interrupted_mid_stage():
    """A Ctrl-C leaves the stage running; the compile's end (run_end) must silence its ticker, or a
    `still running` line follows the CLI's one `interrupted` line."""
    import time

    stream = io.StringIO()
    console = ConsoleProgress(stream, ticker=True)
    console.HEARTBEAT_S, console.TICK_S = 0.05, 0.01
    console.before_stage(_Info())
    time.sleep(0.2)
    assert "still running" in stream.getvalue()  # the ticker runs: the test can fail
    console.run_end()
    printed = stream.getvalue()
    time.sleep(0.3)
    assert stream.getvalue() == printed


def test_the_latest_step_is_shown_even_when_it_comes_right_after_another():
    """A short step followed at once by a long library call: the console must name the long one."""
    console = ConsoleProgress(io.StringIO(), ticker=False)
    console.before_stage(_Info())
    console.step("export: load the PyTorch model", 1, 6)
    console.step("export: torch.onnx.export (TorchScript trace, no progress inside)", 3, 6)
    assert console._text().endswith("torch.onnx.export (TorchScript trace, no progress inside) 3/6")
    console.step("onnxslim: iter: 9", 4, 0)  # total unknown: no count shown
    assert console._text().endswith("onnxslim: iter: 9")
    console.stage_done(StageResult(name="export", pass_name="export", status="ok"))


def test_a_sweep_is_a_console_phase_of_its_own():
    stream = io.StringIO()
    console = ConsoleProgress(stream, ticker=False)
    console.before_sweep("fuse")
    console.step("batch sweep 16x128", 2, 5)
    assert "curves fuse: latency sweep — batch sweep 16x128 2/5" in console._text()
    console.sweep_done("fuse", 4, False)
    console.before_sweep("int8")
    console.sweep_done("int8", 0, False, "latency sweep failed: ValueError: shape")
    lines = stream.getvalue().splitlines()
    assert "ok curves fuse" in lines[0] and "4 sweep points" in lines[0]
    assert "failed curves int8" in lines[1] and "ValueError: shape" in lines[1]


def test_the_heartbeat_counts_from_the_last_line_printed_not_from_the_phase_start():
    """A stage that starts 7 s after the last line gets its first log line within a second or so."""
    stream = io.StringIO()
    console = ConsoleProgress(stream, ticker=False)
    console.before_stage(_Info())
    console._last_line = console._started - 7.5  # the previous phase's end line, 7.5 s before this stage
    console.tick(console._started + 0.6)
    assert stream.getvalue().strip().endswith("export: export ... (1s, still running)")
    console.stage_done(StageResult(name="export", pass_name="export", status="ok"))


def test_a_phase_that_raises_stops_the_spinner_and_prints_nothing_of_its_own():
    from optpipe.pass_infra.instruments import Instruments

    stream = io.StringIO()
    console = ConsoleProgress(stream, ticker=False)
    with pytest.raises(ValueError):
        with Instruments([console]).phase("preflight: the model"):
            raise ValueError("bad input")  # the CLI prints its one line for it
    assert stream.getvalue() == "" and console._status is None
    with Instruments([console]).phase("report: report.json"):
        pass
    assert "ok report (" in stream.getvalue()


def test_on_a_terminal_the_spinner_shows_the_seconds_the_phase_has_run():
    from rich.console import Console

    console = ConsoleProgress(io.StringIO(), ticker=False)
    console.console = Console(file=io.StringIO(), force_terminal=True)
    console.before_stage(_Info())
    console.step("torch.onnx.export (TorchScript trace, no progress inside)", 3, 6)
    console.tick(console._started + 3.2)
    assert "no progress inside) 3/6" in console._shown and "3s" in console._shown
    console.tick(console._started + 4.2)  # no new step: the seconds still move
    assert "4s" in console._shown
    console.stage_done(StageResult(name="export", pass_name="export", status="ok"))


def test_bench_silence_tells_progress_silence_from_console_silence():
    """bench/silence.py: a heartbeat line ends a console silence, never a progress silence."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_silence", Path(__file__).resolve().parent.parent / "bench" / "silence.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    events = [(1.0, "stage a", "start"), (2.0, "stage a", "step 1"), (14.0, "stage a", "step 2"), (15.0, "stage b", "start")]
    lines = [(2.0, "stage a", "... step 1"), (10.0, "stage a", "... still running"), (14.5, "stage a", "ok a"), (15.5, "stage b", "ok b")]
    progress, console = bench.longest_gaps(events, 0.0), bench.longest_gaps(lines, 0.0)
    assert progress["stage a"] == (12.0, "step 2") and console["stage a"][0] == 8.0
    clock = bench.Clocked()
    stream = bench.ClockedLines(clock)
    clock.before_phase("preflight: the model")
    stream.write("  ... preflight\n  partial")
    assert [(scope, text) for _, scope, text in stream.lines] == [("preflight", "... preflight")]


def test_a_failing_onnx_runtime_run_prints_nothing_of_its_own(tmp_path, capfd):
    """ORT's C++ logger printed "[E:onnxruntime:...] Non-zero status code ... Reshape" on the terminal, between optpipe's
    lines, for a run the export's checks try at another shape and report through the exception."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from optpipe.core.runtime import ort_session

    shape = numpy_helper.from_array(np.array([4, 4], np.int64), "shape")
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])], [shape])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), tmp_path / "r.onnx")
    session = ort_session(tmp_path / "r.onnx", threads=1)
    with pytest.raises(Exception, match="reshape"):
        session.run(None, {"x": np.zeros(5, np.float32)})
    assert "onnxruntime" not in capfd.readouterr().err


WARNS = '''import itertools
import warnings

import torch

CALLS = itertools.count()


class Chatty(torch.nn.Module):  # warns on every call, as torch's nested-tensor prototype did in eager's fast path
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        if not torch.jit.is_tracing() and not torch.compiler.is_compiling():
            call = next(CALLS)
            warnings.warn(f"chatty library call {call}")
            print(f"chatty print {call}")  # a model's own print per call: 94,000 lines on the console in one compile
        return self.fc(x)


def chatty():
    torch.manual_seed(0)
    return Chatty().eval()
'''


def test_python_warnings_while_stages_are_measured_go_to_the_evaluation_log(tmp_path, cli_run):
    from helpers_recipes import compile_recipe, small_recipe

    (tmp_path / "chatty_model.py").write_text(WARNS)
    result = compile_recipe(tmp_path, cli_run, small_recipe({"factory": "chatty_model:chatty", "path": "."}))
    assert result.exit_code == 0, result.output
    assert "chatty library call" not in result.output and "chatty print" not in result.output
    logged = (tmp_path / "run" / "logs" / "evaluation.log").read_text()
    assert "chatty library call" in logged and "chatty print" in logged
