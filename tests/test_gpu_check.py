"""scripts/gpu_check.sh: its --dry-run runs every command and flag of the GPU check on CPU, tiny sizes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def script_env(**extra):
    """This interpreter's bin folder first on PATH, the script's own variables unset, then `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "VENV", "DATA_DIR", "JDP_DATA_DIR", "PYTHON")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra)
    return env


def test_bash_syntax():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(SCRIPT, os.X_OK)


def test_without_out_it_stops_and_names_out(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=30,
                            cwd=tmp_path, env=script_env())
    assert result.returncode != 0
    assert "OUT" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_unknown_argument_and_help(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=30,
                            env=script_env(OUT=str(tmp_path)))
    assert result.returncode != 0 and "--bogus" in result.stderr
    result = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30,
                            env=script_env())
    assert result.returncode == 0 and "--dry-run" in result.stdout and "OUT" in result.stdout


@pytest.mark.slow
def test_dry_run_writes_every_file(tmp_path):
    out = tmp_path / "check"
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=600,
                            cwd=tmp_path, env=script_env(OUT=str(out), PYTHON=sys.executable))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]

    bench = json.loads((out / "bench-train" / "bench_train.json").read_text())
    assert isinstance(bench["results"], list) and bench["results"]
    assert {r["precision"] for r in bench["results"]} == {"float32", "bf16"}
    for precision in ("float32", "bf16"):
        history = json.loads((out / f"train-{precision}" / "history.json").read_text())
        assert len(history["epochs"]) == 2
        assert history["config"]["precision"] == precision
        assert (out / f"train-{precision}.log").read_text().startswith(f"== train-{precision}: ")
    for steps_per_call in (1, 2):  # ResNet-18's runs, with a smaller model on a CPU
        history = json.loads((out / f"train-lenet_flax-s{steps_per_call}" / "history.json").read_text())
        assert history["config"]["steps_per_call"] == steps_per_call and len(history["epochs"]) == 2
    loop = json.loads((out / "bench-loop" / "bench_loop.json").read_text())["results"][0]
    assert loop["seconds_per_step"]["train_s"] > 0 and loop["train_vs_bare"] > 0
    allreduce = json.loads((out / "bench-allreduce" / "allreduce.json").read_text())
    assert allreduce["results"] and all(r["wrong"] == 0 for r in allreduce["results"])
    for log in ("bench-train.log", "bench-allreduce.log"):
        assert (out / log).stat().st_size > 0

    summary = (out / "SUMMARY.md").read_text()
    assert "dry run" in summary and "float32" in summary and "bf16" in summary
    assert "| train-float32 | 2 |" in summary and "| train-bf16 | 2 |" in summary
    assert "lenet_flax: 1 step per call / 2:" in summary and "jdp bench loop" in summary
    figures = json.loads((out / "summary.json").read_text())
    assert figures["dry_run"] and figures["lesson_pytorch"] == {"note": "not run: dry run", "seconds_per_epoch": None}
    assert figures["train"]["train-float32"]["vs_floor"] > 0 and figures["bench_loop"]["train_vs_bare"] > 0
    assert not (out / "venv").exists() and not (out / "install.log").exists()
    assert list(tmp_path.iterdir()) == [out]  # nothing written outside $OUT
