"""Issue 10's "must never happen" list, each shown: cache commands never delete what optpipe did
not publish, runs and caches never nest, a factory never runs code from outside the recipe's
folder unless allowed, Ctrl-C is never a stage failure, values never hang or exhaust the machine;
and a full disk ends in one line, the cache consistent.

The CLI runs in-process (reliability_fixtures.run_main); files that must survive are checked
byte for byte afterwards.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import onnx
import onnxruntime
import pytest
import torch
from reliability_fixtures import HERE, onnx_recipe, run_main, write_linear_onnx, write_recipe

from optpipe.cache.admin import list_entries
from optpipe.cache.folder import MARKER, CacheFolderError, is_marked
from optpipe.cache.store import StageCache, default_cache_dir, verify_entry
from optpipe.core.errors import RecipeError
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.safety.recipe_loading import load_recipe, parse_recipe
from optpipe.safety.resource_bounds import available_cores

REPO = HERE.parent


def _snapshot(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and "Logging error" not in err, err
    assert len(lines) == 1, err
    return lines[0]


def _project(folder: Path) -> Path:
    """A project's own files, including folders two levels down named like cache kinds and keys."""
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "main.py").write_text("print('precious')\n")
    (folder / "stages" / ("ab" * 32)).mkdir(parents=True)  # named exactly like an entry
    (folder / "stages" / ("ab" * 32) / "data.bin").write_bytes(b"precious")
    (folder / "results").mkdir()
    (folder / "results" / "summary.json").write_text("{}")
    return folder


# --- 1. cache commands delete only cache entries ------------------------------------------------


def test_an_empty_optpipe_cache_means_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OPTPIPE_CACHE", "")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "optpipe"


def test_cache_commands_leave_a_project_alone(monkeypatch, tmp_path, capsys):
    project = _project(tmp_path / "project")
    before = _snapshot(project)
    monkeypatch.chdir(project)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OPTPIPE_CACHE", "")  # used to make the working directory the cache
    for args in (["gc", "--older-than", "0s"], ["gc", "--max-size", "0"], ["verify", "--delete"], ["ls"]):
        code, out, err = run_main(["cache", *args], capsys)
        assert code == 0 and "Traceback" not in err, err
    for flag in (["--cache-dir", str(project)], ["--cache-dir", "."]):
        for args in (["gc", "--max-size", "0"], ["verify", "--delete"]):
            code, out, err = run_main(["cache", *flag, *args], capsys)
            assert code == 2 and "is not an optpipe cache" in _one_error_line(err)
    monkeypatch.setenv("OPTPIPE_CACHE", str(project))
    code, out, err = run_main(["cache", "gc", "--max-size", "0"], capsys)
    assert code == 2 and "is not an optpipe cache" in _one_error_line(err)
    assert _snapshot(project) == before, "every file of the project is still there, unchanged"
    assert not (project / MARKER).exists()


def test_gc_and_verify_touch_only_entries_optpipe_published(tmp_path, capsys):
    root = tmp_path / "cache"
    cache = StageCache(root)
    assert is_marked(root)
    workdir = cache.new_workdir()
    (workdir / "model.onnx").write_bytes(b"graph")
    key = StageCache.key(name="entry")
    cache.publish(key, workdir)
    cache.release_workdir(workdir)
    cache.release_leases()
    cache.put_result(StageCache.key(name="result"), {"value": 1})
    cache.release_leases()
    # What a user (or another tool) left in the cache folder: not entries.
    strangers = [root / "stages" / "README.txt", root / "stages" / "notes" / "a.txt", root / "results" / "mine.json",
                 root / "custom" / "thing.bin", root / "run" / "report.json"]
    for path in strangers:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("keep me")
    assert {e.key for e in list_entries(root)} == {key, StageCache.key(name="result")}
    code, out, err = run_main(["cache", "--cache-dir", str(root), "verify", "--delete"], capsys)
    assert code == 0, err
    code, out, err = run_main(["cache", "--cache-dir", str(root), "gc", "--max-size", "0"], capsys)
    assert code == 0 and "removed 2 entries" in out, out
    assert all(path.read_text() == "keep me" for path in strangers)
    assert not (root / "stages" / key).exists()


def test_a_cache_made_before_the_marker_is_adopted_and_a_project_is_not(tmp_path):
    old = tmp_path / "old"
    for sub in ("stages", "results", "tmp", "locks", "calibration"):
        (old / sub).mkdir(parents=True)
    StageCache(old)
    assert is_marked(old)
    project = _project(tmp_path / "project")
    with pytest.raises(CacheFolderError, match="it holds 'src'"):
        StageCache(project)
    assert not is_marked(project)


def test_verify_judges_only_what_carries_a_hash(tmp_path, capsys):
    """ORT's calibration ranges (`calibration/<key>.json`, its own format) are entries without a
    hash: verify must not call them corrupted, nor delete them; a damaged result still fails."""
    root = tmp_path / "cache"
    cache = StageCache(root)
    ranges = root / "calibration" / f"{StageCache.key(name='ranges')}.json"
    ranges.parent.mkdir()
    ranges.write_text('{"x": [-1.0, 1.0]}')
    result_key = StageCache.key(name="result")
    cache.put_result(result_key, {"value": 1})
    cache.release_leases()
    code, out, err = run_main(["cache", "--cache-dir", str(root), "verify", "--delete"], capsys)
    assert code == 0 and "2 ok, 0 corrupted" in out, out
    cache.result_path(result_key).write_text('{"value": 2, "sha256": "0"}')
    code, out, err = run_main(["cache", "--cache-dir", str(root), "verify", "--delete"], capsys)
    assert code == 1 and "1 corrupted" in out and ranges.read_text() == '{"x": [-1.0, 1.0]}'


# --- 2. a run folder and a cache never nest ---------------------------------------------------------


@pytest.mark.parametrize("output, cache", [("cache/run", "cache"), ("run", "run/cache"), ("cache", "cache")])
def test_runs_and_caches_never_nest(tmp_path, monkeypatch, capsys, output, cache):
    write_linear_onnx(tmp_path / "model")
    StageCache(tmp_path / cache)  # an existing cache with a published entry and a run-like folder beside it
    (tmp_path / output / "stages").mkdir(parents=True, exist_ok=True)
    (tmp_path / output / "report.json").write_text("{}")
    before = _snapshot(tmp_path)
    recipe = write_recipe(tmp_path, onnx_recipe(tmp_path, output=output, cache=cache))
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["compile", str(recipe)], capsys)
    assert code == 2 and "inside the" in _one_error_line(err)
    for args in (["gc", "--max-size", "0"], ["verify", "--delete"]):
        assert run_main(["cache", "--cache-dir", str(tmp_path / cache), *args], capsys)[0] == 0
    assert _snapshot(tmp_path) == {**before, recipe: recipe.read_bytes()}, "the run folder's files are all still there"


@pytest.mark.parametrize("output, cache", [("cache/run", "cache"), ("run", "run/cache")])
def test_the_python_api_refuses_nested_folders_as_the_cli_does(tmp_path, output, cache):
    from optpipe.execution.executors import LocalExecutor
    from optpipe.search.runner import compile_recipes

    write_linear_onnx(tmp_path / "model")
    recipe = parse_recipe(onnx_recipe(tmp_path, output=output, cache=cache), base_dir=tmp_path)
    before = _snapshot(tmp_path)
    with pytest.raises(CacheFolderError, match="is inside the"):
        compile_recipe(recipe, RunOptions())
    fine = parse_recipe(onnx_recipe(tmp_path, output="elsewhere", cache="other-cache"), base_dir=tmp_path)
    with pytest.raises(CacheFolderError, match="is inside the"):  # one nested recipe refuses them all, before any work
        compile_recipes([fine, recipe], LocalExecutor())
    # The command line's folders override the recipe's, and are checked the same way.
    with pytest.raises(CacheFolderError, match="is inside the"):
        compile_recipe(fine, RunOptions(output=tmp_path / "c" / "run", cache_dir=tmp_path / "c"))
    assert _snapshot(tmp_path) == before, "nothing was written"


# --- 3. a factory runs code only from the recipe's folder -----------------------------------------


def test_a_factory_outside_model_path_never_runs(tmp_path, monkeypatch, capsys):
    write_linear_onnx(tmp_path / "model")
    precious = tmp_path / "precious.txt"
    precious.write_text("precious")
    recipe = onnx_recipe(tmp_path)
    recipe["model"] = {"factory": "numpy:savetxt", "kwargs": {"fname": str(precious), "X": [1.0]}}
    path = write_recipe(tmp_path, recipe)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["compile", str(path)], capsys)
    assert code == 2 and "--allow-factory numpy" in _one_error_line(err)
    assert precious.read_text() == "precious"


def test_a_factory_in_model_path_or_allowed_by_name_is_accepted(tmp_path):
    recipe = onnx_recipe(tmp_path)
    recipe["model"] = {"factory": "reliability_fixtures:tiny_torch"}  # importable, but not in a model.path
    path = write_recipe(tmp_path, recipe)
    with pytest.raises(RecipeError, match="not in a `model.path` folder"):
        load_recipe(path)
    load_recipe(path, allow_factories=("reliability_fixtures",))
    recipe["model"]["path"] = str(HERE)
    load_recipe(write_recipe(tmp_path, recipe), allow_paths=(HERE,))
    # A module of the same name imported from elsewhere would be what `import` returns: refused.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "onnx.py").write_text("def build():\n    raise SystemExit('never')\n")
    recipe["model"] = {"factory": "onnx:build", "path": "pkg"}
    with pytest.raises(RecipeError, match="is not in model.path"):
        load_recipe(write_recipe(tmp_path, recipe))
    # optpipe's own model builders need no flag.
    recipe["model"] = {"factory": "optpipe.models.resnet:resnet50"}
    load_recipe(write_recipe(tmp_path, recipe))


def test_the_readme_says_a_factory_recipe_runs_code():
    text = (REPO / "README.md").read_text()
    assert "A `factory:` recipe runs code" in text and "--allow-factory" in text


# --- 4. Ctrl-C anywhere in an exception's chain ends the run with exit 130 ------------------------


def _ctrl_c() -> None:
    """A real SIGINT to this process: the handler raises KeyboardInterrupt right here."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)  # not reached: the handler runs at the next bytecode


def _wrapped_interrupt(message: str):
    """What a library does when Ctrl-C lands inside it: catches it, raises something else."""

    def raiser(*args, **kwargs):
        try:
            _ctrl_c()
        except KeyboardInterrupt:
            raise RuntimeError(message)

    return raiser


def _swallowed_interrupt(real):
    """Worse: the library catches the Ctrl-C and goes on as if nothing happened."""

    def call(*args, **kwargs):
        try:
            _ctrl_c()
        except KeyboardInterrupt:
            pass
        return real(*args, **kwargs)

    return call


def _caused_interrupt(*args, **kwargs):
    try:
        _ctrl_c()
    except KeyboardInterrupt as exc:
        raise RuntimeError("ONNX Runtime failed") from exc


def _bare_interrupt(*args, **kwargs):
    _ctrl_c()


@pytest.fixture
def ctrl_c_counted():
    """SIGINT/SIGTERM handled as the CLI handles them (counted, then KeyboardInterrupt)."""
    from optpipe.execution import signals

    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signals.terminate_as_interrupt()
    yield
    signal.signal(signal.SIGINT, previous[0])
    signal.signal(signal.SIGTERM, previous[1])


def _factory_recipe(tmp_path: Path):
    # torchscript: the faster exporter; the points below are on both exporters' paths
    export = {"pass": "export", "params": {"exporter": "torchscript", "opset": 18}}
    recipe = onnx_recipe(tmp_path, stages={"export": export, "simplify": {"pass": "simplify", "after": "export"}})
    recipe["model"] = {"factory": "reliability_fixtures:tiny_torch", "path": str(HERE)}
    recipe["output"], recipe["cache"] = str(tmp_path / "run"), str(tmp_path / "cache")
    return parse_recipe(recipe, base_dir=tmp_path)


INTERRUPT_POINTS = {
    # while torch runs its exporter (the case): KeyboardInterrupt in __context__ of its error
    "torch.onnx.export raises": (torch.onnx, "export", _wrapped_interrupt("torch.onnx.export (dynamo) failed")),
    # the exporter swallows the Ctrl-C and finishes: the stage made under an interrupt is not kept
    "torch.onnx.export goes on": (torch.onnx, "export", _swallowed_interrupt(torch.onnx.export)),
    # while PyTorch eager runs the model for the export check: inside forward()
    "the model's forward": (torch.nn.Linear, "forward", _wrapped_interrupt("forward failed")),
    # reading the exported model back: a bare KeyboardInterrupt
    "onnx.load": (onnx, "load", _bare_interrupt),
    # ONNX Runtime checking the export against eager: KeyboardInterrupt as __cause__
    "onnxruntime session": (onnxruntime, "InferenceSession", _caused_interrupt),
}


@pytest.mark.parametrize("point", list(INTERRUPT_POINTS))
def test_ctrl_c_inside_export_stops_the_run(point, tmp_path, monkeypatch, ctrl_c_counted):
    owner, name, raiser = INTERRUPT_POINTS[point]
    recipe = _factory_recipe(tmp_path)
    monkeypatch.setattr(owner, name, raiser)
    with pytest.raises(KeyboardInterrupt, match="interrupted during stage 'export'"):
        compile_recipe(recipe, RunOptions())
    assert not (tmp_path / "run" / "report.json").exists(), "no report: the run did not go on"
    assert not list((tmp_path / "cache" / "stages").iterdir()), "nothing made under the interrupt is published"


def test_ctrl_c_inside_evaluation_stops_the_run(tmp_path, monkeypatch, ctrl_c_counted):
    from optpipe.evaluation.evaluator import Evaluator

    recipe = _factory_recipe(tmp_path)
    monkeypatch.setattr(Evaluator, "evaluate_onnx", _wrapped_interrupt("ORT failed"))
    with pytest.raises(KeyboardInterrupt):
        compile_recipe(recipe, RunOptions())


def test_ctrl_c_in_export_exits_130_with_the_interrupted_line(tmp_path, monkeypatch, capsys):
    """Through the CLI (which installs the handler), with the default exporter choice."""
    recipe = onnx_recipe(tmp_path, stages={"export": {"pass": "export"}})
    recipe["model"] = {"factory": "reliability_fixtures:tiny_torch", "path": str(HERE)}
    path = write_recipe(tmp_path, recipe)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.onnx, "export", _wrapped_interrupt("torch.onnx.export (dynamo) failed: try exporter: torchscript"))
    code, out, err = run_main(["compile", str(path), "--allow-path", str(HERE)], capsys)
    assert code == 130, err
    assert "interrupted during stage 'export'" in err and "error:" not in err and "Traceback" not in err, err


# --- 5. values that would hang or exhaust the machine ----------------------------------------------


def test_threads_are_capped_at_the_available_cores(tmp_path, caplog):
    recipe = onnx_recipe(tmp_path)
    recipe["evaluate"]["threads"] = 10_000
    with caplog.at_level(logging.WARNING, logger="optpipe"):
        parsed = parse_recipe(recipe, base_dir=tmp_path)
    assert parsed.evaluate.threads == available_cores()
    assert "evaluate.threads: 10000 is more than" in caplog.text


def test_a_huge_dim_with_a_pow2_sweep_is_refused_before_any_allocation(tmp_path):
    recipe = onnx_recipe(tmp_path)
    recipe["dims"]["batch"]["max"] = 2**40
    recipe["evaluate"]["sweep"] = {"batch": "pow2"}
    with pytest.raises(RecipeError, match=r"dims\.batch\.max"):
        parse_recipe(recipe, base_dir=tmp_path)


def test_nan_or_negative_tolerances_never_switch_the_check_off(tmp_path):
    for key, value in [("cosine_min", float("nan")), ("max_abs", float("nan")), ("max_abs", -1.0), ("top1_min", float("nan")),
                       ("top1_min", -0.5), ("cosine_min", -1.5), ("max_abs", float("inf"))]:
        recipe = onnx_recipe(tmp_path)
        recipe["evaluate"]["tolerance"] = {key: value}
        with pytest.raises(RecipeError, match=f"evaluate.tolerance.{key}"):
            parse_recipe(recipe, base_dir=tmp_path)


# --- output and cache folders that cannot be written ---------------------------------------------


def _failing_save(code: int):
    real = onnx.save_model

    def save(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(args[1]) if len(args) > 1 else "model.onnx")

    return real, save


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "the disk is full"), (errno.EROFS, "read-only file system")])
def test_a_full_or_read_only_disk_mid_run_is_one_line_and_the_cache_stays_consistent(tmp_path, monkeypatch, capsys, code, words):
    write_linear_onnx(tmp_path / "model")
    path = write_recipe(tmp_path, onnx_recipe(tmp_path))
    if code == errno.ENOSPC:  # the stage log is on the full disk too: logging must not print its own tracebacks
        # (/dev/full opened for the log: a symlink to it in the run folder is refused before the run now)
        from optpipe.execution import services

        real_handler = services.logging.FileHandler
        monkeypatch.setattr(services.logging, "FileHandler", lambda path, *a, **k: real_handler(
            "/dev/full" if Path(path).name == "export.log" else path, *a, **k))
    monkeypatch.chdir(tmp_path)
    _, save = _failing_save(code)
    monkeypatch.setattr(onnx, "save_model", save)  # every stage writes its model with it
    outside = _snapshot(tmp_path)
    code_, out, err = run_main(["compile", str(path)], capsys)
    assert code_ == 2, err
    assert words in _one_error_line(err)
    monkeypatch.undo()
    cache = tmp_path / "cache"
    assert all(verify_entry(e.path) is None for e in list_entries(cache) if e.path.is_dir())
    assert not list((cache / "tmp").glob("work-*")), "no workdir left behind"
    assert {p for p in _snapshot(tmp_path) if p not in outside and not p.is_relative_to(tmp_path / "run")
            and not p.is_relative_to(cache)} == set()


def test_a_library_that_says_a_full_disk_in_its_own_words_stops_the_run_on_the_disk(tmp_path, monkeypatch, capsys):
    """ONNX Runtime ("Failed to write external initializers to file") and torch's writer ("36864 requested and 1344
    written") raise no errno: on a full disk a stage failed with advice that could not help (`set generic: false`)
    and every later stage failed the same way. A failure while the cache's disk is nearly full is that disk's."""
    from optpipe.safety import os_errors

    write_linear_onnx(tmp_path / "model")
    path = write_recipe(tmp_path, onnx_recipe(tmp_path))
    monkeypatch.chdir(tmp_path)

    def save(*args, **kwargs):
        raise RuntimeError("36864 requested and 1344 written")

    real_usage = shutil.disk_usage
    monkeypatch.setattr(onnx, "save_model", save)
    monkeypatch.setattr(os_errors.shutil, "disk_usage", lambda folder: real_usage(folder)._replace(free=3 << 20))
    code, _, err = run_main(["compile", str(path)], capsys)
    assert code == 2, err
    line = _one_error_line(err)
    assert "the disk is full" in line and "cache folder" in line, line
    monkeypatch.setattr(os_errors.shutil, "disk_usage", real_usage)  # with room, the same failure is the stage's own
    code, out, err = run_main(["compile", str(path)], capsys)
    assert code == 1 and "36864 requested and 1344 written" in out + err and "disk is full" not in out + err


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a tmpfs needs root")
def test_a_real_full_tmpfs(tmp_path, monkeypatch, capsys):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("this container cannot mount a tmpfs")
    try:
        write_linear_onnx(tmp_path / "model")
        (disk / "filler").write_bytes(b"\0" * (256 * 1024 - 12 * 1024))  # leaves a few pages: enough to start
        path = write_recipe(tmp_path, onnx_recipe(tmp_path, output=str(disk / "run"), cache=str(disk / "cache")))
        monkeypatch.chdir(tmp_path)
        code, out, err = run_main(["compile", str(path), "--allow-path", str(disk)], capsys)
        assert code == 2, err
        assert "the disk is full" in _one_error_line(err)
        # A run that fails (here in preflight) drops every lock and lease it took: no file stays open.
        assert _open_files_under(disk) == []
        (disk / "filler").unlink()
        if (disk / "cache").exists():
            assert all(verify_entry(e.path) is None for e in list_entries(disk / "cache") if e.path.is_dir())
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def _open_files_under(folder: Path) -> list[str]:
    """Files this process still holds open inside `folder` (Linux /proc)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the fd listdir itself used, closed since
            continue
        if target.startswith(str(folder) + os.sep):
            held.append(target)
    return held


# --- misleading messages ---------------------------------------------------------------------------


def test_inspect_says_when_a_stage_copy_is_missing(tmp_path, monkeypatch, capsys):
    write_linear_onnx(tmp_path / "model")
    recipe = load_recipe(write_recipe(tmp_path, onnx_recipe(tmp_path, stages={"export": {"pass": "export"}})))
    monkeypatch.chdir(tmp_path)
    compile_recipe(recipe, RunOptions())
    code, out, err = run_main(["inspect", "run", "export"], capsys)
    assert code == 0 and "op histogram" in out and "is missing" not in out
    (tmp_path / "run" / "stages" / "export" / "model.onnx").unlink()
    code, out, err = run_main(["inspect", "run", "export"], capsys)
    assert code == 0 and "op histogram" not in out
    assert "stages/export/model.onnx is missing, so its graph sections are not shown" in out, out


# --- the documents stay true ---------------------------------------------------------------------


def test_the_exit_code_table_and_the_catalogue_size_are_documented():
    import re

    from test_reliability_catalogue import CASES

    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("Exit codes:"):].split("\n\n")[0]
    for code, words in [(0, "success"), (1, "a stage failed"), (2, "a user or environment error"), (3, "an internal error"),
                        (130, "interrupted"), (143, "terminated")]:
        assert f"{code} {words}" in table, (code, table)
    doc = (REPO / "docs" / "reliability.md").read_text()
    assert int(re.search(r"\*\*(\d+) bad inputs\*\*", doc).group(1)) == len(CASES)


def test_an_internal_error_is_one_line_and_its_traceback_only_on_request(tmp_path, monkeypatch, capsys):
    import optpipe.safety.recipe_loading

    def bug(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(optpipe.safety.recipe_loading, "load_recipe", bug)
    monkeypatch.delenv("OPTPIPE_DEBUG", raising=False)
    code, out, err = run_main(["validate", str(tmp_path / "r.yaml")], capsys)
    assert code == 3 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("internal error: ZeroDivisionError")], err
    monkeypatch.setenv("OPTPIPE_DEBUG", "1")
    code, out, err = run_main(["validate", str(tmp_path / "r.yaml")], capsys)
    assert code == 3 and "Traceback" in err


def test_odd_but_legal_paths_still_compile(tmp_path, monkeypatch, capsys):
    """The guards refuse what is dangerous, not what is unusual: unicode, spaces, a leading dash."""
    folder = tmp_path / "dossier é 空 -x"
    model = write_linear_onnx(folder / "mödel dir", name="mödel 1.onnx")
    recipe = onnx_recipe(folder, model=str(model.relative_to(folder)), stages={"export": {"pass": "export"}},
                         output="run ✓", cache="cache ✓")
    path = write_recipe(folder, recipe, name="récipe.yaml")
    monkeypatch.chdir(folder)
    code, out, err = run_main(["compile", str(path)], capsys)
    assert code == 0, err
    assert (folder / "run ✓" / "report.json").is_file() and is_marked(folder / "cache ✓")


def test_a_read_only_output_folder_is_one_line(tmp_path, monkeypatch, capsys):
    """Read-only for real where the tests do not run as root (root writes anyway); injected too."""
    write_linear_onnx(tmp_path / "model")
    path = write_recipe(tmp_path, onnx_recipe(tmp_path, output="locked/run"))
    (tmp_path / "locked").mkdir()
    monkeypatch.chdir(tmp_path)
    if os.geteuid() != 0:
        (tmp_path / "locked").chmod(0o500)
    else:
        real = Path.mkdir

        def mkdir(self, *args, **kwargs):
            if self.is_relative_to(tmp_path / "locked"):
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", mkdir)
    try:
        code, out, err = run_main(["compile", str(path)], capsys)
    finally:
        (tmp_path / "locked").chmod(0o700)
    line = _one_error_line(err)
    assert code == 2 and "output folder" in line and "permission is denied; grant access" in line, line
