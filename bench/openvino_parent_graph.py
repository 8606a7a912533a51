"""MiniLM's OpenVINO INT8 on two parent graphs, side by side in one process: the dynamo exporter's
SDPA graph and the TorchScript export with eager attention (the default recipe's), each simplified.

    python bench/openvino_parent_graph.py [--rounds 10] [--iterations 10]

Both `ov-int8` stages are built by optpipe's pass manager with recipes/minilm.yaml's settings
(cached); accuracy is the token cosine over real tokens against PyTorch eager (mean, worst
sentence), timing interleaves the models round by round (bench/minilm_int8.py). docs/int8.md,
OpenVINO section, has the result.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from minilm_int8 import build_stages, eager_runner, outputs_of, time_interleaved  # noqa: E402
from openvino_minilm import sentence_cosines  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default=str(REPO / "runs" / "bench-openvino-parent"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from optpipe.evaluation import openvino_runtime as ovr
    from optpipe.recipe.schema import StageSpec
    from optpipe.safety.recipe_loading import load_recipe

    recipe = load_recipe(REPO / "recipes" / "minilm.yaml")
    ov_int8 = recipe.stages["ov-int8"].model_dump(by_alias=True, exclude_none=True)
    recipe.stages = {
        "export": recipe.stages["export"], "simplify": recipe.stages["simplify"], "ov-int8": recipe.stages["ov-int8"],
        "export-sdpa": StageSpec.model_validate({"pass": "export"}),
        "simplify-sdpa": StageSpec.model_validate({"pass": "simplify", "after": "export-sdpa"}),
        "ov-int8-sdpa": StageSpec.model_validate({**ov_int8, "after": "simplify-sdpa"}),
    }
    stages, services = build_stages(recipe, args.run_dir)
    samples = services.eval_set().arrays
    runners = {"pytorch-eager": eager_runner(services.torch_model(), 2)}
    for name in ("ov-int8-sdpa", "ov-int8"):
        path, hint, names = ovr.stage_settings(stages[name])
        compiled = ovr.compile_model(path, 2, hint)
        print(name, ovr.precision_facts(compiled))
        runners[name] = lambda feeds, run=ovr.runner(compiled, names): run(feeds)["last_hidden_state"]
    reference = outputs_of(runners["pytorch-eager"], samples, 8)
    mask = samples["attention_mask"].astype(bool)
    for name, run in runners.items():
        mean, worst = sentence_cosines(outputs_of(run, samples, 8), reference, mask)
        print(f"{name}: token cosine {mean:.5f}, worst sentence {worst:.5f}")
    for batch in (1, 8):
        feeds = {k: v[:batch] for k, v in samples.items()}
        before = os.getloadavg()[0]
        times = time_interleaved(runners, feeds, 2, 10, args.rounds, args.iterations)
        eager = np.median(times["pytorch-eager"])
        print(f"batch {batch}, load {before:.2f} -> {os.getloadavg()[0]:.2f}: " + ", ".join(
            f"{name} {np.median(ms):.2f} ms ({eager / np.median(ms):.2f}x eager)" for name, ms in times.items()))


if __name__ == "__main__":
    main()
