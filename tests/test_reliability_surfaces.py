"""Catalogue round three (issues 21 and 22): bad input on the surfaces added since round two
(search spaces, the Ray executor, `init`, `export`, hand-edited reports, symlinks in the run
folder). Each case ends the CLI with one `error:` line naming what to change, the documented exit
code, no traceback, and nothing written outside the run folder and the cache; `init` cases write
nothing at all (`test_a_new_surface_case_gets_one_line`).

Most cases need no model run: they are refused by `validate`, by the search's up-front checks,
or before a Ray instance starts. The export and report cases read one finished run, compiled
once per module (`finished`) and copied per case.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from reliability_fixtures import HERE, onnx_recipe, run_main, write_linear_onnx, write_recipe

USER, STAGE = 2, 1


def _recipe(folder: Path, change=None, command: str = "validate", *flags: str) -> list[str]:
    write_linear_onnx(folder / "model")
    recipe = onnx_recipe(folder)
    if change:
        change(recipe)
    return [command, str(write_recipe(folder, recipe)), *flags]


def _searched(**search):
    """simplify searched over `search` (choices as given)."""
    return lambda r: r["stages"]["simplify"].update(search=search)


def _evaluate_search(**settings):
    return lambda r: (r["stages"]["simplify"].update(search={"backend": ["onnxsim", "onnxslim"]}),
                      r["evaluate"].update(search=settings))


def _resources(stage: dict | None = None, evaluate: dict | None = None):
    def change(r):
        if stage is not None:
            r["stages"]["simplify"]["resources"] = stage
        if evaluate is not None:
            r["evaluate"]["resources"] = evaluate
    return change


# --- search spaces ---------------------------------------------------------------------------

SEARCH = {
    "search: a choice list that is empty": (lambda d: _recipe(d, _searched(backend=[])), USER, "stages.simplify.search.backend: no choices"),
    "search: a choice that is a mapping": (lambda d: _recipe(d, _searched(backend=[{"a": 1}])), USER, "is not a plain value"),
    "search: choices nested two deep": (lambda d: _recipe(d, _searched(backend=[[["onnxsim"]]])), USER, "is not a plain value"),
    "search: a step of 1e-300": (lambda d: _recipe(d, _searched(backend={"min": 0, "max": 1, "step": 1e-300})), USER, "1e+300 steps is too many"),
    "search: an infinite step": (lambda d: _recipe(d, _searched(backend={"min": 0, "max": 1, "step": float("inf")})), USER, "step: Input should be a finite number"),
    "search: a negative step": (lambda d: _recipe(d, _searched(backend={"min": 0, "max": 1, "step": -0.1})), USER, "step: Input should be greater than 0"),
    "search: a range with min above max": (lambda d: _recipe(d, _searched(backend={"min": 2, "max": 1, "step": 1})), USER, "expected min <= max"),
    "search: a NaN range bound": (lambda d: _recipe(d, _searched(backend={"min": float("nan"), "max": 1, "step": 1})), USER, "min: Input should be a finite number"),
    "search: a choice that breaks the pass": (lambda d: _recipe(d, _searched(backend=["onnxslim", "magic"])), USER, "stages.simplify.search.backend"),
    "search: a param the pass does not have": (lambda d: _recipe(d, _searched(backnd=["onnxslim"])), USER, "stages.simplify.search.backnd"),
    "search: a param both set and searched": (lambda d: _recipe(d, lambda r: r["stages"]["simplify"].update(
        params={"backend": "onnxslim"}, search={"backend": ["onnxsim"]})), USER, "backend"),
    "search: a NaN wall-time budget": (lambda d: _recipe(d, _evaluate_search(wall_time_s=float("nan"))), USER, "evaluate.search.wall_time_s"),
    "search: a negative trial budget": (lambda d: _recipe(d, _evaluate_search(trials=-3)), USER, "evaluate.search.trials"),
    "search: an infinite trial budget": (lambda d: _recipe(d, _evaluate_search(trials=float("inf"))), USER, "evaluate.search.trials"),
    "search: a seed beyond numpy's": (lambda d: _recipe(d, _evaluate_search(seed=2**40)), USER, "evaluate.search.seed"),
    "search: an objective listed twice": (lambda d: _recipe(d, _evaluate_search(objectives=["latency", "latency"])), USER, "objectives listed twice"),
    "search: a sampler beside a grid": (lambda d: _recipe(d, _evaluate_search(strategy="grid", sampler="nsga2")), USER, "samples only with strategy optuna"),
    "search: a huge grid without --yes": (lambda d: _recipe(d, lambda r: (r["stages"]["simplify"].update(
        search={"backend": ["onnxsim", "onnxslim"], "check_atol": {"min": 0, "max": 1, "step": 0.001}}),
        r["evaluate"].update(search={"strategy": "grid"})), "compile"), USER, "--yes"),
}

# --- the Ray executor: refused before (or instead of) starting a Ray instance ----------------------

RAY = {
    "ray: resources NaN and negative": (lambda d: _recipe(d, _resources({"CPU": float("nan"), "GPU": -1}), "compile", "--executor", "ray"),
                                        USER, "stages.simplify.resources.CPU: Input should be a finite number"),
    "ray: a negative GPU count": (lambda d: _recipe(d, _resources({"GPU": -1})), USER, "stages.simplify.resources.GPU: Input should be greater than or equal to 0"),
    "ray: an infinite evaluation resource": (lambda d: _recipe(d, _resources(evaluate={"CPU": float("inf")})), USER, "evaluate.resources.CPU"),
    "ray: a resource amount that is text": (lambda d: _recipe(d, _resources({"CPU": "lots"})), USER, "stages.simplify.resources.CPU"),
    "ray: nothing answers at the address": (lambda d: _recipe(d, None, "compile", "--executor", "ray", "--address", "127.0.0.1:1"), USER, "127.0.0.1:1"),
    "ray: an address that is no address": (lambda d: _recipe(d, None, "compile", "--executor", "ray", "--address", "not an address"), USER, "--address"),
    "ray: a Ray Client address nothing answers": (lambda d: _recipe(d, None, "compile", "--executor", "ray", "--address", "ray://127.0.0.1:1"), USER, "--address"),
}

# --- init: garbage, folders, huge files, code it must not call; a failed init writes nothing ---------


def _file(folder: Path, name: str, data: bytes | str = b"") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def _sparse(folder: Path, name: str, size: int) -> Path:
    """A file that says it is `size` bytes and takes no disk (what a 3 GiB download cut short leaves)."""
    path = _file(folder, name)
    os.truncate(path, size)
    return path


def _user_module(folder: Path, text: str, function: str = "build") -> str:
    """A module in the working directory, named after the case folder: each case imports its own
    (an in-process run keeps a module once imported, and the factory guard refuses one imported
    from elsewhere)."""
    name = "user_" + "".join(c if c.isalnum() else "_" for c in folder.name)
    _file(folder, f"{name}.py", text)
    return f"{name}:{function}"


INIT = {
    "init: random bytes named .onnx": (lambda d: ["init", str(_file(d, "m.onnx", np.random.default_rng(3).bytes(2048)))], USER, "is not an ONNX model"),
    "init: an empty .onnx": (lambda d: ["init", str(_file(d, "m.onnx"))], USER, "is empty"),
    "init: a 3 GiB file named .onnx": (lambda d: ["init", str(_sparse(d, "big.onnx", 3 * 2**30))], USER, "over the 2 GiB an ONNX protobuf can hold"),
    "init: a folder without config.json": (lambda d: (d.joinpath("hf").mkdir(parents=True), ["init", str(d / "hf")])[1], USER, "has no config.json"),
    "compile: a model folder that does not exist (a GGUF not converted yet)": (
        lambda d: _recipe(d, lambda r: r.update(model={"hf": "models/gemma"}), "compile"), USER, "scripts/gguf_to_hf.py"),
    "init: a config.json that is not JSON": (lambda d: (_file(d / "hf", "config.json", "{not json"), ["init", str(d / "hf")])[1], USER, "config.json"),
    "init: a text file": (lambda d: ["init", str(_file(d, "notes.txt", "hello"))], USER, "is not an .onnx file, a Hugging Face folder or module:factory"),
    "init: the standard library as factory": (lambda d: ["init", "os:system"], USER, "standard library"),
    "init: shutil as factory": (lambda d: ["init", "shutil:rmtree"], USER, "standard library"),
    "init: an installed module not allowed": (lambda d: ["init", "numpy:savetxt"], USER, "--allow-factory numpy"),
    "init: a module of the working directory whose function fails": (
        lambda d: ["init", _user_module(d, "def build():\n    raise ValueError('broken net')\n")], USER, "broken net"),
    "init: a factory returning no module": (
        lambda d: ["init", _user_module(d, "def build():\n    return 42\n")], USER, "not a torch.nn.Module"),
    "init: a function the module lacks": (lambda d: ["init", _user_module(d, "X = 1\n", "nothing")], USER, ":nothing': AttributeError"),
    "init: a model outside the working directory": (
        lambda d: (write_linear_onnx(d.parent / (d.name + "-outside")), ["init", f"../{d.name}-outside/model.onnx"])[1], USER, "--allow-path"),
    "init: -o in a folder that does not exist": (lambda d: ["init", str(write_linear_onnx(d / "model")), "-o", str(d / "no" / "such" / "r.yaml")],
                                                 USER, "does not exist"),
    "init: -o names a folder": (lambda d: (d.joinpath("taken").mkdir(parents=True), ["init", str(write_linear_onnx(d / "model")), "-o", str(d / "taken"), "--force"])[1],
                                USER, "is not a regular file"),
}

# --- export: over user files, into odd folders -------------------------------------------------


def _finished_run(folder: Path) -> Path:
    """A compiled run (in-process, quietly): the export stage of the linear model."""
    from optpipe.execution.pipeline import RunOptions, compile_recipe
    from optpipe.safety.recipe_loading import load_recipe

    write_linear_onnx(folder / "model")
    compile_recipe(load_recipe(write_recipe(folder, onnx_recipe(folder, stages={"export": {"pass": "export"}}))), RunOptions())
    return folder / "run"


def _export(folder: Path, to: Path | str, *extra: str, stage: str = "export") -> list[str]:
    return ["export", str(_finished_run(folder)), "--stage", stage, "--format", "ort", "--to", str(to), *extra]


def _users_folder(folder: Path) -> Path:
    _file(folder / "dest", "model.onnx", "the user's own model")
    return folder / "dest"


def _linked_folder(folder: Path) -> Path:
    (folder / "elsewhere").mkdir(parents=True)
    (folder / "dest").mkdir()
    os.symlink(folder / "elsewhere", folder / "dest" / "model.onnx")
    return folder / "dest"


EXPORT = {
    "export: over a user's files": (lambda d: _export(d, _users_folder(d)), USER, "holds files optpipe did not write"),
    "export: into the cache": (lambda d: _export(d, d / "cache" / "bundle"), USER, "is inside the cache"),
    "export: into a folder holding the cache": (lambda d: _export(d, d), USER, "choose a folder that does not hold the cache"),
    "export: into a folder with a symlink in it": (lambda d: _export(d, _linked_folder(d)), USER, "is a symlink"),
    "export: a stage the run lacks": (lambda d: _export(d, d / "out", stage="nope"), USER, "stage 'nope' is not in this run"),
    "export: a hand-edited report.json": (lambda d: (_finished_run(d).joinpath("report.json").write_text("{cut"),
                                                      ["export", str(d / "run"), "--stage", "export", "--format", "ort", "--to", str(d / "out")])[1],
                                          USER, "is not a readable optpipe report"),
    "export: from a folder that is no run": (lambda d: ["export", str(d), "--stage", "export", "--format", "ort", "--to", str(d / "out")],
                                             USER, "is not an optpipe run folder"),
}

# --- hand-edited report.json under report / inspect / diff ----------------------------------------


def _edited_report(folder: Path, edit, command: str = "report") -> list[str]:
    run = _finished_run(folder)
    path = run / "report.json"
    edit(path)
    if command == "diff":
        return ["diff", f"{run}:export", f"{run}:export"]
    return [command, str(run)]


def _json_edit(change):
    def edit(path: Path) -> None:
        document = json.loads(path.read_text())
        change(document)
        path.write_text(json.dumps(document))
    return edit


REPORTS = {
    "report: report.json is not JSON": (lambda d: _edited_report(d, lambda p: p.write_text("{cut")), USER, "is not a readable optpipe report"),
    "report: report.json is a list": (lambda d: _edited_report(d, lambda p: p.write_text("[1, 2]")), USER, "holds a list, not an object"),
    "report: a schema from the future": (lambda d: _edited_report(d, _json_edit(lambda r: r.update(schema_version=99))), USER, "schema version 99"),
    "report: a stage whose status is garbage": (lambda d: _edited_report(d, _json_edit(lambda r: r["stages"][0].update(status=["?"]))), USER, "report.json"),
    "report: stages removed": (lambda d: _edited_report(d, _json_edit(lambda r: r.pop("stages"))), USER, "report.json"),
    "report: report.json is empty": (lambda d: _edited_report(d, lambda p: p.write_text("")), USER, "report.json"),
    "inspect: report.json is not JSON": (lambda d: _edited_report(d, lambda p: p.write_text("{cut"), "inspect"), USER, "is not a readable optpipe report"),
    "inspect: a stage with a latency that is text": (lambda d: _edited_report(d, _json_edit(lambda r: r["stages"][0].update(latency="fast")), "inspect"),
                                                     USER, "report.json"),
    "diff: report.json is not JSON": (lambda d: _edited_report(d, lambda p: p.write_bytes(b"\xff\xfe"), "diff"), USER, "report.json"),
}

# --- symlinks in the run folder pointing outside ------------------------------------------------


def _link_in_run(folder: Path, name: str, target_is_dir: bool = True) -> list[str]:
    args = _recipe(folder, None, "compile")
    outside = folder / "outside"
    outside.mkdir(parents=True, exist_ok=True)
    target = outside if target_is_dir else _file(outside, "precious.txt", "keep me")
    link = folder / "run" / name
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)
    return args + ["--force"]


LINKS = {
    "link: run/logs to a folder elsewhere": (lambda d: _link_in_run(d, "logs"), USER, "run/logs' in the run folder is a symlink"),
    "link: run/stages to a folder elsewhere": (lambda d: _link_in_run(d, "stages"), USER, "is a symlink"),
    "link: run/targets to a folder elsewhere": (lambda d: _link_in_run(d, "targets"), USER, "is a symlink"),
    "link: run/report.json to a user's file": (lambda d: _link_in_run(d, "report.json", target_is_dir=False), USER, "report.json' in the run folder is a symlink"),
    "link: a stage log to a user's file": (lambda d: _link_in_run(d, "logs/export.log", target_is_dir=False), USER, "export.log' in the run folder is a symlink"),
    "link: a model in a stage copy": (lambda d: _link_in_run(d, "stages/export/model.onnx", target_is_dir=False), USER, "is a symlink"),
}

CASES = {**SEARCH, **RAY, **INIT, **EXPORT, **REPORTS, **LINKS}


def _contents(folder: Path) -> dict[Path, bytes]:
    """Every regular file under `folder` (links not followed) with its bytes."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = Path(root, name)
            if path.is_file() and not path.is_symlink() and path.stat().st_size < 2**20:
                files[path] = path.read_bytes()
    return files


@pytest.mark.parametrize("case", list(CASES))
def test_a_new_surface_case_gets_one_line(case, tmp_path, monkeypatch, capsys):
    build, expected_code, words = CASES[case]
    monkeypatch.delenv("OPTPIPE_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    args = build(tmp_path)
    capsys.readouterr()
    before = _contents(tmp_path.parent)  # the case's neighbours ("outside") included
    code, out, err = run_main(args, capsys)
    after = _contents(tmp_path.parent)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)
               and not {"run", "cache"} & set(p.relative_to(tmp_path.parent).parts[1:2])}
    assert not changed, changed  # nothing written or changed outside the run folder and the cache
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in out + err, err
    assert len(errors) == 1, err
    assert words in errors[0], errors[0]
    assert code == expected_code, (code, err)


def test_the_round_three_catalogue_is_large_enough():
    assert len(CASES) >= 40


# --- what the refusals above must still let through ------------------------------------------------


def test_export_writes_over_its_own_export_and_over_user_files_only_with_force(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = _export(tmp_path, tmp_path / "dest")
    assert run_main(args, capsys)[0] == 0
    first = json.loads((tmp_path / "dest" / "manifest.json").read_text())
    assert run_main(args, capsys)[0] == 0, "a folder holding optpipe's manifest is optpipe's to replace"
    again = json.loads((tmp_path / "dest" / "manifest.json").read_text())
    assert [a["stage"] for a in again["artifacts"]] == [a["stage"] for a in first["artifacts"]] == ["export"]
    users = _users_folder(tmp_path / "u")
    code, _, err = run_main(args[:-1] + [str(users)], capsys)
    assert code == USER and (users / "model.onnx").read_text() == "the user's own model", err
    code, _, err = run_main(args[:-1] + [str(users), "--force"], capsys)
    assert code == 0 and (users / "manifest.json").is_file(), err


def test_init_writes_a_model_outside_with_allow_path_and_nothing_without(tmp_path, monkeypatch, capsys):
    outside = tmp_path / "outside"
    write_linear_onnx(outside)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code, _, err = run_main(["init", "../outside/model.onnx", "-o", "r.yaml"], capsys)
    assert code == USER and not (work / "r.yaml").exists() and list(work.iterdir()) == [], err
    code, out, err = run_main(["init", "../outside/model.onnx", "-o", "r.yaml", "--allow-path", str(outside)], capsys)
    assert code == 0 and "--allow-path" in out, err
    assert run_main(["validate", "r.yaml", "--allow-path", str(outside)], capsys)[0] == 0


def test_a_symlink_beside_the_run_folder_is_not_refused(tmp_path, monkeypatch, capsys):
    """Only links inside the run folder carry its writes elsewhere: a `latest -> run` link beside it, and
    a user's own file inside it, are left alone and the compile runs."""
    monkeypatch.chdir(tmp_path)
    args = _recipe(tmp_path, lambda r: r["stages"].pop("simplify"), "compile")
    _file(tmp_path / "run", "notes.txt", "mine")
    os.symlink(tmp_path / "run", tmp_path / "latest")
    code, _, err = run_main(args, capsys)
    assert code == 0, err
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine" and (tmp_path / "latest" / "report.json").is_file()


def test_a_disk_error_names_the_file_being_written():
    """shutil and os.replace give a copy's destination as filename2: a full output folder is not the cache's disk."""
    import errno

    from optpipe.safety.os_errors import describe

    exc = OSError(errno.ENOSPC, "No space left on device", "/cache/stages/k/model.onnx", None, "/run/stages/s/model.onnx")
    assert "'/run/stages/s/model.onnx'" in describe(exc)
    assert describe(exc, "output folder", Path("/run")).startswith("cannot use output folder '/run'")
    assert describe(exc, "cache folder", Path("/cache")).startswith("cannot use '/run/stages/s/model.onnx'"), "not the cache's"


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a tmpfs needs root")
def test_a_full_output_disk_names_the_output_folder_not_the_cache(tmp_path, monkeypatch, capsys):
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("this container cannot mount a tmpfs")
    try:
        (disk / "filler").write_bytes(b"\0" * (256 * 1024 - 16 * 1024))  # the run folder's disk: 16 KB left
        monkeypatch.chdir(tmp_path)
        args = _recipe(tmp_path, lambda r: r.update(output=str(disk / "run")), "compile", "--allow-path", str(disk))
        code, _, err = run_main(args, capsys)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == USER and len(errors) == 1, err
        assert f"output folder '{disk / 'run'}'" in errors[0] and "the disk is full" in errors[0] and "cache" not in errors[0], errors[0]
    finally:
        subprocess.run(["umount", str(disk)], check=False)
