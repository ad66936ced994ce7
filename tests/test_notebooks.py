"""Every notebook in examples/notebooks executes top to bottom (their cells assert results)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "examples" / "notebooks"
CELL_TIMEOUT_S = 240


def _kernel_manager_class():
    """A kernel manager whose kernel runs on this interpreter (the test venv's python)."""
    from jupyter_client.manager import KernelManager

    class ThisInterpreter(KernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            cmd = super().format_kernel_cmd(extra_arguments)
            return [sys.executable, *cmd[1:]]

    return ThisInterpreter


def test_kernel_runs_on_this_interpreter():
    km = _kernel_manager_class()(kernel_name="python3")
    cmd = km.format_kernel_cmd()
    assert cmd[0] == sys.executable and "ipykernel_launcher" in " ".join(cmd)


def test_notebooks_are_current_and_have_no_outputs(tmp_path):
    sys.path.insert(0, str(NOTEBOOKS))
    try:
        import _build
    finally:
        sys.path.remove(str(NOTEBOOKS))
    for fresh in _build.build(tmp_path):
        committed = NOTEBOOKS / fresh.name
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} differs from what _build.py writes; run python examples/notebooks/_build.py"
        )
        nb = nbformat.read(committed, as_version=4)
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")


@pytest.mark.slow
@pytest.mark.e2e  # whole notebooks: `make test-e2e` (CI); make test checks they are current above
@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebook_executes(name, tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # ipykernel forwards the output of spawned processes (file descriptors 1 and 2) into the
    # notebook, except when it sees this variable; the test checks that forwarding.
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        kernel_manager_class=_kernel_manager_class(),
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError with the failing cell and its traceback
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    if name.startswith("01"):  # the launched processes' logging reached the notebook
        streamed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
        assert "[rank 0/2] INFO quickstart: step 60" in streamed
    if name.startswith("03"):
        assert (tmp_path / "fp16_loss_scale.png").stat().st_size > 0
