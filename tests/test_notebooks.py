"""The notebooks in colabs/ run headless, top to bottom, and are committed without outputs."""

from __future__ import annotations

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

COLABS = pathlib.Path(__file__).resolve().parents[1] / "colabs"


@pytest.mark.parametrize("path", sorted(COLABS.glob("*.ipynb")), ids=lambda p: p.name)
def test_committed_without_outputs_and_with_badge(path):
    nb = nbformat.read(path, as_version=4)
    assert "colab.research.google.com" in nb.cells[0].source, "first cell: the Colab badge"
    assert any("google.colab" in c.source for c in nb.cells if c.cell_type == "code"), (
        "a guarded install cell"
    )
    for c in nb.cells:
        if c.cell_type == "code":
            assert not c.outputs and c.execution_count is None, f"{path.name}: outputs committed"


# in the slow tier (which CI runs) to keep the default tier near 8 minutes: 13 s
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # jupyter_client's own imports, not ours
def test_quickstart_runs():
    nb = nbformat.read(COLABS / "quickstart.ipynb", as_version=4)
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=300).execute()
    out = "".join(
        o.get("text", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("output_type") == "stream" and o.get("name") == "stdout"
    )
    assert "budget spent: 8.0 of 8" in out
    assert "round trip error: 0.0" in out
    err = float(out.split("max |TA - dense sum of kept directions|:")[1].split()[0])
    assert err < 1e-4
