"""The regime study: where does budget-aware allocation help?

Net Utility's interference term can only inform the allocation when the tasks' input subspaces
are related, and truncation can only help when the merge suffers from interference. Whether a
set of adapters is in that regime depends on how they were trained. The study varies the
training regime **one factor at a time** around a paper-like centre and measures, per cell, the
data-free indices a user can compute on their own adapters and what the allocation did:

* **cells** (the encoder's :data:`encoder.REGIME`, :func:`regime_cells`): the centre (one shared LoRA initialisation for every task, as the
  paper's codebase trains; equal training for every task; all tasks; LoRA rank 16), then each
  factor moved alone: per-task initialisation (this project's earlier regime, the "corner" where
  overlaps sit at chance), heterogeneity (a few tasks trained with 4x the steps and 4x the
  learning rate), fewer tasks (fixed subsets of 5 and 3, drawn once with seed 0), and a lower
  rank (8). This design is ours; the paper varies none of these.
* **indices** per cell and seed (:func:`netutility_jax.diagnose` and the scores): the input
  overlap relative to chance, the heterogeneity ``h``, the effective rank of the task spectra
  (``exp`` of the entropy of ``s^2 / sum s^2``, averaged over tasks and modules), lambda, each
  task's energy share.
* **merge regime**: TA keeping every direction (normalized accuracy), Iso-C minus TA (both
  keeping everything: how much interference costs), uniform at the tightest budget minus
  keep-all (whether truncation helps at all).
* **the allocation**: Net Utility minus uniform (TA, full space, global top-K) at each budget,
  Net Utility minus energy-only (lambda = 0, the same top-K), each with the paired bootstrap
  interval over test texts (pooled over seeds) and the t interval over seeds, and per task the
  delta against the task's energy share.
* **data-aware Net Utility** (``net_utility_data``; this project's, not the paper's: the paper
  names the data-free geometry as its limitation): the same global top-K scored with each
  task's input second moments as ``G_i`` (``nu.score(..., input_moments=...)``,
  docs/input_moments.md), estimated from the inputs of every LoRA target under the base model on
  :data:`runner.MOMENT_TEXTS` unlabelled training texts per task; reported as NU(data) minus
  uniform and NU(data) minus NU (the data-free score) at each budget, with the same intervals.

Cells reuse trained adapters wherever they can: the task-subset cells train nothing (the
centre's adapters, from the cache), the heterogeneity cell retrains only its scaled tasks, and
every merge is cached per job (``runner.JobCache``), so a study interrupted resumes where it
stopped. The centre's training is the ``--grid mechanism`` preset's, so either run fills the
other's cache.

Outputs: ``study.json`` (every number, the design, the command, commit and versions),
``study.md`` and ``study.png`` (the deltas against the indices; :mod:`study_report` writes
both).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import InputError
from . import grid as gr
from . import records, suites
from . import report_tables as rt
from . import stats as st
from . import study_report as sr

__all__ = [
    "STUDY_FILES",
    "Cell",
    "CellResult",
    "Study",
    "analyse_cell",
    "effective_rank",
    "regime_cells",
    "regime_grid",
    "render",
    "run_study",
    "write_outputs",
]


STUDY_FILES = ("study.json", "study.md", "study.png")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One training regime of a study.

    Attributes:
      name: short label (``"centre"``, ``"init=per_task"``, ``"tasks=3"``, ...).
      factor: the factor it moves (``"centre"``, ``"init"``, ``"heterogeneity"``, ``"tasks"``,
        ``"rank"``).
      level: the factor's value, in words.
      train: ``(field, value)`` overrides of the centre's training config.
      tasks: the tasks it merges (None: the centre's); a subset reuses the centre's adapters.
    """

    name: str
    factor: str
    level: str
    train: tuple[tuple[str, Any], ...] = ()
    tasks: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Study:
    """A set of cells around a centre, each merged with the same grid.

    Attributes:
      name: the study's name (``netutility demo --study NAME``).
      centre: the centre's preset (tasks, data sizes, seeds, training); its ``grid`` is unused.
      grid: what every cell merges: TA in full space at ``budgets`` with uniform and Net Utility,
        keep-all TA and Iso-C, and the energy-only control.
      cells: the cells, the centre first.
    """

    name: str
    centre: gr.Preset
    grid: gr.GridConfig
    cells: tuple[Cell, ...]

    def __post_init__(self):
        names = [c.name for c in self.cells]
        if len(set(names)) < len(names):
            raise InputError(f"Study {self.name!r}: cell names {names} repeat.")
        for c in self.cells:
            if c.tasks is not None:
                extra = [t for t in c.tasks if t not in self.centre.tasks]
                if extra or len(c.tasks) < 2:
                    raise InputError(
                        f"Study {self.name!r}, cell {c.name!r}: tasks {list(c.tasks)} must be "
                        f"at least 2 of the centre's {list(self.centre.tasks)}."
                    )

    def preset(self, cell: Cell) -> gr.Preset:
        """The preset a cell runs: the centre with the cell's tasks, training and the grid."""
        return dataclasses.replace(
            self.centre,
            name=f"{self.name}:{cell.name}",
            tasks=cell.tasks or self.centre.tasks,
            train=dataclasses.replace(self.centre.train, **dict(cell.train)),
            grid=self.grid,
        )


def _subset(tasks: Sequence[str], k: int) -> tuple[str, ...]:
    """``k`` of ``tasks``, drawn once with seed 0 and kept in the tasks' order."""
    pick = set(np.random.default_rng(0).permutation(len(tasks))[:k].tolist())
    return tuple(t for i, t in enumerate(tasks) if i in pick)


#: The data-aware control's variant (``grid.VARIANTS``): Net Utility with the tasks' input
#: second moments, this project's extension.
DATA = "net_utility_data"


def regime_grid(budgets: tuple[int, ...], *, data: bool = True) -> gr.GridConfig:
    """What every cell of a regime study merges: TA in full space at ``budgets`` (uniform and
    Net Utility), keep-all TA and Iso-C, the energy-only control and (``data``) the data-aware
    one."""
    # the data-aware control last: every other job's coefficient search (and cache key) is as
    # it was without it
    data_control = (("ta", "full", DATA),) if data else ()
    return gr.GridConfig(
        rows=(gr.Row("ta", "full"),),
        budgets=budgets,
        no_budget=(("ta", "full"), ("iso_c", "full")),
        controls=(("ta", "full", "energy"), *data_control),
        full_capacity=False,
        weight_average=False,
    )


def _has_data(grid: gr.GridConfig) -> bool:
    return any(v == DATA for _, _, v in grid.controls)


def regime_cells(
    tasks: tuple[str, ...], scaled: tuple[str, ...], subsets: tuple[int, ...]
) -> tuple[Cell, ...]:
    """A regime study's cells around its centre: the centre, per-task initialisation, ``scaled``
    tasks with 4x steps and learning rate, subsets of ``subsets`` of ``tasks``, rank 8."""
    scale = tuple((t, 4.0) for t in scaled)
    return (
        Cell("centre", "centre", "shared init, equal training, all tasks, r 16"),
        Cell("init=per_task", "init", "per-task initialisation", (("init", "per_task"),)),
        Cell(
            "h=4x",
            "heterogeneity",
            f"{', '.join(scaled)}: 4x steps and 4x learning rate",
            (("step_scale", scale), ("lr_scale", scale)),
        ),
        *(
            Cell(f"tasks={k}", "tasks", f"{k} of {len(tasks)} tasks", tasks=_subset(tasks, k))
            for k in subsets
        ),
        Cell("rank=8", "rank", "LoRA rank 8 (alpha 8)", (("lora_rank", 8), ("lora_alpha", 8.0))),
    )


_grid, _cells = regime_grid, regime_cells  # their former names


# ----------------------------------------------------------------------------------- analysis


def effective_rank(sigma: Any) -> float:
    """Mean over tasks and modules of ``exp(H(p))``, ``p = s^2 / sum s^2`` over a task's
    candidate directions in a module (``sigma`` of ``nu.ModuleScores``, ``(M, r)`` per module,
    0 for non-candidates); rows without candidates are skipped."""
    vals = []
    for s in sigma:
        s2 = np.asarray(s, np.float64) ** 2
        for row in np.atleast_2d(s2):
            tot = row.sum()
            if tot > 0:
                p = row[row > 0] / tot
                vals.append(math.exp(-float((p * np.log(p)).sum())))
    return float(np.mean(vals)) if vals else float("nan")


@dataclasses.dataclass
class CellResult:
    """One cell's numbers (JSON-ready through :meth:`to_dict`)."""

    cell: Cell
    tasks: list[str]
    seeds: list[int]
    test_texts: int
    indices: dict[str, Any]
    regime: dict[str, Any]
    allocation: dict[str, Any]
    per_task: dict[str, Any]
    seconds: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return records.to_jsonable(
            {
                "cell": self.cell.name,
                "factor": self.cell.factor,
                "level": self.cell.level,
                "train": dict(self.cell.train),
                "tasks": self.tasks,
                "seeds": self.seeds,
                "test_texts": self.test_texts,
                "indices": self.indices,
                "regime": self.regime,
                "allocation": self.allocation,
                "per_task": self.per_task,
                "seconds": self.seconds,
            }
        )


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(xs)) if xs else float("nan")


def analyse_cell(cell: Cell, run: Any, *, alpha: Any = "auto") -> CellResult:
    """The indices, merge regime and allocation deltas of one cell's ``runner.Run``."""
    grid = run.preset.grid
    names = [t.name for t in run.tasks]
    sx = rt.Stats(run)
    low = min(grid.budgets)
    indices = _indices(run, names, low, alpha)
    regime = {
        "keep_all_ta": rt.summary_dict(sx.value("ta/full/all")),
        "iso_c_minus_ta": rt.summary_dict(sx.delta("iso_c/full/all", "ta/full/all")),
        "uniform_minus_keep_all": rt.summary_dict(
            sx.delta(f"ta/full/R{low}/uniform", "ta/full/all")
        ),
    }
    allocation = _allocation(sx, grid)
    return CellResult(
        cell=cell,
        tasks=names,
        seeds=[s.seed for s in run.seeds],
        test_texts=len(run.test),
        indices=indices,
        regime=regime,
        allocation=allocation,
        per_task=_per_task(sx, names, low, indices["per_seed"], data=_has_data(grid)),
        seconds=dict(run.seconds),
    )


def _indices(run: Any, names: Sequence[str], low: int, alpha: Any) -> dict[str, Any]:
    """The data-free indices of a cell per seed (``nu.diagnose`` at the tightest budget
    ``low``, and the seed's scores), their means over seeds, and the seeds' under
    ``"per_seed"``."""
    import netutility_jax as nu

    per_seed = []
    for s in run.seeds:
        diag = nu.diagnose(s.adapters, budget=low, alpha=alpha, names=names)
        per_seed.append(
            {
                "seed": s.seed,
                "overlap_vs_chance": diag.overlap_vs_chance,
                "heterogeneity": s.scoring["heterogeneity"],
                "effective_rank": effective_rank([m.sigma for m in s.scores.modules.values()]),
                "lam": s.scoring["lam"],
                "alpha": s.scoring["alpha"],
                "rotation_changed_fraction": diag.rotation_changed_fraction,
                "energy_share": {t.name: t.energy_share for t in diag.tasks},
                "kept_vs_uniform": {t.name: t.kept_vs_uniform for t in diag.tasks},
                "warnings": list(diag.warnings),
            }
        )
    indices: dict[str, Any] = {
        k: _mean([p[k] for p in per_seed])
        for k in (
            "overlap_vs_chance", "heterogeneity", "effective_rank", "lam",
            "rotation_changed_fraction",
        )
    }  # fmt: skip
    indices["per_seed"] = per_seed
    return indices


def _allocation(sx: rt.Stats, grid: gr.GridConfig) -> dict[str, Any]:
    """Per budget: uniform's and Net Utility's normalized accuracy, Net Utility minus uniform
    and minus energy, and the data-aware control's against both (when the grid has it)."""
    allocation: dict[str, Any] = {}
    data = _has_data(grid)
    for r in grid.budgets:
        u, o, e, dd = (f"ta/full/R{r}/{a}" for a in ("uniform", "net_utility", "energy", DATA))
        allocation[str(r)] = {
            "uniform": rt.summary_dict(sx.value(u)),
            "net_utility": rt.summary_dict(sx.value(o)),
            "net_utility_minus_uniform": rt.summary_dict(sx.delta(o, u)),
            "net_utility_minus_energy": rt.summary_dict(sx.delta(o, e)),
        }
        if data:
            allocation[str(r)] |= {
                "net_utility_data": rt.summary_dict(sx.value(dd)),
                "net_utility_data_minus_uniform": rt.summary_dict(sx.delta(dd, u)),
                "net_utility_data_minus_net_utility": rt.summary_dict(sx.delta(dd, o)),
            }
    return allocation


def _per_task(
    sx: rt.Stats, names: Sequence[str], low: int, per_seed: Sequence[Mapping[str, Any]], *,
    data: bool,
) -> dict[str, Any]:  # fmt: skip
    """Per task at the tightest budget ``low``: its energy share and kept share against
    uniform's (means over seeds), and Net Utility minus uniform on it (with ``data``, the
    data-aware control minus uniform and minus Net Utility)."""
    per_task = {}
    du, do = sx.draws(f"ta/full/R{low}/uniform"), sx.draws(f"ta/full/R{low}/net_utility")
    dd = sx.draws(f"ta/full/R{low}/{DATA}") if data else None

    def delta(a: Any, b: Any, i: int) -> float | None:
        return (
            None
            if a is None or b is None
            else float(np.nanmean(a.per_task[:, i] - b.per_task[:, i]))
        )

    for i, n in enumerate(names):
        per_task[n] = {
            "energy_share": _mean([p["energy_share"][n] for p in per_seed]),
            "kept_vs_uniform": _mean([p["kept_vs_uniform"][n] for p in per_seed]),
            "delta": delta(do, du, i),
        }
        if data:
            per_task[n]["delta_data"] = delta(dd, du, i)  # NU(data) - uniform
            per_task[n]["delta_data_vs_net_utility"] = delta(dd, do, i)
    return per_task


# ----------------------------------------------------------------------------------- running


def run_study(
    study: Study,
    task_list: Sequence[Any],
    *,
    seeds: Sequence[int] | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    alpha: Any = "auto",
    suite: Any = None,
    cells: Sequence[str] | None = None,
) -> list[CellResult]:
    """Run every cell of ``study`` (or those named in ``cells``) and analyse it.

    Args:
      study: ``encoder.REGIME``, ``encoder.REGIME_QUICK`` or your own.
      task_list: the centre's tasks (``tasks.Task`` objects, in ``study.centre.tasks`` order);
        a subset cell takes its tasks from it.
      seeds: training seeds (default the centre's).
      cache_dir, progress, log, alpha, suite: as in ``runner.run_experiment``.
      cells: names of the cells to run (default all, in order).
    """
    from . import runner

    by_name = {t.name: t for t in task_list}
    missing = [t for t in study.centre.tasks if t not in by_name]
    if missing:
        raise InputError(f"run_study: the tasks {missing} of study {study.name!r} are not given.")
    chosen = list(study.cells)
    if cells is not None:
        unknown = [c for c in cells if c not in {x.name for x in study.cells}]
        if unknown:
            raise InputError(
                f"run_study: unknown cells {unknown}; study {study.name!r} has "
                f"{[c.name for c in study.cells]}."
            )
        chosen = [c for c in study.cells if c.name in cells]
    if suite is None and _has_data(study.grid):
        # one default suite (runner's) for every cell: the tasks' input moments (base model,
        # training texts) are then estimated once per task, not once per cell
        suite = suites.get(runner.DEFAULT_SUITE).build()
    out = []
    for cell in chosen:
        preset = study.preset(cell)
        log(f"{study.name} cell {cell.name}: {cell.level}")
        run = runner.run_experiment(
            [by_name[t] for t in preset.tasks],
            preset,
            seeds=seeds,
            cache_dir=cache_dir,
            progress=progress,
            log=log,
            alpha=alpha,
            suite=suite,
        )
        out.append(analyse_cell(cell, run, alpha=alpha))
    return out


# ----------------------------------------------------------------------------------- rendering


def _pooled_tasks(cells: Sequence[CellResult]) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for c in cells:
        for t in c.per_task.values():
            if t["delta"] is not None and math.isfinite(t["energy_share"]):
                xs.append(t["energy_share"] * len(c.tasks))  # 1 = an equal share
                ys.append(t["delta"])
    return xs, ys


def render(
    study: Study, cells: Sequence[CellResult], *, command: str | None = None, commit: Any = None
) -> tuple[dict[str, Any], str, Any]:
    """``(results, markdown, figure)`` of a study's analysed cells."""
    budgets = list(study.grid.budgets)
    low = min(budgets)
    xs, ys = _pooled_tasks(cells)
    corr = st.pearson(xs, ys)
    ran = {c.cell.name for c in cells}  # the design lists the cells that ran (``--cells``)
    results = {
        "study": study.name,
        "suite": "encoder",
        "command": command,
        "commit": commit,
        "versions": records.versions(),
        "design": {
            "centre": {
                "tasks": list(study.centre.tasks),
                # the seeds that ran (the centre cell's, or the first cell's), not the preset's
                "seeds": sorted({s for c in cells[:1] for s in c.seeds})
                or list(study.centre.seeds),
                "train": dataclasses.asdict(study.centre.train),
                "max_train": study.centre.max_train,
                "n_val": study.centre.n_val,
                "n_test": study.centre.n_test,
            },
            "budgets": budgets,
            "merges": "TA in full space: uniform and Net Utility (global top-K) at each budget, "
            "energy only (lambda 0)"
            + (
                ", data-aware Net Utility (input second moments from "
                f"{_moment_texts()} unlabelled training texts per task through the base model; "
                "this project's, not the paper's)"
                if _has_data(study.grid)
                else ""
            )
            + "; TA and Iso-C keeping every direction",
            "data_aware": _has_data(study.grid),
            "moment_texts": _moment_texts() if _has_data(study.grid) else None,
            "cells": [
                {
                    "name": c.name,
                    "factor": c.factor,
                    "level": c.level,
                    "train": dict(c.train),
                    "tasks": list(c.tasks or study.centre.tasks),
                }
                for c in study.cells
                if c.name in ran
            ],
        },
        "cells": [c.to_dict() for c in cells],
        "per_task_delta_vs_energy": {
            "x": "task energy share x number of tasks (1 = an equal share)",
            "y": f"Net Utility minus uniform, normalized accuracy, TA at R={low}",
            "pearson": corr._asdict(),
        },
    }
    results = records.to_jsonable(results)
    return results, sr.markdown(results, low), sr.figure(cells, low, xs, ys)


def _moment_texts() -> int:
    from .runner import MOMENT_TEXTS

    return MOMENT_TEXTS


def existing(out: pathlib.Path) -> list[pathlib.Path]:
    """The study files already in ``out``."""
    return [out / f for f in STUDY_FILES if (out / f).exists()]


def write_outputs(
    results: Mapping[str, Any], markdown: str, figure: Any, out: str | os.PathLike,
    *, overwrite: bool = False,
) -> list[str]:  # fmt: skip
    """Write ``study.json``, ``study.md`` and ``study.png`` to ``out``, each atomically, every
    file rendered before any is written.

    Raises:
      FileExistsError: a study file exists and ``overwrite`` is False.
    """
    out = pathlib.Path(out)
    found = existing(out)
    if found and not overwrite:
        raise FileExistsError(f"{found[0]} already exists")
    buf = io.BytesIO()
    figure.savefig(buf, format="png", dpi=130)
    files = {
        "study.json": (json.dumps(results, indent=1, allow_nan=False) + "\n").encode(),
        "study.md": markdown.encode(),
        "study.png": buf.getvalue(),
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        with records.atomic_file(out / name, "wb") as f:
            f.write(data)
    return [str(out / n) for n in files]
