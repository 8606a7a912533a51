"""No usage data leaves a compile (issue 22): OpenVINO's converter and NNCF report to an analytics
service through openvino_telemetry unless told otherwise. Each conversion wrote ~/intel/stats and
~/intel/openvino_ga_cid and started sender processes (11 per compile, measured before the fix).

The compile runs in a fresh interpreter (telemetry is a process-wide singleton, decided at its
first use) with HOME pointed at an empty folder, and a spy on every process it starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from reliability_fixtures import HERE, onnx_recipe, write_linear_onnx, write_recipe

# Records every Python process the compile starts (the telemetry senders were multiprocessing
# Processes, one per event), then runs the CLI.
DRIVER = """
import json, multiprocessing, sys
started = []
start = multiprocessing.Process.start
def spy_start(self):
    started.append(repr(self._target))
    return start(self)
multiprocessing.Process.start = spy_start
from optpipe.cli.main import main
try:
    main()
finally:
    import os
    env = {name: os.environ.get(name) for name in ("CI", "NNCF_CI")}
    open(sys.argv[0] + ".json", "w").write(json.dumps({"started": started, "env": env}))
"""


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_compile_with_openvino_stages_sends_no_telemetry(tmp_path):
    home = tmp_path / "home"
    (home / "intel").mkdir(parents=True)
    (home / "intel" / "stats").write_text('{"usage_count": 7}')  # what a machine that ran OpenVINO before holds
    before = _files(home / "intel")
    write_linear_onnx(tmp_path / "model")
    stages = {"export": {"pass": "export"}, "ov": {"pass": "openvino", "after": "export"},
              "ov8": {"pass": "openvino", "after": "export", "params": {"precision": "int8", "subset_size": 4}}}
    recipe = onnx_recipe(tmp_path, stages=stages)
    recipe["data"]["calibration"] = {"source": "synthetic", "samples": 4}
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    for name in ("CI", "NNCF_CI", "TF_BUILD", "JENKINS_URL"):  # the switches a CI machine would set anyway
        env.pop(name, None)
    done = subprocess.run([sys.executable, str(driver), "compile", str(write_recipe(tmp_path, recipe))], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    spied = json.loads(Path(str(driver) + ".json").read_text())
    assert spied["started"] == [], spied["started"]  # no telemetry sender started
    assert _files(home / "intel") == before, "nothing under HOME/intel written"
    assert spied["env"] == {"CI": None, "NNCF_CI": None}, "the switch is set only around the library calls"
    assert "Traceback" not in done.stderr


def test_the_switch_is_restored_after_the_call(monkeypatch):
    from optpipe.evaluation.openvino_runtime import telemetry_off

    monkeypatch.setenv("CI", "false")
    monkeypatch.delenv("NNCF_CI", raising=False)
    with telemetry_off():
        assert os.environ["CI"] == "true" and os.environ["NNCF_CI"] == "1"
    assert os.environ["CI"] == "false" and "NNCF_CI" not in os.environ
