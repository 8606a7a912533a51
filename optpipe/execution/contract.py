"""The pass contract, checked by the manager around every pass run, the way onnx-ir's
`PassBase.__call__` checks a pass's requires/ensures:

- `run` returns the artifact it wrote into `ctx.workdir`, and that is what gets published;
- the workdir holds the model, its external data and info.json, nothing else (a stray
  file would change the content hash and with it every downstream cache key);
- the input artifact is unchanged (a pass must not edit its input in place: a cache
  entry is shared by every stage, run and process that uses it).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

from optpipe.core.artifact import DATA_FILE, INFO_FILE, MANIFEST_FILE, MODEL_FILE, ModelArtifact, write_info
from optpipe.cache.store import verify_entry
from optpipe.core.errors import PassError
from optpipe.execution.services import LogWriter
from optpipe.pass_infra.pass_base import Pass, PassContext

#: What a published stage folder may hold (the cache adds its manifest when publishing).
ARTIFACT_FILES = frozenset({MODEL_FILE, DATA_FILE, INFO_FILE})
#: The model files per format a pass declares (`Pass.produces`): all required, nothing else allowed.
FORMAT_FILES = {"onnx": (MODEL_FILE, DATA_FILE), "openvino-ir": ("model.xml", "model.bin", "openvino.json")}

InputState = Optional[dict[str, tuple[int, int]]]


def run_pass(pass_: Pass, model: ModelArtifact | None, ctx: PassContext) -> ModelArtifact:
    """Run a pass in this process under the contract; returns the artifact it made, checked."""
    before = input_state(model)
    with contextlib.redirect_stdout(LogWriter(ctx.log)):
        returned = pass_.run(model, ctx)
    check_input_unchanged(pass_.name, model, before)
    return accept_output(pass_.name, returned, ctx.workdir, pass_.produces)


def accept_output(pass_name: str, returned: object, workdir: Path, produces: str = "onnx") -> ModelArtifact:
    """The artifact `run` returned, once it is known to be the workdir and to hold only an artifact's files.

    Its info is what goes to info.json: the returned object is the result, not whatever lies on disk.
    """
    if not isinstance(returned, ModelArtifact):
        raise PassError(f"pass '{pass_name}' returned {type(returned).__name__}, not a ModelArtifact; return the artifact it wrote")
    if returned.folder.resolve() != workdir.resolve():
        raise PassError(f"pass '{pass_name}' returned an artifact in {returned.folder}, not its workdir; write the result into ctx.workdir")
    allowed = {*FORMAT_FILES[produces], INFO_FILE}
    for entry in sorted(workdir.iterdir()):
        if entry.name not in allowed or not entry.is_file():
            raise PassError(
                f"pass '{pass_name}' left '{entry.name}' in its workdir, which may hold only {', '.join(sorted(allowed))}; "
                "remove scratch files before returning"
            )
    for required in FORMAT_FILES[produces]:
        if not (workdir / required).is_file():
            raise PassError(f"pass '{pass_name}' wrote no {required}; save the result with optpipe.core.artifact.save_model")
    return write_info(workdir, returned.info)


def input_state(model: ModelArtifact | None) -> InputState:
    """Size and modification time of every file of the input: cheap to take before and after a pass."""
    if model is None:
        return None
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in model.folder.iterdir() if p.is_file()}


def check_input_unchanged(pass_name: str, model: ModelArtifact | None, before: InputState) -> None:
    """Raise when the pass changed its input.

    Re-hashing a multi-GB input after every pass would double the cost of cheap passes,
    so the files' sizes and times are compared first; only when they moved is the
    input's manifest (a cache entry records every file's hash) checked, so a file
    rewritten with the same bytes is not a violation.
    """
    if model is None or before is None:
        return
    after = input_state(model)
    if after == before:
        return
    changed = sorted(name for name in set(before) | set(after) if before.get(name) != after.get(name))
    if (model.folder / MANIFEST_FILE).exists() and MANIFEST_FILE not in changed and verify_entry(model.folder) is None:
        return
    raise PassError(
        f"pass '{pass_name}' modified its input artifact ({', '.join(changed)}); a pass must read its input "
        "and write only into ctx.workdir"
    )
