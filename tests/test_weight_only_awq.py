"""weight_only's `algorithm: awq`: NNCF's activation-aware INT4 on the ONNX graph, run by ONNX Runtime (passes/_nncf_awq.py)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import onnx
import pytest
import yaml

from helpers_passes import artifact_of, context
from optpipe.core.errors import PassError
from optpipe.execution.stage_runner import run_checked
from optpipe.passes import get_pass
from test_generation_report import decoder_recipe
from test_weight_only import _run, _run_proto, _worst_cosine, gemm_mlp, run_model, setup  # noqa: F401 (setup: the MLP fixture)

AWQ = {"bits": 4, "block_size": 32, "algorithm": "awq", "ratio": 0.5}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A tiny Llama through export -> weight_only awq (half its MatMuls in INT4) -> generation against eager."""
    from click.testing import CliRunner

    from optpipe.cli import cli

    tmp = tmp_path_factory.mktemp("awq")
    stages = {"export": {"pass": "export"},
              "awq": {"pass": "weight_only", "after": "export", "params": AWQ}}
    recipe = decoder_recipe(tmp, stages=stages)
    data = yaml.safe_load(recipe.read_text())
    data["data"]["calibration"] = {"source": "synthetic", "samples": 4, "seed": 1}
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    cache = tmp / "cache"
    first = CliRunner().invoke(cli, ["compile", str(recipe), "--cache-dir", str(cache)], catch_exceptions=False)
    again = CliRunner().invoke(cli, ["compile", str(recipe), "--cache-dir", str(cache)], catch_exceptions=False)
    return tmp, first, again


def test_awq_writes_int4_and_int8_matmulnbits_that_generate(compiled):
    tmp, first, again = compiled
    assert first.exit_code == 0, first.output
    report = {s["name"]: s for s in json.loads((tmp / "run" / "report.json").read_text())["stages"]}
    stage = report["awq"]
    assert stage["status"] in ("ok", "out-of-tolerance"), stage  # random weights: the bounds judge nothing
    info = stage["info"]
    assert info["algorithm"] == "awq" and info["ratio"] == 0.5 and info["weights"] == "on disk (worker)"
    # About half of the 14 layer MatMuls' weights in INT4 by NNCF (its ratio counts weights), the rest and the
    # untied LM head at 8 bits by ORT's quantizer: every MatMul with a weight quantized, none twice.
    int4, int8 = info["int4_matmuls"], info["int8_matmuls"]
    assert int4 > 0 and int8 > 1 and int4 + int8 == 15, info
    graph = onnx.load(str(tmp / "run" / "stages" / "awq" / "model.onnx"), load_external_data=False).graph
    nbits = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in graph.node if n.op_type == "MatMulNBits"]
    assert sorted(a["bits"] for a in nbits) == [4] * int4 + [8] * int8
    assert {a["accuracy_level"] for a in nbits} == {4}, "NNCF's level 0 replaced by the stage's (int8 activations)"
    assert not [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in {i.name for i in graph.initializer}]
    macs = info["coverage"]["macs"]
    assert macs["int4"] > 0 and macs["int8"] > 0
    generation = stage["generation"]
    assert generation["rows"] and all(r["decode_tokens_per_s"] > 0 for r in generation["rows"])
    assert 0 <= generation["next_token_agreement"] <= 1 and generation["perplexity"] > 1
    assert again.exit_code == 0, again.output
    rerun = {s["name"]: s for s in json.loads((tmp / "run" / "report.json").read_text())["stages"]}
    assert rerun["awq"]["cached"] is True


def test_awq_joins_nncf_and_the_cpu_class_to_the_key():
    """Its statistics run on ONNX Runtime's kernels: the CPU class decides them, as it does a guard's choices."""
    cls = get_pass("weight_only")
    awq, default = cls(cls.Params(**AWQ)), cls(cls.Params())
    assert set(awq.fingerprint(SimpleNamespace())) == {"nncf", "cpu"} and default.fingerprint(SimpleNamespace()) == {}
    assert awq.needs_calibration and not default.needs_calibration


def test_the_memory_preflight_takes_awq_as_its_own_step():
    """NNCF's statistics sessions (1.9x the weights on Gemma 3 270M), not the streaming worker's 0.9x."""
    from optpipe.plan.source_preflight import _step_kind
    from optpipe.safety.memory_estimate import PASS_FACTORS, WEIGHT_ONLY_AWQ, WEIGHT_ONLY_WORKER

    assert _step_kind("weight_only", AWQ, 1 << 30) == WEIGHT_ONLY_AWQ
    assert _step_kind("weight_only", {"bits": 4}, 1 << 30) == WEIGHT_ONLY_WORKER
    assert PASS_FACTORS[WEIGHT_ONLY_AWQ] > PASS_FACTORS[WEIGHT_ONLY_WORKER]


@pytest.mark.parametrize("params, said", [
    ({"algorithm": "awq", "symmetric": False}, "symmetric .*asymmetric zero points do not load in ONNX Runtime"),
    ({"algorithm": "awq", "bits": 8}, "awq quantizes to 4 bits"),
    ({"ratio": 0.5}, "options of `algorithm: awq`"),
    ({"scale_estimation": True}, "options of `algorithm: awq`"),
    ({"algorithm": "awq", "ratio": 0}, "ratio"),
])
def test_awq_refusals_name_the_fix_at_recipe_read(params, said):
    from optpipe.core.errors import RecipeError
    from optpipe.plan.validate import configure

    with pytest.raises(RecipeError, match=said) as caught:
        configure("q", SimpleNamespace(pass_name="weight_only", params=params), {"weight_only": get_pass("weight_only")})
    assert str(caught.value).startswith("stages.q.params") and "\n" not in str(caught.value)


def test_awq_without_calibration_data_is_refused_naming_it(tmp_path):
    from click.testing import CliRunner

    from optpipe.cli import cli

    recipe = decoder_recipe(tmp_path, stages={"export": {"pass": "export"},
                                              "awq": {"pass": "weight_only", "after": "export", "params": AWQ}})
    result = CliRunner().invoke(cli, ["compile", str(recipe), "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code == 2, result.output
    assert "data.calibration" in result.output and "algorithm awq" in result.output


def test_awq_on_a_graph_that_is_no_decoder(setup):
    """NNCF's AWQ (passes/_nncf_awq.py) on an MLP with an attention-like MatMul: the MatMuls with a weight in INT4
    from the calibration batches, except the last one (NNCF keeps a model's last MatMul, an LM head's place, out of
    INT4), which goes to 8 bits; the activations' MatMul left alone; the output as close as round-to-nearest's."""
    tmp, source, _, feeds, reference = setup
    out = _run(setup, "weight_only", "awq", bits=4, block_size=32, algorithm="awq")
    graph = out.load(with_weights=False).graph
    bits = sorted(onnx.helper.get_attribute_value(a) for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute
                  if a.name == "bits")
    assert bits == [4, 8] and out.info["int4_matmuls"] == 1 and out.info["int8_matmuls"] == 1
    assert [n.name for n in graph.node if n.op_type == "MatMul"] == ["scores"]
    assert _worst_cosine(run_model(out.path, feeds)[0], reference) >= 0.98


def test_awq_that_put_nothing_in_int4_says_so(setup):
    """NNCF keeps the last MatMul out of INT4 and fills `ratio` of the rest's weights a whole layer at a time: half of
    this MLP's one other MatMul is no layer, so nothing is INT4 and the stage is INT8 round-to-nearest; it says so.
    A block wider than a MatMul's input (K 128) at ratio 1 is NNCF's refusal, one line naming the fix."""
    from optpipe.evaluation.verdict import pass_warnings

    out = _run(setup, "weight_only", "awq-half", bits=4, block_size=32, algorithm="awq", ratio=0.5)
    assert out.info["int4_matmuls"] == 0 and out.info["int8_matmuls"] == 2
    [warning] = pass_warnings(out.info)
    assert warning.startswith("awq: NNCF put no MatMul in INT4 (ratio 0.5, block_size 32)")
    with pytest.raises(PassError, match=r"NNCF's AWQ weight compression failed: InvalidGroupSizeError.*`block_size`"):
        _run(setup, "weight_only", "awq-wide", bits=4, block_size=256, algorithm="awq")


def test_awq_refuses_exclude_names_the_model_does_not_have(setup):
    """Checked before NNCF's statistics run (NNCF's own scope check is off: its names are the graph's)."""
    with pytest.raises(PassError, match=r"exclude names nodes the model does not have: \['nope'\]"):
        _run(setup, "weight_only", "awq-unknown", bits=4, block_size=32, algorithm="awq", exclude=["nope"])


def test_awq_leaves_no_gemm_weight_in_float(setup):
    """Gemms with a weight (GPT-2's Conv1D, torch.addmm) that NNCF leaves: ORT's 8 bits take them as MatMuls, as the
    default algorithm does (AWQ's leftovers used to be looked for among MatMuls only, so a Gemm-only graph stayed
    FP32). The activations' Gemm stays; the output as close as int8's."""
    tmp, _, recipe, feeds, _ = setup
    model = gemm_mlp(5)
    expected = _run_proto(model, feeds)[0]
    cls = get_pass("weight_only")
    out = run_checked(cls(cls.Params(**{**AWQ, "ratio": 1.0})), artifact_of(model, tmp / "gemm-awq-source"),
                      context(recipe, tmp / "gemm-awq", feeds))
    graph = out.load(with_weights=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulNBits") == 2 and ops.count("Gemm") == 1 and "MatMul" not in ops, ops
    assert out.info["int4_matmuls"] + out.info["int8_matmuls"] == 2
    assert _worst_cosine(run_model(out.path, feeds)[0], expected) >= 0.98


def test_awq_with_every_weight_excluded_quantizes_nothing_and_says_why(setup):
    """Nothing for NNCF and nothing left for 8 bits: the stage writes the model as it was, and names the nodes it
    left in float with why."""
    out = _run(setup, "weight_only", "awq-none", bits=4, block_size=32, algorithm="awq", exclude=["mm1", "mm2"])
    assert out.info["int4_matmuls"] == 0 and out.info["int8_matmuls"] == 0
    assert {entry["node"] for entry in out.info["left_in_float"]} == {"mm1", "mm2", "scores"}
    assert not [n for n in out.load(with_weights=False).graph.node if n.op_type == "MatMulNBits"]
