"""The object-store cache backend against a real S3-compatible server (moto's, on 127.0.0.1)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from optpipe.cache.backends import FsspecEntryStore, TieredStageCache

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
from remote_fixtures import s3_url  # noqa: E402,F401 (the module's S3 server, shared with test_cache_untrusted)


def _store(s3_url) -> FsspecEntryStore:
    url, options = s3_url
    return FsspecEntryStore(url, **options)


def _entry(cache: TieredStageCache, key: str, text: str) -> Path:
    workdir = cache.new_workdir()
    (workdir / "model.onnx").write_text(text)
    (workdir / "model.onnx.data").write_bytes(text.encode() * 3)
    return cache.publish_folder(key, workdir, "stages", {"stage": "s"})


def test_an_entry_published_on_one_machine_is_found_on_another(tmp_path, s3_url):
    first = TieredStageCache(tmp_path / "node-a", _store(s3_url))
    published = _entry(first, "k1", "weights")
    second = TieredStageCache(tmp_path / "node-b", _store(s3_url))
    found = second.lookup_folder("k1", "stages")
    assert found is not None and found.parent.parent == tmp_path / "node-b"
    assert (found / "model.onnx.data").read_bytes() == (published / "model.onnx.data").read_bytes()
    a, b = (json.loads((f / "entry.json").read_text()) for f in (published, found))
    assert a["content"] == b["content"] and a["files"] == b["files"]


def test_an_upload_without_its_manifest_is_invisible(tmp_path, s3_url):
    url, options = s3_url
    fs = s3fs.S3FileSystem(**options)
    fs.pipe_file(f"{url}/stages/half/model.onnx", b"partial")  # a writer killed before the commit
    cache = TieredStageCache(tmp_path / "node", _store(s3_url))
    assert cache.lookup_folder("half", "stages") is None


def test_a_corrupted_remote_file_is_refused(tmp_path, s3_url):
    url, options = s3_url
    _entry(TieredStageCache(tmp_path / "a", _store(s3_url)), "k2", "good")
    s3fs.S3FileSystem(**options).pipe_file(f"{url}/stages/k2/model.onnx", b"evil")
    assert TieredStageCache(tmp_path / "b", _store(s3_url)).lookup_folder("k2", "stages") is None


def test_results_round_trip_and_a_tampered_one_is_refused(tmp_path, s3_url):
    url, options = s3_url
    TieredStageCache(tmp_path / "a", _store(s3_url)).put_result("r1", {"p50": 1.5})
    assert TieredStageCache(tmp_path / "b", _store(s3_url)).get_result("r1") == {"p50": 1.5}
    fs = s3fs.S3FileSystem(**options)
    fs.pipe_file(f"{url}/results/r1.json", json.dumps({"sha256": "0" * 64, "value": {"p50": 0.1}}).encode())
    assert TieredStageCache(tmp_path / "c", _store(s3_url)).get_result("r1") is None


def test_a_compile_on_a_fresh_machine_reuses_the_object_store(tmp_path, s3_url, tiny_recipe):
    from optpipe.execution.executors import LocalExecutor, Progress
    from optpipe.search.runner import compile_recipes
    from optpipe.safety.recipe_loading import load_recipe

    url, options = s3_url
    recipe = load_recipe(tiny_recipe())
    runs = []
    for machine in ("first", "second"):
        log = tmp_path / f"{machine}.log"
        with open(log, "w") as stream:
            [(report, failed)] = compile_recipes([recipe], LocalExecutor(), cache_dir=tmp_path / machine, remote_cache=url,
                                                 storage_options=options, progress=Progress(stream))
        runs.append((report, log.read_text()))
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
    (first, first_log), (second, second_log) = runs
    assert " ok pass export" in first_log
    assert " ok pass" not in second_log and " cached pass export" in second_log  # nothing recomputed
    assert [s.hash for s in first.stages] == [s.hash for s in second.stages]


def test_a_new_prefix_with_nothing_under_it_is_a_new_cache(tmp_path, s3_url):
    """Issue 22: an empty prefix was `cannot list it (FileNotFoundError: bucket/team)`."""
    url, options = s3_url
    fresh = f"{url}/never-written"
    assert FsspecEntryStore(fresh, **options).check() == fresh
    cache = TieredStageCache(tmp_path / "node", FsspecEntryStore(fresh, **options))
    assert cache.lookup_folder("k9", "stages") is None and cache.get_result("k9") is None
    _entry(cache, "k9", "first")
    assert TieredStageCache(tmp_path / "other", FsspecEntryStore(fresh, **options)).lookup_folder("k9", "stages") is not None


def test_a_missing_bucket_is_one_line_naming_the_flag(s3_url):
    from optpipe.core.errors import OptpipeError

    _, options = s3_url
    with pytest.raises(OptpipeError, match="bucket 'no-such-bucket' does not exist; create it or point --remote-cache"):
        FsspecEntryStore("s3://no-such-bucket/team", **options).check()


def test_an_object_store_gone_mid_run_is_one_warning_and_the_run_goes_on(tmp_path, caplog):
    """A real s3fs client against a port nothing listens on (as a server lost after the up-front check)."""
    import logging

    options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"},
               "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    cache = TieredStageCache(tmp_path / "node", FsspecEntryStore(f"s3://gone-{tmp_path.name}/p", **options))
    with caplog.at_level(logging.WARNING, logger="optpipe.cache"):
        assert cache.lookup_folder("k7", "stages") is None
        assert _entry(cache, "k7", "local").exists() and cache.get_result("k7") is None
    cache.release_leases()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "local cache only" in warnings[0], warnings
