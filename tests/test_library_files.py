"""A compile leaves nothing in the user's home or temp folder (the quality bar: nothing outside the
output and cache folders is touched). ONNX Runtime's telemetry, matplotlib's font list and torch's
inductor cache each wrote there by default (core/library_files.py). A real compile in a subprocess
with an empty HOME and TMPDIR: torch export, ORT int8, OpenVINO int8, the report and two targets."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
MODELS = HERE.parent / "recipes" / "models"

RECIPE = {
    "name": "tiny",
    "model": {"factory": "tiny:build_mlp", "path": "models"},
    "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 32]}],
    "dims": {"batch": {"min": 1, "opt": 4, "max": 16}},
    "data": {"eval": {"source": "synthetic", "samples": 16, "seed": 0}, "calibration": {"source": "synthetic", "samples": 8}},
    "stages": {
        "export": {"pass": "export"},
        "int8": {"pass": "int8", "after": "export"},
        "ov": {"pass": "openvino", "after": "export", "params": {"precision": "int8", "subset_size": 8}},
    },
    "targets": [{"kind": "ort"}, {"kind": "openvino"}],
    "evaluate": {"batch_sizes": [1], "warmup": 1, "iterations": 5},
    "output": "out",
    "cache": "cache",
}


def _optpipe_in_empty_home(folder: Path, *args: str) -> list[str]:
    """Run `optpipe ARGS` in `folder` in a subprocess whose HOME and TMPDIR are empty folders of their own (made
    once); what it left in them. Fails on a non-zero exit."""
    home, tmp = folder / "home", folder / "tmp"
    home.mkdir(exist_ok=True), tmp.mkdir(exist_ok=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(tmp), "OPTPIPE_CACHE": ""}
    proc = subprocess.run([sys.executable, "-m", "optpipe.cli", *args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sorted(str(p.relative_to(folder)) for p in [*home.rglob("*"), *tmp.rglob("*")])


def test_a_compile_writes_nothing_into_home_or_tmp(tmp_path):
    shutil.copytree(MODELS, tmp_path / "models")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(RECIPE))
    left = _optpipe_in_empty_home(tmp_path, "compile", "recipe.yaml")
    assert (tmp_path / "out" / "report.html").is_file()
    assert left == [], left
    assert (tmp_path / "cache" / "tmp" / "libraries" / "matplotlib").is_dir()  # the font list went here
    # `optpipe report` draws the plots again (their digest file removed): matplotlib's font list is not left in home.
    (tmp_path / "out" / ".report-plots.json").unlink()
    left = _optpipe_in_empty_home(tmp_path, "report", "out")
    assert left == [], left


MODELING = '''
import torch
from transformers import PretrainedConfig, PreTrainedModel


class TinyConfig(PretrainedConfig):
    model_type = "optpipe_tiny_custom"

    def __init__(self, vocab=50, hidden=8, **kwargs):
        self.vocab, self.hidden = vocab, hidden
        super().__init__(**kwargs)


class TinyModel(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab, config.hidden)
        self.post_init()

    def forward(self, input_ids):
        return self.embed(input_ids)
'''


def test_a_model_with_its_own_code_is_imported_from_the_cache_not_home(tmp_path, monkeypatch):
    """`trust_remote_code: true`: transformers copies the folder's modeling code into ~/.cache/huggingface/modules
    before importing it; with HF_MODULES_CACHE under the cache folder, home stays empty."""
    import importlib.util

    source = tmp_path / "src" / "modeling_tiny.py"
    source.parent.mkdir()
    source.write_text(MODELING)
    spec = importlib.util.spec_from_file_location("modeling_tiny", source)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "modeling_tiny", module)  # save_pretrained copies the code of the class's module
    spec.loader.exec_module(module)
    module.TinyConfig.register_for_auto_class()
    module.TinyModel.register_for_auto_class("AutoModel")
    module.TinyModel(module.TinyConfig()).save_pretrained(tmp_path / "custom")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({
        "name": "custom", "model": {"hf": "custom", "trust_remote_code": True},
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 50]}],
        "dims": {"batch": {"min": 1, "opt": 1, "max": 2}, "sequence": {"min": 2, "opt": 4, "max": 8}},
        "data": {"eval": {"source": "synthetic", "samples": 2}}, "stages": {"export": {"pass": "export"}},
        "evaluate": {"batch_sizes": [1], "warmup": 1, "iterations": 2}, "output": "out", "cache": "cache"}))
    left = _optpipe_in_empty_home(tmp_path, "compile", "recipe.yaml")
    assert left == [], left
    assert list((tmp_path / "cache" / "tmp" / "libraries" / "hf_modules").rglob("modeling_tiny.py"))


def test_several_recipes_compiled_together_write_nothing_into_home_or_tmp(tmp_path):
    """Several recipes (as a search or a Ray run) go through the executor's tasks, not the one-recipe compile:
    the tasks point the libraries' files into the cache folder too (matplotlib's font list was written to home)."""
    shutil.copytree(MODELS, tmp_path / "models")
    for name in ("a", "b"):
        recipe = {**RECIPE, "name": name, "output": f"out-{name}", "targets": [],
                  "stages": {"export": {"pass": "export"}, "int8": {"pass": "int8", "after": "export"}}}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    left = _optpipe_in_empty_home(tmp_path, "compile", "a.yaml", "b.yaml")
    assert (tmp_path / "out-a" / "report.html").is_file() and (tmp_path / "out-b" / "report.html").is_file()
    assert left == [], left
