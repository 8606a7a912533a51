"""The import-linter contracts (pyproject.toml) hold, and they catch a new cycle or an upward
import, also one made inside a function, so the check cannot silently rot."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / ".ci"))
from lint_imports import assemble, lint  # noqa: E402


def test_the_package_keeps_its_contracts():
    result = lint()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, line, broken",
    [
        # the schema importing the pipeline: a cycle, and a leaf layer reaching the top
        ("recipe/schema.py", "from optpipe.execution import pipeline  # noqa\n", "No import cycles"),
        # a function-level import counts as much as a top-level one
        ("plan/dag.py", "def _late():\n    from optpipe.execution.stage_runner import StageRunner  # noqa\n", "optpipe.plan is not allowed to import optpipe.execution"),
        # a pass module (mapped into optpipe by package-dir) reaching up to the CLI
        ("passes/simplify.py", "from optpipe.cli import main  # noqa\n", "optpipe.passes is not allowed to import optpipe.cli"),
        # two siblings of one package importing each other
        ("evaluation/latency.py", "from optpipe.evaluation import evaluator  # noqa\n", "No cycles are allowed in optpipe.evaluation"),
    ],
    ids=["schema-imports-pipeline", "function-level-upward-import", "mapped-pass-module", "sibling-cycle"],
)
def test_an_added_cycle_or_upward_import_breaks_a_contract(tmp_path, module, line, broken):
    package = assemble(REPO, tmp_path)
    with open(package / module, "a", encoding="utf-8") as fh:
        fh.write("\n" + line)
    result = lint(REPO, package)
    assert result.returncode != 0, result.stdout
    assert broken in result.stdout, result.stdout
