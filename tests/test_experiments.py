"""Every experiment's --quick mode runs end to end and writes its JSON, PNG and markdown table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["reproduce", "scaling", "eval", "concise"])
def test_quick_mode_writes_outputs(name, tmp_path):
    result = subprocess.run([sys.executable, str(EXPERIMENTS / f"{name}.py"), "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / f"{name}.json").read_text())
    assert record["quick"] is True
    table = (tmp_path / f"{name}.md").read_text()
    assert table.startswith("| ") and table in result.stdout
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    if name == "eval":  # exercise 4: every device count and mode gives the same accuracy
        assert record["identical"] is True and len({r["test_acc"] for r in record["results"]}) == 1


@pytest.mark.parametrize("name", ["reproduce", "scaling", "eval", "concise", "local_sgd", "hierarchical", "network_faults",
                                  "slow_network"])
def test_help(name):
    result = subprocess.run([sys.executable, str(EXPERIMENTS / f"{name}.py"), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--quick" in result.stdout and "--data-dir" in result.stdout
