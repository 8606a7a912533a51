"""A run writes its report, logs and stage copies into its folder: only into a new or empty one, or one a run wrote.

`output: .` beside the recipe, or a project folder given as --output, had its own report.md and logs/ written over."""
from __future__ import annotations

import json

import pytest

from optpipe.core.errors import RunFolderError
from optpipe.recipe.run_paths import RUN_MARKER, check_not_foreign, mark_run_folder


def test_a_folder_of_the_users_files_is_refused_naming_what_would_be_written_over(tmp_path):
    (tmp_path / "report.md").write_text("my notes")
    (tmp_path / "stages").mkdir()
    (tmp_path / "train.py").write_text("")  # a file a run never writes: no clash by itself
    with pytest.raises(RunFolderError, match="holds report.md, stages, which a run would write over"):
        check_not_foreign(tmp_path)
    (tmp_path / "report.md").unlink()
    (tmp_path / "stages").rmdir()
    check_not_foreign(tmp_path)  # the other files stay, and a run may write beside them


@pytest.mark.parametrize("earlier", ["cut short (its marker and logs only)", "of a version before the marker", "locked"])
def test_a_folder_an_earlier_run_wrote_is_the_runs_to_update(tmp_path, earlier):
    (tmp_path / "logs").mkdir()
    (tmp_path / "report.md").write_text("# optpipe report")
    if earlier.startswith("cut short"):
        mark_run_folder(tmp_path)
        assert (tmp_path / RUN_MARKER).is_file()
    elif earlier.startswith("of a version"):
        (tmp_path / "report.json").write_text(json.dumps({"schema_version": 3, "optpipe_version": "0.1.0", "stages": []}))
    else:
        (tmp_path / ".optpipe.lock").write_text("")
    check_not_foreign(tmp_path)


def test_a_report_json_that_is_not_optpipes_does_not_make_a_run_folder(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps({"accuracy": 0.9}))
    with pytest.raises(RunFolderError, match="holds report.json"):
        check_not_foreign(tmp_path)
