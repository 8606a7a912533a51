"""Task-aware accuracy: classification against labels, a detector head whose classes flip while
row cosine stays ~1, a tiny decoder LM (next-token agreement, perplexity on real text), rtol per
output, and an input-insensitive model whose figures the report calls meaningless."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers_passes import artifact_of, run_model
from optpipe.calibration.dataset import build_sample_set
from optpipe.core.errors import DataError, RecipeError, UserInputError
from optpipe.evaluation.accuracy import compare
from optpipe.evaluation.task_metrics import box_iou, mean_average_precision, nms
from optpipe.recipe.schema import TaskSpec, Tolerance
from optpipe.recipe.task_bounds import TaskBounds
from optpipe.safety.recipe_loading import parse_recipe
from optpipe.reporting.run_report import build_report, render_markdown
from optpipe.core.results import StageResult

TOL = Tolerance(cosine_min=0.99)



# --- what the user's input cannot carry: UserInputError (the stage fails as the user's, exit 2) ---


@pytest.mark.parametrize("labels, words", [(np.array([0, 1, 2, 7, 3]), "from 0 to 7, but the task's output has 5 classes"),
                                           (np.array([0, -2, 1, 1, 4]), "from -2 to 4")])
def test_labels_outside_the_classes_name_the_data(labels, words):
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1, (5, 5))
    with pytest.raises(DataError, match=words):
        compare({"logits": logits}, {"logits": logits}, {"x": np.zeros((5, 1))}, TOL, "ref",
                task=TaskSpec(kind="classification"), labels=labels)


@pytest.mark.parametrize("task, words", [(TaskSpec(kind="detection"), "change evaluate.task.kind"),
                                         (TaskSpec(kind="language-model"), "change evaluate.task.kind"),
                                         (TaskSpec(kind="classification", output="boxes"), "evaluate.task.output: the model has no output 'boxes'")])
def test_a_task_the_outputs_cannot_carry_is_the_recipes(task, words):
    logits = np.random.default_rng(2).normal(0, 1, (4, 6))
    with pytest.raises(RecipeError, match=words):
        compare({"scores": logits}, {"scores": logits}, {"x": np.zeros((4, 1))}, TOL, "ref", task=task)


def test_a_tolerance_for_a_missing_output_is_the_recipes():
    y = np.random.default_rng(3).normal(0, 1, (4, 3))
    tolerance = Tolerance(outputs={"logits": {"max_abs": 0.1}})
    with pytest.raises(UserInputError, match="tolerance.outputs: the model has no output 'logits'"):
        compare({"y": y}, {"y": y}, {"x": np.zeros((4, 1))}, tolerance, "ref")


# --- classification ----------------------------------------------------------------------------


def test_classification_against_labels_and_reference():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 200)
    reference = rng.normal(0, 1, (200, 10))
    reference[np.arange(200), labels] += 3  # a classifier right on most samples
    candidate = reference.copy()
    flip = np.arange(0, 200, 10)  # 10% of the samples: the top class drops just below the runner-up
    top = reference.argmax(-1)
    candidate[flip, top[flip]] = np.sort(reference, axis=-1)[flip, -2] - 0.01
    task = TaskSpec(kind="classification", agreement_min=0.95)
    acc = compare({"logits": candidate}, {"logits": reference}, {"x": np.zeros((200, 1))}, TOL, "ref", task=task, labels=labels)
    metrics, on_labels = acc.task.metrics, acc.task.labels
    assert metrics["top1_agreement"] == pytest.approx(0.9) and metrics["top5_agreement"] == 1.0
    assert on_labels["reference_top1"] - on_labels["top1"] > 0.05
    assert not acc.within_tolerance and any("top-1 accuracy on the labels" in v for v in acc.violations)
    same = compare({"logits": reference}, {"logits": reference}, {"x": np.zeros((200, 1))}, TOL, "ref", task=task, labels=labels)
    assert same.within_tolerance and same.task.labels["top1"] == same.task.labels["reference_top1"] > 0.8


def test_a_token_classifier_is_judged_per_real_token():
    # [batch, seq, classes] (NER): its top-1 had been one argmax over each sample's tokens and classes flattened together,
    # blind to tokens whose class flipped. Padded positions count for nothing.
    rng = np.random.default_rng(1)
    reference = rng.normal(0, 1, (8, 12, 5))
    mask = np.ones((8, 12), np.int64)
    mask[:, 9:] = 0  # 3 padded positions per sentence
    candidate = reference.copy()
    top = reference.argmax(-1)
    flip = [(0, 1), (3, 4), (5, 7)]  # three real tokens drop their class below the runner-up
    for b, t in flip:
        candidate[b, t, top[b, t]] = np.sort(reference[b, t])[-2] - 0.01
    candidate[:, 10] = -reference[:, 10]  # padding: anything
    inputs = {"input_ids": np.zeros((8, 12), np.int64), "attention_mask": mask}
    task = TaskSpec(kind="classification")
    acc = compare({"logits": candidate}, {"logits": reference}, inputs, TOL, "ref", task=task)
    assert acc.task.metrics["top1_agreement"] == pytest.approx(1 - 3 / 72)
    labels = top.copy()
    labels[:, 0] = (labels[:, 0] + 1) % 5  # the reference wrong on 8 of 72 real tokens
    acc = compare({"logits": reference}, {"logits": reference}, inputs, TOL, "ref", task=task, labels=labels)
    assert acc.task.labels["reference_top1"] == pytest.approx(1 - 8 / 72)


def test_a_question_answering_head_agrees_where_its_start_and_its_end_both_do():
    # Two outputs, one answer: a span moves when either end moves. Read alone, the start logits held 0.9 here.
    rng = np.random.default_rng(2)
    start, end = rng.normal(0, 1, (20, 16)), rng.normal(0, 1, (20, 16))
    moved_start, moved_end = start.copy(), end.copy()
    for i in (0, 1):
        moved_start[i] = np.roll(start[i], 1)
    for i in (5, 6, 7):
        moved_end[i] = np.roll(end[i], 1)
    task = TaskSpec(kind="classification", output=["start_logits", "end_logits"])
    acc = compare({"start_logits": moved_start, "end_logits": moved_end}, {"start_logits": start, "end_logits": end},
                  {"x": np.zeros((20, 1))}, TOL, "ref", task=task)
    assert acc.task.metrics["top1_agreement"] == pytest.approx(15 / 20) and acc.task.output == "start_logits, end_logits"
    assert not acc.within_tolerance and any("every output together" in v for v in acc.violations)


@pytest.mark.parametrize("task, words", [
    (TaskSpec(kind="detection", output=["a", "b"]), "a detection task reads one output"),
    (TaskSpec(kind="classification", output=["a", "nope"]), "the model has no output 'nope'"),
    (TaskSpec(kind="classification", output=["a", "a"]), "list each output once"),
])
def test_a_list_of_task_outputs_is_for_classification_and_the_models_own_names(task, words):
    from optpipe.recipe.task_outputs import task_outputs

    with pytest.raises(RecipeError, match=words):
        task_outputs(task, {"a": None, "b": None})


def _recipe(tmp_path, data: dict, inputs=None):
    return parse_recipe(
        {"model": {"onnx": "m.onnx"}, "inputs": inputs or [{"name": "x", "shape": ["batch", 4]}],
         "dims": {"batch": {"min": 1, "opt": 1, "max": 8}}, "stages": {"export": {"pass": "export"}}, "data": {"eval": data},
         "evaluate": {"task": {"kind": "classification"}}},  # the task that reads labels (a labels file needs one)
        base_dir=tmp_path,
    )


def test_npz_labels_and_npy_labels_file_become_sample_set_labels(tmp_path):
    x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, labels=np.array([0, 1, 2, 0, 1, 2]))
    samples = build_sample_set(_recipe(tmp_path, {"source": "npz", "path": "data.npz", "samples": 4}).data.eval,
                               _recipe(tmp_path, {"source": "npz", "path": "data.npz"}).model_source(), tmp_path / "cache")
    assert set(samples.arrays) == {"x"}, "labels are never fed to the model"
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", np.array([2, 2, 1, 1, 0, 0]))
    recipe = _recipe(tmp_path, {"source": "npy", "path": "x.npy", "labels": "y.npy", "samples": 5})
    from_file = build_sample_set(recipe.data.eval, recipe.model_source(), tmp_path / "cache")
    assert from_file.labels.tolist() == [2, 2, 1, 1, 0] and len(from_file) == 5
    np.save(tmp_path / "bad.npy", np.array([0.5, 1.5]))
    bad = _recipe(tmp_path, {"source": "npy", "path": "x.npy", "labels": "bad.npy"})
    with pytest.raises(DataError, match="one integer per sample"):
        build_sample_set(bad.data.eval, bad.model_source(), tmp_path / "cache")


def test_images_in_class_subfolders_are_labelled_by_folder(tmp_path):
    from PIL import Image

    for cls, color in (("cat", (250, 10, 10)), ("dog", (10, 250, 10)), ("fox", (10, 10, 250))):
        (tmp_path / "photos" / cls).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (20, 20), tuple(c - 5 * i for c in color)).save(tmp_path / "photos" / cls / f"{i}.png")
    recipe = _recipe(tmp_path, {"source": "images", "path": "photos", "samples": 6, "preprocess": {"resize": 16, "crop": 16}},
                     inputs=[{"name": "images", "shape": ["batch", 3, 16, 16]}])
    samples = build_sample_set(recipe.data.eval, recipe.model_source(), tmp_path / "cache")
    assert samples.labels.tolist() == [0, 1, 2, 0, 1, 2]
    # The label follows the picture: the dominant channel is the class's colour.
    assert samples.arrays["images"].mean(axis=(2, 3)).argmax(-1).tolist() == samples.labels.tolist()


# --- detection ---------------------------------------------------------------------------------

ANCHORS, CLASSES, FEATURES = 64, 6, 16


def detector_head(seed: int = 0, class_noise: float = 0.0) -> onnx.ModelProto:
    """A YOLO-style head [N, anchors, features] -> [N, anchors, 4 box (pixels) + objectness + classes]."""
    rng = np.random.default_rng(seed)
    w_box = rng.normal(0, 0.5, (FEATURES, 4)).astype(np.float32)
    w_obj = rng.normal(0, 1.0, (FEATURES, 1)).astype(np.float32)
    w_cls = rng.normal(0, 1.0, (FEATURES, CLASSES)).astype(np.float32)
    w_cls += np.random.default_rng(99).normal(0, class_noise, w_cls.shape).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w_box, "w_box"), (w_obj, "w_obj"), (w_cls, "w_cls"),
                                                         (np.array(640, np.float32), "pixels"))]
    nodes = [
        helper.make_node("MatMul", ["features", "w_box"], ["box_logits"]),
        helper.make_node("Sigmoid", ["box_logits"], ["box_unit"]),
        helper.make_node("Mul", ["box_unit", "pixels"], ["boxes"]),
        helper.make_node("MatMul", ["features", "w_obj"], ["obj_logits"]),
        helper.make_node("Sigmoid", ["obj_logits"], ["objectness"]),
        helper.make_node("MatMul", ["features", "w_cls"], ["cls_logits"]),
        helper.make_node("Sigmoid", ["cls_logits"], ["classes"]),
        helper.make_node("Concat", ["boxes", "objectness", "classes"], ["output0"], axis=-1),
    ]
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", ANCHORS, FEATURES])],
                              [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["batch", ANCHORS, 5 + CLASSES])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_detection_metric_catches_class_flips_that_cosine_misses(tmp_path):
    features = {"features": np.random.default_rng(1).normal(size=(8, ANCHORS, FEATURES)).astype(np.float32)}
    reference = {"output0": run_model(artifact_of(detector_head(), tmp_path / "ref").path, features)[0]}
    perturbed = {"output0": run_model(artifact_of(detector_head(class_noise=0.6), tmp_path / "noisy").path, features)[0]}
    task = TaskSpec(kind="detection", agreement_min=0.95, map50_min=0.9, score_threshold=0.3)

    cosine_only = compare(perturbed, reference, features, TOL, "ref")
    assert cosine_only.worst_cosine > 0.999 and cosine_only.within_tolerance, "row cosine is blind to the class flips"

    detected = compare(perturbed, reference, features, TOL, "ref", task=task)
    metrics = detected.task.metrics
    # The Pareto axis follows the task: the error is the lost agreement, not the (tiny) lost cosine.
    assert detected.error == pytest.approx(1 - min(metrics["class_agreement"], metrics["map50"]))
    assert detected.error > 0.1 > 0.001 > cosine_only.error
    assert metrics["confident_predictions"] > 50
    assert metrics["class_agreement"] < 0.9 and metrics["map50"] < 0.9
    assert not detected.within_tolerance and any("class agreement" in v for v in detected.violations)

    same = compare(reference, reference, features, TOL, "ref", task=task)
    assert same.within_tolerance and same.task.metrics["class_agreement"] == 1.0 and same.task.metrics["map50"] == 1.0
    fp16 = {"output0": reference["output0"].astype(np.float16).astype(np.float32)}  # storage rounding only
    assert compare(fp16, reference, features, TOL, "ref", task=task).task.metrics["class_agreement"] > 0.99


def test_nms_and_map_on_hand_made_boxes():
    boxes = np.array([[0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30], [0, 0, 10, 10]], dtype=float)
    scores = np.array([[0.9, 0.0], [0.8, 0.0], [0.7, 0.0], [0.0, 0.6]])
    kept_boxes, kept_classes, kept_scores = nms(boxes, scores, 0.5, 0.45)
    # The second box overlaps the first (IoU 0.81) in the same class; the fourth is another class.
    assert kept_classes.tolist() == [0, 0, 1] and kept_scores.tolist() == [0.9, 0.7, 0.6]
    assert box_iou(boxes[:1], boxes[1:2])[0, 0] == pytest.approx(81 / 100)
    truth = [(kept_boxes, kept_classes, kept_scores)]
    assert mean_average_precision(truth, truth, 0.5) == (1.0, 1.0)
    shifted = [(kept_boxes + np.array([5, 5, 5, 5]), kept_classes, kept_scores)]  # IoU 25/175: all misses
    assert mean_average_precision(shifted, truth, 0.5)[0] == 0.0


# --- language model ----------------------------------------------------------------------------

TEXT = ("the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
        "all that glitters is not gold. the early bird catches the worm. ") * 4


@pytest.fixture(scope="module")
def tiny_decoder():
    """A 1-layer causal transformer LM trained for a few seconds on character-level text."""
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    vocab = sorted(set(TEXT))
    ids = torch.tensor([vocab.index(c) for c in TEXT])

    class Decoder(torch.nn.Module):
        def __init__(self, v: int, d: int = 24, seq: int = 32):
            super().__init__()
            self.embed, self.pos = torch.nn.Embedding(v, d), torch.nn.Parameter(torch.zeros(seq, d))
            self.block = torch.nn.TransformerEncoderLayer(d, 2, 48, dropout=0.0, batch_first=True)
            self.head = torch.nn.Linear(d, v)

        def forward(self, tokens):
            n = tokens.shape[1]
            mask = torch.nn.Transformer.generate_square_subsequent_mask(n)
            return self.head(self.block(self.embed(tokens) + self.pos[:n], src_mask=mask, is_causal=True))

    model = Decoder(len(vocab))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    windows = ids.unfold(0, 33, 7)
    for _ in range(40):
        logits = model(windows[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, len(vocab)), windows[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, windows[:8, :32], len(vocab)


def test_language_model_next_token_agreement_and_perplexity(tiny_decoder):
    import torch

    model, tokens, vocab = tiny_decoder
    with torch.no_grad():
        reference = model(tokens).numpy()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.15)
        damaged = model(tokens).numpy()
        model.load_state_dict(state)
    inputs = {"input_ids": tokens.numpy()}
    task = TaskSpec(kind="language-model", agreement_min=0.95, perplexity_ratio_max=1.05)
    same = compare({"logits": reference}, {"logits": reference}, inputs, TOL, "ref", task=task)
    assert same.within_tolerance
    assert same.task.metrics["reference_perplexity"] < vocab / 3, "the trained LM predicts the text far better than chance"
    assert same.task.metrics["next_token_agreement"] == 1.0 and same.task.metrics["perplexity_ratio"] == 1.0
    fp16 = {"logits": reference.astype(np.float16).astype(np.float32)}
    assert compare(fp16, {"logits": reference}, inputs, TOL, "ref", task=task).within_tolerance
    worse = compare({"logits": damaged}, {"logits": reference}, inputs, TOL, "ref", task=task)
    assert worse.task.metrics["perplexity_ratio"] > 1.05 and worse.task.metrics["next_token_agreement"] < 0.95
    assert not worse.within_tolerance and any("perplexity" in v for v in worse.violations)
    # A stage's own bounds (tolerance.task) replace the task's for that stage only: here looser than the damage.
    ratio, agreement = worse.task.metrics["perplexity_ratio"], worse.task.metrics["next_token_agreement"]
    loose = Tolerance(task=TaskBounds(perplexity_ratio_max=ratio * 1.01, agreement_min=agreement * 0.99))
    assert compare({"logits": damaged}, {"logits": reference}, inputs, loose, "ref", task=task).within_tolerance
    only_ppl = Tolerance(task=TaskBounds(perplexity_ratio_max=ratio * 1.01))
    still = compare({"logits": damaged}, {"logits": reference}, inputs, only_ppl, "ref", task=task)
    assert not still.within_tolerance and all("agreement" in v for v in still.violations)


def test_a_stage_task_bound_needs_the_task_that_reads_it():
    from optpipe.core.errors import RecipeError

    def recipe(task, bounds):
        return parse_recipe({"model": {"onnx": "m.onnx"}, "inputs": [{"name": "x", "shape": [1, 4]}],
                             "stages": {"export": {"pass": "export"},
                                        "q": {"pass": "int8", "after": "export", "tolerance": {"task": bounds}}},
                             "evaluate": {"task": task} if task else {}})

    bounded = recipe({"kind": "classification", "agreement_min": 0.99}, {"agreement_min": 0.95})
    assert bounded.evaluate.task.bounded(bounded.tolerance_for("q").task).agreement_min == 0.95
    assert bounded.evaluate.task.bounded(bounded.tolerance_for("export").task).agreement_min == 0.99
    with pytest.raises(RecipeError, match=r"stages\.q\.tolerance\.task: bounds a task metric, and evaluate\.task is not set"):
        recipe(None, {"agreement_min": 0.95})
    with pytest.raises(RecipeError, match=r"tolerance\.task\.perplexity_ratio_max: a classification task does not read it"):
        recipe({"kind": "classification"}, {"perplexity_ratio_max": 1.2})
    with pytest.raises(RecipeError, match=r"tolerance\.task\.perplexity_ratio_max: an embeddings task does not read it"):
        recipe({"kind": "embeddings"}, {"perplexity_ratio_max": 1.2})
    with pytest.raises(RecipeError, match="perplexity_ratio_max"):
        recipe({"kind": "language-model"}, {"perplexity_ratio_max": 0.5})  # below 1: no model could pass


# --- rtol, input sensitivity -------------------------------------------------------------------


def test_rtol_per_output_on_pixel_scale_outputs():
    rng = np.random.default_rng(0)
    reference = {"boxes": rng.uniform(100, 600, (16, 4)), "scores": rng.uniform(0, 1, (16, 3))}
    candidate = {"boxes": reference["boxes"] * (1 + 1e-4), "scores": reference["scores"] + 1e-4}
    atol_only = Tolerance(cosine_min=None, max_abs=1e-3)
    assert not compare(candidate, reference, {}, atol_only, "ref").within_tolerance, "0.06 px fails an absolute 1e-3"
    per_output = Tolerance(cosine_min=None, max_abs=1e-3, outputs={"boxes": {"rtol": 1e-3, "max_abs": 0.0}})
    acc = compare(candidate, reference, {}, per_output, "ref")
    assert acc.within_tolerance and acc.polygraphy_match is True
    assert next(o for o in acc.outputs if o.name == "boxes").beyond_tolerance == 0.0
    tight = Tolerance(cosine_min=None, max_abs=1e-3, outputs={"boxes": {"rtol": 1e-5}})
    acc = compare(candidate, reference, {}, tight, "ref")
    assert not acc.within_tolerance and acc.polygraphy_match is False
    assert any("boxes" in v and "rtol" in v for v in acc.violations)


def insensitive_model() -> onnx.ModelProto:
    """Outputs of hundreds of pixels that move ~3e-4 between samples: a random-init detector's symptom."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 1e-4, (8, 100)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.uniform(0, 600, 100).astype(np.float32), "offsets")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["small"]), helper.make_node("Add", ["small", "offsets"], ["out"])]
    graph = helper.make_graph(nodes, "flat", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 100])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_input_insensitive_model_is_flagged_and_the_report_says_so(tmp_path):
    x = {"x": np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32)}
    reference = {"out": run_model(artifact_of(insensitive_model(), tmp_path / "m").path, x)[0]}
    candidate = {"out": reference["out"] * (1 + 1e-6)}
    acc = compare(candidate, reference, x, TOL, "export")
    assert acc.within_tolerance and acc.worst_cosine > 0.99999
    assert acc.outputs[0].input_sensitivity < 1e-5
    assert len(acc.warnings) == 1 and "mean nothing" in acc.warnings[0]
    sensitive = {"out": np.random.default_rng(0).normal(0, 1, (16, 100))}
    assert compare(sensitive, sensitive, {}, TOL, "export").warnings == []

    recipe = parse_recipe({"model": {"onnx": "m.onnx"}, "inputs": [{"name": "x", "shape": [1, 4]}], "stages": {"export": {"pass": "export"}}})
    stage = StageResult(name="export", pass_name="export", status="ok", accuracy=acc, warnings=acc.warnings)
    text = render_markdown(build_report(recipe.name, recipe.evaluate, [stage]))
    assert "meaningless" in text and "## Warnings" in text and "mean nothing" in text


def test_one_input_insensitive_output_beside_sensitive_ones_is_named(tmp_path):
    """YOLOS: pred_boxes barely depend on the image while logits do; a model-wide figure hid it."""
    rng = np.random.default_rng(2)
    boxes = rng.uniform(0, 1, (1, 50)) + rng.normal(0, 1e-5, (16, 50))  # nearly one box set for every sample
    reference = {"logits": rng.normal(0, 1, (16, 10)), "pred_boxes": boxes}
    acc = compare(reference, reference, {}, TOL, "export")
    [warning] = acc.warnings
    assert warning.startswith("output 'pred_boxes' (spread") and "logits" not in warning and "mean nothing" not in warning
    stage = StageResult(name="export", pass_name="export", status="ok", accuracy=acc, warnings=acc.warnings)
    recipe = parse_recipe({"model": {"onnx": "m.onnx"}, "inputs": [{"name": "x", "shape": [1, 4]}], "stages": {"export": {"pass": "export"}}})
    text = render_markdown(build_report(recipe.name, recipe.evaluate, [stage]))
    assert "(some outputs barely depend on the inputs)" in text and "meaningless" not in text


def test_a_reference_of_subnormal_outputs_is_flagged_meaningless():
    """A random-init MobileViT's logits peaked at 2.9e-41: eager 'disagreed' with its export (cosine 0.976) and every
    quantized stage, whose outputs were exactly 0, scored cosine 0. The figures are noise, and the report says so."""
    rng = np.random.default_rng(3)
    logits = (rng.normal(0, 1, (8, 10)) * 1e-41).astype(np.float32)  # subnormal float32
    flushed = {"logits": np.zeros_like(logits)}
    acc = compare(flushed, {"logits": logits}, {}, TOL, "export")
    [warning] = acc.warnings
    assert "'logits' (at most " in warning and "zero or subnormal everywhere" in warning and "mean nothing" in warning
    stage = StageResult(name="int8", pass_name="int8", status="ok", accuracy=acc, warnings=acc.warnings)
    recipe = parse_recipe({"model": {"onnx": "m.onnx"}, "inputs": [{"name": "x", "shape": [1, 4]}], "stages": {"export": {"pass": "export"}}})
    text = render_markdown(build_report(recipe.name, recipe.evaluate, [stage]))
    assert "(meaningless: outputs ~0)" in text
    # One output ~0 beside a real one: that output is named, the figures "mean little", not the whole model's.
    both = {"logits": logits, "boxes": rng.normal(0, 1, (8, 4)).astype(np.float32)}
    [warning] = compare(both, both, {}, TOL, "export").warnings
    assert warning.startswith("the reference's output 'logits'") and "mean little" in warning
    assert compare({"z": np.zeros((2, 3), np.float32)}, {"z": np.zeros((2, 3), np.float32)}, {}, TOL, "e").warnings[0].startswith(
        "the reference's output 'z' (all zeros)")
    # Normal in float32 but below float16's range (a random-init MobileNetV2: 3.2e-25): said, not judged meaningless.
    small = {"logits": logits * 1e16}
    [warning] = compare(small, small, {}, TOL, "export").warnings
    assert "below float16's smallest normal" in warning and "mean nothing" not in warning
    stage = StageResult(name="fp16", pass_name="fp16", status="ok", accuracy=compare(small, small, {}, TOL, "export"))
    assert "(output below fp16's range)" in render_markdown(build_report(recipe.name, recipe.evaluate, [stage]))
    normal = {"logits": rng.normal(0, 1, (8, 10)).astype(np.float32)}  # (logits * 1e41 had overflowed float32 to ±inf)
    assert compare(normal, normal, {}, TOL, "export").warnings == []


def test_the_pass_guard_judges_by_the_task_metric(tmp_path):
    """The guard of an fp16/int8 pass holds the stage to the recipe's task, not to cosine alone."""
    from helpers_passes import context
    from optpipe.passes import registry

    recipe = parse_recipe({
        "model": {"onnx": "unused.onnx"}, "inputs": [{"name": "features", "shape": ["batch", ANCHORS, FEATURES]}],
        "dims": {"batch": {"min": 1, "opt": 1, "max": 8}}, "stages": {"export": {"pass": "export"}},
        "evaluate": {"tolerance": {"cosine_min": 0.9}, "threads": 1, "accuracy_batch": 8,
                     "task": {"kind": "detection", "agreement_min": 1.0, "map50_min": 1.0, "score_threshold": 0.3}},
    })
    features = {"features": np.random.default_rng(1).normal(size=(8, ANCHORS, FEATURES)).astype(np.float32)}
    passes = registry()
    int8 = passes["int8"](passes["int8"].Params(mode="dynamic", max_excluded=0))
    out = int8.run(artifact_of(detector_head(), tmp_path / "in"), context(recipe, tmp_path / "q", features))
    guard = out.info["guard"]
    # int8 keeps the row cosine far above 0.9, but a perfect class agreement on 64 x 8 anchors it does not.
    assert guard["cosine"] > 0.99 and guard["held"] is False


def test_an_integer_output_is_held_by_equality_not_cosine():
    """Class ids of detections: 2 of 200 flipped keep the cosine at 0.999, yet two predictions changed."""
    rng = np.random.default_rng(0)
    ref = rng.integers(1, 10, (20, 10)).astype(np.int64)  # 20 samples, 10 detections' class ids each
    cand = ref.copy()
    cand[0, :2] = cand[0, :2] % 9 + 1
    inputs = {"x": np.zeros((20, 1))}
    flipped = compare({"cls": cand}, {"cls": ref}, inputs, TOL, "ref")
    out = flipped.outputs[0]
    assert out.cosine_mean > 0.99 and out.equal_share == 0.99
    assert flipped.within_tolerance  # 99% equal meets cosine_min 0.99 as its bound
    worse = cand.copy()
    worse[1:4, :2] = worse[1:4, :2] % 9 + 1
    failed = compare({"cls": worse}, {"cls": ref}, inputs, TOL, "ref")
    assert failed.outputs[0].cosine_mean > 0.99 and not failed.within_tolerance
    assert any("(integers) equals the reference in 96.0%" in v for v in failed.violations), failed.violations
    # top1_min sets the bound; a numeric tolerance (integer pixel values) means closeness, not equality.
    assert not compare({"cls": cand}, {"cls": ref}, inputs, Tolerance(top1_min=1.0), "ref").within_tolerance
    assert compare({"cls": worse}, {"cls": ref}, inputs, Tolerance(cosine_min=0.99, max_abs=9), "ref").within_tolerance
    floats = compare({"y": worse.astype(np.float32)}, {"y": ref.astype(np.float32)}, inputs, TOL, "ref")
    assert floats.outputs[0].equal_share is None and floats.within_tolerance  # float outputs: cosine, as before


def test_a_class_id_output_beside_logits_is_judged_by_equality_alone_and_the_cosine_figure_is_the_logits():
    """A classifier that outputs logits and their argmax: its int8 stage flipped 6% of the labels. The verdict
    names the equality it missed, not also the labels' cosine (0.967: a cosine of class ids, meaningless); the
    stage's cosine is the logits', and its error (the frontier's axis) the labels' unequal share."""
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(50, 10)).astype(np.float32)
    ids = logits.argmax(-1)
    moved = ids.copy()
    moved[:3] = (moved[:3] + 5) % 10
    result = compare({"logits": logits * 1.001, "label": moved}, {"logits": logits, "label": ids}, {"x": np.zeros((50, 1))}, TOL, "ref")
    label = next(o for o in result.outputs if o.name == "label")
    assert label.cosine_mean < 0.99 and label.equal_share == 0.94
    assert result.violations == ["output 'label' (integers) equals the reference in 94.0% of its elements < 0.99 "
                                 "(an integer output is held by equality, not cosine)"]
    assert result.worst_cosine == pytest.approx(1.0) and result.error == pytest.approx(0.06)
    alone = compare({"label": moved}, {"label": ids}, {"x": np.zeros((50, 1))}, TOL, "ref")
    assert alone.worst_cosine == label.cosine_mean  # no float output: the figure there is


def test_segmentation_judges_per_pixel_classes_that_cosine_lets_flip():
    """Near-tied logits (a random-weight head's): a 0.02 nudge flips a fifth of the pixels at cosine 0.9999."""
    rng = np.random.default_rng(3)
    ref = 10.0 + rng.normal(0, 0.01, (4, 3, 16, 16))
    ref[:, 0] += 0.01
    cand = ref.copy()
    tied = rng.random((4, 16, 16)) < 0.2
    cand[:, 1][tied] = ref.max(1)[tied] + 0.02
    spec = TaskSpec(kind="segmentation")
    acc = compare({"logits": cand}, {"logits": ref}, {}, Tolerance(cosine_min=0.9), "export", task=spec)
    metrics = acc.task.metrics
    assert acc.worst_cosine > 0.999, acc.worst_cosine  # what cosine alone would pass
    assert 0.75 < metrics["pixel_agreement"] < 0.85 and metrics["miou"] < 0.9, metrics  # measured 0.80
    assert not acc.within_tolerance and any("per-pixel class agreement" in v for v in acc.violations)
    labels = ref.argmax(1)
    labelled = compare({"logits": cand}, {"logits": ref}, {}, Tolerance(cosine_min=0.9), "export", task=spec, labels=labels)
    assert labelled.task.labels["reference_miou"] == 1.0 and labelled.task.labels["miou"] < 0.9
    with pytest.raises(DataError, match="one class per pixel"):
        compare({"logits": cand}, {"logits": ref}, {}, Tolerance(cosine_min=0.9), "export", task=spec, labels=labels[:, 0])
    with pytest.raises(RecipeError, match=r"\[N, classes, H, W\]"):
        compare({"logits": cand[:, :, 0]}, {"logits": ref[:, :, 0]}, {}, Tolerance(cosine_min=0.9), "export", task=spec)


def test_labels_the_reference_itself_scores_at_chance_on_are_said_in_the_report():
    """Labels in another class order (another label file, a background class at 0 shifting every index by one): the
    reference scored ~0 on them, each stage "kept" that, and nothing said the label figures meant nothing."""
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 10, 64)
    reference = rng.normal(size=(64, 10))
    reference[np.arange(64), labels] += 3  # right on most samples...
    task = TaskSpec(kind="classification")
    shifted = compare({"logits": reference}, {"logits": reference}, {"x": np.zeros((64, 1))}, TOL, "ref", task=task,
                      labels=(labels + 1) % 10)  # ...in its own class order
    [note] = shifted.task.notes
    assert "no better than chance for 10 classes (0.100) on 64 samples" in note and "class order" in note
    right = compare({"logits": reference}, {"logits": reference}, {"x": np.zeros((64, 1))}, TOL, "ref", task=task, labels=labels)
    assert right.task.notes == []

    recipe = parse_recipe({"model": {"onnx": "m.onnx"}, "inputs": [{"name": "x", "shape": [1, 4]}], "stages": {"export": {"pass": "export"}}})
    assert note in shifted.warnings  # the stage's warnings: the console and the report's Warnings section
    stage = StageResult(name="export", pass_name="export", status="ok", accuracy=shifted, warnings=shifted.warnings)
    text = render_markdown(build_report(recipe.name, recipe.evaluate, [stage]))
    assert "## Warnings" in text and "no better than chance" in text and "labels top5 0.375 ⚠ |" in text
    assert "barely depend" not in text  # the cosine is not what the note is about


def test_a_single_logit_is_read_as_a_binary_classifier_not_one_class():
    """Over one class, top-1 agreement read 1.000 whatever a stage did."""
    logits = np.random.default_rng(6).normal(size=(40, 1))
    flipped = logits.copy()
    flipped[:8] *= -1  # 8 of 40 predictions change side
    acc = compare({"logit": flipped}, {"logit": logits}, {"x": np.zeros((40, 1))}, TOL, "ref", task=TaskSpec(kind="classification"),
                  labels=(logits[:, 0] > 0).astype(np.int64))
    assert acc.task.metrics["top1_agreement"] == pytest.approx(32 / 40) and not acc.within_tolerance
    assert acc.task.labels["reference_top1"] == 1.0 and acc.task.labels["top1"] == pytest.approx(32 / 40)
