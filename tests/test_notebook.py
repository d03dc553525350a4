"""Executes the lesson notebook top to bottom in quick mode so it can never silently rot."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "multiple_devices_from_scratch.ipynb"


@pytest.mark.slow
def test_notebook_runs_in_quick_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("JDP_NOTEBOOK_QUICK", "1")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
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
