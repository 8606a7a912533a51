"""A learned position table bounds the sequence dims a recipe may declare (optpipe/source/position_limit.py).

The export's checks stop at twice the trace size: `sequence: {max: 4096}` on a 512-position BERT exported and
evaluated 'ok', and its artifacts promised 4096 to a server."""
from __future__ import annotations

import pytest
import yaml

transformers = pytest.importorskip("transformers")

from helpers_recipes import compile_recipe, small_recipe  # noqa: E402
from optpipe.core.errors import RecipeError  # noqa: E402
from optpipe.recipe.schema import DimRange, InputSpec, ModelInputs  # noqa: E402
from optpipe.source.position_limit import check_sequence_dims, position_limit  # noqa: E402

TOKENS = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"], "range": [0, 100]}]


def _token_dims(longest: int) -> dict:
    return {"batch": {"min": 1, "opt": 1, "max": 2}, "sequence": {"min": 1, "opt": 16, "max": longest}}


SMALL = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=100)


def _inputs(longest: int, masked: bool = True) -> ModelInputs:
    ids = InputSpec(name="input_ids", dtype="int64", shape=["batch", "sequence"], range=(0, 100))
    mask = InputSpec(name="attention_mask", dtype="int64", shape=["batch", "sequence"], fill=1)
    return ModelInputs((ids, mask) if masked else (ids,),
                       {"batch": DimRange(min=1, opt=1, max=4), "sequence": DimRange(min=1, opt=8, max=longest)})


@pytest.mark.parametrize("config, positions", [
    (transformers.BertConfig(num_hidden_layers=1, max_position_embeddings=64, **SMALL), 64),
    # RoBERTa's table starts after its padding row: 66 rows serve 64 positions
    (transformers.RobertaConfig(num_hidden_layers=1, max_position_embeddings=66, pad_token_id=1, **SMALL), 64),
    (transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=48, vocab_size=100), 48),
    # OPT keeps 2 offset rows ahead of its positions
    (transformers.OPTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, ffn_dim=64, word_embed_proj_dim=32,
                            max_position_embeddings=40, vocab_size=100), 40),
])
def test_a_learned_position_table_bounds_the_sequence_it_serves(config, positions):
    model = transformers.AutoModel.from_config(config)
    assert position_limit(model)[1] == positions
    check_sequence_dims(model, _inputs(positions))  # at the limit: fine
    with pytest.raises(RecipeError, match=rf"dims\.sequence\.max: {positions + 1} is longer .* at most {positions}"):
        check_sequence_dims(model, _inputs(positions + 1))
    model.eval()
    import torch

    with torch.no_grad():  # the limit is the real one: the model runs at it
        model(input_ids=torch.ones((1, positions), dtype=torch.int64))


def test_rotary_positions_take_any_length():
    model = transformers.AutoModel.from_config(transformers.LlamaConfig(
        num_hidden_layers=1, num_key_value_heads=2, max_position_embeddings=32, **SMALL))
    assert position_limit(model) is None
    check_sequence_dims(model, _inputs(100_000, masked=False))


def test_compile_refuses_a_sequence_dim_past_the_table_in_one_line(tmp_path, cli_run):
    model = {"hf_config": {"model_type": "bert", "num_hidden_layers": 1, "max_position_embeddings": 64, **SMALL},
             "task": "feature-extraction"}
    result = compile_recipe(tmp_path, cli_run, small_recipe(model, TOKENS, _token_dims(4096), samples=2))
    assert result.exit_code == 2, result.output
    assert ("dims.sequence.max: 4096 is longer than the model takes: its learned position table "
            "(embeddings.position_embeddings) has 64 positions") in result.output


def test_an_onnx_source_with_a_position_table_is_held_to_its_rows(tmp_path, cli_run):
    """An exported model keeps its module names: the table's rows bound the recipe's sequence dims."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from optpipe.source.position_limit import onnx_position_limit

    table = numpy_helper.from_array(np.zeros((64, 8), np.float32), "bert.embeddings.position_embeddings.weight")
    nodes = [helper.make_node("Shape", ["input_ids"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["length"], axis=0),
             helper.make_node("Range", ["zero", "length", "step"], ["positions"]),
             helper.make_node("Gather", [table.name, "positions"], ["embedded"])]
    scalars = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("one", 1), ("zero", 0), ("step", 1))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", "S"])],
                              [helper.make_tensor_value_info("embedded", TensorProto.FLOAT, ["S", 8])], [table, *scalars])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), tmp_path / "m.onnx")
    assert onnx_position_limit(graph) == (table.name, 64)
    recipe = small_recipe({"onnx": "m.onnx"}, TOKENS, _token_dims(100), samples=2)
    result = compile_recipe(tmp_path, cli_run, recipe)
    assert result.exit_code == 2, result.output
    assert "dims.sequence.max: 100 is longer than the model takes" in result.output and "at most 64" in result.output
    recipe["dims"]["sequence"]["max"] = 64
    assert compile_recipe(tmp_path, cli_run, recipe).exit_code == 0


def test_init_on_an_onnx_file_keeps_the_sequence_within_its_position_table(tmp_path, cli_run, monkeypatch):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.zeros((64, 8), np.float32), "transformer.wpe.weight")
    graph = helper.make_graph([helper.make_node("Gather", [table.name, "input_ids"], ["embedded"])], "g",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", "S"])],
                              [helper.make_tensor_value_info("embedded", TensorProto.FLOAT, ["N", "S", 8])], [table])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), tmp_path / "m.onnx")
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "m.onnx", "-o", "recipe.yaml")
    assert result.exit_code == 0, result.output
    sequence = [dim for name, dim in yaml.safe_load((tmp_path / "recipe.yaml").read_text())["dims"].items() if name != "batch"]
    assert sequence == [{"min": 1, "opt": 64, "max": 64}]
