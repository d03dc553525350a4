"""`jdp bench formulations`: every float32 formulation computes the reference's gradients; the bench runs."""

import json
import os
import subprocess
import sys

import pytest

from jdp.bench import formulations
from jdp.cli import main as cli
from jdp.training import formulation

# The fast tier checks the bf16 cast; every other formulation is slow. (The custom VJP's matmul branches
# are checked in the fast tier by tests/test_fast.py, on small arrays.)
FAST = ("bf16",)


def tiered(names):
    return [name if name in FAST else pytest.param(name, marks=pytest.mark.slow) for name in names]


@pytest.mark.parametrize("name", tiered(n for n in formulations.FORMULATIONS if not n.startswith("bf16")))
def test_float32_formulations_have_the_reference_gradients(name):
    assert formulations.gradient_error(formulations.FORMULATIONS[name][1]) < 1e-5


@pytest.mark.parametrize("name", tiered(["bf16", "bf16-operands", "bf16-conv2-forward-grads"]))
def test_bfloat16_formulations_are_close_but_not_float32(name):
    assert 1e-4 < formulations.gradient_error(formulations.FORMULATIONS[name][1]) < 0.1


@pytest.mark.slow
def test_bench_times_and_writes_the_table(tmp_path):
    done = subprocess.run([sys.executable, "-m", "jdp", "bench", "formulations", "--only", "split-2", "--steps", "1",
                           "--rounds", "1", "--batch-size", "64", "--cpu-devices", "2", "--write-table",
                           "--out", str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, formulation.CACHE_ENV: str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    (entry,) = formulation.read_cache(tmp_path / "cache" / formulation.CACHE_FILE)
    assert entry.devices == 2 and entry.formulation in ("fast", "split-2") and entry.kind.device_kind == "cpu"
    assert json.loads((tmp_path / "formulations.json").read_text())["table_entry"] == entry.to_json()
    record = json.loads((tmp_path / "formulations.json").read_text())
    rows = {r["name"]: r for r in record["results"]}
    assert list(rows) == ["reference", "fast", "split-2"]
    assert rows["reference"]["vs_reference"] == 1.0 and rows["fast"]["vs_fast"] == 1.0
    for r in rows.values():
        assert r["images_per_s"] == pytest.approx(64 / min(r["seconds"]))
    assert "| split-2 |" in (tmp_path / "formulations.md").read_text()


def test_table_has_a_row_per_formulation_with_its_ratios():
    rows = [{"name": "reference", "what": "the lesson's", "ms_per_step": 80.0, "images_per_s": 3200.0,
             "vs_reference": 1.0, "vs_fast": 0.5, "median_vs_fast": 0.49, "gradient_error": 0.0},
            {"name": "fast", "what": "jdp's", "ms_per_step": 40.0, "images_per_s": 6400.0,
             "vs_reference": 2.0, "vs_fast": 1.0, "median_vs_fast": 1.0, "gradient_error": 1.7e-6}]
    lines = formulations.format_table(rows).splitlines()
    assert lines[0].startswith("| formulation | ms/step |") and len(lines) == 4
    assert lines[3] == "| fast | 40.0 | 6400 | 2.00 | 1.00 | 1.00 | 1.7e-06 | jdp's |"


def test_the_table_adopts_a_trained_formulation_only_at_a_clear_median_speed_up():
    seconds = {"reference": [2.0] * 3, "fast": [1.0] * 3, "split-2": [0.97, 0.96, 0.98],
               "split-4": [0.9, 0.92, 1.1], "bf16": [0.5] * 3}  # bf16 is no formulation jdp trains
    assert formulations.pick(seconds) == ("split-4", pytest.approx(1 / 0.92))  # the median round, not the best
    del seconds["split-4"]
    assert formulations.pick(seconds) == ("fast", 1.0)  # 1.03x: within the margin


def test_unknown_formulation_is_refused_by_name(capsys):
    assert cli.main(["bench", "formulations", "--only", "winograd"]) == 2
    assert "`--only`: no formulation `winograd`" in capsys.readouterr().err
