"""Several recipes in one `optpipe compile`: each gets its own run folder and report."""
from __future__ import annotations

import json


def test_two_recipes_in_one_command_each_get_their_report(tiny_recipe, cli_run, tmp_path):
    first = tiny_recipe(name="a.yaml", output=str(tmp_path / "run-a"))
    second = tiny_recipe({"stages": {"simplify": None}}, name="b.yaml", output=str(tmp_path / "run-b"))
    result = cli_run("compile", str(first), str(second))
    assert result.exit_code == 0, result.output
    a = json.loads((tmp_path / "run-a" / "report.json").read_text())
    b = json.loads((tmp_path / "run-b" / "report.json").read_text())
    assert [s["name"] for s in a["stages"]] == ["pytorch-eager", "export", "simplify"]
    assert [s["name"] for s in b["stages"]] == ["pytorch-eager", "export"]
    assert a["stages"][1]["hash"] == b["stages"][1]["hash"]  # one cache: the export ran once
    assert "done: 2 recipes" in result.output


def test_output_with_several_recipes_is_a_user_error(tiny_recipe, cli_run, tmp_path):
    result = cli_run("compile", str(tiny_recipe(name="a.yaml")), str(tiny_recipe(name="b.yaml")), "-o", str(tmp_path / "x"))
    assert result.exit_code == 2 and "--output names one run folder" in result.output


def test_two_recipes_writing_one_run_folder_is_a_user_error(tiny_recipe, cli_run, tmp_path):
    # The second's report replaced the first's, and the command said ok.
    first = tiny_recipe(name="a.yaml", output=str(tmp_path / "run"))
    second = tiny_recipe({"stages": {"simplify": None}}, name="b.yaml", output=str(tmp_path / "run"))
    result = cli_run("compile", str(first), str(second))
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert f"recipes 1 ('tiny') and 2 ('tiny') both write to {tmp_path / 'run'}; give each its own `output`" in result.output
    assert not (tmp_path / "run" / "report.json").exists()
