"""A cache entry is untrusted data: what a hostile manifest, file or result can make optpipe do.

Every poisoned remote entry is tried on a file:// folder and on a real S3 server (moto's): it
must write nothing outside the cache (nor anything in it), be refused with one warning line,
and leave the local cache without an entry for its key (so it is recomputed).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
from remote_fixtures import Remote, remote, s3_url  # noqa: F401 (fixtures)

from optpipe.cache.backends import FsspecEntryStore, TieredStageCache
from optpipe.cache.manifest import MAX_FILES, MAX_MANIFEST_BYTES, UntrustedEntry, checked_files, checked_sizes
from optpipe.cache.store import StageCache, verify_entry
from optpipe.core.artifact import content_hash

KEY = "a" * 64
GOOD = b"weights" * 100


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest(files: dict[str, bytes], **extra) -> dict:
    hashes = {name: _sha(data) for name, data in files.items()}
    return {"key": KEY, "kind": "stages", "files": hashes, "sizes": {n: len(d) for n, d in files.items()},
            "content": content_hash(hashes), **extra}


def _plant(remote: Remote, files: dict[str, bytes], manifest: dict | bytes | None = None) -> None:
    for name, data in files.items():
        remote.put(f"stages/{KEY}/{name}", data)
    raw = manifest if isinstance(manifest, bytes) else json.dumps(manifest or _manifest(files)).encode()
    remote.put(f"stages/{KEY}/entry.json", raw)


def _pull(tmp_path: Path, remote: Remote, caplog) -> Path | None:
    cache = TieredStageCache(tmp_path / "node" / "cache", FsspecEntryStore(remote.url, **remote.options))
    with caplog.at_level(logging.WARNING, logger="optpipe.cache"):
        found = cache.lookup_folder(KEY, "stages")
    cache.release_leases()
    return found


def _written(tmp_path: Path) -> set[Path]:
    """Files the pull left under the node (its marker; lock files aside: they hold no data)."""
    return {p for p in (tmp_path / "node").rglob("*") if p.is_file() and p.parent.name != "locks"}


@pytest.mark.parametrize("name", [
    "../x", "../../../../outside/pwn", "/etc/passwd", "a/b", "a\\b", "..", ".", "C:evil", "x\x00y",
    "", "a" * 200, "model.onnx/", "entry.json", 7, "\u2025x",
])
def test_a_name_that_is_not_a_plain_file_name_is_refused(name):
    with pytest.raises(UntrustedEntry):
        checked_files({"files": {name: "0" * 64}})


@pytest.mark.parametrize("manifest, why", [
    ({"files": {"model.onnx": "0" * 63}}, "sha256"),
    ({"files": {"model.onnx": "G" * 64}}, "sha256"),
    ({"files": {"model.onnx": 5}}, "sha256"),
    ({"files": {"Model.onnx": "0" * 64, "model.onnx": "1" * 64}}, "case"),
    ({"files": {f"f{i}": "0" * 64 for i in range(MAX_FILES + 1)}}, "files"),
    ({"files": {}}, "files"),
    ({"files": ["model.onnx"]}, "file list"),
    ([], "file list"),
])
def test_a_manifest_that_breaks_a_rule_is_refused(manifest, why):
    with pytest.raises(UntrustedEntry, match=why):
        checked_files(manifest)


@pytest.mark.parametrize("size", [-1, 1 << 60, 1.5, "10", True, None])
def test_a_size_that_is_not_a_byte_count_is_refused(size):
    with pytest.raises(UntrustedEntry):
        checked_sizes({"sizes": {"model.onnx": size}}, {"model.onnx": "0" * 64})


@pytest.mark.parametrize("name", ["../../../outside/pwn", "ABSOLUTE"])
def test_a_traversing_remote_entry_writes_nothing_outside_and_is_refused(tmp_path, remote, caplog, name):
    """The defect of issue 22: the files were written under the listed names before any check."""
    if name == "ABSOLUTE":
        name = str(tmp_path / "outside" / "abs-pwn")
    payload = b"echo pwned\n"
    manifest = _manifest({name: payload, "model.onnx": GOOD})
    remote.put(f"stages/{KEY}/model.onnx", GOOD)
    if remote.url.startswith("s3://"):
        remote.put(f"stages/{KEY}/{name.lstrip('/')}", payload)
    _plant(remote, {}, manifest)
    assert _pull(tmp_path, remote, caplog) is None
    assert not (tmp_path / "outside").exists() and not Path(tmp_path.parent / "outside" / "pwn").exists()
    assert _written(tmp_path) == {tmp_path / "node" / "cache" / "CACHEDIR.TAG"}, "nothing at all is written"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not a plain file name" in warnings[0].getMessage()


def test_a_truncated_download_is_refused_and_leaves_no_file(tmp_path, remote, caplog):
    manifest = _manifest({"model.onnx": GOOD, "model.onnx.data": GOOD * 3})
    _plant(remote, {"model.onnx": GOOD, "model.onnx.data": GOOD[:100]}, manifest)
    assert _pull(tmp_path, remote, caplog) is None
    assert _written(tmp_path) == {tmp_path / "node" / "cache" / "CACHEDIR.TAG"}
    assert "does not match its hash" in caplog.text


def test_a_file_larger_than_its_declared_size_stops_the_download(tmp_path, remote, caplog):
    manifest = _manifest({"model.onnx": GOOD})
    _plant(remote, {"model.onnx": GOOD * 2000}, manifest)  # 1.4 MB behind a 700-byte declaration
    assert _pull(tmp_path, remote, caplog) is None
    assert "larger than its declared" in caplog.text and len(_written(tmp_path)) == 1


def test_an_oversized_manifest_is_refused_unread(tmp_path, remote, caplog):
    manifest = json.dumps({**_manifest({"model.onnx": GOOD}), "pad": "x" * MAX_MANIFEST_BYTES}).encode()
    _plant(remote, {"model.onnx": GOOD}, manifest)
    assert _pull(tmp_path, remote, caplog) is None
    assert "over" in caplog.text


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'{"files": {"m": "0"}}', b"{}"])
def test_a_garbage_manifest_is_refused(tmp_path, remote, caplog, raw):
    _plant(remote, {"model.onnx": GOOD}, raw)
    assert _pull(tmp_path, remote, caplog) is None
    assert caplog.text.count("WARNING") == 1


def test_a_manifest_whose_content_hash_lies_is_refused(tmp_path, remote, caplog):
    _plant(remote, {"model.onnx": GOOD}, {**_manifest({"model.onnx": GOOD}), "content": "0" * 64})
    assert _pull(tmp_path, remote, caplog) is None


def test_a_file_removed_during_the_download_is_refused(tmp_path, remote, caplog):
    """A listing that changed under the reader (another writer replacing the entry)."""
    manifest = _manifest({"model.onnx": GOOD, "model.onnx.data": GOOD})
    _plant(remote, {"model.onnx": GOOD}, manifest)  # model.onnx.data named but gone
    assert _pull(tmp_path, remote, caplog) is None
    assert "missing" in caplog.text and len(_written(tmp_path)) == 1


def test_a_good_remote_entry_is_published_with_its_labels_only(tmp_path, remote, caplog):
    manifest = _manifest({"model.onnx": GOOD}, stage="simplify", recipe="r", extra_path="/etc/passwd")
    _plant(remote, {"model.onnx": GOOD}, manifest)
    found = _pull(tmp_path, remote, caplog)
    assert found is not None and (found / "model.onnx").read_bytes() == GOOD and verify_entry(found) is None
    local = json.loads((found / "entry.json").read_text())
    assert local["stage"] == "simplify" and "extra_path" not in local and local["from_remote"] is True


def test_a_symlink_in_a_shared_folder_entry_is_refused(tmp_path, caplog):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"private key")
    remote = Remote(f"file://{tmp_path / 'remote'}", {})
    _plant(remote, {"model.onnx": GOOD}, _manifest({"model.onnx": GOOD, "info.json": b"private key"}))
    os.symlink(secret, Path(remote.root) / "stages" / KEY / "info.json")
    assert _pull(tmp_path, remote, caplog) is None
    assert "link" in caplog.text and len(_written(tmp_path)) == 1


def test_a_symlink_in_a_local_entry_is_refused(tmp_path):
    cache = StageCache(tmp_path / "cache")
    workdir = cache.new_workdir()
    (workdir / "model.onnx").write_bytes(GOOD)
    entry = cache.publish_folder(KEY, workdir, "stages")
    secret = tmp_path / "secret"
    secret.write_bytes(GOOD)
    (entry / "model.onnx").unlink()
    os.symlink(secret, entry / "model.onnx")  # same bytes, same hash: only the link gives it away
    assert "link" in verify_entry(entry)
    assert cache.lookup_folder(KEY, "stages") is None and secret.exists()
    cache.release_leases()


@pytest.mark.parametrize("wrapped", [
    {"sha256": "x", "value": {"p50": 1}},
    {"value": [1, 2], "sha256": hashlib.sha256(b"[1,2]").hexdigest()},
    [1, 2],
    "x" * (MAX_MANIFEST_BYTES + 1),
])
def test_a_hostile_remote_result_is_refused(tmp_path, remote, caplog, wrapped):
    remote.put(f"results/{KEY}.json", json.dumps(wrapped).encode())
    cache = TieredStageCache(tmp_path / "node" / "cache", FsspecEntryStore(remote.url, **remote.options))
    assert cache.get_result(KEY) is None
    cache.release_leases()


@pytest.mark.parametrize("sets", [["../../etc/passwd"], "eval", [{"a": 1}], [None]])
def test_a_forged_record_of_the_data_a_pass_read_is_ignored(tmp_path, sets):
    """The record is a cache result like any other: names that are no data set are no record."""
    from optpipe.execution.stage_runner import StageRunner, _data_record_key

    cache = StageCache(tmp_path / "cache")
    cache.put_result(_data_record_key("base"), {"sets": sets})
    runner = StageRunner.__new__(StageRunner)  # only its cache is read here
    runner.cache = cache
    assert runner._data_read_last_time("base") == {}
    cache.release_leases()


@pytest.mark.parametrize("planted", ["tmp", "stages", "results"])
def test_a_symlinked_folder_in_a_shared_remote_is_never_written_through(tmp_path, caplog, planted):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shared = tmp_path / "remote"
    shared.mkdir()
    os.symlink(elsewhere, shared / planted)
    cache = TieredStageCache(tmp_path / "node" / "cache", FsspecEntryStore(f"file://{shared}"))
    workdir = cache.new_workdir()
    (workdir / "model.onnx").write_bytes(GOOD)
    with caplog.at_level(logging.WARNING, logger="optpipe.cache"):
        local = cache.publish_folder(KEY, workdir, "stages")
        cache.put_result(KEY, {"p50": 1.0})
    cache.release_leases()
    assert verify_entry(local) is None, "the local entry stands"
    assert list(elsewhere.iterdir()) == [], "nothing written through the link"
    assert "is a link or a file, not a folder" in caplog.text


def test_sizes_beyond_the_free_disk_are_refused_before_any_download(tmp_path, remote, caplog):
    manifest = _manifest({"model.onnx": GOOD})
    manifest["sizes"] = {"model.onnx": 1 << 39}  # 512 GiB: a valid byte count, more than this disk has
    _plant(remote, {"model.onnx": GOOD}, manifest)
    assert _pull(tmp_path, remote, caplog) is None
    assert "free where it would be downloaded" in caplog.text and len(_written(tmp_path)) == 1


def test_a_killed_publishers_staging_folder_is_swept_from_a_shared_remote(tmp_path):
    from optpipe.cache.remote_io import STALE_S

    shared = tmp_path / "remote"
    old, live = shared / "tmp" / "push-old", shared / "tmp" / "push-live"
    for folder in (old, live):
        folder.mkdir(parents=True)
        (folder / "model.onnx").write_bytes(GOOD)
    os.utime(old, (0, 0))
    cache = TieredStageCache(tmp_path / "node", FsspecEntryStore(str(shared)))
    workdir = cache.new_workdir()
    (workdir / "model.onnx").write_bytes(GOOD)
    cache.publish_folder(KEY, workdir, "stages")
    cache.release_leases()
    assert not old.exists() and live.exists(), f"only what is older than {STALE_S} s is swept"
    assert verify_entry(shared / "stages" / KEY) is None


@pytest.mark.parametrize("planted", ["link", "file"])
def test_an_entry_that_is_a_link_or_a_file_is_dropped_and_only_it(tmp_path, planted):
    cache = StageCache(tmp_path / "cache")
    elsewhere = tmp_path / "elsewhere"
    workdir = cache.new_workdir()
    (workdir / "model.onnx").write_bytes(GOOD)
    cache.publish_folder(KEY, workdir, "stages")
    os.rename(cache.entry_dir(KEY), elsewhere)  # a whole, valid entry, outside the cache
    if planted == "link":
        os.symlink(elsewhere, cache.entry_dir(KEY))
    else:
        cache.entry_dir(KEY).write_bytes(b"x")
    assert cache.lookup_folder(KEY, "stages") is None
    assert not os.path.lexists(cache.entry_dir(KEY)) and verify_entry(elsewhere) is None, "the link went, not its target"
    assert not list((tmp_path / "cache" / "tmp").glob("trash-*")), "nothing left in the trash"
    cache.release_leases()


class _Failing:
    """A remote that fails as a dead network does (every call), or as a full local disk would."""

    def __init__(self, exc: BaseException, url: str):
        self.exc, self.url, self.calls = exc, url, 0

    def _fail(self, *args):
        self.calls += 1
        raise self.exc

    fetch_folder = push_folder = fetch_result = push_result = _fail


def test_a_remote_that_fails_mid_run_is_one_warning_and_the_local_cache_goes_on(tmp_path, caplog):
    remote = _Failing(ConnectionError("Could not connect to the endpoint URL"), f"s3://gone-{tmp_path.name}/x")
    cache = TieredStageCache(tmp_path / "cache", remote)
    with caplog.at_level(logging.WARNING, logger="optpipe.cache"):
        assert cache.lookup_folder(KEY, "stages") is None
        workdir = cache.new_workdir()
        (workdir / "model.onnx").write_bytes(GOOD)
        entry = cache.publish_folder(KEY, workdir, "stages")
        cache.put_result(KEY, {"p50": 1.0})
        assert cache.get_result(KEY) == {"p50": 1.0}
    cache.release_leases()
    assert verify_entry(entry) is None and remote.calls == 1, "asked once, then left alone"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "goes on with the local cache only" in warnings[0] and "ConnectionError" in warnings[0]


def test_a_full_local_disk_during_a_download_is_not_blamed_on_the_remote(tmp_path):
    import errno

    remote = _Failing(OSError(errno.ENOSPC, "No space left on device"), f"file://{tmp_path}/r")
    with pytest.raises(OSError) as raised:
        TieredStageCache(tmp_path / "cache", remote).lookup_folder(KEY, "stages")
    assert raised.value.errno == errno.ENOSPC
