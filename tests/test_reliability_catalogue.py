"""A catalogue of bad inputs (recipes, models, data, resources): each ends the CLI with one
`error:` line that names what to change, the documented exit code, and no traceback.

The CLI runs in-process through `optpipe.cli:main` (the wrapper that turns errors into
lines and exit codes), with the working directory in a fresh folder per case.
"""
from __future__ import annotations

import io
import os
import shutil
import zipfile
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
import yaml
from onnx import helper, numpy_helper
from reliability_fixtures import (
    HERE,
    PLUGIN,
    onnx_recipe,
    run_main,
    write_custom_op_onnx,
    write_linear_onnx,
    write_recipe,
)

USER, STAGE = 2, 1


@pytest.fixture
def plugin_passes(monkeypatch):
    from optpipe.passes import registry

    monkeypatch.setenv("OPTPIPE_PLUGINS", PLUGIN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    registry.cache_clear()
    yield
    registry.cache_clear()


# --- the catalogue: name -> builder(folder) returning (args, exit code, words the error line must hold) ---


def _recipe_file(folder: Path, recipe: dict | None = None, **extra) -> list[str]:
    write_linear_onnx(folder / "model")
    return ["compile", str(write_recipe(folder, recipe or onnx_recipe(folder, **extra)))]


def _raw_recipe(folder: Path, text: str | bytes) -> list[str]:
    path = folder / "recipe.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return ["validate", str(path)]


def _mutated(folder: Path, change) -> list[str]:
    recipe = onnx_recipe(folder)
    change(recipe)
    return _recipe_file(folder, recipe)


def _with_model(folder: Path, make_model, stages=None) -> list[str]:
    make_model(folder / "model")
    return ["compile", str(write_recipe(folder, onnx_recipe(folder, stages=stages)))]


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _escaping_external_data(folder: Path) -> None:
    path = write_linear_onnx(folder)
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../secret.bin"
    (folder.parent / "secret.bin").write_bytes(b"\0" * 4096)
    onnx.save_model(model, str(path))


def _symlinked_external_data(folder: Path) -> None:
    path = write_linear_onnx(folder)
    data = folder / "model.onnx.data"
    outside = folder.parent / "elsewhere.bin"
    outside.write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(outside)


def _npz(folder: Path, **arrays) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "data.npz", **arrays)
    return "data.npz"


def _with_eval_data(folder: Path, which: str = "eval", **arrays) -> list[str]:
    recipe = onnx_recipe(folder)
    recipe["data"][which] = {"source": "npz", "path": _npz(folder, **arrays), "samples": 4}
    return _recipe_file(folder, recipe)


def _factory_recipe(folder: Path, inputs: list | None = None, evaluate_tolerance: bool = False, **model) -> list[str]:
    recipe = onnx_recipe(folder)
    if evaluate_tolerance:  # an output name only the exported model can refute: caught by the evaluation
        recipe["evaluate"]["tolerance"] = {"outputs": {"z": {"max_abs": 0.1}}}
    recipe["inputs"] = inputs or recipe["inputs"]
    recipe["model"] = {"factory": "reliability_fixtures:tiny_torch", "path": str(HERE), **model}
    return ["compile", str(write_recipe(folder, recipe)), "--allow-path", str(HERE)]


def _pickled_checkpoint(folder: Path) -> list[str]:
    import torch

    class Payload:  # an object beyond tensors: what a malicious pickle carries
        def __reduce__(self):
            return (os.system, ("echo pwned > pwned.txt",))

    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}, "payload": Payload()}, folder / "weights.pt")
    return _factory_recipe(folder, checkpoint="weights.pt")


def _mismatched_checkpoint(folder: Path) -> list[str]:
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"fc9.weight": torch.zeros(2, 2)}, folder / "weights.pt")
    return _factory_recipe(folder, checkpoint="weights.pt")


def _stage(pass_name: str, **spec) -> dict:
    return {"export": {"pass": "export"}, "bad": {"pass": pass_name, "after": "export", **spec}}


BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(6)
)

CASES = {
    # recipes
    "recipe file missing": (lambda d: ["compile", str(d / "nope.yaml")], USER, "does not exist"),
    "malformed yaml": (lambda d: _raw_recipe(d, "model: {onnx: [unclosed\n"), USER, "malformed YAML at line"),
    "yaml python object": (lambda d: _raw_recipe(d, "model: !!python/object/apply:os.system ['echo hi']\n"), USER, "plain values only"),
    "yaml not a mapping": (lambda d: _raw_recipe(d, "- just\n- a list\n"), USER, "expected a mapping"),
    "yaml billion laughs": (lambda d: _raw_recipe(d, BILLION_LAUGHS), USER, "expands to more than"),
    "recipe not utf-8": (lambda d: _raw_recipe(d, b"\xff\xfe\x00bad"), USER, "not a UTF-8 text file"),
    "recipe too large": (lambda d: _raw_recipe(d, "# " + "x" * (1 << 20) + "\n"), USER, "too large for a recipe"),
    "unknown key typo": (lambda d: _mutated(d, lambda r: r.update(stagez=r.pop("stages"))), USER, "did you mean 'stages'"),
    "missing model": (lambda d: _mutated(d, lambda r: r.pop("model")), USER, "model: required key is missing"),
    "unknown pass": (lambda d: _mutated(d, lambda r: r["stages"]["simplify"].update({"pass": "simplfy"})), USER, "did you mean 'simplify'"),
    "stage cycle": (lambda d: _mutated(d, lambda r: r["stages"].update(
        a={"pass": "simplify", "after": "b"}, b={"pass": "simplify", "after": "a"})), USER, "form a cycle"),
    "unknown parent": (lambda d: _mutated(d, lambda r: r["stages"]["simplify"].update(after="exprot")), USER, "unknown stage 'exprot'"),
    "bad param value": (lambda d: _mutated(d, lambda r: r["stages"]["simplify"].update(params={"backend": "magic"})), USER, "stages.simplify.params.backend"),
    "dims out of order": (lambda d: _mutated(d, lambda r: r["dims"].update(batch={"min": 8, "opt": 2, "max": 1})), USER, "min <= opt <= max"),
    "negative timeout": (lambda d: _mutated(d, lambda r: r["stages"]["simplify"].update(timeout_s=-5)), USER, "stages.simplify.timeout_s"),
    "stage name escapes": (lambda d: _mutated(d, lambda r: r["stages"].update({"../../evil": {"pass": "simplify", "after": "export"}})), USER, "not a plain name"),
    "output escapes": (lambda d: _mutated(d, lambda r: r.update(output="../../../../tmp/optpipe-escape")), USER, "output: '../../../../tmp/optpipe-escape' resolves to"),
    "data path escapes": (lambda d: _mutated(d, lambda r: r["data"].update(eval={"source": "npy", "path": "/etc/passwd"})), USER, "data.eval.path"),
    "model path escapes by symlink": (lambda d: (os.symlink("/etc", d / "etc-link"), _mutated(d, lambda r: r["model"].update(onnx="etc-link/hosts")))[1], USER, "model.onnx: 'etc-link/hosts' resolves to"),
    "factory runs a shell": (lambda d: _mutated(d, lambda r: r.update(model={"factory": "os:system", "kwargs": {"command": "touch pwned"}})), USER, "standard library"),
    # models
    "onnx file missing": (lambda d: _mutated(d, lambda r: r["model"].update(onnx="model/missing.onnx")), USER, "does not exist"),
    "not an onnx file": (lambda d: _with_model(d, lambda f: (f.mkdir(parents=True), (f / "model.onnx").write_text("<html>not a model</html>"))), USER, "not an ONNX model"),
    "truncated onnx": (lambda d: _with_model(d, lambda f: _truncate(write_linear_onnx(f), 0.6)), USER, "model.onnx"),
    "external data escapes": (lambda d: _with_model(d, _escaping_external_data), USER, "outside the model's folder"),
    "external data symlinked out": (lambda d: _with_model(d, _symlinked_external_data), USER, "outside the model's folder"),
    "external data truncated": (lambda d: _with_model(d, lambda f: (write_linear_onnx(f), _truncate(f / "model.onnx.data", 0.5))), USER, "is truncated"),
    "external data missing": (lambda d: _with_model(d, lambda f: (write_linear_onnx(f), (f / "model.onnx.data").unlink())), USER, "which is missing"),
    "input name mismatch": (lambda d: _with_model(d, lambda f: write_linear_onnx(f, input_name="pixels")), USER, "make the recipe's input names match"),
    "input dtype mismatch": (lambda d: _with_model(d, lambda f: write_linear_onnx(f, dtype=onnx.TensorProto.DOUBLE)), USER, "inputs.0.dtype"),
    "input shared by the batch (fixed lead)": (lambda d: _mutated(d, lambda r: r["inputs"].append({"name": "codes", "dtype": "float32", "shape": [4, 16]})),
                                               USER, "inputs.1 ('codes') leads with the fixed size 4, while inputs.0 ('x') leads with the batch dim 'batch'"),
    "input shared by the batch (0-d)": (lambda d: _mutated(d, lambda r: r["inputs"].append({"name": "t", "dtype": "float32", "shape": []})),
                                        USER, "inputs.1 ('t') is 0-d (one value), while inputs.0 ('x') leads with the batch dim"),
    "input fixed dim mismatch": (lambda d: _with_model(d, lambda f: write_linear_onnx(f, in_dim=12)), USER, "fixes axis 1 of 'x' to 12"),
    "unknown standard op": (lambda d: _with_model(d, write_custom_op_onnx), USER, "model.onnx: 'model.onnx' uses ops that no ONNX schema defines"),
    "custom domain op": (lambda d: _with_model(d, lambda f: write_custom_op_onnx(f, "com.example")), USER, "ONNX Runtime cannot run op 'FrobnicateTensor'"),
    "nan outputs": (lambda d: _with_model(d, lambda f: write_linear_onnx(f, op="log"), {"export": {"pass": "export"}}), STAGE, "stage 'export' failed: it outputs NaN or Inf in 'y'"),
    "pickled checkpoint": (_pickled_checkpoint, USER, "set `model.allow_pickle: true` if you trust the file"),
    "checkpoint does not fit": (_mismatched_checkpoint, USER, "does not fit the factory's module"),
    "factory forward fails on the inputs": (lambda d: _factory_recipe(d, inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", 12]}]),
                                            USER, "the PyTorch model fails on the recipe's inputs (x [1, 12] float32)"),
    "factory module missing": (lambda d: _mutated(d, lambda r: r.update(model={"factory": "no_such_module_xyz:build", "path": "."})), USER, "module 'no_such_module_xyz' is not in model.path"),
    # data
    "eval data wrong dtype": (lambda d: _with_eval_data(d, x=np.zeros((4, 16), np.float64)), USER, "data.eval: input 'x' is float64"),
    "eval data wrong rank": (lambda d: _with_eval_data(d, x=np.zeros((4, 16, 1), np.float32)), USER, "has rank 3"),
    "eval data missing input": (lambda d: _with_eval_data(d, pixels=np.zeros((4, 16), np.float32)), USER, "no array for input 'x'"),
    "calibration data with Inf": (lambda d: _with_eval_data(d, "calibration", x=np.full((4, 16), np.inf, np.float32)), USER,
                                  "data.calibration: input 'x' holds NaN or Inf (64 of 64 values), so no quantization range"),
    "calibration data wrong size": (lambda d: _with_eval_data(d, "calibration", x=np.zeros((4, 15), np.float32)), USER, "data.calibration: input 'x' has size 15 on axis 1"),
    "eval data pickled objects": (lambda d: _with_eval_data(d, x=np.array([{"a": 1}] * 4, dtype=object)), USER, "not a readable npz"),
    "eval data not npz": (lambda d: (d.mkdir(exist_ok=True), (d / "data.npz").write_text("nope"), _mutated(d, lambda r: r["data"].update(eval={"source": "npz", "path": "data.npz"})))[2], USER, "not a readable npz"),
    "eval data with a NaN": (lambda d: _mutated(d, lambda r: r.update(
        stages={"export": {"pass": "export"}},
        data={**r["data"], "eval": {"source": "npz", "samples": 4,
                                    "path": _npz(d, x=np.where(np.eye(4, 16) > 0, np.nan, 0.5).astype(np.float32))}})),
        STAGE, "the data itself has NaN or Inf in input 'x' (4 of 64 values): fix the data"),
    "eval data missing file": (lambda d: _mutated(d, lambda r: r["data"].update(eval={"source": "npz", "path": "gone.npz"})), USER, "does not exist"),
    # resources
    "stage over its time limit": (lambda d: _with_model(d, write_linear_onnx, _stage("sleepy", timeout_s=1)), STAGE, "exceeded its time limit of 1 s; raise stages.bad.timeout_s"),
    "stage out of memory": (lambda d: _with_model(d, write_linear_onnx, _stage("hog")), STAGE, "stage 'bad' failed: ran out of memory"),
    "stage killed like by the oom killer": (lambda d: _with_model(d, write_linear_onnx, _stage("selfkill", timeout_s=60)), STAGE, "killed (SIGKILL), most likely by the system running out of memory"),
    # command line
    "only an unknown stage": (lambda d: _recipe_file(d) + ["--only", "nope"], USER, "--only: unknown stage 'nope'"),
    "gc without limits": (lambda d: ["cache", "--cache-dir", str(d / "c"), "gc"], USER, "give --older-than"),
    "gc with a bad size": (lambda d: ["cache", "--cache-dir", str(d / "c"), "gc", "--max-size", "lots"], USER, "not a size"),
}


# --- issue 10 (round two): the examples, then what an attacker or a careless user tries ---


def _set(path: str, value):
    """A change to the recipe at a dotted path (`evaluate.tolerance.max_abs`), creating mappings."""

    def change(recipe: dict) -> None:
        *parents, last = path.split(".")
        node = recipe
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return change


def _value(path: str, value) -> Callable[[Path], list[str]]:
    """`validate` a recipe with one value changed: what the check lets through, or not."""
    def build(folder: Path) -> list[str]:
        write_linear_onnx(folder / "model")
        recipe = onnx_recipe(folder)
        _set(path, value)(recipe)
        return ["validate", str(write_recipe(folder, recipe))]

    return build


def _yaml_text(folder: Path, text: str) -> list[str]:
    write_linear_onnx(folder / "model")
    return _raw_recipe(folder, text)


BASE_YAML = """name: tiny
model: {onnx: model/model.onnx}
inputs: [{name: x, dtype: float32, shape: [batch, 16]}]
dims: {batch: {min: 1, opt: 2, max: 8}}
"""
STAGES_YAML = "stages:\n  export: {pass: export}\n  simplify: {pass: simplify, after: export}\n"
DEEP_YAML = "a: " + "[" * 3000 + "]" * 3000 + "\n"
LAUGHS_MAPPINGS = "a: &a {k0: x, k1: x, k2: x, k3: x, k4: x, k5: x, k6: x, k7: x, k8: x, k9: x}\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} {{{', '.join(f'k{j}: *{chr(97 + i)}' for j in range(10))}}}\n" for i in range(6)
)


def _int_input_onnx(folder: Path) -> Path:
    """y = float(ids) @ W: a model with an int64 input, for synthetic integer ranges."""
    folder.mkdir(parents=True, exist_ok=True)
    weight = numpy_helper.from_array(np.ones((16, 4), np.float32), "W")
    nodes = [helper.make_node("Cast", ["ids"], ["f"], to=onnx.TensorProto.FLOAT), helper.make_node("MatMul", ["f", "W"], ["y"])]
    graph = helper.make_graph(nodes, "ints", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["batch", 16])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 4])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save_model(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


def _int_input_recipe(folder: Path, **spec) -> list[str]:
    _int_input_onnx(folder / "model")
    recipe = onnx_recipe(folder)
    recipe["inputs"] = [{"name": "ids", "dtype": "int64", "shape": ["batch", 16], **spec}]
    return ["compile", str(write_recipe(folder, recipe))]


def _opset_99(folder: Path) -> None:
    path = write_linear_onnx(folder)
    model = onnx.load(str(path), load_external_data=False)
    model.opset_import[0].version = 99
    onnx.save_model(model, str(path))


def _sequence_output(folder: Path) -> None:
    """The graph ends in a sequence of tensors (SplitToSequence): every evaluation had failed as "fix the data"."""
    path = write_linear_onnx(folder)
    model = onnx.load(str(path))
    model.graph.node.append(onnx.helper.make_node("SplitToSequence", ["y"], ["pieces"], axis=1))
    del model.graph.output[:]
    model.graph.output.append(onnx.helper.make_tensor_sequence_value_info("pieces", onnx.TensorProto.FLOAT, None))
    onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)


def _lying_initializer(folder: Path) -> None:
    """An initializer that declares 100x the rows its data holds."""
    path = write_linear_onnx(folder)
    model = onnx.load(str(path))
    model.graph.initializer[0].dims[0] = 1600
    onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx.data", size_threshold=0)


def _absolute_external_data(folder: Path) -> None:
    path = write_linear_onnx(folder)
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "/etc/passwd"
    onnx.save_model(model, str(path))


def _npz_lying_header(folder: Path) -> list[str]:
    """An npz whose member declares 2^40 rows (64 TiB) and holds 64 bytes."""
    from numpy.lib import format as npy_format

    folder.mkdir(parents=True, exist_ok=True)
    member = io.BytesIO()
    npy_format.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": False, "shape": (2**40, 16)})
    member.write(b"\0" * 64)
    with zipfile.ZipFile(folder / "data.npz", "w") as archive:
        archive.writestr("x.npy", member.getvalue())
    recipe = onnx_recipe(folder)
    recipe["data"]["eval"] = {"source": "npz", "path": "data.npz", "samples": 4}
    return _recipe_file(folder, recipe)


def _special_file_as(folder: Path, make, where: str) -> list[str]:
    """The recipe names, inside its own folder, a FIFO or a link to a device (reading it blocks or never ends)."""
    write_linear_onnx(folder / "model")
    make(folder / "special")
    recipe = onnx_recipe(folder)
    if where == "model":
        recipe["model"] = {"onnx": "special"}
    else:
        recipe["data"]["eval"] = {"source": "npy", "path": "special"}
    return ["compile", str(write_recipe(folder, recipe))]


def _finished_run(folder: Path) -> None:
    """A compiled run (in-process, quietly) for the commands that read one."""
    from optpipe.execution.pipeline import RunOptions, compile_recipe
    from optpipe.safety.recipe_loading import load_recipe

    write_linear_onnx(folder / "model")
    recipe = onnx_recipe(folder, stages={"export": {"pass": "export"}})
    compile_recipe(load_recipe(write_recipe(folder, recipe)), RunOptions())


def _export_to_a_file(folder: Path) -> list[str]:
    _finished_run(folder)
    (folder / "run" / "bundle").write_text("not a folder")
    return ["export", str(folder / "run"), "--stage", "export", "--format", "ort", "--to", str(folder / "run" / "bundle")]


def _folder_with_sources(folder: Path) -> Path:
    """A project folder: what an empty OPTPIPE_CACHE used to turn into the cache."""
    project = folder / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.py").write_text("print('precious')\n")
    (project / "stages" / "notes").mkdir(parents=True)
    (project / "stages" / "notes" / "todo.txt").write_text("precious\n")
    return project


def _cache_subfolder_is_a_file(folder: Path, sub: str = "stages") -> list[str]:
    args = _recipe_file(folder)
    from optpipe.cache.store import StageCache

    StageCache(folder / "cache")
    shutil.rmtree(folder / "cache" / sub, ignore_errors=True)
    (folder / "cache" / sub).write_text("a file where a folder was")
    return args


def _recipe_with_cache(folder: Path, cache, output="run") -> list[str]:
    return _mutated(folder, lambda r: r.update(cache=cache, output=output))


def _symlink_loop(folder: Path, name: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    os.symlink(name, folder / name)
    return name


ROUND_TWO = {
    # 1-3: cache commands on folders that are not caches, runs and caches nested, factories running code
    "cache gc on a project folder": (lambda d: ["cache", "--cache-dir", str(_folder_with_sources(d)), "gc", "--older-than", "0s"], USER, "is not an optpipe cache"),
    "cache verify --delete on a project folder": (lambda d: ["cache", "--cache-dir", str(_folder_with_sources(d)), "verify", "--delete"], USER, "is not an optpipe cache"),
    "cache ls on a file": (lambda d: (d.mkdir(exist_ok=True), (d / "f").write_text("x"), ["cache", "--cache-dir", str(d / "f"), "ls"])[2], USER, "is not an optpipe cache"),
    "compile with a project folder as cache": (lambda d: (_folder_with_sources(d), _recipe_with_cache(d, "project"))[1], USER, "is not an optpipe cache (it holds"),
    "output inside the cache": (lambda d: _recipe_with_cache(d, "cache", "cache/run"), USER, "is inside the cache"),
    "cache inside the output": (lambda d: _recipe_with_cache(d, "run/cache"), USER, "is inside the run folder"),
    "validate: output inside the cache": (_value("output", "cache/run"), USER, "is inside the cache"),
    "output is the cache": (lambda d: _recipe_with_cache(d, "cache", "cache"), USER, "is inside the cache"),
    "two recipes, the second run inside the cache": (lambda d: _recipe_file(d) + [str(write_recipe(d, onnx_recipe(d, output="cache/run2"), "second.yaml"))], USER, "is inside the cache"),
    "output inside the cache by --output": (lambda d: _recipe_file(d) + ["--output", str(d / "cache" / "stages" / "x")], USER, "is inside the cache"),
    "factory numpy savetxt": (lambda d: _mutated(d, lambda r: r.update(model={"factory": "numpy:savetxt", "kwargs": {"fname": "pwned.txt", "X": [1]}})), USER, "module 'numpy' is not in a `model.path` folder"),
    "factory of an installed module beside model.path": (lambda d: _mutated(d, lambda r: r.update(model={"factory": "numpy:savetxt", "path": ".", "kwargs": {"fname": "pwned.txt", "X": [1]}})), USER, "--allow-factory numpy"),
    "factory of optpipe internals": (lambda d: _mutated(d, lambda r: r.update(model={"factory": "optpipe.cli.main:main"})), USER, "module 'optpipe.cli.main' is not in"),
    "factory relative module": (lambda d: _mutated(d, lambda r: r.update(model={"factory": "..tiny:build", "path": "."})), USER, "is not in model.path"),
    "factory stdlib even if allowed": (lambda d: _mutated(d, lambda r: r.update(model={"factory": "os:system", "kwargs": {"command": "touch pwned"}})) + ["--allow-factory", "os"], USER, "standard library"),
    "factory path is a file": (lambda d: (d.mkdir(exist_ok=True), (d / "tiny.py").write_text("def build():\n    open('pwned', 'w')\n"),
                                          _mutated(d, lambda r: r.update(model={"factory": "tiny:build", "path": "tiny.py"})))[2], USER, "is not in model.path"),
    # 5: values that hang or exhaust the machine
    "dims near 2^40 with a pow2 sweep": (lambda d: _mutated(d, lambda r: (r["dims"].update(batch={"min": 1, "opt": 2, "max": 2**40}), r["evaluate"].update(sweep={"batch": "pow2"}))), USER, "lower dims.batch.max"),
    "dims near 2^40 without a sweep": (_value("dims.batch.max", 2**40), USER, "lower dims.batch.max"),
    "three dims whose product exhausts memory": (lambda d: _mutated(d, lambda r: (r["dims"].update(seq={"min": 1, "opt": 8, "max": 10**6}, batch={"min": 1, "opt": 2, "max": 10**4}),
                                                                                   r["inputs"][0].update(shape=["batch", "seq", 16]))), USER, "lower dims.batch.max or dims.seq.max"),
    "samples absurd": (_value("data.eval.samples", 10**9), USER, "data.eval.samples"),
    "samples beyond memory": (lambda d: _mutated(d, lambda r: (r["inputs"][0].update(shape=["batch", 16, 1024, 1024]), r["data"]["eval"].update(samples=90_000))), USER, "lower data.eval.samples"),
    "accuracy batch beyond memory": (_value("evaluate.accuracy_batch", 10**12), USER, "lower evaluate.accuracy_batch"),
    "iterations absurd": (_value("evaluate.iterations", 10**9), USER, "evaluate.iterations"),
    "warmup absurd": (_value("evaluate.warmup", 10**12), USER, "evaluate.warmup"),
    "sweep of ten thousand points": (lambda d: _mutated(d, lambda r: (r["dims"].update(batch={"min": 1, "opt": 2, "max": 10_000}),
                                                                       r["evaluate"].update(sweep={"batch": list(range(1, 10_001))}))), USER, "evaluate.sweep.batch: 10000 values"),
    "batch sizes by the hundred": (lambda d: _mutated(d, lambda r: (r["dims"].update(batch={"min": 1, "opt": 2, "max": 1000}), r["evaluate"].update(batch_sizes=list(range(1, 201))))), USER, "evaluate.batch_sizes: 200 values"),
    "timeout infinite": (_value("stages.simplify.timeout_s", float("inf")), USER, "stages.simplify.timeout_s"),
    "sweep iterations absurd": (_value("evaluate.sweep_iterations", 10**10), USER, "evaluate.sweep_iterations"),
    # recipe values the check let through
    "batch size zero": (_value("evaluate.batch_sizes", [0]), USER, "evaluate.batch_sizes.0"),
    "batch size negative": (_value("evaluate.batch_sizes", [1, -4]), USER, "evaluate.batch_sizes.1"),
    "batch sizes empty": (_value("evaluate.batch_sizes", []), USER, "evaluate.batch_sizes"),
    "batch size beyond dims max": (_value("evaluate.batch_sizes", [1, 64]), USER, "64 is outside dims.batch [1, 8]"),
    "batch size below dims min": (lambda d: _mutated(d, lambda r: (r["dims"].update(batch={"min": 2, "opt": 2, "max": 8}), r["evaluate"].update(batch_sizes=[1]))), USER, "1 is outside dims.batch [2, 8]"),
    "axis of size zero": (_value("inputs.0.shape", ["batch", 0]), USER, "an axis of size 0"),
    "axis of negative size": (_value("inputs.0.shape", ["batch", -16]), USER, "inputs.0.shape"),
    "dim min zero": (_value("dims.batch", {"min": 0, "opt": 2, "max": 8}), USER, "dims.batch.min"),
    "samples zero": (_value("data.eval.samples", 0), USER, "data.eval.samples"),
    "range high low": (_value("inputs.0.range", [1.0, -1.0]), USER, "inputs.0.range"),
    "range empty": (_value("inputs.0.range", [0.5, 0.5]), USER, "finite low < high"),
    "range with nan": (_value("inputs.0.range", [float("nan"), 1.0]), USER, "inputs.0.range"),
    "fill infinite": (_value("inputs.0.fill", float("inf")), USER, "inputs.0.fill"),
    "max_abs negative": (_value("evaluate.tolerance.max_abs", -1.0), USER, "evaluate.tolerance.max_abs"),
    "max_abs infinite": (_value("evaluate.tolerance.max_abs", float("inf")), USER, "evaluate.tolerance.max_abs"),
    "cosine_min above one": (_value("evaluate.tolerance.cosine_min", 1.5), USER, "evaluate.tolerance.cosine_min"),
    "cosine_min below minus one": (_value("evaluate.tolerance.cosine_min", -2.0), USER, "evaluate.tolerance.cosine_min"),
    "cosine_min nan": (_value("evaluate.tolerance.cosine_min", float("nan")), USER, "evaluate.tolerance.cosine_min"),
    "top1_min negative": (_value("evaluate.tolerance.top1_min", -0.1), USER, "evaluate.tolerance.top1_min"),
    "top1_min above one": (_value("evaluate.tolerance.top1_min", 1.01), USER, "evaluate.tolerance.top1_min"),
    "stage tolerance nan": (_value("stages.simplify.tolerance", {"max_abs": float("nan")}), USER, "stages.simplify.tolerance.max_abs"),
    "timeout nan": (_value("stages.simplify.timeout_s", float("nan")), USER, "stages.simplify.timeout_s"),
    "inputs empty": (_value("inputs", []), USER, "inputs"),
    # YAML
    "duplicate stages key": (lambda d: _yaml_text(d, BASE_YAML + STAGES_YAML + "stages:\n  export: {pass: export}\n"), USER, "key 'stages' appears twice"),
    "duplicate stage name": (lambda d: _yaml_text(d, BASE_YAML + STAGES_YAML + "  export: {pass: simplify}\n"), USER, "line 8"),
    "duplicate nested param": (lambda d: _yaml_text(d, BASE_YAML + "stages:\n  export: {pass: export, params: {opset: 18, opset: 20}}\n"), USER, "key 'opset' appears twice"),
    "deep yaml nesting": (lambda d: _raw_recipe(d, DEEP_YAML), USER, "nests deeper than"),
    "deep yaml mappings": (lambda d: _raw_recipe(d, "a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 200)) + "  " * 200 + "v\n"), USER, "nests deeper than"),
    "billion laughs of mappings": (lambda d: _raw_recipe(d, LAUGHS_MAPPINGS), USER, "expands to more than"),
    "empty recipe file": (lambda d: _raw_recipe(d, ""), USER, "expected a mapping"),
    "recipe is a folder": (lambda d: (d.mkdir(exist_ok=True), ["validate", str(d)])[1], USER, "is a folder"),
    "recipe is /dev/zero": (lambda d: ["validate", "/dev/zero"], USER, "not a regular file"),
    "recipe is a fifo": (lambda d: (d.mkdir(exist_ok=True), os.mkfifo(d / "r.yaml"), ["validate", str(d / "r.yaml")])[2], USER, "not a regular file"),
    # names and paths
    "stage name unicode": (_value("stages", {"éxport": {"pass": "export"}}), USER, "not a plain name"),
    "stage name with a newline": (_value("stages", {"export\nerror: forged": {"pass": "export"}}), USER, "export\\nerror: forged"),
    "recipe name with a slash": (_value("name", "../../etc/x"), USER, "name: '../../etc/x' is not a plain name"),
    "model is a folder": (lambda d: _mutated(d, lambda r: r["model"].update(onnx="model")), USER, "is a folder"),
    "model is a fifo": (lambda d: _special_file_as(d, os.mkfifo, "model"), USER, "not a regular file"),
    "model links to /dev/zero": (lambda d: _special_file_as(d, lambda p: os.symlink("/dev/zero", p), "model"), USER, "resolves to /dev/zero"),
    "data is a fifo": (lambda d: _special_file_as(d, os.mkfifo, "data"), USER, "not a regular file or folder"),
    "data links to /dev/urandom": (lambda d: _special_file_as(d, lambda p: os.symlink("/dev/urandom", p), "data"), USER, "data.eval.path"),
    "output is a file": (lambda d: (d.mkdir(exist_ok=True), (d / "run").write_text("x"), _recipe_file(d))[2], USER, "output folder"),
    "output a folder of the user's files": (lambda d: (d.mkdir(exist_ok=True), (d / "mine" / "logs").mkdir(parents=True), (d / "mine" / "report.md").write_text("notes"),
                                                      _recipe_file(d) + ["--output", str(d / "mine")])[3], USER, "holds report.md, logs, which a run would write over"),
    "output is the model's own folder": (lambda d: (args := _mutated(d, lambda r: r.update(output="model")), (d / "model" / "report.md").write_text("notes"), args)[2],
                                         USER, "is not an optpipe run folder and holds report.md"),
    "output name too long": (lambda d: _recipe_file(d) + ["--output", str(d / ("r" * 300))], USER, "too long"),
    "cache is a file": (lambda d: (d.mkdir(exist_ok=True), (d / "cache").write_text("x"), _recipe_file(d))[2], USER, "cache folder"),
    # /proc makes no new folders (mkdir says ENOENT, as root too): was "internal error: FileNotFoundError"
    "--cache-dir under /proc": (lambda d: _recipe_file(d) + ["--cache-dir", "/proc/optpipe-test-cache"], USER, "cache folder '/proc/optpipe-test-cache'"),
    "--output under /proc": (lambda d: _recipe_file(d) + ["--output", "/proc/optpipe-test-run"], USER, "output folder '/proc/optpipe-test-run'"),
    "init --output under /proc": (lambda d: (write_linear_onnx(d / "model"), ["init", str(d / "model" / "model.onnx"), "-o", "/proc/optpipe-test.yaml"])[1],
                                  USER, "/proc"),
    "cache is a symlink loop": (lambda d: _recipe_with_cache(d, _symlink_loop(d, "loop")), USER, "cache: 'loop' is a symlink loop"),
    "--cache-dir is a symlink loop": (lambda d: _recipe_file(d) + ["--cache-dir", str(d / _symlink_loop(d, "loop"))], USER, "cache folder"),
    "cache sub-folder is a file": (_cache_subfolder_is_a_file, USER, "'stages' is a file"),
    "cache datasets folder is a file": (lambda d: _cache_subfolder_is_a_file(d, "datasets"), USER, "cache/datasets': a file stands where a folder is needed; remove that file"),
    "OPTPIPE_CACHE is a file": (lambda d: (d.mkdir(exist_ok=True), (d / "cfile").write_text("x"), _recipe_with_cache(d, None))[2], USER, "is a file", {"OPTPIPE_CACHE": lambda d: str(d / "cfile")}),
    "OPTPIPE_CACHE is the project": (lambda d: (_folder_with_sources(d), _recipe_with_cache(d, None))[1], USER, "is not an optpipe cache", {"OPTPIPE_CACHE": lambda d: str(d / "project")}),
    "OPTPIPE_PLUGINS names a missing module": (lambda d: _recipe_file(d), USER, "cannot import pass module", {"OPTPIPE_PLUGINS": "no_such_plugin_xyz"}),
    # models and data that lie
    "onnx opset 99": (lambda d: _with_model(d, _opset_99), USER, "declares opset 99, newer than any ONNX release"),
    "onnx initializer larger than its data": (lambda d: _with_model(d, _lying_initializer), USER, "is not a valid ONNX model"),
    "onnx output a sequence of tensors": (lambda d: _with_model(d, _sequence_output), USER, "output 'pieces' of 'model.onnx' is a sequence of tensors, not a tensor"),
    "onnx external data at an absolute path": (lambda d: _with_model(d, _absolute_external_data), USER, "outside the model's folder"),
    "npz header declares 64 TiB": (_npz_lying_header, USER, "ends before the 4 rows its header declares"),
    "text data with an onnx model": (lambda d: (d.mkdir(exist_ok=True), (d / "t.txt").write_text("hello\n"),
                                                _mutated(d, lambda r: r["data"].update(eval={"source": "text", "path": "t.txt"})))[2], USER, "an ONNX file has none; add `tokenizer: {hf: FOLDER}`"),
    "synthetic integer range holding no integer": (lambda d: _int_input_recipe(d, range=[0.2, 0.7]), USER, "fix inputs.0.range"),
    "synthetic fill out of dtype": (lambda d: _int_input_recipe(d, dtype="uint8", fill=300), USER, "inputs.0"),
    # command line
    "export --to an existing file": (_export_to_a_file, USER, "--to: "),
    "gc with a negative age": (lambda d: ["cache", "--cache-dir", str(d / "c"), "gc", "--older-than", "-1d"], USER, "not an age"),
    # remote caches and cache markers (issues 21, 22)
    "--remote-cache is a file": (lambda d: _remote(d, lambda r: r.write_text("x")), USER, "is a file, not a folder; point --remote-cache"),
    "--remote-cache under a file": (lambda d: _remote(d, lambda r: r.write_text("x"), "/sub"), USER, "--remote-cache"),
    "--remote-cache with an unknown protocol": (lambda d: _recipe_file(d) + ["--remote-cache", "nosuch://bucket/x"], USER, "use s3://, gs://, file://"),
    "--remote-cache gs:// without gcsfs": (lambda d: _recipe_file(d) + ["--remote-cache", "gs://bucket/x"], USER, "gcsfs"),
    "cache marker left empty by a full disk": (lambda d: _recipe_with_cache(d, _empty_marker(d)), USER, "delete '"),
}


def _remote(folder: Path, make, tail: str = "") -> list[str]:
    args = _recipe_file(folder)
    make(folder / "remote")
    return args + ["--remote-cache", f"file://{folder / 'remote'}{tail}"]


def _empty_marker(folder: Path) -> str:
    (folder / "old-cache").mkdir(parents=True)
    (folder / "old-cache" / "CACHEDIR.TAG").write_bytes(b"")  # what a full disk left before the marker was atomic
    return "old-cache"


CASES.update(ROUND_TWO)


# --- evaluation that fails on the user's input: exit 2 with the key to change, never "a stage failed" ---


def _with_task(folder: Path, **task) -> list[str]:
    return _mutated(folder, _set("evaluate.task", task))


def _labelled_eval(folder: Path, labels: np.ndarray) -> list[str]:
    recipe = onnx_recipe(folder)
    x = np.random.default_rng(0).standard_normal((len(labels), 16)).astype(np.float32)
    recipe["data"]["eval"] = {"source": "npz", "path": _npz(folder, x=x, labels=labels), "samples": len(labels)}
    recipe["evaluate"]["task"] = {"kind": "classification"}
    return _recipe_file(folder, recipe)


def _labels_file(folder: Path, task: dict | None, where: str = "eval") -> list[str]:
    recipe = onnx_recipe(folder)
    np.save(folder / "labels.npy", np.zeros(16, dtype=np.int64))
    recipe["data"].setdefault(where, {})["labels"] = "labels.npy"
    if task:
        recipe["evaluate"]["task"] = task
    return _recipe_file(folder, recipe)


def _ids_beyond_vocabulary(folder: Path, data: bool = True) -> list[str]:
    """Token ids the model's embedding table (16 rows) does not have: in the eval data (the recipe's
    `range` fits), or in the synthetic inputs the recipe's `range` builds (caught by preflight)."""
    (folder / "model").mkdir(parents=True, exist_ok=True)
    table = numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32), "E")
    axis = numpy_helper.from_array(np.array([1], np.int64), "axis")
    nodes = [helper.make_node("Gather", ["E", "ids"], ["emb"]), helper.make_node("ReduceMax", ["emb", "axis"], ["y"], keepdims=0)]
    graph = helper.make_graph(nodes, "embed", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["batch", 16])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 4])], [table, axis])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.save_model(model, str(folder / "model" / "model.onnx"))
    recipe = onnx_recipe(folder, stages={"export": {"pass": "export"}})
    recipe["inputs"] = [{"name": "ids", "dtype": "int64", "shape": ["batch", 16], "range": [0, 16] if data else [0, 1000]}]
    if data:
        recipe["data"]["eval"] = {"source": "npz", "path": _npz(folder, ids=np.full((4, 16), 40, np.int64)), "samples": 4}
    return ["compile", str(write_recipe(folder, recipe))]


def _factory_ids_beyond_vocabulary(folder: Path) -> list[str]:
    """A PyTorch model (with its eager baseline) and eval ids past its embedding table: forward()
    refuses them as ONNX Runtime does, so the data is at fault, in one line."""
    recipe = onnx_recipe(folder)
    recipe["inputs"] = [{"name": "ids", "dtype": "int64", "shape": ["batch", 16], "range": [0, 16]}]
    recipe["model"] = {"factory": "reliability_fixtures:tiny_embedding", "path": str(HERE)}
    recipe["evaluate"]["eager_baseline"] = True
    recipe["data"]["eval"] = {"source": "npz", "path": _npz(folder, ids=np.full((4, 16), 40, np.int64)), "samples": 4}
    return ["compile", str(write_recipe(folder, recipe)), "--allow-path", str(HERE)]


EVALUATION_INPUT = {
    "tolerance for an output the model lacks": (lambda d: _mutated(d, _set("evaluate.tolerance", {"outputs": {"logits": {"cosine_min": 0.9}}})),
                                                USER, "evaluate.tolerance.outputs: the model has no output 'logits'; its outputs are 'y'"),
    "stage tolerance for an output the model lacks": (lambda d: _mutated(d, _set("stages.simplify.tolerance", {"outputs": {"z": {"max_abs": 0.1}}})),
                                                      USER, "stages.simplify.tolerance.outputs: the model has no output 'z'"),
    "task output the model lacks": (lambda d: _with_task(d, kind="classification", output="scores"), USER, "evaluate.task.output: the model has no output 'scores'"),
    "detection task on a classifier's output": (lambda d: _with_task(d, kind="detection"), USER, "change evaluate.task.kind"),
    "labels beyond the output's classes": (lambda d: _labelled_eval(d, np.arange(6) + 3), USER, "data.eval: labels run from 3 to 8, but the task's output has 4 classes"),
    "negative labels": (lambda d: _labelled_eval(d, np.array([0, 1, -1, 2])), USER, "data.eval: labels run from -1 to 2"),
    # A labels file nothing reads: the user would believe top-1 on it was held.
    "labels without a task": (lambda d: _labels_file(d, None), USER, "data.eval.labels: only a classification or segmentation task reads labels, and evaluate.task is not set"),
    "labels for a detector": (lambda d: _labels_file(d, {"kind": "detection"}), USER, "evaluate.task is detection"),
    "labels on calibration data": (lambda d: _labels_file(d, {"kind": "classification"}, "calibration"), USER, "data.calibration.labels: calibration reads no labels"),
    "eval ids beyond the model's vocabulary": (lambda d: _ids_beyond_vocabulary(d), USER, "data.eval: the recipe's own model fails on the evaluation data"),
    "synthetic ids beyond the model's vocabulary": (lambda d: _ids_beyond_vocabulary(d, data=False), USER,
                                                    "inputs: 'model.onnx' fails on inputs built from the recipe's input specs (ids [2, 16])"),
    "factory: eval ids beyond the model's vocabulary": (lambda d: _factory_ids_beyond_vocabulary(d), USER,
                                                        "data.eval: the recipe's own model fails on the evaluation data"),
    "a stage breaks the model at run time": (lambda d: _with_model(d, write_linear_onnx, _stage("runbreak")), STAGE, "stage 'bad' failed: evaluation failed"),
    "factory: tolerance for an output the model lacks": (lambda d: _factory_recipe(d, evaluate_tolerance=True), USER, "tolerance.outputs: the model has no output 'z'"),
}


CASES.update(EVALUATION_INPUT)


# --- files named model.onnx that are not usable ONNX: refused up front (exit 2), never a failed stage ---


def _lying_text(text: str):
    """A model.onnx written from ONNX's text syntax: it parses, and lies in what its text says."""

    def write(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        onnx.save_model(onnx.parser.parse_model(text), str(folder / "model.onnx"))

    return write


def _bytes_as_model(data: bytes):
    def write(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.onnx").write_bytes(data)

    return write


def _another_protobuf(folder: Path) -> None:
    """A protobuf, but an ONNX tensor, not a model."""
    folder.mkdir(parents=True, exist_ok=True)
    tensor = numpy_helper.from_array(np.ones((16, 4), np.float32), "W")
    (folder / "model.onnx").write_bytes(tensor.SerializeToString())


def _head_of_header(folder: Path) -> None:
    """Cut inside the graph's first node: the protobuf ends mid-message."""
    path = write_linear_onnx(folder)
    _truncate(path, 0.2)


_HEADER = '<ir_version: 9, opset_import: ["" : 18]>\n'
LYING = {
    "random bytes": (_bytes_as_model(np.random.default_rng(7).bytes(4096)), "not an ONNX model"),
    "a text file": (_bytes_as_model(b"y = x @ W + b\nthis is my model, honest\n"), "not an ONNX model"),
    "a zip file": (_bytes_as_model(b"PK\x03\x04" + bytes(200)), "model.onnx"),
    "protobuf cut early": (_head_of_header, "model.onnx"),
    "a tensor, not a model": (_another_protobuf, "not an ONNX model"),
    "dangling node input": (_lying_text(_HEADER + "g (float[batch, 16] x) => (float[batch, 16] y) { y = Add (x, z) }"),
                            "input 'z' of node"),
    "output never produced": (_lying_text(_HEADER + "g (float[batch, 16] x) => (float[batch, 16] y) { h = Relu (x) }"),
                              "not a valid ONNX model"),
    "declared output shape lies": (_lying_text(_HEADER + "g (float[batch, 16] x) => (float[batch, 4] y) { y = Relu (x) }"),
                                   "Inferred shape and existing shape differ"),
    "declared output type lies": (_lying_text(_HEADER + "g (float[batch, 16] x) => (int64[batch, 16] y) { y = Relu (x) }"),
                                  "Inferred elem type differs"),
    "matmul shapes that cannot multiply": (_lying_text(
        _HEADER + "g (float[batch, 16] x) => (float[batch, 4] y) <float[3, 4] w = {1,2,3,4,5,6,7,8,9,10,11,12}> { y = MatMul (x, w) }"),
        "Incompatible dimensions for matrix multiplication"),
    "op missing from its opset": (_lying_text('<ir_version: 9, opset_import: ["" : 11]>\n'
                                              "g (float[batch, 16] x) => (float[batch, 16] y) { y = Gelu (x) }"),
                                  "uses ops that no ONNX schema defines at its opset (Gelu)"),
    "opset from the future": (_lying_text('<ir_version: 9, opset_import: ["" : 40]>\n'
                                          "g (float[batch, 16] x) => (float[batch, 16] y) { y = Relu (x) }"), "declares opset 40"),
    "ir version from the future": (_lying_text('<ir_version: 99, opset_import: ["" : 18]>\n'
                                               "g (float[batch, 16] x) => (float[batch, 16] y) { y = Relu (x) }"), "ir_version 99"),
}


@pytest.mark.parametrize("case", list(LYING))
def test_a_lying_onnx_file_is_refused_before_any_stage(case, tmp_path, monkeypatch, capsys):
    write, words = LYING[case]
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(_with_model(tmp_path, write), capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in out + err and len(errors) == 1, err
    assert words in errors[0] and "stage" not in errors[0], errors[0]
    assert code == USER, (code, err)
    assert not (tmp_path / "run" / "stages").exists(), "preflight refuses the file before any stage runs"


@pytest.mark.parametrize("case", ["random bytes", "declared output shape lies", "opset from the future"])
def test_validate_refuses_a_lying_onnx_file_as_compile_does(case, tmp_path, monkeypatch, capsys):
    write, words = LYING[case]
    monkeypatch.chdir(tmp_path)
    args = _with_model(tmp_path, write)
    code, out, err = run_main(["validate", args[1]], capsys)
    assert code == USER and words in err and "valid;" not in out, (code, out, err)


def _files(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if not p.is_dir()} if folder.exists() else set()


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_one_line(case, tmp_path, monkeypatch, capsys, plugin_passes):
    build, expected_code, words, *env = CASES[case]
    for name, value in (env[0] if env else {}).items():
        monkeypatch.setenv(name, value(tmp_path) if callable(value) else value)
    monkeypatch.delenv("OPTPIPE_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    args = build(tmp_path)
    before = _files(tmp_path)
    code, out, err = run_main(args, capsys)
    # Nothing written outside the run folder and the cache.
    written = {p for p in _files(tmp_path) - before if not {"run", "cache"} & set(p.relative_to(tmp_path).parts[:1])}
    assert not written, written
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in out + err, err
    assert len(errors) == 1, err
    assert words in errors[0], errors[0]
    assert code == expected_code, (code, err)
    assert not (tmp_path / "pwned.txt").exists() and not (tmp_path / "pwned").exists()


def test_the_catalogue_is_large_enough():
    assert len(CASES) >= 25
    assert len(ROUND_TWO) >= 60  # issue 10: its examples plus 30 and more found by attacking the CLI


@pytest.mark.parametrize("task", [None, {"kind": "embeddings"}])
def test_labels_the_data_carries_without_a_classification_task_are_said_to_be_unchecked(task, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = _labelled_eval(tmp_path, np.array([0, 1, 2, 3]))  # an npz `labels` array, read with the data
    recipe = yaml.safe_load(Path(args[1]).read_text())
    recipe["evaluate"].pop("task") if task is None else recipe["evaluate"].update(task=task)
    Path(args[1]).write_text(yaml.safe_dump(recipe))
    code, out, err = run_main(args, capsys)
    assert code == 0, err
    assert "the evaluation data carries labels" in err and "they are not checked" in err, err
    _labelled_eval(tmp_path, np.array([0, 1, 2, 3]))  # with the classification task: read, and nothing said
    code, out, err = run_main(args, capsys)
    assert code == 0 and "carries labels" not in err, err
