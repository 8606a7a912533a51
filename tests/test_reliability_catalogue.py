"""A catalogue of bad inputs (recipes, models, data, resources): each ends the CLI with one
`error:` line that names what to change, the documented exit code, and no traceback.

The CLI runs in-process through `optpipe.cli:main` (the wrapper that turns errors into
lines and exit codes), with the working directory in a fresh folder per case.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from reliability_fixtures import (
    HERE,
    PLUGIN,
    onnx_recipe,
    write_custom_op_onnx,
    write_linear_onnx,
    write_recipe,
)

from optpipe.cli import main

USER, STAGE = 2, 1


def run_main(args: list[str], capsys) -> tuple[int, str, str]:
    """Run the console script in-process; returns (exit code, stdout, stderr)."""
    previous = signal.getsignal(signal.SIGTERM)
    old_argv = sys.argv
    sys.argv = ["optpipe", *args]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = old_argv
        signal.signal(signal.SIGTERM, previous)
    out, err = capsys.readouterr()
    return code, out, err


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


def _factory_recipe(folder: Path, **model) -> list[str]:
    recipe = onnx_recipe(folder)
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
    "input fixed dim mismatch": (lambda d: _with_model(d, lambda f: write_linear_onnx(f, in_dim=12)), USER, "fixes axis 1 of 'x' to 12"),
    "unknown standard op": (lambda d: _with_model(d, write_custom_op_onnx), STAGE, "stage 'export' failed: model.onnx: 'model.onnx' uses ops that no ONNX schema defines"),
    "custom domain op": (lambda d: _with_model(d, lambda f: write_custom_op_onnx(f, "com.example")), STAGE, "ONNX Runtime cannot run op 'FrobnicateTensor'"),
    "nan outputs": (lambda d: _with_model(d, lambda f: write_linear_onnx(f, op="log"), {"export": {"pass": "export"}}), STAGE, "stage 'export' failed: it outputs NaN or Inf in 'y'"),
    "pickled checkpoint": (_pickled_checkpoint, STAGE, "set `model.allow_pickle: true` if you trust the file"),
    "checkpoint does not fit": (_mismatched_checkpoint, STAGE, "does not fit the factory's module"),
    "factory module missing": (lambda d: _mutated(d, lambda r: r.update(model={"factory": "no_such_module_xyz:build"})), STAGE, "cannot import 'no_such_module_xyz'"),
    # data
    "eval data wrong dtype": (lambda d: _with_eval_data(d, x=np.zeros((4, 16), np.float64)), USER, "data.eval: input 'x' is float64"),
    "eval data wrong rank": (lambda d: _with_eval_data(d, x=np.zeros((4, 16, 1), np.float32)), USER, "has rank 3"),
    "eval data missing input": (lambda d: _with_eval_data(d, pixels=np.zeros((4, 16), np.float32)), USER, "no array for input 'x'"),
    "calibration data wrong size": (lambda d: _with_eval_data(d, "calibration", x=np.zeros((4, 15), np.float32)), USER, "data.calibration: input 'x' has size 15 on axis 1"),
    "eval data pickled objects": (lambda d: _with_eval_data(d, x=np.array([{"a": 1}] * 4, dtype=object)), USER, "not a readable npz"),
    "eval data not npz": (lambda d: (d.mkdir(exist_ok=True), (d / "data.npz").write_text("nope"), _mutated(d, lambda r: r["data"].update(eval={"source": "npz", "path": "data.npz"})))[2], USER, "not a readable npz"),
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


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_one_line(case, tmp_path, monkeypatch, capsys, plugin_passes):
    build, expected_code, words = CASES[case]
    monkeypatch.chdir(tmp_path)
    args = build(tmp_path)
    code, out, err = run_main(args, capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in out + err, err
    assert len(errors) == 1, err
    assert words in errors[0], errors[0]
    assert code == expected_code, (code, err)
    assert not (tmp_path / "pwned.txt").exists() and not (tmp_path / "pwned").exists()


def test_the_catalogue_is_large_enough():
    assert len(CASES) >= 25
