"""The cache under damage and contention: partial entries, tampering, killed writers, leases, gc."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from optpipe.cache import admin as cache_admin
from optpipe.cache.store import StageCache, sweep_leftovers, verify_entry
from optpipe.calibration.dataset import DATASETS, SAMPLES_FILE, build_sample_set
from optpipe.cache.locking import hold_exclusive, hold_shared, release
from optpipe.recipe.schema import DataSource
from optpipe.safety.recipe_loading import parse_recipe
from optpipe.execution.run_folder import publish_stage_folders, verify_run_folder


def _entry(cache: StageCache, key: str, payload: bytes = b"weights") -> Path:
    workdir = cache.new_workdir()
    (workdir / "model.onnx").write_bytes(b"graph")
    (workdir / "model.onnx.data").write_bytes(payload)
    (workdir / "info.json").write_text("{}")
    cache.publish(key, workdir, {"stage": "s", "pass": "p", "recipe": "r"})
    cache.release_workdir(workdir)
    return cache.entry_dir(key)


def _drop_own_leases(root: Path) -> None:
    """This process leased every entry it published (as a compile does until it ends); a gc test
    plays another process."""
    StageCache(root).release_leases()


def test_a_whole_entry_is_found_and_verified(tmp_path):
    cache = StageCache(tmp_path)
    folder = _entry(cache, "k1")
    assert verify_entry(folder) is None
    hit = cache.lookup("k1")
    assert hit is not None and hit.path.read_bytes() == b"graph"
    assert json.loads((folder / "entry.json").read_text())["pass"] == "p"
    assert not list((tmp_path / "tmp").iterdir()), "the workdir and its lock are gone once published"


@pytest.mark.parametrize("damage", ["tamper", "truncate", "delete", "extra", "no-manifest"])
def test_a_damaged_entry_is_dropped_with_a_warning(tmp_path, caplog, damage):
    cache = StageCache(tmp_path)
    folder = _entry(cache, "k1", payload=b"x" * 4096)
    data = folder / "model.onnx.data"
    if damage == "tamper":
        data.write_bytes(b"y" * 4096)
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:100])
    elif damage == "delete":
        data.unlink()
    elif damage == "extra":
        (folder / "planted.py").write_text("print('hi')")
    else:  # a writer killed before the manifest: such a folder is never published, but if one appears
        (folder / "entry.json").unlink()
    with caplog.at_level(logging.WARNING, logger="optpipe.cache.store"):
        assert cache.lookup("k1") is None
    assert "corrupted" in caplog.text and "recomputing" in caplog.text
    assert not folder.exists()


def test_publishing_a_key_twice_keeps_the_first_entry(tmp_path):
    cache = StageCache(tmp_path)
    _entry(cache, "k1", payload=b"first")
    _entry(cache, "k1", payload=b"second")  # a second process finishing the same stage
    assert (cache.entry_dir("k1") / "model.onnx.data").read_bytes() == b"first"
    assert verify_entry(cache.entry_dir("k1")) is None


def test_results_carry_their_hash(tmp_path, caplog):
    cache = StageCache(tmp_path)
    cache.put_result("r1", {"latency": [1.5]})
    assert cache.get_result("r1") == {"latency": [1.5]}
    path = cache.result_path("r1")
    path.write_text(path.read_text().replace("1.5", "0.1"))  # a plausible but forged value
    with caplog.at_level(logging.WARNING, logger="optpipe.cache.store"):
        assert cache.get_result("r1") is None
    assert "does not match its hash" in caplog.text and not path.exists()
    path.write_text('{"sha256": "')  # truncated mid-write by something other than optpipe
    assert cache.get_result("r1") is None


def test_leftovers_of_a_killed_writer_are_swept_but_a_live_workdir_is_not(tmp_path):
    cache = StageCache(tmp_path)
    live = cache.new_workdir()  # this process holds its lock
    dead = tmp_path / "tmp" / ("work-" + "d" * 32)  # as a SIGKILLed process leaves it: lock file, no holder
    dead.mkdir()
    (dead / "model.onnx").write_bytes(b"half")
    (tmp_path / "tmp" / f"{dead.name}.lock").touch()
    (tmp_path / "tmp" / f"{dead.name}.request.json").write_text("{}")
    (tmp_path / "tmp" / "trash-abc").mkdir()
    removed = sweep_leftovers(tmp_path)
    assert dead in removed and not dead.exists() and not (tmp_path / "tmp" / f"{dead.name}.request.json").exists()
    assert live.exists(), "a workdir whose owner is alive is left alone"
    assert not (tmp_path / "tmp" / "trash-abc").exists()
    cache.release_workdir(live)


def test_a_workdir_held_by_another_process_survives_a_sweep(tmp_path):
    lock = tmp_path / "tmp" / ("work-" + "e" * 32 + ".lock")
    workdir = lock.with_suffix("")
    StageCache(tmp_path)
    workdir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,os,sys,time; fd=os.open(sys.argv[1],os.O_RDWR|os.O_CREAT); "
         "fcntl.flock(fd,fcntl.LOCK_EX); print('held',flush=True); time.sleep(30)", str(lock)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        StageCache(tmp_path)  # sweeps on open
        assert workdir.exists()
    finally:
        holder.kill()
        holder.wait()
    StageCache(tmp_path)
    assert not workdir.exists(), "once its owner is dead, the next open sweeps it"


def _recipe(tmp_path: Path):
    return parse_recipe({
        "model": {"onnx": "m.onnx"},
        "inputs": [{"name": "x", "shape": ["batch", 4]}],
        "dims": {"batch": {"min": 1, "opt": 2, "max": 8}},
        "stages": {"export": {"pass": "export"}},
    }, base_dir=tmp_path)


def test_a_tampered_sample_set_is_rebuilt(tmp_path, caplog):
    recipe = _recipe(tmp_path)
    first = build_sample_set(DataSource(samples=4), recipe.model_source(), tmp_path / "cache")
    assert not first.cached
    again = build_sample_set(DataSource(samples=4), recipe.model_source(), tmp_path / "cache")
    assert again.cached and np.array_equal(again.arrays["x"], first.arrays["x"])
    folder = tmp_path / "cache" / DATASETS / first.key
    with open(folder / SAMPLES_FILE, "r+b") as fh:  # flip bytes inside the archive
        fh.seek(-64, os.SEEK_END)
        fh.write(b"\0" * 16)
    with caplog.at_level(logging.WARNING, logger="optpipe.cache.store"):
        rebuilt = build_sample_set(DataSource(samples=4), recipe.model_source(), tmp_path / "cache")
    assert not rebuilt.cached and "corrupted" in caplog.text
    assert np.array_equal(rebuilt.arrays["x"], first.arrays["x"])


def test_gc_prunes_by_age_and_size_and_keeps_entries_in_use(tmp_path):
    cache = StageCache(tmp_path)
    # Entries are named by their sha256 key; gc touches nothing else.
    k = {name: StageCache.key(name=name) for name in ("old", "recent", "leased")}
    old, recent, leased = (_entry(cache, k[name], payload=b"z" * 10_000) for name in ("old", "recent", "leased"))
    week = time.time() - 8 * 86400
    for folder in (old, leased):
        os.utime(folder, (week, week))
    # Another process's lease: a shared flock on the entry's .use file.
    _drop_own_leases(tmp_path)
    fd = hold_shared(tmp_path / "locks" / f"{k['leased']}.use")  # as another running compile holds it
    try:
        result = cache_admin.collect_garbage(tmp_path, older_than_s=7 * 86400, max_bytes=None)
        assert [e.key for e in result.removed] == [k["old"]]
        assert [e.key for e in result.busy] == [k["leased"]]
        assert recent.exists() and leased.exists() and not old.exists()
    finally:
        release(fd)
    result = cache_admin.collect_garbage(tmp_path, older_than_s=None, max_bytes=15_000)
    assert [e.key for e in result.removed] == [k["leased"]], "least recently used first, until it fits"
    assert recent.exists()


def test_gc_waits_for_nobody_and_skips_an_entry_being_computed(tmp_path):
    cache = StageCache(tmp_path)
    busy = StageCache.key(name="busy")
    _entry(cache, busy)
    _drop_own_leases(tmp_path)
    with cache.lock(busy):
        entry = next(e for e in cache_admin.list_entries(tmp_path) if e.key == busy)
        assert not cache_admin.remove(tmp_path, entry)
    assert cache_admin.remove(tmp_path, entry)


def test_run_folder_copies_carry_their_manifest_and_are_restored(tmp_path, caplog):
    from optpipe.core.results import StageResult

    cache = StageCache(tmp_path / "cache")
    _entry(cache, "k1", payload=b"w" * 2048)
    artifact = cache.lookup("k1")
    run = tmp_path / "run"
    results = [StageResult(name="export", pass_name="export", status="ok").with_model(artifact)]
    publish_stage_folders(run, results)
    assert verify_run_folder(run) == {"export": None}
    (run / "stages" / "export" / "model.onnx.data").write_bytes(b"edited")
    assert "does not match" in verify_run_folder(run)["export"]
    with caplog.at_level(logging.WARNING, logger="optpipe.run"):
        publish_stage_folders(run, results)
    assert "was modified" in caplog.text and verify_run_folder(run) == {"export": None}


def test_a_stage_this_run_has_no_model_for_keeps_no_copy_from_an_earlier_run(tmp_path):
    # Seen: a native run's ov-int8 stayed in the run folder beside a run that skipped it on the AVX2
    # class, and passed for that run's output. The cache keeps the entry; other folders stay.
    from optpipe.core.results import StageResult

    cache = StageCache(tmp_path / "cache")
    _entry(cache, "k1", payload=b"w" * 2048)
    run = tmp_path / "run"
    publish_stage_folders(run, [StageResult(name="ov-int8", pass_name="openvino", status="ok").with_model(cache.lookup("k1")),
                                StageResult(name="export", pass_name="export", status="ok").with_model(cache.lookup("k1"))])
    (run / "stages" / "notes").mkdir()  # not optpipe's: never touched
    publish_stage_folders(run, [StageResult(name="ov-int8", pass_name="openvino", status="skipped"),
                                StageResult(name="export", pass_name="export", status="ok").with_model(cache.lookup("k1"))])
    assert sorted(p.name for p in (run / "stages").iterdir()) == ["export", "notes"]
    assert cache.lookup("k1") is not None


@pytest.mark.parametrize("cut_at", [1, 2, 3])  # files copied before Ctrl-C: the copy, then the manifest last
def test_a_publish_cut_short_leaves_the_previous_copy_or_none_never_half_of_one(tmp_path, monkeypatch, cut_at):
    """Seen in CI: Ctrl-C while the run folder was being written left a stage folder without its
    manifest, which `cache verify --run` reports as corrupted."""
    from optpipe.execution import run_folder
    from optpipe.core.results import StageResult

    cache = StageCache(tmp_path / "cache")
    _entry(cache, "k1", payload=b"one" * 512)
    _entry(cache, "k2", payload=b"two" * 512)
    run = tmp_path / "run"
    publish = lambda key, name="export": publish_stage_folders(  # noqa: E731
        run, [StageResult(name=name, pass_name="export", status="ok").with_model(cache.lookup(key))])
    publish("k1")
    before = {p.name: p.read_bytes() for p in (run / "stages" / "export").iterdir()}

    copied = []
    real_copy = run_folder.copy_file

    def interrupted(src, dst):
        if len(copied) == cut_at:
            raise KeyboardInterrupt
        copied.append(src)
        real_copy(src, dst)

    monkeypatch.setattr(run_folder, "copy_file", interrupted)
    for key, name in (("k2", "export"), ("k2", "fresh")):  # replacing a copy, and a first copy
        copied.clear()
        with pytest.raises(KeyboardInterrupt):
            publish(key, name)
    assert {p.name: p.read_bytes() for p in (run / "stages" / "export").iterdir()} == before
    assert verify_run_folder(run) == {"export": None}  # no half copy of 'fresh', nor of the hidden staging folders
    monkeypatch.undo()
    (run / "stages" / ".export.1-dead.tmp.old").mkdir()  # what a SIGKILL between the two renames leaves
    publish("k2")
    assert verify_run_folder(run) == {"export": None}
    assert b"two" in (run / "stages" / "export" / "model.onnx.data").read_bytes()
    assert [p.name for p in (run / "stages").iterdir()] == ["export"]  # what the cut publishes left is swept


def test_locks_die_with_their_process(tmp_path):
    """A SIGKILLed holder never leaves a lock held: the kernel drops flocks with the process."""
    path = tmp_path / "k.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,os,sys,time; fd=os.open(sys.argv[1],os.O_RDWR|os.O_CREAT); "
         "fcntl.flock(fd,fcntl.LOCK_EX); print('held',flush=True); time.sleep(30)", str(path)],
        stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    fd = hold_exclusive(path)
    assert fd is not None
    release(fd)


def test_size_and_age_parsing():
    assert cache_admin.parse_size("20G") == 20 << 30 and cache_admin.parse_size("512mb") == 512 << 20
    assert cache_admin.parse_age("2w") == 14 * 86400 and cache_admin.parse_age("90") == 90
    assert cache_admin.human_age(7200) == "2h" and cache_admin.human_size(2048) == "2.0 KB"


def test_a_foreign_or_empty_marker_names_the_file_to_delete(tmp_path):
    """Issue 22: a full disk left a 0-byte CACHEDIR.TAG, and no message said which file to delete."""
    from optpipe.cache.folder import CacheFolderError, require_marked

    root = tmp_path / "cache"
    root.mkdir()
    (root / "CACHEDIR.TAG").write_bytes(b"")
    with pytest.raises(CacheFolderError, match=f"delete '{root / 'CACHEDIR.TAG'}'"):
        StageCache(root)
    with pytest.raises(CacheFolderError, match="delete the foreign"):
        require_marked(root)
    (root / "CACHEDIR.TAG").unlink()  # what the message says to do
    StageCache(root)
    assert require_marked(root)


def test_the_marker_is_whole_or_absent_when_the_disk_fills(tmp_path, monkeypatch):
    import errno

    from optpipe.cache import folder

    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        folder.prepare_cache_folder(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == [], "no half marker, no temp file"
    monkeypatch.undo()
    StageCache(tmp_path / "cache")
    assert folder.is_marked(tmp_path / "cache")
