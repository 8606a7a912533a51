"""Run import-linter (the contracts in pyproject.toml) on optpipe as it is installed.

pyproject.toml maps `passes/` to optpipe.passes and `calibration/` to optpipe.calibration,
but grimp (import-linter's graph builder) walks only the package's own folder. So the
package is assembled in a temporary folder (optpipe/ with passes/ and calibration/ copied
in) and checked there.

    python .ci/lint_imports.py            # exit code 0 when every contract is kept
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Folders of the repository that pyproject.toml's package-dir maps into optpipe.
MAPPED = {"passes": "passes", "calibration": "calibration"}


def assemble(repo: Path, dest: Path) -> Path:
    """Copy the package as installed into `dest`; returns the package folder."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    package = dest / "optpipe"
    shutil.copytree(repo / "optpipe", package, ignore=ignore)
    for name, folder in MAPPED.items():
        shutil.copytree(repo / folder, package / name, ignore=ignore)
    return package


def lint(repo: Path = REPO, package: Path | None = None, *extra: str) -> subprocess.CompletedProcess:
    """lint-imports with `repo`'s pyproject.toml on `package` (default: `repo` assembled afresh)."""
    with tempfile.TemporaryDirectory(prefix="optpipe-lint-") as tmp:
        root = package.parent if package is not None else assemble(repo, Path(tmp)).parent
        env = {**os.environ, "PYTHONPATH": str(root)}  # ahead of the editable install's finder
        command = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
                   str(repo / "pyproject.toml"), "--no-cache", *extra]
        return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)


if __name__ == "__main__":
    result = lint(REPO, None, *sys.argv[1:])
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    sys.exit(result.returncode)
