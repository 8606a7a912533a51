"""Triton param `text_ensemble`: a client sends strings, not token ids, as production BERT deployments do.

Beside the model `<name>` it writes `<name>_tokenizer` (strings -> the model's token inputs, with the
model's own tokenizer.json), `<name>_pooling` (token states -> one vector per string; only when
pooling is mean or cls) and `<name>_text`, the ensemble that chains them inside Triton. Both steps
are python-backend models (targets/triton_text_steps.py): the tokenizer runs on the CPU in the server's
Python with the `tokenizers` package, whatever backend runs the model.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from optpipe.core.errors import OptpipeError, TargetError
from optpipe.targets.base import TargetJob, TritonParams
from optpipe.targets.pbtxt import tensor_text as _tensor_text

TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
STEPS_SOURCE = "triton_text_steps.py"


def write_text_ensemble(job: TargetJob, params: TritonParams, model: dict[str, Any]) -> dict[str, Any]:
    """The three folders beside `model` (its config dict) in job.out_dir; returns the names written."""
    names = [t["name"] for t in model["input"]]
    if model["max_batch_size"] <= 0 or not names or set(names) - set(TOKEN_INPUTS):
        raise TargetError(f"targets (triton): text_ensemble needs a batched model whose inputs are a tokenizer's "
                          f"({', '.join(TOKEN_INPUTS)}); this one takes {', '.join(names)}")
    folder = tokenizer_folder(job)
    pooling = pooling_mode(params.pooling, folder)
    name, batch = model["name"], model["max_batch_size"]
    low, high = sequence_range(job)
    token_outputs = [{"name": n, "data_type": "TYPE_INT64", "dims": [-1]} for n in names]
    tokenizer = {"name": f"{name}_tokenizer", "max_batch_size": batch,
                 "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}], "output": token_outputs,
                 "parameters": {"step": "tokenizer", "max_length": str(high), "min_length": str(low), "pad_id": str(pad_id(folder))}}
    steps = [(tokenizer["name"], {"TEXT": "TEXT"}, {n: n for n in names}),
             (name, {n: n for n in names}, {t["name"]: t["name"] for t in model["output"]})]
    outputs = model["output"]
    written = {"ensemble": f"{name}_text", "tokenizer": tokenizer["name"], "pooling": pooling}
    _write_step(job.out_dir, tokenizer, folder / "tokenizer.json")
    if pooling != "none":
        states = model["output"][0]
        if "attention_mask" not in names or len(states["dims"]) != 2:
            raise TargetError(f"targets (triton): pooling {pooling} needs token states [batch, sequence, hidden] and an attention_mask; "
                              f"set pooling: none")
        outputs = [{"name": "embedding", "data_type": "TYPE_FP32", "dims": [states["dims"][1]]}]
        pool = {"name": f"{name}_pooling", "max_batch_size": batch,
                "input": [dict(states), {"name": "attention_mask", "data_type": "TYPE_INT64", "dims": [-1]}], "output": outputs,
                "parameters": {"step": "pooling", "pooling": pooling}}
        steps.append((pool["name"], {states["name"]: states["name"], "attention_mask": "attention_mask"}, {"embedding": "embedding"}))
        _write_step(job.out_dir, pool)
        written["pooling_model"] = pool["name"]
    ensemble_dir = job.out_dir / written["ensemble"]
    (ensemble_dir / "1").mkdir(parents=True, exist_ok=True)  # Triton wants a version folder, even an empty one
    text = [f'name: "{written["ensemble"]}"', 'platform: "ensemble"', f"max_batch_size: {batch}",
            "input [", _tensor_text({"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}), "]",
            "output [", ",\n".join(_tensor_text(t) for t in outputs), "]", "ensemble_scheduling {", "  step ["]
    text.append(",\n".join(_step_text(*step) for step in steps))
    text += ["  ]", "}"]
    (ensemble_dir / "config.pbtxt").write_text("\n".join(text) + "\n")
    return written


def tokenizer_folder(job: TargetJob) -> Path:
    from optpipe.source.model_source import hf_folder

    try:
        folder = hf_folder(job.settings.shapes)  # type: ignore[arg-type]  (a ModelSource: the recipe's model)
    except (OptpipeError, AttributeError) as exc:
        raise TargetError(f"targets (triton): text_ensemble needs the model's tokenizer: {exc}") from None
    if not (folder / "tokenizer.json").is_file():
        raise TargetError(f"targets (triton): text_ensemble needs a fast tokenizer (tokenizer.json) in {folder}")
    return folder


def pooling_mode(choice: str, folder: Path) -> str:
    """auto: what the sentence-transformers config beside the model says (1_Pooling/config.json), else none."""
    if choice != "auto":
        return choice
    config = folder / "1_Pooling" / "config.json"
    if not config.is_file():
        return "none"
    modes = json.loads(config.read_text())
    return "mean" if modes.get("pooling_mode_mean_tokens") else "cls" if modes.get("pooling_mode_cls_token") else "none"


def sequence_range(job: TargetJob) -> tuple[int, int]:
    """The recipe's sequence dim (input_ids' second): what the tokenizer truncates and pads to."""
    spec = next((i for i in job.settings.shapes.inputs if i.name == "input_ids"), job.settings.shapes.inputs[0])
    dim = spec.shape[1] if len(spec.shape) > 1 else None
    if isinstance(dim, int):
        return dim, dim
    if dim is None or dim not in job.settings.shapes.dims:
        raise TargetError("targets (triton): text_ensemble needs input_ids shaped [batch, sequence]")
    return job.settings.shapes.dims[dim].min, job.settings.shapes.dims[dim].max


def pad_id(folder: Path) -> int:
    from tokenizers import Tokenizer

    config = folder / "tokenizer_config.json"
    token = json.loads(config.read_text()).get("pad_token") if config.is_file() else None
    token = token.get("content") if isinstance(token, dict) else token
    found = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(token) if token else None
    return int(found or 0)


def _write_step(out_dir: Path, config: dict[str, Any], extra: Path | None = None) -> None:
    version = out_dir / config["name"] / "1"
    if version.exists():
        shutil.rmtree(version)
    version.mkdir(parents=True)
    shutil.copyfile(Path(__file__).with_name(STEPS_SOURCE), version / "model.py")
    if extra is not None:
        shutil.copyfile(extra, version / extra.name)
    lines = [f'name: "{config["name"]}"', 'backend: "python"', f'max_batch_size: {config["max_batch_size"]}',
             "input [", ",\n".join(_tensor_text(t) for t in config["input"]), "]",
             "output [", ",\n".join(_tensor_text(t) for t in config["output"]), "]",
             "instance_group [ { count: 1 kind: KIND_CPU } ]"]
    lines += [f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in config["parameters"].items()]
    (out_dir / config["name"] / "config.pbtxt").write_text("\n".join(lines) + "\n")


def _step_text(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'      input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'      output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return "    {\n" + f'      model_name: "{model}"\n      model_version: -1\n' + "\n".join(maps) + "\n    }"
