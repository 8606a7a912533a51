"""Why a stage's accuracy figures may mean less than they seem, said beside them: a reference that computes ~0
(subnormal outputs, flushed or not as runtimes please), outputs below float16's range, and a language model's
next-token logits tied at their maximum. The report's rows mark a figure under these warnings by the phrases here."""
from __future__ import annotations

import numpy as np


def magnitude_warnings(pairs: list[tuple[str, np.ndarray, np.ndarray]]) -> list[str]:
    """The warning when a float output of the reference is all zeros or all subnormal (below its dtype's smallest
    normal): runtimes flush such values to zero or not as they please, so every figure on it is noise. A random-init
    MobileViT's logits peaked at 2.9e-41: eager 'disagreed' with its own export (cosine 0.976) and every int8,
    fp16 and bf16 stage scored cosine 0 on outputs that were exactly zero. Milder: an output that stays below
    float16's smallest normal, which reduced-precision stages may flush (said, not judged meaningless)."""
    floats, tiny, small = 0, [], []
    for name, _, ref in pairs:
        ref = np.asarray(ref)
        if ref.dtype.kind != "f" or ref.size == 0:
            continue
        floats += 1
        peak = max(float(ref.max()), -float(ref.min()))  # no |ref| copy of a big output
        if np.isfinite(peak) and peak < np.finfo(ref.dtype).tiny:
            tiny.append(f"'{name}' ({'all zeros' if peak == 0 else f'at most {peak:.1e}'})")
        elif np.isfinite(peak) and peak < HALF_NORMAL:
            small.append(f"'{name}' (at most {peak:.1e})")
    warnings = []
    if tiny:
        many = len(tiny) > 1
        verdict = MEANINGLESS if len(tiny) == floats else f"the figures on {'them' if many else 'it'} mean little"
        warnings.append(f"the reference's output{'s' if many else ''} {', '.join(tiny)} {'are' if many else 'is'} {NEAR_ZERO}: "
                        "the model computes ~0 (random weights?), and runtimes flush such values to zero or not as they "
                        f"please, so {verdict}")
    if small:
        # A random-init MobileNetV2's logits peaked at 3.2e-25: its fp16 guard and ov-int8 scored cosine 0, ov-bf16 0.99998.
        warnings.append(f"the reference's output{'s' if len(small) > 1 else ''} {', '.join(small)} {BELOW_HALF}: a stage "
                        "computing in fp16 (or an int8 path with fp16 steps) may flush it and score ~0, which then says "
                        "more about the model's scale (random weights?) than about the stage")
    return warnings


def tied_logits_warnings(rows: np.ndarray) -> list[str]:
    """The warning when the reference's next-token logits ([positions, vocabulary]) tie at their maximum in most
    positions: its greedy token is then the lowest tied id, which any candidate with the same ties "agrees" with,
    and flat logits make the perplexity the vocabulary's size. A Qwen2 built with initializer_range 1e20 gave
    logits of exactly 0 everywhere: agreement 1.000, perplexity 2048.000 for every stage, and no word of it."""
    if rows.size == 0 or rows.shape[-1] < 2:
        return []
    top2 = np.partition(rows, -2, axis=-1)[:, -2:]
    tied = int((top2[:, 0] == top2[:, 1]).sum())
    if tied * 2 <= len(rows):
        return []
    return [f"the reference's next-token logits {TIED} in {tied} of {len(rows)} prompt positions (flat logits: the model's "
            f"weights not loaded, or a degenerate model), so {MEANINGLESS}"]


MEANINGLESS = "these accuracy figures mean nothing"
BARELY = "across the evaluation samples"  # the input-sensitivity warnings (accuracy._sensitivity_warnings)  # the report's rows mark a figure under these warnings
TIED = "tie at their maximum"
NEAR_ZERO = "zero or subnormal everywhere"
BELOW_HALF = "stays below float16's smallest normal (6.1e-05)"
HALF_NORMAL = float(np.finfo(np.float16).tiny)
