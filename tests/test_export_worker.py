"""A big model's dynamo export runs in a worker process of its own (passes/export.py `own_process`):
onnxscript's rewriter, which torch.onnx runs on every dynamo export, keeps the last graph it matched and,
through it, the torch model's Parameters; exported in the compile's process they outlived the export.
Tiny Llama decoders stand in for big ones (the size thresholds lowered)."""
from __future__ import annotations

import gc
import json

import torch

from optpipe.execution import services
from optpipe.execution.pipeline import RunOptions, compile_recipe
from optpipe.passes import export
from optpipe.safety.recipe_loading import load_recipe
from test_generation_report import LLAMA, decoder_recipe

VOCAB = 263  # a vocabulary no other test's model has: its embedding is told apart from theirs


def _compile(tmp_path, monkeypatch, worker_bytes: int):
    tmp_path.mkdir()
    monkeypatch.setattr(export, "WORKER_MIN_BYTES", worker_bytes)
    monkeypatch.setattr(services, "RELEASE_BYTES", 0)  # the parent drops its own copy after the export's self-check
    recipe = decoder_recipe(tmp_path, stages={"export": {"pass": "export"}}, cache=str(tmp_path / "cache"),
                            model={"hf_config": {**LLAMA, "vocab_size": VOCAB}, "task": "causal-lm", "outputs": ["logits"]},
                            inputs=[{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, VOCAB]}])
    report = compile_recipe(load_recipe(recipe), RunOptions())
    services.RunServices.torch_model.cache_clear()  # the eager rows' reload, held by the class-level cache
    gc.collect()
    return report, json.loads((tmp_path / "run" / "report.json").read_text())


def _count_loads_during_self_checks(monkeypatch) -> list[tuple[str, int]]:
    """(stage, torch model loads) per self-check, in this process."""
    from optpipe.evaluation import self_check

    loads, during_check = [], []
    real_load, real_check = services.load_torch_model, self_check.NumericSelfCheck.after_stage
    monkeypatch.setattr(services, "load_torch_model", lambda source: loads.append(1) or real_load(source))

    def watched(self, info, input, output):
        before = len(loads)
        real_check(self, info, input, output)
        during_check.append((info.name, len(loads) - before))

    monkeypatch.setattr(self_check.NumericSelfCheck, "after_stage", watched)
    return during_check


def _embeddings_alive() -> int:
    return sum(1 for obj in gc.get_objects()
               if type(obj) is torch.nn.Parameter and tuple(obj.shape) == (VOCAB, LLAMA["hidden_size"]))


def _model_digest(report) -> str:
    return next(s for s in report.stages if s.name == "export").model.content_hash()  # model.onnx and its data


def test_a_big_dynamo_export_runs_apart_and_leaves_no_weights_in_the_compile(tmp_path, monkeypatch):
    from optpipe.evaluation import self_check

    loads = _count_loads_during_self_checks(monkeypatch)
    apart, apart_json = _compile(tmp_path / "apart", monkeypatch, 0)
    assert _embeddings_alive() == 0  # exported here, onnxscript's last matched graph would hold the embedding
    stage = next(s for s in apart_json["stages"] if s["name"] == "export")
    assert stage["status"] == "ok"
    assert "onnxscript" in stage["info"]["own_process"]
    # The export handed eager's outputs and greedy tokens to its self-check: the compile's process checked the
    # worker's graph with an ONNX Runtime session alone (1.1 B: the worker had held the model and a session at once).
    assert loads == [("export", 0)]
    assert stage["info"]["generation_check"]["same_tokens"] == 1.0 and stage["info"]["self_check"]["passed"]
    assert not list((tmp_path / "apart" / "cache").rglob("*" + self_check.HANDOVER_SUFFIX))  # taken, not left behind
    here, here_json = _compile(tmp_path / "here", monkeypatch, 1 << 60)
    assert "own_process" not in next(s for s in here_json["stages"] if s["name"] == "export")["info"]
    # The same seeded model, exported in either process: the same graph and weights, the same verdicts.
    assert _model_digest(apart) == _model_digest(here)
    for a, b in zip(apart.stages, here.stages):
        assert (a.name, a.status, a.generation.perplexity) == (b.name, b.status, b.generation.perplexity)


def test_an_encoder_s_auto_export_runs_apart_with_the_same_result(tmp_path, monkeypatch):
    """Not only decoders: `exporter: auto` tries dynamo first, so a big encoder's export runs apart too."""
    import yaml

    def compile_bert(folder, worker_bytes):
        folder.mkdir()
        monkeypatch.setattr(export, "WORKER_MIN_BYTES", worker_bytes)
        recipe = folder / "recipe.yaml"
        recipe.write_text(yaml.safe_dump({
            "name": "tiny-bert",
            "model": {"hf_config": {"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                                    "intermediate_size": 64, "vocab_size": 101}},
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 101]},
                       {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "sequence"], "fill": 1}],
            "dims": {"batch": {"min": 1, "opt": 1, "max": 2}, "sequence": {"min": 4, "opt": 8, "max": 16}},
            "data": {"eval": {"source": "synthetic", "samples": 2}},
            "stages": {"export": {"pass": "export"}},
            "evaluate": {"threads": 1, "warmup": 1, "iterations": 2},
            "output": str(folder / "run"), "cache": str(folder / "cache")}))
        report = compile_recipe(load_recipe(recipe), RunOptions())
        info = json.loads((folder / "run" / "report.json").read_text())["stages"]
        return report, next(s for s in info if s["name"] == "export")

    apart, apart_stage = compile_bert(tmp_path / "apart", 0)
    here, here_stage = compile_bert(tmp_path / "here", 1 << 60)
    assert apart_stage["status"] == here_stage["status"] == "ok"
    assert "own_process" in apart_stage["info"] and "own_process" not in here_stage["info"]
    assert apart_stage["info"]["exporter"] == here_stage["info"]["exporter"]
    assert apart_stage["info"]["self_check"] == here_stage["info"]["self_check"]
    assert _model_digest(apart) == _model_digest(here)


def test_a_graph_that_generates_otherwise_than_eager_fails_its_self_check(tmp_path, monkeypatch):
    """The generation check still judges: eager's greedy tokens shifted by one, the stage fails saying so."""
    from optpipe.evaluation import generation_check

    real = generation_check.eager_reference

    def shifted(*args):
        reference = real(*args)
        return {**reference, generation_check.TOKENS: (reference[generation_check.TOKENS] + 1) % VOCAB}

    monkeypatch.setattr(generation_check, "eager_reference", shifted)
    report, _ = _compile(tmp_path / "here", monkeypatch, 1 << 60)
    stage = next(s for s in report.stages if s.name == "export")
    assert stage.status == "failed" and "does not generate as eager does: 0% of 4 greedy tokens" in stage.reason
