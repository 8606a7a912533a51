"""`optpipe init` finds every input of forward() (signature, config, tokenizer) or refuses naming the one
it cannot infer, and picks the stages by what the model computes (its share of Conv MACs), not its name."""
from __future__ import annotations

from pathlib import Path

import yaml

TINY_CLIP = dict(
    text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     max_position_embeddings=32, eos_token_id=2, bos_token_id=1, pad_token_id=0),
    vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
    projection_dim=16,
)
TINY_SEGFORMER = dict(image_size=64, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                      num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=5, patch_sizes=[7, 3], strides=[4, 2])

USER_MODELS = '''
import torch
from torch import nn


class Pair(nn.Module):
    """Two required inputs; nothing says what `boxes` is."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, obs, boxes):
        return self.proj(obs) + boxes.sum()


def pair():
    return Pair().eval()


def picky():
    class Refusing(nn.Module):  # its first layer says 8 features; forward splits them in 3
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 4)

        def forward(self, x):
            return self.proj(x.reshape(x.shape[0], 3, -1))
    return Refusing().eval()
'''


def _init(cli_run, *args):
    result = cli_run("init", *args)
    return result, (yaml.safe_load(Path(args[-1]).read_text()) if result.exit_code == 0 else None)


def test_a_two_input_clip_gets_both_inputs_sized_from_its_config(tmp_path, cli_run, monkeypatch):
    import transformers

    transformers.CLIPModel(transformers.CLIPConfig(**TINY_CLIP)).save_pretrained(tmp_path / "clip")
    monkeypatch.chdir(tmp_path)
    result, recipe = _init(cli_run, "clip", "-o", "clip.yaml")
    assert result.exit_code == 0, result.output
    inputs = {spec["name"]: spec for spec in recipe["inputs"]}
    assert set(inputs) == {"input_ids", "pixel_values", "attention_mask"}, inputs
    assert inputs["pixel_values"]["shape"] == ["batch", 3, 32, 32] and inputs["input_ids"]["range"] == [0, 100]
    assert recipe["dims"]["sequence"]["max"] == 32  # the text tower's max_position_embeddings
    assert "a transformer recipe" in result.output


def test_a_conv_heavy_segformer_gets_the_cnn_recipe(tmp_path, cli_run, monkeypatch):
    import transformers

    config = transformers.SegformerConfig(**TINY_SEGFORMER, architectures=["SegformerForSemanticSegmentation"])
    transformers.SegformerForSemanticSegmentation(config).save_pretrained(tmp_path / "segformer")
    monkeypatch.chdir(tmp_path)
    result, recipe = _init(cli_run, "segformer", "-o", "seg.yaml")
    assert result.exit_code == 0, result.output
    assert "a cnn recipe" in result.output and "in convolutions" in result.output  # measured: 42% of its MACs
    assert recipe["model"]["task"] == "semantic-segmentation" and recipe["evaluate"]["task"] == {"kind": "segmentation"}
    assert recipe["stages"]["int8"] == {"pass": "int8", "after": "simplify", "params": {"mode": "static", "target": "ort-cpu"}}


def test_an_input_init_cannot_infer_is_named_in_one_line(tmp_path, cli_run, monkeypatch):
    (tmp_path / "user_nets.py").write_text(USER_MODELS)
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "user_nets:pair", "-o", "pair.yaml")
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert "cannot infer input 'boxes' of Pair.forward()" in line and "write `inputs`" in line
    # a plain module has no config: the line gives the input its first layer told, to copy (no Hugging Face names),
    # under forward()'s own name for it (it had said `x`, which names no parameter of forward(obs, boxes))
    assert "first layer tells its first input only ({name: obs, dtype: float32, shape: [batch, 8]})" in line
    assert "config" not in line and "input_ids" not in line
    refused = cli_run("init", "user_nets:picky", "-o", "picky.yaml")
    assert refused.exit_code == 2, refused.output
    [line] = refused.output.strip().splitlines()
    assert "forward() does not take the inferred input(s) x ['batch', 8]" in line
    assert not Path("pair.yaml").exists() and not Path("picky.yaml").exists()


TINY_WAV2VEC2 = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
                     conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                     num_labels=3)
TINY_WHISPER = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                    encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=50, vocab_size=100,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, num_labels=3)


def test_audio_classifiers_get_their_task_and_inputs(tmp_path, cli_run, monkeypatch):
    """An audio classifier's class is named `...ForSequenceClassification` (wav2vec2, HuBERT), which
    AutoModelForSequenceClassification refuses: its task comes from transformers' own tables. wav2vec2 makes one
    weight with a legacy constructor that ignores the meta device: the model is still measured on meta/CPU
    rather than refused. Whisper's classifier takes a fixed-length log-mel spectrogram sized from its config, AST
    a fixed grid of filterbank frames."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.AutoModelForAudioClassification.from_config(
        transformers.Wav2Vec2Config(**TINY_WAV2VEC2)).save_pretrained(tmp_path / "wav2vec2")
    transformers.AutoModelForAudioClassification.from_config(
        transformers.WhisperConfig(**TINY_WHISPER)).save_pretrained(tmp_path / "whisper")
    monkeypatch.chdir(tmp_path)
    result, recipe = _init(cli_run, "wav2vec2", "-o", "wav2vec2.yaml")
    assert result.exit_code == 0, result.output
    assert recipe["model"]["task"] == "audio-classification" and recipe["evaluate"]["task"] == {"kind": "classification"}
    assert recipe["inputs"] == [{"name": "input_values", "dtype": "float32", "shape": ["batch", "samples"]}]
    result, recipe = _init(cli_run, "whisper", "-o", "whisper.yaml")
    assert result.exit_code == 0, result.output
    assert recipe["model"]["task"] == "audio-classification"
    assert recipe["inputs"] == [{"name": "input_features", "dtype": "float32", "shape": ["batch", 16, 100]}]
    # The Audio Spectrogram Transformer's input_values are filterbank frames, sized from its config, not samples.
    transformers.AutoModelForAudioClassification.from_config(transformers.ASTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, max_length=64, num_mel_bins=32,
        num_labels=3)).save_pretrained(tmp_path / "ast")
    result, recipe = _init(cli_run, "ast", "-o", "ast.yaml")
    assert result.exit_code == 0, result.output
    assert recipe["inputs"] == [{"name": "input_values", "dtype": "float32", "shape": ["batch", 64, 32]}]


def test_init_leaves_openvino_out_of_an_onnx_file_with_onnx_runtimes_own_ops(tmp_path, cli_run, monkeypatch):
    """An Optimum -O2 / ORT-optimized file (com.microsoft Attention, BiasGelu...): init wrote three OpenVINO stages, and
    each failed ("OpenVINO's FP32 conversion does not compute what the input ONNX does", MiniLM's at cosine 0.69)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.ones((16, 8), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Gelu", ["h"], ["y"], domain="com.microsoft")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=9)
    onnx.save(model, tmp_path / "fused.onnx")
    monkeypatch.chdir(tmp_path)
    result, recipe = _init(cli_run, "fused.onnx", "-o", "fused.yaml")
    assert result.exit_code == 0, result.output
    assert "openvino" not in {spec["pass"] for spec in recipe["stages"].values()} and "int8" in recipe["stages"]
    assert "no OpenVINO stage: the model holds ONNX Runtime's own ops (Gelu)" in (tmp_path / "fused.yaml").read_text()


ROUND_ELEVEN_MODELS = '''
import torch
from torch import nn


class Counted(nn.Module):
    """A forward torch's FLOP counter cannot run (as a Mamba's reference scan, which reads grad_fn under it)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x):
        if isinstance(torch.overrides._get_current_function_mode(), torch.utils._python_dispatch.TorchDispatchMode) or \\
                torch.utils._python_dispatch._get_current_dispatch_mode() is not None:
            raise AssertionError("Expected gradient function to be set")
        return self.proj(x)


def counted():
    return Counted().eval()


def quantized():
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    return torch.ao.quantization.quantize_dynamic(net, {nn.Linear}, dtype=torch.qint8)
'''


def test_a_roberta_style_position_table_bounds_the_sequence(tmp_path, cli_run, monkeypatch):
    # XLM-R and MPNet number positions after the padding index: 64 positions take 62 tokens. init ran the model at 64
    # and refused it ("does not run on the inputs inferred"); real checkpoints carry 514 for 512 tokens.
    import transformers

    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100,
                 max_position_embeddings=64)
    transformers.XLMRobertaForQuestionAnswering(transformers.XLMRobertaConfig(**small)).save_pretrained(tmp_path / "xlmr")
    transformers.MPNetModel(transformers.MPNetConfig(**small)).save_pretrained(tmp_path / "mpnet")
    transformers.BertModel(transformers.BertConfig(**small)).save_pretrained(tmp_path / "bert")  # no such offset
    monkeypatch.chdir(tmp_path)
    for folder, longest in (("xlmr", 62), ("mpnet", 62), ("bert", 64)):
        result, recipe = _init(cli_run, folder, "-o", f"{folder}.yaml")
        assert result.exit_code == 0, result.output
        assert recipe["dims"]["sequence"]["max"] == longest, (folder, recipe["dims"])


def test_a_forward_the_flop_counter_cannot_run_gets_its_kind_by_its_inputs(tmp_path, cli_run, monkeypatch):
    (tmp_path / "eleven_nets.py").write_text(ROUND_ELEVEN_MODELS)
    monkeypatch.chdir(tmp_path)
    result, recipe = _init(cli_run, "eleven_nets:counted", "-o", "counted.yaml")
    assert result.exit_code == 0, result.output
    assert "its compute was not measured" in result.output and recipe["inputs"][0]["shape"] == ["batch", 8]


def test_a_module_quantized_by_torch_is_refused_by_init_as_by_the_compile(tmp_path, cli_run, monkeypatch):
    # init had found no layer it knew, guessed an image input [batch, 3, 224, 224], and failed on it.
    (tmp_path / "eleven_quantized_nets.py").write_text(ROUND_ELEVEN_MODELS)
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "eleven_quantized_nets:quantized", "-o", "quantized.yaml")
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert "'eleven_quantized_nets:quantized': the module is quantized in PyTorch already" in line and "224" not in line


def test_a_vision_config_of_height_and_width_gets_both(tmp_path, cli_run, monkeypatch):
    # image_size [32, 48]: init took the first number for both sides and the model refused 32 x 32.
    import transformers

    config = transformers.ViTConfig(image_size=[32, 48], patch_size=8, hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=64, num_labels=3)
    transformers.ViTForImageClassification(config).save_pretrained(tmp_path / "wide")
    monkeypatch.chdir(tmp_path)
    result, recipe = _init(cli_run, "wide", "-o", "wide.yaml")
    assert result.exit_code == 0, result.output
    assert recipe["inputs"][0]["shape"] == ["batch", 3, 32, 48]
