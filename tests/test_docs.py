"""The examples a newcomer reads must run: README's Python block and every docstring example."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = [
    "_core.tree",
    "_core.walk",
    "scoring.decompose",
    "scoring.utility",
    "allocation.allocate",
    "allocation.analysis",
    "allocation._min_share",
    "registry",
    "operators._module_ops",
    "operators.stacked",
    "pipeline.merging",
    "pipeline.streaming",
    "pipeline.planning",
    "scoring.moments",
    "scoring._moment_files",
    "provenance",
    "peft",
    "cli",
    "nnx",
    "checkpoint",
    "plots",
    "experiments.harness.evaluate",
    "experiments.harness.records",
    "experiments.demo",
    "experiments.demo_checks",
    "experiments.harness.stats",
    "experiments.harness.report_markdown",
]


def test_readme_python_block_runs(capsys):
    src = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", src, re.S)
    assert blocks, "README.md has no python example"
    namespace: dict = {}  # later blocks continue the first one, as a reader would
    for code in blocks:
        exec(compile(code, "README.md", "exec"), namespace)
    out = capsys.readouterr().out.split()
    assert float(out[0]) > 0  # lambda
    assert float(out[1]) <= 8  # budget spent never exceeds the budget


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    mod = importlib.import_module(f"netutility_jax.{name}")
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0, f"netutility_jax.{name} has no docstring example"
    assert res.failed == 0
