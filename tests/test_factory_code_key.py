"""The export's cache key names all of a factory's code (optpipe/source/code_digest.py): a model split across
files kept its key when the file it imported changed, and the next compile reused the old export, reported it ok,
and shipped artifacts of a model the user no longer had. The same for a model config a factory kwarg names."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from optpipe.recipe.schema import FactoryModel, InputSpec, ModelSource
from optpipe.source.model_source import source_fingerprint

NET = "import torch\nfrom {blocks} import Block\ndef build(cfg=None):\n    torch.manual_seed(0)\n    return torch.nn.Sequential(Block(), torch.nn.Linear(8, 2))\n"
BLOCKS = "import torch\nSCALE = {scale}\nclass Block(torch.nn.Linear):\n    def __init__(self):\n        super().__init__(8, 8)\n    def forward(self, x):\n        return super().forward(x) * SCALE\n"


def _project(folder: Path, net: str, blocks: str, scale: float = 1.0) -> None:
    (folder / f"{net}.py").write_text(NET.format(blocks=blocks))
    (folder / f"{blocks}.py").write_text(BLOCKS.format(scale=scale))


def _key(folder: Path, factory: str, **kwargs) -> dict:
    source = ModelSource(inputs=[InputSpec(name="x", shape=["batch", 8])], dims={},
                         model=FactoryModel(factory=factory, path=".", kwargs=kwargs), base_dir=folder)
    return source_fingerprint(source)


def test_the_key_changes_with_a_module_the_factory_imports_and_not_with_others(tmp_path):
    _project(tmp_path, "keynet_a", "keyblocks_a")
    (tmp_path / "notes_a.py").write_text("X = 1\n")
    before = _key(tmp_path, "keynet_a:build")
    assert set(before["code"]) >= {"keynet_a.py", "keyblocks_a.py"} and "distribution torch" in before["code"]
    (tmp_path / "notes_a.py").write_text("X = 2\n")  # not imported: not the model
    assert _key(tmp_path, "keynet_a:build") == before
    (tmp_path / "keyblocks_a.py").write_text(BLOCKS.format(scale=3.0))
    assert _key(tmp_path, "keynet_a:build")["code"] != before["code"]


def test_a_package_with_relative_imports_is_read_whole(tmp_path):
    package = tmp_path / "keypkg_b"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "net.py").write_text("from .layers import make\nfrom . import util\ndef build():\n    return make()\n")
    (package / "layers.py").write_text("import torch\ndef make():\n    return torch.nn.Linear(8, 2)\n")
    (package / "util.py").write_text("EPS = 1e-5\n")
    before = _key(tmp_path, "keypkg_b.net:build")["code"]
    assert {"keypkg_b/__init__.py", "keypkg_b/net.py", "keypkg_b/layers.py", "keypkg_b/util.py"} <= set(before)
    (package / "util.py").write_text("EPS = 1e-3\n")
    assert _key(tmp_path, "keypkg_b.net:build")["code"] != before


def test_a_file_a_factory_kwarg_names_is_in_the_key(tmp_path):
    _project(tmp_path, "keynet_c", "keyblocks_c")
    (tmp_path / "model.yaml").write_text("depth: 2\n")
    before = _key(tmp_path, "keynet_c:build", cfg="model.yaml")
    assert "model.yaml" in before["kwargs_files"]
    (tmp_path / "model.yaml").write_text("depth: 3\n")
    assert _key(tmp_path, "keynet_c:build", cfg="model.yaml") != before
    assert _key(tmp_path, "keynet_c:build", cfg="/")["kwargs_files"] == {}  # a folder (or a name) is not read


def test_a_big_file_a_kwarg_names_is_judged_by_size_and_time(tmp_path, monkeypatch):
    from optpipe.source import code_digest

    _project(tmp_path, "keynet_e", "keyblocks_e")
    (tmp_path / "archive.bin").write_bytes(b"x" * 64)
    monkeypatch.setattr(code_digest, "KWARGS_FILE_BYTES", 16)
    stat = (tmp_path / "archive.bin").stat()
    assert _key(tmp_path, "keynet_e:build", cfg="archive.bin")["kwargs_files"] == {"archive.bin": f"64:{stat.st_mtime_ns}"}


def test_an_edited_helper_module_is_exported_again_not_served_from_the_cache(tmp_path):
    _project(tmp_path, "keynet_d", "keyblocks_d")
    recipe = {"name": "split", "model": {"factory": "keynet_d:build", "path": "."},
              "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 8]}],
              "dims": {"batch": {"min": 1, "opt": 1, "max": 4}},
              "data": {"eval": {"source": "synthetic", "samples": 4}},
              "stages": {"export": {"pass": "export"}},
              "evaluate": {"batch_sizes": [1], "warmup": 1, "iterations": 2, "threads": 1}, "output": "run"}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "OPTPIPE_CACHE": str(tmp_path / "cache")}

    def compile_and_read() -> tuple[bool, float]:
        done = subprocess.run([sys.executable, "-m", "optpipe.cli", "compile", "r.yaml"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads((tmp_path / "run" / "report.json").read_text())
        export = next(s for s in report["stages"] if s["name"] == "export")
        return export["cached"], _first_output(tmp_path / "run" / "stages" / "export" / "model.onnx")

    _, first = compile_and_read()
    (tmp_path / "keyblocks_d.py").write_text(BLOCKS.format(scale=3.0))
    cached, second = compile_and_read()
    assert not cached
    assert abs(second) > 0 and abs(second - first) > 1e-3  # the new model's numbers, not the old export's


def _first_output(path: Path) -> float:
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return float(session.run(None, {"x": np.ones((1, 8), np.float32)})[0].sum())
