"""Render a :class:`runner.Run`: ``results.json``, ``results.md``, ``predictions.npz``, figures.

The rendering layer of the experiment, in three parts:

* :mod:`report_tables`: every number, computed from the run's per-text test correctness
  (:mod:`stats`): normalized accuracies are means over seeds, each delta carries the bootstrap
  interval over test texts (pooled over seeds) and the t interval over seeds;
* :mod:`report_markdown`: the tables as markdown, in the wording of a :class:`SuiteReport`
  (the encoder's by default; the language suite passes its own);
* :mod:`report_figures`: the PNG figures.

:func:`render` puts them together in an :class:`Experiment`; :func:`write_outputs` writes it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
from typing import Any

import numpy as np

from . import records
from . import report_figures as rf
from . import report_tables as rt
from .report_markdown import SuiteReport as SuiteReport
from .report_markdown import console_summary as console_summary
from .report_markdown import format_main_table as format_main_table
from .report_markdown import render_markdown as render_markdown
from .report_tables import N_BOOT as N_BOOT

__all__ = [
    "N_BOOT",
    "RESULT_FILES",
    "Experiment",
    "SuiteReport",
    "console_summary",
    "existing_results",
    "format_main_table",
    "render",
    "render_markdown",
    "write_outputs",
]

RESULT_FILES = (
    "results.json",
    "results.md",
    "predictions.npz",
    "budget_heatmap.png",
    "kept_per_task.png",
    "prefix_retention.png",
    "utility_distribution.png",
    "utility_vs_accuracy.png",
    "deltas.png",
    "training_curves.png",
)


@dataclasses.dataclass
class Experiment:
    """What :func:`render` produced: JSON-ready results, markdown, figures, predictions."""

    results: dict[str, Any]
    markdown: str
    figures: dict[str, Any]
    predictions: dict[str, np.ndarray]


def render(run: Any, suite: SuiteReport | None = None, *, command: str | None = None) -> Experiment:
    """Statistics, results dict, markdown and figures of ``run``.

    Args:
      run: a :class:`runner.Run`.
      suite: the suite's wording and fields (default :class:`SuiteReport`, the encoder's;
        ``suite.report(run)`` of a ``suites.Suite``).
      command: the command that produced the run, recorded in ``results["command"]`` (None:
        a Python call).
    """
    suite = SuiteReport() if suite is None else suite
    sx = rt.Stats(run)
    rows = rt.main_rows(run, sx)
    results = rt.collect(run, sx, rows, suite, command=command)
    return Experiment(
        records.to_jsonable(results),
        render_markdown(results, rows, run.preset.grid, suite),
        rf.figures(run, results),
        rt.predictions(run),
    )


def existing_results(out: pathlib.Path) -> list[pathlib.Path]:
    """The result files (:data:`RESULT_FILES`) already in ``out``."""
    return [out / f for f in RESULT_FILES if (out / f).exists()]


def write_outputs(exp: Experiment, out: str | os.PathLike, *, overwrite: bool = False) -> list[str]:
    """Write results.json, results.md, predictions.npz and the figures into ``out``.

    Every file is rendered before any is written, and each is written atomically (a temporary
    file renamed into place), so a failure leaves no half-written result. With ``overwrite``, a
    result file of an earlier run that this one does not produce (a figure of one seed's masks,
    when every seed was read back) is removed once the new files are in place.

    Returns:
      The paths written, in the order of :data:`RESULT_FILES`.

    Raises:
      FileExistsError: a result file exists and ``overwrite`` is False.
    """
    out = pathlib.Path(out)
    existing = existing_results(out)
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} already exists")
    files = _encode(exp)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in RESULT_FILES:
        if name in files:
            with records.atomic_file(out / name, "wb") as f:
                f.write(files[name])
            written.append(str(out / name))
    for path in existing:  # an earlier run's figure this run does not draw would pass for its own
        if path.name not in files:
            path.unlink()
    return written


def _encode(exp: Experiment) -> dict[str, bytes]:
    """Every output file's bytes (strict JSON: non-finite numbers are null)."""
    text = json.dumps(records.to_jsonable(exp.results), indent=1, allow_nan=False) + "\n"
    files = {"results.json": text.encode(), "results.md": exp.markdown.encode()}
    buf = io.BytesIO()
    np.savez_compressed(buf, **exp.predictions)
    files["predictions.npz"] = buf.getvalue()
    for name, fig in exp.figures.items():
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=130)
        files[name] = buf.getvalue()
    return files
