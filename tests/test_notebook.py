"""Executes the lesson notebook top to bottom in quick mode so it can never silently rot."""

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "multiple_devices_from_scratch.ipynb"
WHICH_ALLREDUCE = NOTEBOOK.parent / "which_allreduce.ipynb"
SLOW_NETWORK = NOTEBOOK.parent / "slow_network.ipynb"


def execute_quick(path: Path, folder: Path, monkeypatch) -> nbformat.NotebookNode:
    """The notebook at `path`, executed top to bottom in quick mode with `folder` as its working directory."""
    monkeypatch.setenv("JDP_NOTEBOOK_QUICK", "1")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    return notebook


@pytest.mark.slow
def test_notebook_runs_in_quick_mode(tmp_path, monkeypatch):
    notebook = execute_quick(NOTEBOOK, tmp_path, monkeypatch)
    outputs = "".join(
        out.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )
    assert "manual: [[[3.0, 3.0]], [[3.0, 3.0]]]" in outputs and "psum:   [[[3.0, 3.0]], [[3.0, 3.0]]]" in outputs
    assert "1 device and 2 devices give the same parameters after one step" in outputs
    assert outputs.count("test acc: ") == 2
    assert (tmp_path / "accuracy.png").stat().st_size > 1000
    assert not any(out.get("output_type") == "error" for cell in notebook.cells for out in cell.get("outputs", []))


def test_committed_notebook_keeps_full_run_outputs():
    """The committed copy shows a full run on Fashion-MNIST (10 epochs on 1 and on 2 devices)."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    text = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []))
    assert text.count("test acc: 0.8") == 2, "commit the notebook with the outputs of a full run"
    assert any("image/png" in out.get("data", {}) for cell in notebook.cells if cell.cell_type == "code"
               for out in cell.get("outputs", []))


@pytest.mark.slow
def test_which_allreduce_notebook_measures_fits_and_predicts(tmp_path, monkeypatch):
    """notebooks/which_allreduce.ipynb in quick mode: 4 device counts measured, a held-out fit, 5 predictions."""
    notebook = execute_quick(WHICH_ALLREDUCE, tmp_path, monkeypatch)
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    text = "".join(out.get("text", "") for out in outputs)
    assert not any(out.get("output_type") == "error" for out in outputs)
    assert text.count("jdp bench allreduce: ") == 4 and "held out: 8 devices, fitted on [2, 3, 4]" in text
    assert text.count("# jdp predict: ") == 5 and text.count("*") >= 5 * 3
    assert sum("image/png" in out.get("data", {}) for out in outputs) == 3  # the fit, ResNet-18 on two clusters
    runs = tmp_path / "which_allreduce"
    fit = json.loads((runs / "fit" / "fit.json").read_text())
    assert fit["link"] == "shared" and fit["held_out"]["devices"] == 8
    assert all(f["alpha_s"] >= 0 and f["beta_s_per_byte"] >= 0 for f in fit["algorithms"].values())
    assert len(list(runs.glob("predict-*/predict.png"))) == 4


def test_committed_which_allreduce_keeps_a_full_run():
    """The committed copy shows a full run's outputs: the sweep's largest size and the figures."""
    notebook = nbformat.read(WHICH_ALLREDUCE, as_version=4)
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    assert "4194304" in "".join(out.get("text", "") for out in outputs), "commit it after a full (not quick) run"
    assert sum("image/png" in out.get("data", {}) for out in outputs) == 3


@pytest.mark.slow
def test_slow_network_notebook_runs_its_quick_experiment(tmp_path, monkeypatch):
    """notebooks/slow_network.ipynb in quick mode: three rows on an emulated 2-host cluster at 100mbit, the
    table with the cost model's prediction beside each, and both figures."""
    import shutil

    from jdp.runtime import cluster

    missing = cluster.missing_privileges(cluster.effective_capabilities(), shutil.which)
    if missing is not None:
        pytest.skip(f"no emulated cluster here: {missing}")
    notebook = execute_quick(SLOW_NETWORK, tmp_path, monkeypatch)
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    assert not any(out.get("output_type") == "error" for out in outputs)
    table = "".join(out.get("data", {}).get("text/markdown", "") for out in outputs)
    assert all(f"| 100mbit | {row} |" in table for row in ("psum", "diloco-h16", "streaming-int8"))
    assert sum("image/png" in out.get("data", {}) for out in outputs) == 2
    record = json.loads((tmp_path / "slow_network" / "slow-network.json").read_text())
    assert [r["row"] for r in record["rows"]] == ["psum", "diloco-h16", "streaming-int8"]
    streaming, psum = record["rows"][2], record["rows"][0]
    assert 0 < streaming["mb_sent_per_host"] < psum["mb_sent_per_host"] / 10  # 16 steps: 1/4 of the model in int8
    assert all(len(r["nic_mb_sent"]) == 2 and r["predicted_wall_s"] > 0 for r in record["rows"])


def test_committed_slow_network_keeps_a_full_run():
    """The committed copy shows the full table (every row at each of the three rates) and both figures."""
    notebook = nbformat.read(SLOW_NETWORK, as_version=4)
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    table = "".join(out.get("data", {}).get("text/markdown", "") for out in outputs)
    rows = ("psum", "ring", "hierarchical", "bf16-wire", "powersgd-r2", "local-sgd-h16", "diloco-h16", "diloco-h64",
            "streaming-int8", "streaming-fp8")
    missing = [f"{rate} {row}" for rate in ("1gbit", "100mbit", "10mbit") for row in rows
               if f"| {rate} | {row} |" not in table]
    assert not missing and "Fashion-MNIST" in table, f"commit it after a full (not quick) run; missing: {missing}"
    assert sum("image/png" in out.get("data", {}) for out in outputs) == 2
