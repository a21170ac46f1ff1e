"""The experiment runner's progress display: bars in a terminal, widget bars in a notebook with
ipywidgets, and one log line per job in a notebook without (a text bar there prints a new line
at every update)."""

from __future__ import annotations

import importlib.util

import pytest

from netutility_jax.experiments.harness import runner


@pytest.mark.parametrize(
    "notebook, widgets, asked, want",
    [
        (False, False, True, True),
        (False, True, False, False),
        (True, True, True, True),
        (True, False, True, False),
        (True, True, False, False),
    ],
)
def test_bars_only_where_they_render(monkeypatch, notebook, widgets, asked, want):
    monkeypatch.setattr(runner, "_in_notebook", lambda: notebook)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            (object() if widgets else None) if name == "ipywidgets" else real(name, *a)
        ),
    )
    assert runner._bars_enabled(asked) is want


def test_outside_a_kernel_is_not_a_notebook():
    assert runner._in_notebook() is False
