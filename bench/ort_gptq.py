"""Does ONNX Runtime's GPTQ do more than round-to-nearest? (issue 20: "ORT GPTQ untried")

ONNX Runtime's MatMulNBitsQuantizer runs GPTQ through the Intel Neural Compressor code it ships
(`onnxruntime.quantization.neural_compressor.weight_only.gptq`). This script gives that function one
layer: a random weight W [K, N] (ONNX MatMul's layout) and the Hessian H = 2/n XᵀX of activations X with
correlated input channels (as a layer's inputs are), and compares its INT4 weight with round-to-nearest
on the same groups, and with a reference GPTQ written from the paper's algorithm (Frantar et al. 2022,
Algorithm 1) on the same grid. It prints each one's output error ‖X Ŵ - X W‖.

    python bench/ort_gptq.py

Measured (onnxruntime 1.31.1, 2026-12-03; no CPU dependence: NumPy only): ORT's GPTQ equals round-to-nearest
to float rounding (mean |difference| 2e-8; output error 1.000x RTN's), the reference GPTQ 0.27x RTN's. The reason, read in its source: after `H = cholesky(inv(H)).T`
(upper triangular) the error is propagated with `Hinv1[i:, i]`, the column below the diagonal, which is
zero; the paper's update takes the row, `Hinv1[i, i:]`. So `weight_only` offers no `algorithm: gptq`:
the stage would say GPTQ and deliver round-to-nearest. NNCF's GPTQ (`openvino_weights`, `gptq: true`) works.
"""
from __future__ import annotations

import numpy as np

K, N, GROUP, BITS = 256, 128, 32, 4
MAXQ = 2**BITS - 1


def activations(rng: np.random.Generator, n: int = 2048) -> np.ndarray:
    """Correlated channels, as a layer's inputs are (a residual stream of lower rank than its width), plus noise."""
    return rng.normal(size=(n, 32)) @ rng.normal(size=(32, K)) + 0.3 * rng.normal(size=(n, K))


def grid(block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric 4-bit scale and zero point per output column of one group of K rows (ORT's own rule)."""
    low, high = np.minimum(block.min(0), 0), np.maximum(block.max(0), 0)
    scale = np.where(high > low, (high - low) / MAXQ, 1.0)
    return scale, np.round(-low / scale)


def snap(w: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    return (np.clip(np.round(w / scale) + zero, 0, MAXQ) - zero) * scale


def round_to_nearest(w: np.ndarray) -> np.ndarray:
    out = np.empty_like(w)
    for g in range(0, K, GROUP):
        out[g: g + GROUP] = snap(w[g: g + GROUP], *grid(w[g: g + GROUP]))
    return out


def reference_gptq(w: np.ndarray, h: np.ndarray, percdamp: float = 0.01) -> np.ndarray:
    """GPTQ's Algorithm 1 on rows = input channels: quantize row i, spread its error over rows i+1.. by
    the upper Cholesky factor's row i; each group's grid from its rows as updated (as ORT's code does)."""
    w, h = w.astype(np.float64).copy(), h.copy()
    h[np.diag_indices(K)] += percdamp * np.mean(np.diag(h))
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T
    q = np.zeros_like(w)
    for i in range(K):
        if i % GROUP == 0:
            scale, zero = grid(w[i: i + GROUP])
        q[i] = snap(w[i], scale, zero)
        err = (w[i] - q[i]) / hinv[i, i]
        w[i:] -= np.outer(hinv[i, i:], err)
    return q


def main() -> None:
    from onnxruntime import __version__
    from onnxruntime.quantization.neural_compressor.weight_only import gptq

    rng = np.random.default_rng(0)
    w = rng.normal(size=(K, N)).astype(np.float32)
    x = activations(rng)
    h = 2 / len(x) * x.T @ x
    ort = gptq(w.copy(), h.copy(), num_bits=BITS, group_size=GROUP, scheme="asym", blocksize=128, percdamp=0.01,
               actorder=False, mse=False, perchannel=True)
    rows = {"round-to-nearest": round_to_nearest(w), f"ORT {__version__} gptq()": ort, "GPTQ (Algorithm 1)": reference_gptq(w, h)}
    base = np.linalg.norm(x @ (rows["round-to-nearest"] - w))
    print(f"one layer W [{K}, {N}], INT4 asymmetric, groups of {GROUP} along K; X: {len(x)} rows of rank-32 activations + noise\n")
    print("| weights | output error ‖XŴ-XW‖ | vs round-to-nearest | mean |Ŵ - RTN| |")
    print("|---|---|---|---|")
    for name, q in rows.items():
        error = np.linalg.norm(x @ (q - w))
        print(f"| {name} | {error:.2f} | {error / base:.3f}x | {np.abs(q - rows['round-to-nearest']).mean():.2e} |")


if __name__ == "__main__":
    main()
