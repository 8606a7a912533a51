"""Tiny models, recipes and test-only passes for the reliability tests.

The passes here are registered only where a test sets OPTPIPE_PLUGINS=reliability_fixtures
(with this folder on the import path); they are never part of optpipe.passes.
"""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper
from pydantic import Field

from optpipe.core.artifact import ModelArtifact, save_model, write_info
from optpipe.pass_infra.pass_base import Pass, PassContext, PassParams

HERE = Path(__file__).resolve().parent
PLUGIN = "reliability_fixtures"
GATE_DIR_ENV = "RELIABILITY_GATE_DIR"


# --- models ---------------------------------------------------------------------------------


def write_linear_onnx(folder: Path, name: str = "model.onnx", in_dim: int = 16, out_dim: int = 4, op: str = "linear",
                      input_name: str = "x", dtype: int = TensorProto.FLOAT) -> Path:
    """y = x @ W + b with W in external data (so the pair model.onnx + data is exercised);
    op='log' gives y = log(x @ W + b), which is NaN for negative values."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((in_dim, out_dim)).astype(np.float32), "W")
    bias = numpy_helper.from_array(rng.standard_normal(out_dim).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", [input_name, "W"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["lin"])]
    nodes.append(helper.make_node("Log" if op == "log" else "Identity", ["lin"], ["y"]))
    graph = helper.make_graph(
        nodes, "linear",
        [helper.make_tensor_value_info(input_name, dtype, ["batch", in_dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", out_dim])],
        [weight, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    path = folder / name
    onnx.save_model(model, str(path), save_as_external_data=True, location=name + ".data", size_threshold=0)
    return path


def write_custom_op_onnx(folder: Path, domain: str = "") -> Path:
    """A graph whose one node is an op nobody implements (in the default domain, or a custom one)."""
    folder.mkdir(parents=True, exist_ok=True)
    node = helper.make_node("FrobnicateTensor", ["x"], ["y"], domain=domain)
    graph = helper.make_graph([node], "custom", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])])
    opsets = [helper.make_opsetid("", 18)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 9
    path = folder / "model.onnx"
    onnx.save_model(model, str(path))
    return path


def tiny_torch(in_dim: int = 16, out_dim: int = 4):
    """A factory for the `factory` model source: a two-layer MLP with fixed weights."""
    import torch

    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        output_names = ["y"]

        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(in_dim, 8)
            self.fc2 = torch.nn.Linear(8, out_dim)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    return Tiny()


def tiny_embedding(vocab: int = 16):
    """A factory whose forward() looks token ids up in a table of `vocab` rows (ids beyond it fail)."""
    import torch

    torch.manual_seed(0)

    class Embed(torch.nn.Module):
        output_names = ["y"]

        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(vocab, 4)

        def forward(self, ids):
            return self.table(ids).amax(dim=1)

    return Embed()


# --- recipes --------------------------------------------------------------------------------


def onnx_recipe(folder: Path, model: str = "model/model.onnx", stages: dict | None = None, **extra) -> dict:
    recipe = {
        "name": "tiny",
        "model": {"onnx": model},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 16]}],
        "dims": {"batch": {"min": 1, "opt": 2, "max": 8}},
        "data": {"eval": {"source": "synthetic", "samples": 8}},
        "stages": stages or {"export": {"pass": "export"}, "simplify": {"pass": "simplify", "after": "export"}},
        "evaluate": {"warmup": 1, "iterations": 3, "batch_sizes": [1], "eager_baseline": False},
        "output": "run",
        "cache": "cache",
    }
    recipe.update(extra)
    return recipe


def write_recipe(folder: Path, recipe: dict, name: str = "recipe.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def plugin_env(gate_dir: Path | None = None) -> dict[str, str]:
    """Environment for a subprocess compile that knows the test passes."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    env["OPTPIPE_PLUGINS"] = PLUGIN
    if gate_dir is not None:
        env[GATE_DIR_ENV] = str(gate_dir)
    return env


def run_main(args: list[str], capsys) -> tuple[int, str, str]:
    """Run the console script in-process (optpipe.cli:main, the wrapper that turns errors into
    lines and exit codes); returns (exit code, stdout, stderr)."""
    import logging
    import sys

    from optpipe.cli import main

    previous, previous_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    old_argv, raise_logging = sys.argv, logging.raiseExceptions
    sys.argv = ["optpipe", *args]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = old_argv
        logging.raiseExceptions = raise_logging
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    out, err = capsys.readouterr()
    return code, out, err


# --- test-only passes ---------------------------------------------------------------------------


def _copy_model(model: ModelArtifact, ctx: PassContext, note: dict) -> ModelArtifact:
    for file in model.files():
        if file.name in ("model.onnx", "model.onnx.data"):
            shutil.copyfile(file, ctx.workdir / file.name)
    return write_info(ctx.workdir, note)


class GateParams(PassParams):
    tag: str = Field("gate", description="changes the cache key; names the marker files")


class GatePass(Pass):
    """Copy the model; while RELIABILITY_GATE_DIR is set, say so and wait there for a release file.

    Each run appends a line to <dir>/<tag>.runs (so a test counts how often the stage computed),
    writes <dir>/<tag>.started, then waits up to 60 s for <dir>/release: a deterministic point
    at which a test can kill the compile mid-pass.
    """

    name = "gate"
    Params = GateParams

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        folder = os.environ.get(GATE_DIR_ENV)
        if folder:
            gate = Path(folder)
            with open(gate / f"{self.params.tag}.runs", "a") as fh:
                fh.write(f"{os.getpid()}\n")
            (gate / f"{self.params.tag}.started").touch()
            deadline = time.monotonic() + 60
            while not (gate / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return _copy_model(model, ctx, {"gate": self.params.tag})


class SleepParams(PassParams):
    seconds: float = 30.0


class SleepPass(Pass):
    """Copy the model after sleeping (a stage that overruns its time limit)."""

    name = "sleepy"
    Params = SleepParams

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        time.sleep(self.params.seconds)
        return _copy_model(model, ctx, {})


class HogPass(Pass):
    """Ask for far more memory than exists (numpy raises MemoryError without touching it)."""

    name = "hog"

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        np.empty(1 << 50, dtype=np.uint8)
        return _copy_model(model, ctx, {})


class BuggyPass(Pass):
    """A bug inside a pass (not the user's input): a KeyError from its own code."""

    name = "buggy"

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        return {}["missing"]


class RuntimeBreakPass(Pass):
    """A pass that breaks the model at run time, not at load: its output goes through a Reshape
    to rows of 3, which ONNX Runtime refuses on [batch, 4] data. The user's model and data are fine."""

    name = "runbreak"

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        graph = onnx.load(str(model.path)).graph
        out = graph.output[0]
        renamed = out.name + "_pre"
        for node in graph.node:
            node.output[:] = [renamed if o == out.name else o for o in node.output]
        graph.initializer.append(numpy_helper.from_array(np.array([-1, 3], np.int64), "rows_of_3"))
        graph.node.append(helper.make_node("Reshape", [renamed, "rows_of_3"], [out.name]))
        graph.output[0].CopyFrom(helper.make_tensor_value_info(out.name, TensorProto.FLOAT, None))
        broken = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        broken.ir_version = 9
        return save_model(broken, ctx.workdir, {"runbreak": True})


class SelfKillPass(Pass):
    """Die the way the kernel's OOM killer kills: SIGKILL (run it with a timeout_s, in a worker)."""

    name = "selfkill"

    def run(self, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")
