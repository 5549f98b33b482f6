"""Every example notebook executes without a failing cell (on a small subset: RAG_ACCEL_NB_SMALL=1).
The committed notebooks keep the outputs of a full run; this executes a copy and writes nothing back.

05_serving_on_vllm starts a `rag-accel serve` server with the Python named by RAG_ACCEL_VLLM_PYTHON (a virtualenv
with vLLM: it cannot share this one); skipped when that is unset, an error when RAG_ACCEL_REQUIRE_VLLM=1 (as the
adapters' remote-mode tests). If a cell fails, the server it started is stopped before the kernel is."""

from __future__ import annotations

from pathlib import Path

import pytest

from rag_accel.serving.server_process import vllm_python_or_skip

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
SERVING = {"05_serving_on_vllm"}  # start a server with RAG_ACCEL_VLLM_PYTHON, as `srv`, stopped in the last cell
STOP_SERVER = "if 'srv' in globals():\n    srv.stop()"


def test_there_are_five_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    serving = path.stem in SERVING
    if serving:
        monkeypatch.setenv("RAG_ACCEL_VLLM_PYTHON", vllm_python_or_skip())  # absolute: the notebooks run in examples/
    monkeypatch.setenv("RAG_ACCEL_NB_SMALL", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(path, as_version=4)
    # serving: a cell past its timeout is interrupted (not left running), so that the server can be stopped
    client = nbclient.NotebookClient(nb, timeout=1200 if serving else 900, interrupt_on_timeout=serving,
                                     kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}})
    if not serving:
        client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    else:
        # execute() cell by cell, so that a failing cell cannot leave the server (its own process group) running
        with client.setup_kernel():
            try:
                for i, cell in enumerate(nb.cells):
                    client.execute_cell(cell, i, execution_count=client.code_cells_executed + 1)
            finally:
                stop = nbformat.v4.new_code_cell(STOP_SERVER)
                nb.cells.append(stop)
                client.execute_cell(stop, len(nb.cells) - 1)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert outputs and not [o for o in outputs if o.get("output_type") == "error"]
