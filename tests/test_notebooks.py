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


@pytest.mark.parametrize("path", sorted(COLABS.glob("*.ipynb")), ids=lambda p: p.name)
def test_install_cells_and_badges_point_at_the_projects_repository(path):
    import re
    import tomllib

    repo = tomllib.loads((COLABS.parent / "pyproject.toml").read_text())["project"]["urls"][
        "Repository"
    ]
    slug = repo.removeprefix("https://github.com/")
    nb = nbformat.read(path, as_version=4)
    assert f"colab.research.google.com/github/{slug}/blob/main/colabs/{path.name}" in (
        nb.cells[0].source
    )
    installs = [
        line for c in nb.cells if c.cell_type == "code" for line in c.source.splitlines()
        if "pip install" in line and "git+" in line
    ]  # fmt: skip
    assert installs, "an install cell from the repository"
    for line in installs:
        assert re.search(rf"git\+{re.escape(repo)}(['\s]|$)", line), line


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
    # every figure shows as an image, not as "<Figure size ...>" text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]  # fmt: skip
    assert len(images) >= 3
    figures = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
               if o.get("data", {}).get("text/plain", "").startswith("<Figure")]  # fmt: skip
    assert figures and all("image/png" in o["data"] for o in figures)
    assert "budget spent: 8.0 of 8" in out
    assert "round trip error: 0.0" in out
    err = float(out.split("max |TA - dense sum of kept directions|:")[1].split()[0])
    assert err < 1e-4
