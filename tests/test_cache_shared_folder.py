"""A remote cache on a shared filesystem (file://, a plain path): compiles on different machines
(each with its own local cache) share one folder. No Ray is needed: a machine is a local cache."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_fixtures import onnx_recipe, plugin_env, run_main, write_linear_onnx, write_recipe

from optpipe.cache.store import verify_entry


@pytest.fixture
def project(tmp_path) -> Path:
    write_linear_onnx(tmp_path / "model")
    return write_recipe(tmp_path, onnx_recipe(tmp_path))


def _compile(project: Path, machine: str, remote: str, capsys) -> tuple[int, str, dict]:
    folder = project.parent
    code, out, err = run_main(["compile", str(project), "--cache-dir", str(folder / machine), "--remote-cache", remote,
                               "-o", str(folder / f"run-{machine}")], capsys)
    report = json.loads((folder / f"run-{machine}" / "report.json").read_text()) if code == 0 else {}
    return code, err, report


def _stages(report: dict) -> dict:
    return {s["name"]: s for s in report["stages"]}


def _remote_entries(shared: Path) -> list[Path]:
    return sorted(p for kind in ("stages", "datasets") for p in (shared / kind).glob("*") if p.is_dir())


def test_a_second_machine_reuses_the_shared_folder_and_a_tampered_entry_is_rebuilt(project, tmp_path, capsys):
    shared = tmp_path / "nfs" / "optpipe"  # does not exist yet: created by the first publish
    code, err, first = _compile(project, "a", f"file://{shared}", capsys)
    assert code == 0, err
    entries = _remote_entries(shared)
    assert entries and all(verify_entry(p) is None for p in entries)
    assert not list((shared / "tmp").glob("push-*")), "every publish renamed its staging folder into place"

    code, err, second = _compile(project, "b", str(shared), capsys)  # a plain path: the same folder
    assert code == 0, err
    for name, stage in _stages(second).items():
        assert stage["cached"] and stage["evaluation_cached"], f"{name} was recomputed on the second machine"
        assert stage["hash"] == _stages(first)[name]["hash"]

    victim = next(p for p in (shared / "stages").iterdir() if json.loads((p / "entry.json").read_text()).get("stage") == "simplify")
    (victim / "model.onnx.data").write_bytes(b"tampered by someone with write access")
    code, err, third = _compile(project, "c", f"file://{shared}", capsys)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "remote cache entry" in line]
    assert len(warnings) == 1 and "corrupted" in warnings[0], err
    assert [s["hash"] for s in third["stages"]] == [s["hash"] for s in first["stages"]]
    assert any(not s["cached"] for s in third["stages"]), "the tampered stage was recomputed"
    assert verify_entry(victim) is None, "the rebuilt entry replaced the tampered one in the shared folder"


def test_two_concurrent_compiles_share_one_folder(project, tmp_path):
    shared = tmp_path / "shared"
    folder = project.parent
    procs = [subprocess.Popen([sys.executable, "-m", "optpipe.cli", "compile", str(project), "--cache-dir", str(folder / m),
                               "--remote-cache", f"file://{shared}", "-o", str(folder / f"run-{m}")],
                              cwd=folder, env=plugin_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for m in ("a", "b")]
    outcomes = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    assert all(code == 0 for code, _ in outcomes), outcomes
    reports = [json.loads((folder / f"run-{m}" / "report.json").read_text()) for m in ("a", "b")]
    assert [s["hash"] for s in reports[0]["stages"]] == [s["hash"] for s in reports[1]["stages"]]
    assert all(verify_entry(p) is None for p in _remote_entries(shared))
    assert not any("corrupted" in err for _, err in outcomes), outcomes
    assert not list((shared / "tmp").glob("push-*"))


def _a_file(tmp_path: Path) -> Path:
    (tmp_path / "remote").write_text("not a folder")
    return tmp_path / "remote"


def _under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "plain").write_text("x")
    return tmp_path / "plain" / "remote"


@pytest.mark.parametrize("where, expected", [
    (_a_file, "is a file, not a folder; point --remote-cache"),
    (_under_a_file, "cannot create the folder"),
])
def test_a_remote_folder_that_cannot_be_used_is_one_line(project, tmp_path, capsys, where, expected):
    code, out, err = run_main(["compile", str(project), "--remote-cache", f"file://{where(tmp_path)}"], capsys)
    assert code == 2 and expected in err and "--remote-cache" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists(), "refused before any work"


@pytest.mark.parametrize("where", ["same", "inside", "around"])
def test_a_remote_folder_that_is_or_nests_with_the_local_cache_is_refused(project, tmp_path, capsys, where):
    cache = tmp_path / "cache"
    remote = {"same": cache, "inside": cache / "remote", "around": tmp_path}[where]
    code, out, err = run_main(["compile", str(project), "--cache-dir", str(cache), "--remote-cache", f"file://{remote}"], capsys)
    assert code == 2 and "apart from --cache-dir" in err and len(err.strip().splitlines()) == 1, err
