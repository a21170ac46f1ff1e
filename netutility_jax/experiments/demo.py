"""``netutility demo``: train task LoRAs on MiniLM, merge them under rank budgets, compare allocations.

The built-in experiment of netutility-jax, laid out like the paper's Table 2 on 7 real text
classification tasks (:mod:`netutility_jax.experiments.tasks`):

1. per task, a LoRA (rank 16, alpha 16 on q, k, v, o of the 6 layers) and a linear head are
   trained on MiniLM-L6, or loaded from the cache (:mod:`netutility_jax.experiments.train`);
2. every configuration method x space x budget ``R`` x allocation (uniform, the paper's baseline,
   vs. net utility) is merged with ``nu.merge_adapters`` (``alpha="auto"``: the paper's
   heterogeneity rule; ``lam="auto"``), its merge coefficient chosen on validation, and its
   normalized accuracy measured on test (:mod:`netutility_jax.experiments.evaluate`);
3. the analyses: budget spent with positive-only admission at full capacity ``R = M r``, the
   fraction of non-prefix kept sets, directions per layer x module, retention by rank, and mean
   net utility per task against the task's relative accuracy.

Work is shared where the library says results are identical: TA is the same in every space (merged
once, reported for all three), TSV, Iso-C and Iso-C + TSV are the same in full and Core space
(``nu.merge`` docstring). Every method is linear in its coefficient, so a configuration is merged
once and each coefficient candidate is a fold.

Outputs (``--out``, default ``netutility-demo``): ``results.json``, ``results.md`` and PNG figures,
each written to a temporary file and renamed into place; existing results are never overwritten
without ``--overwrite``.

Exit codes: 0 done; 1 results exist (no ``--overwrite``); 2 bad arguments, missing data or
missing model weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..cli import float_or_auto
from . import evaluate as ev
from . import tasks as tk
from . import train as tr

PROG = "netutility demo"
DEFAULT_OUT = "netutility-demo"
RESULT_FILES = (
    "results.json",
    "results.md",
    "budget_heatmap.png",
    "kept_per_task.png",
    "prefix_retention.png",
    "utility_distribution.png",
    "utility_vs_accuracy.png",
)


# ------------------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A merge method of the grid.

    Attributes:
      label: name in the tables.
      method: ``nu.merge`` method.
      options: method options (``density``, ``p``, ``isotropize``).
      coefs: initial merge-coefficient candidates (widened at the edge, see
        :func:`evaluate.select_coef`).
      same_spaces: groups of spaces in which the method gives identical results.
    """

    label: str
    method: str
    options: tuple[tuple[str, Any], ...] = ()
    coefs: tuple[float, ...] = (0.75, 1.0, 1.25)
    same_spaces: tuple[tuple[str, ...], ...] = (("full",), ("core",), ("knots",))

    def canonical_space(self, space: str) -> str:
        for group in self.same_spaces:
            if space in group:
                return group[0]
        return space


_FULL_CORE = (("full", "core"), ("knots",))
_SUM = (0.25, 0.5, 1.0)
#: The grid's methods. Coefficient grids are geometric (widened at the edges and refined on
#: validation, :func:`evaluate.select_coef`): TA, DARE, TSV and Iso-C sum or renormalize 7 task
#: updates, and every head also sees the other 6 tasks' updates, so the best coefficient is
#: usually below 1; TIES takes a disjoint mean (larger ones). DARE: drop rate p = 0.5 (LoRA
#: updates are low rank and dense; the p = 0.9 used on full fine-tunes wipes them out), a fixed
#: key from the seed. TIES: density 0.2 (the TIES paper's top 20%, the library default), trimmed
#: per module. Allocation scope is the paper's: local (per module) for TIES and DARE, global
#: otherwise.
METHODS: dict[str, MethodSpec] = {
    "ta": MethodSpec("TA", "ta", coefs=_SUM, same_spaces=(("full", "core", "knots"),)),
    "tsv": MethodSpec("TSV", "tsv", coefs=_SUM, same_spaces=_FULL_CORE),
    "dare": MethodSpec("DARE", "dare", (("p", 0.5),), coefs=_SUM),
    "ties": MethodSpec("TIES", "ties", (("density", 0.2),), coefs=(0.5, 1.0, 2.0)),
    "iso_c": MethodSpec("Iso-C", "iso_c", coefs=_SUM, same_spaces=_FULL_CORE),
    "iso_c_tsv": MethodSpec(
        "Iso-C + TSV", "tsv", (("isotropize", True),), coefs=_SUM, same_spaces=_FULL_CORE
    ),
}
SPACE_LABELS = {"full": "Full", "core": "Core", "knots": "KnOTS"}
ALLOCATIONS = ("uniform", "net_utility")


@dataclasses.dataclass(frozen=True)
class GridConfig:
    """What is merged and how it is evaluated.

    Attributes:
      methods: keys of :data:`METHODS`.
      spaces: ``"full"``, ``"core"``, ``"knots"``.
      budgets: budgets R (average directions per module).
      val_per_task: validation texts per task for the coefficient search (balanced subset).
      test_per_task: test texts per task for the reported accuracies (balanced subset; None all).
      coef_extend: at most this many extra coefficient candidates beyond the grid's edge.
      coef_refine: this many geometric midpoints around the best candidate.
      reference_all: also merge TA with every component (``allocation="all"``).
      full_budget: also merge TA with net utility at full capacity ``R = M r`` (budget analysis).
    """

    methods: tuple[str, ...]
    spaces: tuple[str, ...]
    budgets: tuple[int, ...]
    val_per_task: int
    test_per_task: int | None
    coef_extend: int = 2
    coef_refine: int = 1
    reference_all: bool = True
    full_budget: bool = True


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named pair of training and grid settings."""

    name: str
    train: tr.TrainConfig
    grid: GridConfig


QUICK = Preset(
    "quick",
    tr.TrainConfig(
        max_steps=32,
        learning_rate=3e-3,
        eval_every=16,
        patience=2,
        probe_examples=200,
        val_examples=120,
    ),
    GridConfig(
        methods=("ta", "ties", "tsv"),
        spaces=("full", "core"),
        budgets=(16,),
        val_per_task=30,
        test_per_task=100,
        coef_extend=1,
        coef_refine=0,
    ),
)
FULL = Preset(
    "full",
    tr.TrainConfig(epochs=2.0, learning_rate=2e-3, eval_every=25, patience=3),
    GridConfig(
        methods=("ta", "tsv", "dare", "ties", "iso_c", "iso_c_tsv"),
        spaces=("full", "core", "knots"),
        budgets=(64, 32, 16),
        val_per_task=40,
        test_per_task=200,
    ),
)


class DemoError(Exception):
    """A problem the user can fix; printed as one line, exit code ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# -------------------------------------------------------------------------------------- tasks


def task_args(custom: Sequence[str] = (), selection: str | None = None) -> list[str]:
    """Task arguments for ``tasks.load_tasks``: built-ins plus ``--task`` ones, or ``--tasks``.

    Raises:
      DemoError: a bad ``--task`` spec, an unknown name in ``--tasks``, fewer than 2 tasks.
    """
    customs: dict[str, str] = {}
    for arg in custom:
        try:
            name, path = tk.parse_task_arg(arg)
        except tk.TaskDataError as e:
            raise DemoError(f"--task: {e}") from None
        if name in customs:
            raise DemoError(f"--task: task name {name!r} is given twice")
        customs[name] = f"{name}={path}"
    if selection is None:
        out = [*tk.BUILTIN_TASKS, *customs.values()]
    else:
        names = [n.strip() for n in selection.split(",") if n.strip()]
        out = []
        for n in names:
            if n in customs:
                out.append(customs[n])
            elif n in tk.BUILTIN_TASKS:
                out.append(n)
            else:
                known = ", ".join([*tk.BUILTIN_TASKS, *customs])
                raise DemoError(f"--tasks: unknown task {n!r}; known tasks: {known}")
        if len(set(names)) != len(names):
            raise DemoError(f"--tasks: a task is listed twice in {selection!r}")
    if len(out) < 2:
        raise DemoError(f"merging needs at least 2 tasks, got {len(out)}: {out}")
    return out


def check_data(args: Sequence[str]) -> None:
    """Raise :class:`DemoError` (one line, with the apt command) if built-in data is missing."""
    missing = [a for a in args if "=" not in a and not tk.data_available(a)]
    if missing:
        raise DemoError(
            f"the Debian data of built-in task(s) {', '.join(missing)} is not installed; install "
            f"it with: {tk.APT_INSTALL_COMMAND}  (or choose other tasks with --tasks)"
        )


def check_weights() -> None:
    """Raise :class:`DemoError` if the pretrained MiniLM package is missing."""
    from . import minilm

    try:
        minilm.model_dir()
    except (ModuleNotFoundError, FileNotFoundError):
        raise DemoError(
            f"the pretrained MiniLM weights are not installed; install them with: {minilm.INSTALL}"
        ) from None


def load_tasks(args: Sequence[str], *, seed: int) -> list[Any]:
    try:
        return tk.load_tasks(args, seed=seed)
    except tk.TaskDataMissingError as e:
        raise DemoError(
            f"the Debian data of built-in task {e.task!r} is not installed; install it with: "
            f"{tk.APT_INSTALL_COMMAND}"
        ) from None
    except (tk.TaskDataError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise DemoError(f"cannot load the tasks: {msg}") from None


# ------------------------------------------------------------------------------------- merging


@dataclasses.dataclass(frozen=True)
class MergeJob:
    """One distinct merge of the grid (``spaces``: the table spaces it stands for)."""

    key: str
    method: str
    space: str
    spaces: tuple[str, ...]
    budget: int
    allocation: str


def grid_jobs(grid: GridConfig) -> list[MergeJob]:
    """The distinct merges of ``grid``, identical configurations merged once."""
    jobs: dict[str, MergeJob] = {}
    for m, r, alloc, space in itertools.product(
        grid.methods, grid.budgets, ALLOCATIONS, grid.spaces
    ):
        spec = METHODS[m]
        canon = spec.canonical_space(space)
        if canon not in grid.spaces:  # e.g. TA with only "core": run it there
            canon = next(s for s in grid.spaces if spec.canonical_space(s) == canon)
        key = f"{m}/{canon}/R{r}/{alloc}"
        if key in jobs:
            j = jobs[key]
            jobs[key] = dataclasses.replace(j, spaces=(*j.spaces, space))
        else:
            jobs[key] = MergeJob(key, m, canon, (space,), r, alloc)
    return list(jobs.values())


def _merge(adapters, job: MergeJob, *, seed: int, alpha: Any = "auto") -> tuple[Any, Any]:
    import jax

    import netutility_jax as nu

    spec = METHODS[job.method]
    opts = dict(spec.options)
    key = jax.random.key(seed) if spec.method in ("dare", "dare_ties") else None
    merged, report = nu.merge_adapters(
        adapters,
        budget=job.budget,
        method=spec.method,
        space=job.space,
        allocation=job.allocation,
        alpha=alpha,
        key=key,
        **opts,
    )
    # one merge's LAPACK work at a time (jaxlib CPU can deadlock on concurrent batched LAPACK)
    return jax.block_until_ready(merged), report


def _report_summary(report: Any) -> dict[str, Any]:
    return {
        "scope": report.scope,
        "lam": report.lam,
        "alpha": report.alpha,
        "heterogeneity": report.heterogeneity,
        "budget_spent": report.budget_spent,
        "non_prefix_fraction": report.non_prefix_fraction,
        "kept_per_task": [int(x) for x in np.asarray(report.kept_per_task)],
    }


def _eval_record(res: ev.MergeEval) -> dict[str, Any]:
    return {
        "coef": res.coef,
        "val_scores": {f"{c:g}": s for c, s in res.val_scores.items()},
        "val_normalized": res.val_normalized,
        "test_accuracy": res.test_accuracy,
        "test_normalized": res.test_normalized.per_task,
        "normalized": res.test_normalized.mean,
    }


# ------------------------------------------------------------------------------------ analyses


def pearson(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Pearson ``r`` and its two-sided permutation p-value (exact for n <= 8).

    Example:
      >>> r, p = pearson([1, 2, 3, 4], [2, 4, 6, 8.5])
      >>> round(r, 3), round(p, 3)
      (0.998, 0.083)
    """
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if len(x) != len(y) or len(x) < 3:
        return float("nan"), float("nan")
    xc, yc = x - x.mean(), y - y.mean()
    den = np.sqrt((xc**2).sum() * (yc**2).sum())
    if den == 0:
        return float("nan"), float("nan")
    r = float((xc * yc).sum() / den)
    if len(x) <= 8:
        perms = np.array(list(itertools.permutations(range(len(y)))))
    else:
        rng = np.random.default_rng(0)
        perms = np.array([rng.permutation(len(y)) for _ in range(20000)])
    rs = (yc[perms] * xc).sum(1) / den
    p = float(np.mean(np.abs(rs) >= abs(r) - 1e-12))
    return r, p


def mean_net_utility(scores: Any) -> np.ndarray:
    """``(M,)`` mean net utility of each task's candidate directions over all modules."""
    u = np.concatenate([np.asarray(m.utility, np.float64) for m in scores.modules.values()], 1)
    fin = np.isfinite(u)
    return np.where(fin, u, 0).sum(1) / np.maximum(fin.sum(1), 1)


# -------------------------------------------------------------------------------------- tables


def _num(x: float | None) -> str:
    return "–" if x is None or not np.isfinite(x) else f"{x:.1f}"


def _delta(u: float | None, o: float | None) -> str:
    if u is None or o is None or not (np.isfinite(u) and np.isfinite(o)):
        return "–"
    d = round(o - u, 1)
    if d == 0:
        return "0.0"
    return f"**{d:+.1f}**" if d > 0 else f"{d:+.1f}"


def format_table(rows: Sequence[Mapping[str, Any]], budgets: Sequence[int]) -> str:
    """A markdown table laid out like the paper's Table 2.

    Args:
      rows: ``{"space": str, "method": str, "cells": {R: (uniform, ours)}}`` (values or None);
        a ``"note"`` string is appended to the method name.
      budgets: the column groups, in order.

    Example:
      >>> print(format_table([{"space": "Full", "method": "TA", "cells": {16: (60.0, 62.5)}}], [16]))
      | Space | Method | R=16 Unif. | R=16 Ours | R=16 Δ |
      |---|---|---:|---:|---:|
      | Full | TA | 60.0 | 62.5 | **+2.5** |
    """
    head = ["Space", "Method"]
    for r in budgets:
        head += [f"R={r} Unif.", f"R={r} Ours", f"R={r} Δ"]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * 2 + "---:|" * (3 * len(budgets)),
    ]
    for row in rows:
        cells = [row["space"], row["method"] + row.get("note", "")]
        for r in budgets:
            u, o = row["cells"].get(r, (None, None))
            cells += [_num(u), _num(o), _delta(u, o)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_rows(
    records: Mapping[str, Mapping[str, Any]],
    grid: GridConfig,
    value: Callable[[Mapping[str, Any]], float | None] = lambda rec: rec["normalized"],
) -> list[dict[str, Any]]:
    """Rows of the Table 2 layout from the merge records (keyed by :class:`MergeJob` key).

    TA comes first, once (identical in every space, space "all"); then each space with the
    other methods. Rows that repeat another space's numbers are marked with a dagger.
    """
    rows = []

    def cell(m, space, r):
        spec = METHODS[m]
        canon = spec.canonical_space(space)
        if canon not in grid.spaces:
            canon = next(s for s in grid.spaces if spec.canonical_space(s) == canon)
        out = []
        for alloc in ALLOCATIONS:
            rec = records.get(f"{m}/{canon}/R{r}/{alloc}")
            out.append(None if rec is None else value(rec))
        return tuple(out), canon != space

    if "ta" in grid.methods:
        rows.append(
            {
                "space": "all",
                "method": "TA",
                "cells": {r: cell("ta", grid.spaces[0], r)[0] for r in grid.budgets},
            }
        )
    for space in grid.spaces:
        for m in grid.methods:
            if m == "ta":
                continue
            cells, shared = {}, False
            for r in grid.budgets:
                cells[r], shared = cell(m, space, r)
            row = {"space": SPACE_LABELS[space], "method": METHODS[m].label, "cells": cells}
            if shared:
                row["note"] = " †"
            rows.append(row)
    return rows


def _coef_rows(records, grid) -> list[dict[str, Any]]:
    rows = table_rows(records, grid, value=lambda rec: rec["coef"])
    for row in rows:
        row["cells"] = {
            r: tuple("–" if c is None else f"{c:g}" for c in v) for r, v in row["cells"].items()
        }
    return rows


def format_coef_table(records, grid) -> str:
    head = ["Space", "Method"] + [f"R={r} Unif. / Ours" for r in grid.budgets]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * len(grid.budgets)]
    for row in _coef_rows(records, grid):
        cells = [row["space"], row["method"] + row.get("note", "")]
        cells += [" / ".join(row["cells"][r]) for r in grid.budgets]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- experiment


@dataclasses.dataclass
class Experiment:
    """What :func:`run_experiment` produced: JSON-ready results, markdown, figures."""

    results: dict[str, Any]
    markdown: str
    figures: dict[str, Any]


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, mininterval=1.0, dynamic_ncols=True)


def run_experiment(
    task_list: Sequence[Any],
    preset: Preset,
    *,
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    progress: bool = True,
    log: Callable[[str], None] = print,
    backbone: ev.Backbone | None = None,
    alpha: float | str = "auto",
) -> Experiment:
    """Train (or load) the task LoRAs, run the merge grid and the analyses.

    Args:
      task_list: ``tasks.Task`` objects (at least 2).
      preset: :data:`QUICK`, :data:`FULL` or your own.
      cache_dir: trained-adapter cache (default :func:`train.default_cache_dir`).
      seed: training seed (data order, initialization) and DARE's key.
      progress: show tqdm bars.
      log: where one-line status messages go.
      backbone: the base model (default :class:`evaluate.Backbone`, the pretrained MiniLM).
      alpha: scoring geometry: ``"auto"`` (the paper's heterogeneity rule), ``1.0`` (Gram) or
        ``0.0`` (row space).
    """
    import jax

    import netutility_jax as nu

    t_start = time.perf_counter()
    alpha_arg = alpha
    grid = preset.grid
    tcfg = dataclasses.replace(preset.train, seed=seed)
    names = [t.name for t in task_list]
    m_tasks = len(task_list)

    backbone = ev.Backbone() if backbone is None else backbone
    t0 = time.perf_counter()
    trained = tr.train_tasks(
        task_list, tcfg, cache_dir=cache_dir, backbone=backbone, progress=progress, log=log
    )
    train_wall = time.perf_counter() - t0
    adapters = [t.adapter for t in trained]
    heads = [t.head for t in trained]
    rank = tcfg.lora_rank

    t0 = time.perf_counter()
    val = ev.make_eval_set(
        names,
        [ev.balanced_subset(t.val, grid.val_per_task) for t in task_list],
        max_len=tcfg.max_len,
    )
    test = ev.make_eval_set(
        names,
        [ev.balanced_subset(t.test, grid.test_per_task) for t in task_list],
        max_len=tcfg.max_len,
    )
    evaluator = ev.Evaluator(backbone, adapters, heads, val, test)
    base_emb = backbone.embed(test)
    base_heads = ev.accuracies(base_emb, heads, test)
    probe = ev.accuracies(base_emb, [t.probe for t in trained], test)
    single_wall = time.perf_counter() - t0
    log(
        "single-LoRA test accuracy: "
        + ", ".join(f"{n} {evaluator.single_test[n]:.3f}" for n in names)
    )

    jobs = grid_jobs(grid)
    extra: list[MergeJob] = []
    if grid.reference_all:
        extra.append(MergeJob("ta/full/all", "ta", "full", ("full",), m_tasks * rank, "all"))
    if grid.full_budget and m_tasks * rank not in grid.budgets:
        r = m_tasks * rank
        extra.append(
            MergeJob(f"ta/full/R{r}/net_utility", "ta", "full", ("full",), r, "net_utility")
        )
    records: dict[str, dict[str, Any]] = {}
    reports: dict[str, Any] = {}
    t0 = time.perf_counter()
    bar = _progress_bar(len(jobs) + len(extra), "merge grid", progress)
    with bar:
        for job in [*jobs, *extra]:
            bar.set_postfix_str(job.key)
            ts = time.perf_counter()
            merged, report = _merge(adapters, job, seed=seed, alpha=alpha_arg)
            tm = time.perf_counter() - ts
            passes0, tok0 = backbone.passes, backbone.tokens
            spec = METHODS[job.method]
            res = evaluator.evaluate(
                merged, spec.coefs, extend=grid.coef_extend, refine=grid.coef_refine
            )
            records[job.key] = {
                "method": job.method,
                "label": spec.label,
                "space": job.space,
                "spaces": list(job.spaces),
                "budget": job.budget if job.allocation != "all" else None,
                "allocation": job.allocation,
                "options": dict(spec.options),
                **_report_summary(report),
                **_eval_record(res),
                "merge_seconds": tm,
                "eval_seconds": time.perf_counter() - ts - tm,
                "forward_passes": backbone.passes - passes0,
                "padded_tokens": backbone.tokens - tok0,
            }
            reports[job.key] = report
            bar.update(1)
            if not progress:
                r = records[job.key]
                log(
                    f"{job.key}: normalized accuracy {r['normalized']:.1f} (coef {r['coef']:g}; "
                    f"merge {r['merge_seconds']:.1f} s, evaluation {r['eval_seconds']:.1f} s)"
                )
    grid_wall = time.perf_counter() - t0

    # --------------------------------------------------------------------------- analyses
    nu_report = next(
        (reports[j.key] for j in jobs if j.allocation == "net_utility"),
        next(iter(reports.values())),
    )
    h, alpha, lam = nu_report.heterogeneity, nu_report.alpha, nu_report.lam
    scores = nu.score(adapters, alpha=alpha, lam="auto")
    hm_budget = max(grid.budgets)
    masks = jax.block_until_ready(nu.allocate(scores, hm_budget))
    hm_key = f"ta/full/R{hm_budget}/net_utility"
    hm_report = reports.get(hm_key)

    spent = []
    for r in sorted(
        {*grid.budgets, *(j.budget for j in extra if j.allocation != "all")}, reverse=True
    ):
        ours = records.get(f"ta/full/R{r}/net_utility")
        unif = records.get(f"ta/full/R{r}/uniform")
        if ours is None:
            continue
        if unif is None and r == m_tasks * rank:
            unif = records.get("ta/full/all")  # uniform at full capacity keeps everything
        spent.append(
            {
                "budget": r,
                "used_avg": ours["budget_spent"],
                "unspent_fraction": 1.0 - ours["budget_spent"] / r,
                "ours": ours["normalized"],
                "uniform": None if unif is None else unif["normalized"],
            }
        )
    non_prefix = {
        k: rec["non_prefix_fraction"]
        for k, rec in records.items()
        if rec["allocation"] == "net_utility"
    }
    mnu = mean_net_utility(scores)
    rel = [evaluator.single_test[n] - probe[n] for n in names]
    r_corr, p_corr = pearson(mnu, rel)
    r_heads, p_heads = pearson(mnu, [evaluator.single_test[n] - base_heads[n] for n in names])

    figures = {
        "budget_heatmap.png": nu.plots.budget_heatmap(
            hm_report if hm_report is not None else masks,
            title=f"Directions kept per layer x module (TA, net utility, R={hm_budget})",
        ),
        "kept_per_task.png": nu.plots.kept_per_task(
            masks, names, title=f"Directions kept per task (net utility, R={hm_budget})"
        ),
        "prefix_retention.png": nu.plots.prefix_retention(
            masks, scores, title=f"Retention by rank (net utility, R={hm_budget})"
        ),
        "utility_distribution.png": nu.plots.utility_distribution(scores, masks, names),
        "utility_vs_accuracy.png": _scatter(names, mnu, rel, r_corr, p_corr),
    }

    total_wall = time.perf_counter() - t_start
    results = {
        "preset": preset.name,
        "seed": seed,
        "tasks": [
            {
                "name": t.name,
                "labels": list(t.labels),
                "source": t.source,
                "train": len(t.train),
                "val": len(t.val),
                "test": len(t.test),
            }
            for t in task_list
        ],
        "train_config": dataclasses.asdict(tcfg),
        "grid": {
            **dataclasses.asdict(grid),
            "coefs": {m: list(METHODS[m].coefs) for m in grid.methods},
            "options": {m: dict(METHODS[m].options) for m in grid.methods},
            "eval_texts": {"val": len(val), "test": len(test)},
            "eval_padded_tokens": {"val": val.padded_tokens, "test": test.padded_tokens},
        },
        "heterogeneity": h,
        "alpha": alpha,
        "alpha_rule": (
            "alpha = 0 if h > 1.0 else 1 (paper: h = 1.83 vision -> 0, 0.63 NLI -> 1)"
            if alpha_arg == "auto"
            else f"set by the caller (alpha={alpha_arg})"
        ),
        "lambda": lam,
        "single": {
            n: {
                "test_accuracy": evaluator.single_test[n],
                "val_accuracy": evaluator.single_val[n],
                "base_with_task_head": base_heads[n],
                "base_linear_probe": probe[n],
                "relative_accuracy": evaluator.single_test[n] - probe[n],
                "mean_net_utility": float(mnu[i]),
            }
            for i, n in enumerate(names)
        },
        "training": {
            t.name: {
                k: t.info.get(k)
                for k in (
                    "cache_hit",
                    "cache_key",
                    "best_step",
                    "best_val_accuracy",
                    "steps",
                    "planned_steps",
                    "stopped_early",
                    "train_seconds",
                    "steps_per_second",
                    "probe_val_accuracy",
                    "history",
                )
            }
            for t in trained
        },
        "merges": records,
        "analyses": {
            "budget_spent": spent,
            "non_prefix_fraction": non_prefix,
            "retention_by_rank": {
                "budget": hm_budget,
                "fraction": [float(x) for x in np.asarray(nu.retention_by_rank(masks, scores))],
            },
            "kept_per_module": {"budget": hm_budget, "kept": nu.kept_per_module(masks)},
            "utility_vs_accuracy": {
                "n": m_tasks,
                "pearson_r": r_corr,
                "permutation_p": p_corr,
                "relative_to": "base linear probe (ridge on the frozen base embedding)",
                "pearson_r_vs_base_with_task_head": r_heads,
                "permutation_p_vs_base_with_task_head": p_heads,
                "paper": -0.78,
            },
        },
        "timings": {
            "total_seconds": total_wall,
            "training_seconds": train_wall,
            "single_eval_seconds": single_wall,
            "grid_seconds": grid_wall,
            "forward_passes": backbone.passes,
            "forward_seconds": backbone.seconds,
            "forward_padded_tokens": backbone.tokens,
        },
        "environment": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "cpus": os.cpu_count(),
            "note": "other processes may share the CPUs; timings are wall clock",
        },
    }
    return Experiment(results, render_markdown(results, grid), figures)


def _scatter(names, mnu, rel, r, p):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.scatter(mnu, np.asarray(rel) * 100)
    for n, x, y in zip(names, mnu, rel, strict=True):
        ax.annotate(n, (x, y * 100), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("mean net utility of the task's directions")
    ax.set_ylabel("relative accuracy (LoRA - base probe), %")
    ax.set_title(f"Pearson r = {r:+.2f} (n = {len(names)}, permutation p = {p:.2f})", fontsize=9)
    return fig


def render_markdown(results: Mapping[str, Any], grid: GridConfig) -> str:
    """The results as markdown: Table 2 layout, coefficients, single accuracies, analyses."""
    rec = results["merges"]
    tc = results["train_config"]
    names = [t["name"] for t in results["tasks"]]
    lines = [
        f"# netutility demo ({results['preset']})",
        "",
        f"{len(names)} tasks: {', '.join(names)}. MiniLM-L6 + LoRA r={tc['lora_rank']}, "
        f"alpha={tc['lora_alpha']:g} on q, k, v, o of 6 layers (full capacity M r = "
        f"{len(names) * tc['lora_rank']}). Geometry: h = {results['heterogeneity']:.2f} -> "
        f"alpha = {results['alpha']:g}; lambda = {results['lambda']:.3g} (median rule).",
        "",
        "## Normalized accuracy (%): merged / single-LoRA x 100, mean over tasks (test)",
        "",
        format_table(table_rows(rec, grid), grid.budgets),
        "",
        "TA is identical in every space (merged once). † identical to the Full row (TSV, Iso-C and "
        "Iso-C + TSV are the same operator in full and Core space; computed once). Unif.: each "
        "task keeps an equal share of its top directions per module; Ours: net-utility allocation "
        "(global budget for TA/TSV/Iso-C, per module for TIES/DARE), positive utilities only. "
        f"Test: {results['grid']['eval_texts']['test']} texts "
        f"({grid.test_per_task or 'all'} per task).",
    ]
    if "ta/full/all" in rec:
        a = rec["ta/full/all"]
        lines += [
            "",
            f"Reference, TA with every component (no budget): {a['normalized']:.1f} "
            f"(coef {a['coef']:g}).",
        ]
    lines += [
        "",
        "## Merge coefficients chosen on validation (Unif. / Ours)",
        "",
        format_coef_table(rec, grid),
        "",
        "Candidates per method: "
        + "; ".join(f"{METHODS[m].label} {list(METHODS[m].coefs)}" for m in grid.methods)
        + f", widened by up to {grid.coef_extend} grid step(s) when the best is at an edge, then "
        f"{grid.coef_refine} geometric midpoint(s) next to the best; scored by "
        f"mean normalized accuracy on {results['grid']['eval_texts']['val']} validation texts "
        f"({grid.val_per_task} per task). Test labels are never used to choose.",
        "",
        "## Single-LoRA accuracies (test)",
        "",
        "| Task | LoRA | base + LoRA head | base linear probe | relative | mean net utility |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        s = results["single"][n]
        lines.append(
            f"| {n} | {100 * s['test_accuracy']:.1f} | {100 * s['base_with_task_head']:.1f} | "
            f"{100 * s['base_linear_probe']:.1f} | {100 * s['relative_accuracy']:+.1f} | "
            f"{s['mean_net_utility']:.3g} |"
        )
    an = results["analyses"]
    lines += [
        "",
        "## Budget spent with positive-only admission (TA, full space)",
        "",
        "| R | Uniform | Ours | used (avg per module) | unspent | Δ |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for s in an["budget_spent"]:
        lines.append(
            f"| {s['budget']} | {_num(s['uniform'])} | {_num(s['ours'])} | {s['used_avg']:.1f} | "
            f"{100 * s['unspent_fraction']:.1f}% | {_delta(s['uniform'], s['ours'])} |"
        )
    npf = an["non_prefix_fraction"]
    uv = an["utility_vs_accuracy"]
    lines += [
        "",
        f"At R = {len(names) * tc['lora_rank']} (full capacity) uniform keeps every component, "
        "the same as the reference row.",
        "",
        "## Non-prefix kept sets (net utility)",
        "",
        "Fraction of per-(module, task) kept sets that are not a prefix of the task's spectrum:",
        "",
    ]
    lines += [f"- {k}: {100 * v:.1f}%" for k, v in npf.items()]
    lines += [
        "",
        "## Mean net utility vs relative accuracy",
        "",
        f"Pearson r = {uv['pearson_r']:+.2f} over n = {uv['n']} tasks (two-sided permutation "
        f"p = {uv['permutation_p']:.2f}); relative accuracy = LoRA test accuracy - base linear "
        f"probe accuracy. Against base + LoRA head instead: r = "
        f"{uv['pearson_r_vs_base_with_task_head']:+.2f} (p = "
        f"{uv['permutation_p_vs_base_with_task_head']:.2f}). The paper reports -0.78 on 7 MATH "
        "topics; with 7 points either sign is within noise unless p is small.",
        "",
        "## Figures",
        "",
        f"- budget_heatmap.png: directions kept per layer x module (TA, net utility, "
        f"R = {an['kept_per_module']['budget']})",
        "- kept_per_task.png, prefix_retention.png, utility_distribution.png, "
        "utility_vs_accuracy.png",
        "",
        "## Timings (wall clock; other processes may share the CPUs)",
        "",
    ]
    tm = results["timings"]
    for t, info in results["training"].items():
        how = (
            "cached"
            if info["cache_hit"]
            else f"trained {info['steps']} steps, {info['steps_per_second']:.2f} steps/s"
        )
        lines.append(
            f"- train {t}: {how} (training took {info['train_seconds']:.0f} s; best val "
            f"{info['best_val_accuracy']:.3f} at step {info['best_step']})"
        )
    lines += [
        f"- training total: {tm['training_seconds']:.0f} s; single-LoRA evaluation "
        f"{tm['single_eval_seconds']:.0f} s",
        f"- merge grid: {tm['grid_seconds']:.0f} s for {len(rec)} distinct merges "
        f"({tm['forward_passes']} forward passes in all, "
        f"{tm['forward_padded_tokens'] / max(tm['forward_seconds'], 1e-9):.0f} tokens/s)",
        f"- total: {tm['total_seconds']:.0f} s",
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- outputs


def existing_results(out: pathlib.Path) -> list[pathlib.Path]:
    return [out / f for f in RESULT_FILES if (out / f).exists()]


def write_outputs(exp: Experiment, out: str | os.PathLike, *, overwrite: bool = False) -> list[str]:
    """Write results.json, results.md and the figures into ``out``, each atomically.

    Everything is rendered into a temporary directory inside ``out`` first, then each file is
    renamed into place.

    Raises:
      DemoError: (code 1) a result file exists and ``overwrite`` is False.
    """
    out = pathlib.Path(out)
    existing = existing_results(out)
    if existing and not overwrite:
        raise _exists_error(out, existing)
    out.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".netutility-demo.", suffix=".tmp", dir=out))
    written = []
    try:
        (tmp / "results.json").write_text(
            json.dumps(_jsonable(exp.results), indent=1, allow_nan=True) + "\n"
        )
        (tmp / "results.md").write_text(exp.markdown)
        for name, fig in exp.figures.items():
            fig.savefig(tmp / name, format="png", dpi=150)
        for name in RESULT_FILES:
            if (tmp / name).exists():
                os.replace(tmp / name, out / name)
                written.append(str(out / name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return written


def _exists_error(out: pathlib.Path, existing: Sequence[pathlib.Path]) -> DemoError:
    more = f" (and {len(existing) - 1} other result file(s))" if len(existing) > 1 else ""
    return DemoError(
        f"{existing[0]} already exists{more}; pass --overwrite to replace the results or choose "
        "another --out",
        code=1,
    )


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return x


# ----------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``netutility demo`` options to ``parser``."""
    parser.add_argument(
        "--alpha",
        type=float_or_auto,
        default="auto",
        help="scoring geometry: auto (the paper's heterogeneity rule, default), 1 (Gram) or 0 "
        "(row space)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="short training and a reduced grid (TA, TIES, TSV x full, core x R=16); about 10 "
        "minutes on a 2-core CPU from an empty cache",
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"directory for results.json, results.md and figures (default: ./{DEFAULT_OUT})",
    )
    parser.add_argument(
        "--task",
        action="append",
        default=[],
        metavar="NAME=PATH.csv",
        help="add a task of your own from a CSV with columns text,label (repeatable)",
    )
    parser.add_argument(
        "--tasks",
        default=None,
        metavar="A,B,C",
        help="run only these tasks (built-in names and --task names); default: all built-in "
        f"tasks ({', '.join(tk.BUILTIN_TASKS)}) plus every --task",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help=f"trained-adapter cache (default: ${tr.CACHE_ENV} or {tr.DEFAULT_CACHE_DIR})",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the data splits, training and DARE"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace existing result files in --out"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def run(args: argparse.Namespace) -> int:
    """Run ``netutility demo`` with parsed arguments; returns the exit code."""
    try:
        return _run(args)
    except DemoError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.code


def _run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if args.seed < 0:
        raise DemoError(f"--seed must be >= 0, got {args.seed}")
    out = pathlib.Path(args.out)
    existing = existing_results(out)
    if existing and not args.overwrite:
        raise _exists_error(out, existing)
    specs = task_args(args.task, args.tasks)
    check_data(specs)
    check_weights()
    preset = QUICK if args.quick else FULL
    task_list = load_tasks(specs, seed=args.seed)
    print(
        f"{PROG}: {preset.name} mode, {len(task_list)} tasks, cache "
        f"{args.cache_dir or tr.default_cache_dir()}",
        flush=True,
    )
    exp = run_experiment(
        task_list,
        preset,
        cache_dir=args.cache_dir,
        seed=args.seed,
        progress=not args.no_progress,
        log=lambda s: print(s, flush=True),
        alpha=args.alpha,
    )
    written = write_outputs(exp, out, overwrite=args.overwrite)
    res = exp.results
    print()
    print(format_table(table_rows(res["merges"], preset.grid), preset.grid.budgets))
    uv = res["analyses"]["utility_vs_accuracy"]
    print()
    print(
        f"h = {res['heterogeneity']:.2f} -> alpha = {res['alpha']:g}; lambda = {res['lambda']:.3g}; "
        f"mean net utility vs relative accuracy: r = {uv['pearson_r']:+.2f} (n = {uv['n']}, "
        f"p = {uv['permutation_p']:.2f})"
    )
    print(f"wall time {time.perf_counter() - t0:.0f} s; results in {out}/ ({len(written)} files)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m netutility_jax.experiments.demo [options]``."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train task LoRAs on MiniLM and compare uniform vs net-utility rank "
        "allocation across merge methods, spaces and budgets (the paper's Table 2).",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
