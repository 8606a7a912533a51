"""Task-aware accuracy (evaluate.task): what a user of the model cares about, not row cosine.

Cosine over a row is blind where a few elements matter: on a YOLO head, box coordinates in
pixels dominate the row, so FP16 passed at cosine 0.99997 while 15% of the confident anchors
changed class. Each task here measures the candidate against the reference stage and, where
the data has labels, both against the labels:

- classification: top-1 / top-5 agreement with the reference; top-1 / top-5 accuracy on labels; per real token for
  a [batch, seq, classes] output (a token classifier), with labels [batch, seq] where given;
- detection (YOLO-style output): class agreement on the reference's confident predictions,
  then mAP@0.5 and mean IoU of the candidate's NMS'd boxes against the reference's;
- segmentation ([N, classes, H, W] logits): per-pixel class agreement and mIoU against the
  reference's classes; with per-pixel labels [N, H, W], mIoU of both against them (a SegFormer's
  int8 stage passed at cosine 0.990 while only 87% of its pixels kept their class);
- language-model: next-token top-1 agreement, and perplexity on the evaluation text itself;
- embeddings: the mean token cosine (real tokens only).
"""
from __future__ import annotations

import numpy as np

from optpipe.core.errors import DataError, RecipeError
from optpipe.evaluation.cosine import real_tokens, row_cosines
from optpipe.recipe.schema import TaskSpec
from optpipe.recipe.task_outputs import task_outputs
from optpipe.core.results import TaskAccuracy


def task_accuracy(spec: TaskSpec, candidate: dict[str, np.ndarray], reference: dict[str, np.ndarray],
                  inputs: dict[str, np.ndarray], labels: np.ndarray | None = None) -> TaskAccuracy:
    """`candidate` and `reference` are keyed by the same (the reference's) output names.

    A task the model's outputs cannot carry (no such output, a shape the task cannot read) and
    labels outside the output's classes are the recipe's or the data's to fix: RecipeError and
    DataError, so the stage fails as the user's input (exit 2), not as a broken stage."""
    names = task_outputs(spec, reference)
    if len(names) > 1:
        result = joint_classification(spec, [candidate[n] for n in names], [reference[n] for n in names], inputs, labels)
    else:
        cand = np.asarray(candidate[names[0]], dtype=np.float64)
        ref = np.asarray(reference[names[0]], dtype=np.float64)
        result = TASKS[spec.kind](spec, cand, ref, inputs, labels)
    result.output = ", ".join(names)
    return result


# --- classification ----------------------------------------------------------------------------


def classification(spec: TaskSpec, cand, ref, inputs, labels) -> TaskAccuracy:
    tokens = _token_rows(ref, inputs)
    if tokens is not None:  # a token classifier: one prediction per real token
        cand, ref = cand[tokens], ref[tokens]
        labels = labels[tokens] if labels is not None and np.shape(labels) == tokens.shape else labels
    cand, ref = _binary(_class_rows(cand)), _binary(_class_rows(ref))
    k = min(5, cand.shape[-1])
    ref_top1 = ref.argmax(-1)
    metrics = {
        "top1_agreement": float(np.mean(cand.argmax(-1) == ref_top1)),
        f"top{k}_agreement": float(np.mean(_in_top_k(cand, ref_top1, k))),
    }
    result = TaskAccuracy(kind="classification", output="", metrics=metrics)
    if metrics["top1_agreement"] < spec.agreement_min:
        result.violations.append(f"top-1 agreement {metrics['top1_agreement']:.3f} < {spec.agreement_min}")
    if labels is not None:
        _label_accuracy(result, spec, cand, ref, labels, k)
    return result


def joint_classification(spec: TaskSpec, cands: list, refs: list, inputs, labels) -> TaskAccuracy:
    """Several outputs, each a classification, that one prediction needs together: a question-answering head's answer is
    its start and its end position, so a sample agrees where every output's top-1 does (either moved moves the span)."""
    rows = []
    for cand, ref in zip(cands, refs):
        cand, ref = np.asarray(cand, dtype=np.float64), np.asarray(ref, dtype=np.float64)
        tokens = _token_rows(ref, inputs)
        if tokens is not None:
            cand, ref = cand[tokens], ref[tokens]
        rows.append((_binary(_class_rows(cand)), _binary(_class_rows(ref))))
    if len({len(ref) for _, ref in rows}) != 1:
        raise RecipeError("evaluate.task.output: the outputs listed hold unlike numbers of predictions; list outputs with "
                          "one prediction per sample each (start and end logits)")
    k = min([5, *(cand.shape[-1] for cand, _ in rows)])
    agree = np.all([cand.argmax(-1) == ref.argmax(-1) for cand, ref in rows], axis=0)
    within = np.all([_in_top_k(cand, ref.argmax(-1), k) for cand, ref in rows], axis=0)
    metrics = {"top1_agreement": float(np.mean(agree)), f"top{k}_agreement": float(np.mean(within))}
    result = TaskAccuracy(kind="classification", output="", metrics=metrics)
    if metrics["top1_agreement"] < spec.agreement_min:
        result.violations.append(f"top-1 agreement of every output together {metrics['top1_agreement']:.3f} < {spec.agreement_min}")
    if labels is not None:
        result.notes.append("labels are one class per sample: not measured against several outputs")
    return result


def _binary(rows: np.ndarray) -> np.ndarray:
    """One logit per sample (a sigmoid classifier) read as two classes, class 1 where it is above 0: over one class,
    top-1 agreement was 1 whatever a stage did. (A regression head has no classification task: init writes none.)"""
    return np.concatenate([np.zeros_like(rows), rows], axis=-1) if rows.shape[-1] == 1 else rows


def _token_rows(ref: np.ndarray, inputs) -> np.ndarray | None:
    """The [batch, seq] positions whose classes a [batch, seq, classes] output holds (a token classifier: NER, POS),
    real tokens only where the inputs carry a mask; None for one prediction per sample. Flattened per sample, a
    token classifier's top-1 had been one argmax over all its tokens and classes together."""
    if ref.ndim != 3 or ref.shape[1] < 2:
        return None
    mask = real_tokens(inputs)
    if mask is not None and np.shape(mask) == ref.shape[:2]:
        return np.asarray(mask).astype(bool)
    return np.ones(ref.shape[:2], dtype=bool)


def _class_rows(logits: np.ndarray) -> np.ndarray:
    return logits.reshape(len(logits), -1) if logits.ndim > 2 else logits.reshape(-1, logits.shape[-1])


def _in_top_k(scores: np.ndarray, target: np.ndarray, k: int) -> np.ndarray:
    top = np.argpartition(-scores, k - 1, axis=-1)[:, :k]
    return (top == target[:, None]).any(-1)


def _label_accuracy(result: TaskAccuracy, spec: TaskSpec, cand, ref, labels, k: int) -> None:
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    classes = cand.shape[-1]
    if len(labels) and (labels.min() < 0 or labels.max() >= classes):
        # Such a label can never be predicted: the accuracy on the labels would be a meaningless 0.
        raise DataError(f"data.eval: labels run from {labels.min()} to {labels.max()}, but the task's output has {classes} classes "
                        f"(0..{classes - 1}); fix the labels, or point evaluate.task.output at the classifier's logits")
    if len(labels) != len(cand):
        result.notes.append(f"{len(labels)} labels for {len(cand)} predictions: label accuracy not measured")
        return
    result.labels = {
        "top1": float(np.mean(cand.argmax(-1) == labels)),
        f"top{k}": float(np.mean(_in_top_k(cand, labels, k))),
        "reference_top1": float(np.mean(ref.argmax(-1) == labels)),
        f"reference_top{k}": float(np.mean(_in_top_k(ref, labels, k))),
    }
    chance = _at_chance(result.labels["reference_top1"], classes, len(labels))
    if chance:
        result.notes.append(chance)
    drop = result.labels["reference_top1"] - result.labels["top1"]
    if drop > spec.label_drop_max:
        result.violations.append(
            f"top-1 accuracy on the labels {result.labels['top1']:.3f}, {drop:.3f} below the reference's "
            f"{result.labels['reference_top1']:.3f} (allowed {spec.label_drop_max})"
        )


def _at_chance(top1: float, classes: int, samples: int) -> str | None:
    """Where the reference itself does no better on the labels than guessing (within two standard deviations of
    1 / classes over these samples): the labels are not in the model's class order (another label file, a background
    class at 0 that shifts every index by one) or the model is untrained. A stage then "keeps" an accuracy of ~0."""
    p = 1.0 / classes
    if classes < 2 or not samples or top1 > p + 2 * np.sqrt(p * (1 - p) / samples):
        return None
    return (f"the reference itself gets top-1 {top1:.3f} on the labels, no better than chance for {classes} classes "
            f"({p:.3f}) on {samples} samples: the labels are not in the model's class order (another label file, a "
            "background class at 0?) or the model is untrained, so the label figures mean nothing")


# --- detection ---------------------------------------------------------------------------------


def detection(spec: TaskSpec, cand, ref, inputs, labels) -> TaskAccuracy:
    cand_boxes, cand_scores = decode_yolo(cand, spec.layout)
    ref_boxes, ref_scores = decode_yolo(ref, spec.layout)
    confident = ref_scores.max(-1) > spec.score_threshold
    result = TaskAccuracy(kind="detection", output="", metrics={})
    if not confident.any():
        result.notes.append(f"the reference has no prediction above score {spec.score_threshold}: detection metrics not measured")
        result.violations.append(f"no confident detections in the reference at score_threshold {spec.score_threshold}; "
                                 "lower it, or evaluate on data the model detects things in")
        return result
    agreement = float(np.mean(cand_scores[confident].argmax(-1) == ref_scores[confident].argmax(-1)))
    truth = [nms(b, s, spec.score_threshold, spec.iou_threshold) for b, s in zip(ref_boxes, ref_scores)]
    found = [nms(b, s, spec.score_threshold, spec.iou_threshold) for b, s in zip(cand_boxes, cand_scores)]
    map50, mean_iou = mean_average_precision(found, truth, 0.5)
    result.metrics = {
        "class_agreement": agreement,
        "confident_predictions": float(confident.sum()),
        "map50": map50,
        "mean_iou": mean_iou,
        "reference_boxes": float(sum(len(t[0]) for t in truth)),
        "boxes": float(sum(len(f[0]) for f in found)),
    }
    if agreement < spec.agreement_min:
        result.violations.append(f"class agreement on confident predictions {agreement:.3f} < {spec.agreement_min}")
    if map50 < spec.map50_min:
        result.violations.append(f"mAP@0.5 against the reference's boxes {map50:.3f} < {spec.map50_min}")
    return result


def decode_yolo(output: np.ndarray, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """[N, anchors, 4+1+C] (yolov5: objectness times class scores) or [N, 4+C, anchors] (yolov8)
    into xyxy boxes [N, anchors, 4] and per-class scores [N, anchors, C]."""
    if output.ndim != 3:
        raise RecipeError(f"evaluate.task: a detection output is [batch, anchors, values], got shape {output.shape}; "
                          "set evaluate.task.output to the detection head, or change evaluate.task.kind")
    if layout == "yolov8":
        output = output.transpose(0, 2, 1)
        xywh, scores = output[..., :4], output[..., 4:]
    else:
        xywh, scores = output[..., :4], output[..., 5:] * output[..., 4:5]
    half = xywh[..., 2:4] / 2
    boxes = np.concatenate([xywh[..., :2] - half, xywh[..., :2] + half], axis=-1)
    return boxes, scores


def nms(boxes: np.ndarray, scores: np.ndarray, score_threshold: float, iou_threshold: float,
        max_boxes: int = 300) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class greedy NMS of one image: (boxes [K, 4], classes [K], scores [K]).

    Written with numpy: torchvision (whose batched_nms this matches) does not import beside the
    CPU torch wheel here, and ORT's NonMaxSuppression would need a graph built per call.
    """
    classes = scores.argmax(-1)
    best = scores.max(-1)
    keep_mask = best > score_threshold
    boxes, classes, best = boxes[keep_mask], classes[keep_mask], best[keep_mask]
    # Offsetting each class's boxes far apart makes one pass of NMS per-class (as batched_nms does).
    shifted = boxes + (classes[:, None] * (np.abs(boxes).max(initial=1.0) + 1) * 4)
    order = np.argsort(-best, kind="stable")
    kept = []
    while order.size and len(kept) < max_boxes:
        i = order[0]
        kept.append(i)
        overlaps = box_iou(shifted[i : i + 1], shifted[order[1:]])[0]
        order = order[1:][overlaps <= iou_threshold]
    kept = np.asarray(kept, dtype=np.int64)
    return boxes[kept], classes[kept], best[kept]


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in a [A, 4] with every box in b [B, 4] (xyxy)."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    area = lambda x: np.clip(x[:, 2:] - x[:, :2], 0, None).prod(-1)  # noqa: E731
    union = area(a)[:, None] + area(b)[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def mean_average_precision(found, truth, iou_threshold: float) -> tuple[float, float]:
    """mAP at one IoU threshold (all-point interpolated AP per class, classes of the truth), and
    the mean IoU of the true boxes matched. `found`/`truth`: per image (boxes, classes, scores)."""
    classes = sorted({int(c) for _, cls, _ in truth for c in cls})
    aps, ious = [], []
    for c in classes:
        records, total = [], 0
        for (fb, fc, fs), (tb, tc, _) in zip(found, truth):
            t = tb[tc == c]
            total += len(t)
            f, s = fb[fc == c], fs[fc == c]
            order = np.argsort(-s, kind="stable")
            used = np.zeros(len(t), dtype=bool)
            overlaps = box_iou(f[order], t) if len(t) and len(f) else np.zeros((len(f), len(t)))
            for row, score in zip(overlaps, s[order]):
                j = int(row.argmax()) if len(t) else -1
                hit = j >= 0 and row[j] >= iou_threshold and not used[j]
                if hit:
                    used[j] = True
                    ious.append(float(row[j]))
                records.append((score, hit))
        aps.append(_average_precision(records, total))
    return (float(np.mean(aps)) if aps else 0.0), (float(np.mean(ious)) if ious else 0.0)


def _average_precision(records: list[tuple[float, bool]], total: int) -> float:
    if not total:
        return 0.0
    records.sort(key=lambda r: -r[0])
    hits = np.array([h for _, h in records], dtype=np.float64)
    tp = np.cumsum(hits)
    recall = tp / total
    precision = tp / np.arange(1, len(hits) + 1)
    recall = np.concatenate([[0.0], recall, [1.0]])
    precision = np.concatenate([[1.0], precision, [0.0]])
    precision = np.maximum.accumulate(precision[::-1])[::-1]
    return float(np.sum((recall[1:] - recall[:-1]) * precision[1:]))


# --- language models ---------------------------------------------------------------------------


def language_model(spec: TaskSpec, cand, ref, inputs, labels) -> TaskAccuracy:
    """Logits [N, S, V]: next-token agreement on real tokens; perplexity of the text itself (the
    token at t+1 predicted from position t), for both models."""
    if cand.ndim != 3:
        raise RecipeError(f"evaluate.task: language-model logits are [batch, sequence, vocabulary], got shape {cand.shape}; "
                          "set evaluate.task.output to the logits, or change evaluate.task.kind")
    mask = inputs.get("attention_mask")
    mask = np.ones(cand.shape[:2], dtype=bool) if mask is None or mask.shape != cand.shape[:2] else mask.astype(bool)
    agreement = float(np.mean((cand.argmax(-1) == ref.argmax(-1))[mask]))
    result = TaskAccuracy(kind="language-model", output="", metrics={"next_token_agreement": agreement})
    tokens = inputs.get(spec.tokens)
    if tokens is None or tokens.shape != cand.shape[:2]:
        result.notes.append(f"no input '{spec.tokens}' shaped like the logits: perplexity not measured")
    else:
        target_mask = mask[:, 1:] & mask[:, :-1]
        ppl, ref_ppl = (_perplexity(x[:, :-1], tokens[:, 1:], target_mask) for x in (cand, ref))
        result.metrics.update({"perplexity": ppl, "reference_perplexity": ref_ppl, "perplexity_ratio": ppl / ref_ppl})
        if ppl / ref_ppl > spec.perplexity_ratio_max:
            result.violations.append(f"perplexity {ppl:.3f} is {ppl / ref_ppl:.3f}x the reference's {ref_ppl:.3f} "
                                     f"(allowed {spec.perplexity_ratio_max}x)")
    if agreement < spec.agreement_min:
        result.violations.append(f"next-token top-1 agreement {agreement:.3f} < {spec.agreement_min}")
    return result


def _perplexity(logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> float:
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, targets[..., None].astype(np.int64), axis=-1)[..., 0]
    return float(np.exp(-picked[mask].mean())) if mask.any() else float("nan")


# --- embeddings --------------------------------------------------------------------------------


def embeddings(spec: TaskSpec, cand, ref, inputs, labels) -> TaskAccuracy:
    cosine = float(row_cosines(cand, ref, real_tokens(inputs)).mean())
    result = TaskAccuracy(kind="embeddings", output="", metrics={"token_cosine": cosine})
    if cosine < spec.cosine_min:
        result.violations.append(f"mean token cosine {cosine:.4f} < {spec.cosine_min}")
    return result


# --- segmentation -------------------------------------------------------------------------------


def segmentation(spec: TaskSpec, cand, ref, inputs, labels) -> TaskAccuracy:
    if ref.ndim != 4:
        raise RecipeError(f"evaluate.task: segmentation reads [N, classes, H, W] logits; this output has shape {list(ref.shape)}; "
                          "set evaluate.task.output to the per-pixel logits")
    classes = ref.shape[1]
    ref_pixels, cand_pixels = ref.argmax(1), cand.argmax(1)
    metrics = {"pixel_agreement": float(np.mean(cand_pixels == ref_pixels)),
               "miou": mean_iou(cand_pixels, ref_pixels, classes)}
    result = TaskAccuracy(kind="segmentation", output="", metrics=metrics)
    if metrics["pixel_agreement"] < spec.agreement_min:
        result.violations.append(f"per-pixel class agreement {metrics['pixel_agreement']:.3f} < {spec.agreement_min}")
    if labels is not None:
        labels = np.asarray(labels)
        if labels.shape != ref_pixels.shape:
            raise DataError(f"data.eval labels: segmentation needs one class per pixel, shape {list(ref_pixels.shape)} "
                            f"(samples, H, W of the logits); got {list(labels.shape)}")
        if labels.min() < 0 or labels.max() >= classes:
            raise DataError(f"data.eval labels: classes {int(labels.min())}..{int(labels.max())} outside the model's 0..{classes - 1}")
        ours, theirs = mean_iou(cand_pixels, labels, classes), mean_iou(ref_pixels, labels, classes)
        result.labels = {"miou": ours, "reference_miou": theirs}
        if theirs - ours > spec.label_drop_max:
            result.violations.append(f"mIoU on the labels {ours:.3f}, {theirs - ours:.3f} below the reference's {theirs:.3f} "
                                     f"(label_drop_max {spec.label_drop_max})")
    return result


def mean_iou(found: np.ndarray, truth: np.ndarray, classes: int) -> float:
    """Mean over the classes present in either map of |found ∩ truth| / |found ∪ truth| per class."""
    ious = []
    for c in range(classes):
        f, t = found == c, truth == c
        union = np.logical_or(f, t).sum()
        if union:
            ious.append(np.logical_and(f, t).sum() / union)
    return float(np.mean(ious)) if ious else 1.0


TASKS = {"classification": classification, "detection": detection, "segmentation": segmentation,
         "language-model": language_model, "embeddings": embeddings}
