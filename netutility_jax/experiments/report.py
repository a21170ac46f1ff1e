"""Render a :class:`runner.Run`: statistics, ``results.json``, ``results.md`` and the figures.

Every number in the outputs is computed here from the run's per-text test correctness
(:mod:`stats`): normalized accuracies are means over seeds, each delta carries the bootstrap
interval over test texts (pooled over seeds) and the t interval over seeds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import platform
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import evaluate as ev
from . import grid as gr
from . import stats as st

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
N_BOOT = 2000


@dataclasses.dataclass
class Experiment:
    """What :func:`render` produced: JSON-ready results, markdown, figures, predictions."""

    results: dict[str, Any]
    markdown: str
    figures: dict[str, Any]
    predictions: dict[str, np.ndarray]


# ------------------------------------------------------------------------------------ numbers


def _fmt(x: float | None, nd: int = 1) -> str:
    return "–" if x is None or not np.isfinite(x) else f"{x:.{nd}f}"


def _delta_cell(s: st.Summary | None) -> str:
    """``+1.2 [0.4, 2.0]``: bold if the bootstrap interval excludes 0, ``‡`` if the seed
    interval does too."""
    if s is None:
        return "–"
    iv = s.pooled
    text = f"{iv.estimate:+.1f} [{iv.low:+.1f}, {iv.high:+.1f}]"
    if iv.excludes_zero():
        text = f"**{text}**"
    if s.seeds.excludes_zero():
        text += " ‡"
    return text


def _summary_dict(s: st.Summary) -> dict[str, Any]:
    return {
        "estimate": s.pooled.estimate,
        "bootstrap_ci": [s.pooled.low, s.pooled.high],
        "seed_ci": [s.seeds.low, s.seeds.high],
        "per_seed": s.per_seed.tolist(),
        "per_seed_bootstrap_ci": s.per_seed_ci.tolist(),
        "bootstrap_excludes_zero": s.pooled.excludes_zero(),
        "seeds_exclude_zero": s.seeds.excludes_zero(),
    }


class _Stats:
    """Normalized-accuracy draws of every job (and of zero-shot) over the shared resamples."""

    def __init__(self, run: Any):
        self.run = run
        self.bs = st.Bootstrap(run.test.task, n_boot=N_BOOT, seed=0)
        self.single = np.stack([s.single_correct for s in run.seeds])
        self._cache: dict[str, st.NormalizedDraws] = {}

    def draws(self, key: str) -> st.NormalizedDraws | None:
        if key not in self._cache:
            if key == "zero_shot":
                c = np.stack([s.zero_shot_correct for s in self.run.seeds])
            elif all(key in s.correct for s in self.run.seeds):
                c = np.stack([s.correct[key] for s in self.run.seeds])
            else:
                return None
            self._cache[key] = self.bs.normalized(c, self.single)
        return self._cache[key]

    def value(self, key: str) -> st.Summary | None:
        d = self.draws(key)
        return None if d is None else self.bs.interval(d)

    def delta(self, a: str, b: str) -> st.Summary | None:
        da, db = self.draws(a), self.draws(b)
        return None if da is None or db is None else self.bs.delta(da, db)

    def random_mean(self, prefix: str) -> st.NormalizedDraws | None:
        """The random control averaged over its draws (key prefix ``.../R16/random``)."""
        keys = sorted({k for s in self.run.seeds for k in s.correct if k.startswith(prefix)})
        ds = [self.draws(k) for k in keys]
        if not ds or any(d is None for d in ds):
            return None
        return st.NormalizedDraws(
            np.mean([d.observed for d in ds], 0),
            np.mean([d.boot for d in ds], 0),
            np.mean([d.per_task for d in ds], 0),
        )


def _main_rows(run: Any, sx: _Stats) -> list[dict[str, Any]]:
    grid = run.preset.grid
    spaces = grid.spaces
    rows = []
    for row in grid.rows:
        spec = gr.METHODS[row.method]
        canon = spec.canonical_space(row.space, spaces)
        cells = {}
        for r in row.budgets or grid.budgets:
            u, o = f"{row.method}/{canon}/R{r}/uniform", f"{row.method}/{canon}/R{r}/net_utility"
            cells[r] = {"uniform": sx.value(u), "ours": sx.value(o), "delta": sx.delta(o, u)}
        label = "all" if row.method == "ta" else gr.SPACE_LABELS[row.space]
        rows.append(
            {
                "space": label,
                "method": spec.label,
                "key": row.method,
                "shared": canon != row.space,
                "cells": cells,
            }
        )
    return rows


def format_main_table(rows: Sequence[Mapping[str, Any]], budgets: Sequence[int]) -> str:
    """The paper's Table 2 layout with a 95% interval on every delta.

    Example:
      >>> import numpy as np
      >>> s = st.Summary(np.array([2.0]), np.array([[1.0, 3.0]]), st.Interval(2.0, 1.0, 3.0),
      ...                st.Interval(2.0, float("nan"), float("nan")))
      >>> u = st.Summary(np.array([60.0]), np.array([[59, 61.0]]), st.Interval(60.0, 59, 61),
      ...                st.Interval(60.0, float("nan"), float("nan")))
      >>> o = u._replace(pooled=st.Interval(62.0, 61, 63))
      >>> print(format_main_table([{"space": "Full", "method": "TA",
      ...     "cells": {16: {"uniform": u, "ours": o, "delta": s}}}], [16]))
      | Space | Method | R=16 Unif. | R=16 Ours | R=16 Δ [95% CI] |
      |---|---|---:|---:|---:|
      | Full | TA | 60.0 | 62.0 | **+2.0 [+1.0, +3.0]** |
    """
    head = ["Space", "Method"]
    for r in budgets:
        head += [f"R={r} Unif.", f"R={r} Ours", f"R={r} Δ [95% CI]"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (3 * len(budgets))]
    for row in rows:
        cells = [row["space"], row["method"] + (" †" if row.get("shared") else "")]
        for r in budgets:
            c = row["cells"].get(r)
            if c is None:
                cells += ["", "", ""]
                continue
            u, o = c["uniform"], c["ours"]
            cells += [
                _fmt(None if u is None else u.pooled.estimate),
                _fmt(None if o is None else o.pooled.estimate),
                _delta_cell(c["delta"]),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- render


def render(run: Any) -> Experiment:
    """Statistics, results dict, markdown and figures of ``run``."""
    sx = _Stats(run)
    seeds = [s.seed for s in run.seeds]
    grid = run.preset.grid
    main_rows = _main_rows(run, sx)
    results: dict[str, Any] = {
        "preset": run.preset.name,
        "seeds": seeds,
        "command": None,
        "tasks": _task_info(run),
        "train_config": {
            k: v for k, v in dataclasses.asdict(run.preset.train).items() if k != "seed"
        },
        "grid": _jsonable(dataclasses.asdict(grid)),
        "methods": {
            m: {"label": s.label, "method": s.method, "options": dict(s.options), "start": s.start}
            for m, s in gr.METHODS.items()
        },
        "evaluation": {
            "row_len": ev.ROW_LEN,
            "temperature": ev.TEMPERATURE,
            "val_texts": len(run.val),
            "test_texts": len(run.test),
            "val_tokens": run.val.tokens,
            "test_tokens": run.test.tokens,
            "bootstrap_resamples": N_BOOT,
            "coefficient_grid": "0.1, 0.2, ..., 9.9 (ladder of doublings, then bisection)",
        },
        "scoring": {str(s.seed): s.scoring for s in run.seeds},
        "single": _single(run),
        "table": [
            {
                **{k: v for k, v in row.items() if k != "cells"},
                "cells": {
                    str(r): {k: None if v is None else _summary_dict(v) for k, v in c.items()}
                    for r, c in row["cells"].items()
                },
            }
            for row in main_rows
        ],
        "controls": _controls(run, sx),
        "per_task": _per_task(run, sx),
        "merges": {str(s.seed): s.records for s in run.seeds},
        "training": {str(s.seed): s.training for s in run.seeds},
        "analyses": _analyses(run, sx),
        "timings": {
            **run.seconds,
            "per_seed": {str(s.seed): s.seconds for s in run.seeds},
            "backbone": run.backbone,
        },
        "environment": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "jax": run.backbone.get("jax"),
            "netutility_jax": run.backbone.get("nu"),
            "note": "timings are wall clock; other processes may share the CPUs",
        },
    }
    figures = _figures(run, sx, results)
    predictions = _predictions(run)
    return Experiment(
        _jsonable(results), render_markdown(results, main_rows, grid), figures, predictions
    )


def _task_info(run: Any) -> list[dict[str, Any]]:
    return [
        {
            "name": t.name,
            "labels": list(t.labels),
            "label_texts": list(t.label_texts),
            "pair": bool(t.pair),
            "source": t.source,
            "train": len(t.train),
            "val": len(t.val),
            "test": len(t.test),
        }
        for t in run.tasks
    ]


def _single(run: Any) -> dict[str, Any]:
    out = {}
    for n in [t.name for t in run.tasks]:
        ind = [s.single_test[n] for s in run.seeds]
        zs = run.seeds[0].zero_shot_test[n]
        gap = [x - zs for x in ind]
        out[n] = {
            "zero_shot_test": zs,
            "zero_shot_val": run.seeds[0].zero_shot_val[n],
            "individual_test": st.seed_interval(ind)._asdict(),
            "individual_test_per_seed": ind,
            "individual_val_per_seed": [s.single_val[n] for s in run.seeds],
            "gap": st.seed_interval(gap)._asdict(),
            "zero_shot_normalized": st.seed_interval([100 * zs / x for x in ind])._asdict(),
            "chance": 1.0 / len(next(t for t in run.tasks if t.name == n).labels),
        }
    return out


def _controls(run: Any, sx: _Stats) -> dict[str, Any]:
    grid = run.preset.grid
    spaces = grid.spaces
    out: dict[str, Any] = {}
    zs = sx.value("zero_shot")
    avg = sx.value("average")
    out["zero_shot"] = None if zs is None else _summary_dict(zs)
    out["weight_average"] = None if avg is None else _summary_dict(avg)
    rows = {}
    for method, space in dict.fromkeys((*grid.random, *grid.no_budget)):
        spec = gr.METHODS[method]
        canon = spec.canonical_space(space, spaces)
        base = f"{method}/{canon}"
        row: dict[str, Any] = {"label": spec.label, "space": space}
        allv = sx.value(f"{base}/all")
        row["no_budget"] = None if allv is None else _summary_dict(allv)
        cells = {}
        for r in grid.budgets:
            u, o = f"{base}/R{r}/uniform", f"{base}/R{r}/net_utility"
            cell: dict[str, Any] = {}
            for name, key in (("uniform", u), ("ours", o)):
                v = sx.value(key)
                cell[name] = None if v is None else _summary_dict(v)
            rnd = sx.random_mean(f"{base}/R{r}/random")
            if rnd is not None:
                cell["random"] = _summary_dict(sx.bs.interval(rnd))
                cell["ours_minus_random"] = _summary_dict(sx.bs.delta(sx.draws(o), rnd))
                cell["random_minus_uniform"] = _summary_dict(sx.bs.delta(rnd, sx.draws(u)))
            if allv is not None and sx.draws(o) is not None:
                cell["ours_minus_no_budget"] = _summary_dict(sx.delta(o, f"{base}/all"))
            cells[str(r)] = cell
        row["cells"] = cells
        rows[base] = row
    out["rows"] = rows
    return out


def _per_task(run: Any, sx: _Stats) -> dict[str, Any]:
    """Per task and job: absolute test accuracy and normalized accuracy, means over seeds."""
    names = [t.name for t in run.tasks]
    keys = list(dict.fromkeys(k for s in run.seeds for k in s.records))
    out: dict[str, Any] = {}
    for k in [*keys, "zero_shot"]:
        d = sx.draws(k)
        if d is None:
            continue
        if k == "zero_shot":
            acc = [[s.zero_shot_test[n] for n in names] for s in run.seeds]
        else:
            acc = [[s.records[k]["test_accuracy"][n] for n in names] for s in run.seeds]
        acc = np.asarray(acc)
        out[k] = {
            n: {
                "accuracy": float(acc[:, i].mean()),
                "normalized": float(np.nanmean(d.per_task[:, i])),
            }
            for i, n in enumerate(names)
        }
    return out


def _analyses(run: Any, sx: _Stats) -> dict[str, Any]:
    grid = run.preset.grid
    names = [t.name for t in run.tasks]
    m_r = len(names) * run.preset.train.lora_rank
    budget_rows = []
    for r in sorted({*grid.budgets, *([m_r] if grid.full_capacity else [])}, reverse=True):
        key = f"ta/full/R{r}/net_utility"
        if not all(key in s.records for s in run.seeds):
            continue
        used = [s.records[key]["budget_spent"] for s in run.seeds]
        ukey = f"ta/full/R{r}/uniform" if r != m_r else "ta/full/all"
        row = {
            "budget": r,
            "used": st.seed_interval(used)._asdict(),
            "used_per_seed": used,
            "unspent_fraction": st.seed_interval([1 - u / r for u in used])._asdict(),
            "ours": _opt(sx.value(key)),
            "uniform": _opt(sx.value(ukey)),
            "uniform_key": ukey,
            "delta": _opt(sx.delta(key, ukey)),
        }
        budget_rows.append(row)
    non_prefix = {}
    keys = list(dict.fromkeys(k for s in run.seeds for k in s.records))
    for k in keys:
        vals = [s.records[k].get("non_prefix_fraction") for s in run.seeds if k in s.records]
        if k.endswith("/net_utility") and all(v is not None for v in vals):
            non_prefix[k] = {"per_seed": vals, **st.seed_interval(vals)._asdict()}
    corr = []
    for s in run.seeds:
        mnu = [s.scoring["mean_net_utility"][n] for n in names]
        rel = [s.single_test[n] - s.zero_shot_test[n] for n in names]
        corr.append({"seed": s.seed, **st.pearson(mnu, rel)._asdict()})
    mnu_mean = [np.mean([s.scoring["mean_net_utility"][n] for s in run.seeds]) for n in names]
    rel_mean = [np.mean([s.single_test[n] - s.zero_shot_test[n] for s in run.seeds]) for n in names]
    kept = {}
    for s in run.seeds:
        for m, v in s.kept_per_module.items():
            kept.setdefault(m, []).append(v)
    return {
        "budget_spent": budget_rows,
        "non_prefix_fraction": non_prefix,
        "utility_vs_accuracy": {
            "relative_to": "zero-shot (base model with the frozen heads)",
            "per_seed": corr,
            "seed_mean": st.pearson(mnu_mean, rel_mean)._asdict(),
            "mean_net_utility": dict(zip(names, map(float, mnu_mean), strict=True)),
            "relative_accuracy": dict(zip(names, map(float, rel_mean), strict=True)),
            "paper": -0.78,
        },
        "kept_per_module": {
            "budget": max(grid.budgets),
            "mean_over_seeds": {m: float(np.mean(v)) for m, v in kept.items()},
        },
        "retention_by_rank": {
            "budget": max(grid.budgets),
            "mean_over_seeds": np.mean([s.retention for s in run.seeds], 0).tolist(),
        },
    }


def _opt(s: st.Summary | None) -> dict[str, Any] | None:
    return None if s is None else _summary_dict(s)


def _predictions(run: Any) -> dict[str, np.ndarray]:
    out = {
        "task": run.test.task,
        "label": run.test.labels,
        "task_names": np.asarray(run.test.task_names),
    }
    for s in run.seeds:
        out[f"s{s.seed}/single"] = s.single_correct
        out[f"s{s.seed}/zero_shot"] = s.zero_shot_correct
        for k, v in s.correct.items():
            out[f"s{s.seed}/{k}"] = v
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


# ---------------------------------------------------------------------------------- markdown


def _iv(d: Mapping[str, Any] | None, nd: int = 1, pct: bool = False) -> str:
    """``m [lo, hi]`` of an interval dict (``estimate``/``low``/``high``)."""
    if d is None:
        return "–"
    k = 100 if pct else 1
    est = d.get("estimate")
    lo, hi = d.get("low"), d.get("high")
    if est is None:
        return "–"
    if lo is None or hi is None:
        return _fmt(k * est, nd)
    return f"{_fmt(k * est, nd)} [{_fmt(k * lo, nd)}, {_fmt(k * hi, nd)}]"


def _est(d: Mapping[str, Any] | None, nd: int = 1) -> str:
    return "–" if d is None else _fmt(d["estimate"], nd)


def _dcell(d: Mapping[str, Any] | None) -> str:
    if d is None:
        return "–"
    lo, hi = d["bootstrap_ci"]
    text = f"{d['estimate']:+.1f} [{lo:+.1f}, {hi:+.1f}]"
    if d["bootstrap_excludes_zero"]:
        text = f"**{text}**"
    if d["seeds_exclude_zero"]:
        text += " ‡"
    return text


def render_markdown(
    results: Mapping[str, Any], main_rows: Sequence[Any], grid: gr.GridConfig
) -> str:
    """The results as markdown (every table computed in :func:`render`)."""
    tasks = results["tasks"]
    names = [t["name"] for t in tasks]
    tc = results["train_config"]
    seeds = results["seeds"]
    evl = results["evaluation"]
    sc = results["scoring"]
    lams = [v["lam"] for v in sc.values()]
    alphas = sorted({v["alpha"] for v in sc.values()})
    hs = [v["heterogeneity"] for v in sc.values()]
    m_r = len(names) * tc["lora_rank"]
    n_seeds = len(seeds)
    lines = [
        f"# netutility demo ({results['preset']})",
        "",
        f"{len(names)} tasks: {', '.join(names)}. MiniLM-L6 with frozen zero-shot heads (cosine "
        f"similarity to the base model's embeddings of the label descriptions, temperature "
        f"{evl['temperature']:g}); only the LoRA trains (r={tc['lora_rank']}, "
        f"alpha={tc['lora_alpha']:g} on q, k, v, o of 6 layers; full capacity M r = {m_r}). "
        f"{n_seeds} training seed(s) ({', '.join(map(str, seeds))}); the same data splits for "
        f"every seed. Test: {evl['test_texts']} texts ({', '.join(str(t['test']) for t in tasks)} "
        f"per task); validation: {evl['val_texts']} texts (coefficient search, early stopping). "
        f"Geometry: h = {np.mean(hs):.2f} -> alpha = {', '.join(f'{a:g}' for a in alphas)}; "
        f"lambda = {np.mean(lams):.3g} (median rule; per seed {', '.join(f'{x:.3g}' for x in lams)}).",
        "",
        "## Normalized accuracy (%): merged / single-LoRA x 100, mean over tasks and seeds (test)",
        "",
        format_main_table(main_rows, grid.budgets),
        "",
        "Unif.: each task keeps an equal share of its top directions per module (the paper's "
        "baseline). Ours: Net Utility (global budget for TA, TSV and Iso-C, per module for TIES "
        "and DARE), positive utilities only. Δ = Ours - Unif. with its 95% paired bootstrap "
        f"interval over test texts ({N_BOOT} stratified resamples shared by every merge and seed), "
        f"for the mean over the {n_seeds} seed(s). **Bold**: that interval excludes 0. ‡: the t "
        "interval over seeds (training noise included) excludes 0 as well. TA is identical in "
        "every space; † rows are identical to their Full row (computed once).",
        "",
        "### Deltas per seed",
        "",
        "| Method | R | " + " | ".join(f"seed {s}" for s in seeds) + " | mean [bootstrap CI] | "
        "mean [seed t-interval] |",
        "|---|---:|" + "---:|" * (n_seeds + 2),
    ]
    for row in results["table"]:
        for r, c in row["cells"].items():
            d = c["delta"]
            if d is None:
                continue
            per = [
                f"{v:+.1f} [{lo:+.1f}, {hi:+.1f}]"
                for v, (lo, hi) in zip(d["per_seed"], d["per_seed_bootstrap_ci"], strict=True)
            ]
            lo_s, hi_s = d["seed_ci"]
            seed_iv = (
                f"{d['estimate']:+.1f} [{lo_s:+.1f}, {hi_s:+.1f}]"
                if lo_s is not None
                else f"{d['estimate']:+.1f}"
            )
            lines.append(
                f"| {row['space']} {row['method']} | {r} | " + " | ".join(per)
                + f" | {_dcell(d)} | {seed_iv} |"
            )  # fmt: skip
    lines += _controls_md(results, grid)
    lines += _single_md(results)
    lines += _per_task_md(results, grid)
    lines += _analyses_md(results, m_r)
    lines += _coef_md(results, grid)
    lines += _training_md(results)
    lines += _timings_md(results)
    return "\n".join(lines) + "\n"


def _controls_md(results, grid) -> list[str]:
    c = results["controls"]
    lines = ["", "## Controls: what the budget does", ""]
    zs, avg = c["zero_shot"], c["weight_average"]
    lines.append(
        f"Zero-shot model (frozen heads, no adapter): {_est(zs)} normalized. Weight average (TA "
        f"over every direction, coefficient 1/M, no search): {_est(avg)}. Each task's own "
        "LoRA: 100 by definition."
    )
    for row in c["rows"].values():
        lines += [
            "",
            f"### {row['label']} ({row['space']} space)",
            "",
            f"No budget (every direction, coefficient searched): {_est(row['no_budget'])}.",
            "",
            "| R | Uniform | Random (same count per module as Ours) | Ours | Ours - Random | "
            "Random - Uniform | Ours - No budget |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r, cell in row["cells"].items():
            lines.append(
                f"| {r} | {_est(cell.get('uniform'))} | {_est(cell.get('random'))} | "
                f"{_est(cell.get('ours'))} | {_dcell(cell.get('ours_minus_random'))} | "
                f"{_dcell(cell.get('random_minus_uniform'))} | "
                f"{_dcell(cell.get('ours_minus_no_budget'))} |"
            )
    if any("random" in cell for row in c["rows"].values() for cell in row["cells"].values()):
        lines += [
            "",
            f"Random: {grid.random_draws} draw(s) per seed and budget, averaged; the draws differ "
            "between seeds. Intervals as in the main table.",
        ]
    return lines


def _single_md(results) -> list[str]:
    lines = [
        "",
        "## Single LoRAs against zero-shot (test accuracy, %)",
        "",
        "| Task | labels (chance) | zero-shot | individual LoRA, mean over seeds [t-interval] | gap | "
        "zero-shot normalized |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for t in results["tasks"]:
        s = results["single"][t["name"]]
        zs = 100 * s["zero_shot_test"]
        near = " (near chance)" if s["zero_shot_test"] < s["chance"] + 0.05 else ""
        lines.append(
            f"| {t['name']} | {len(t['labels'])} ({100 * s['chance']:.0f}) | {zs:.1f}{near} | "
            f"{_iv(s['individual_test'], pct=True)} | {_iv(s['gap'], pct=True)} | "
            f"{_iv(s['zero_shot_normalized'])} |"
        )
    lines += [
        "",
        "Zero-shot heads (label descriptions): "
        + "; ".join(
            f"{t['name']}: " + ", ".join(f"{lab} = {txt!r}" for lab, txt in zip(t["labels"], t["label_texts"], strict=True))
            for t in results["tasks"]
        )
        + ".",
    ]  # fmt: skip
    return lines


def _per_task_md(results, grid) -> list[str]:
    pt = results["per_task"]
    names = [t["name"] for t in results["tasks"]]
    lines = [
        "",
        "## Per task (test): accuracy % / normalized %, means over seeds",
        "",
    ]
    head = "| Merge | " + " | ".join(names) + " | mean normalized |"
    lines += [head, "|---|" + "---:|" * (len(names) + 1)]

    def line(label, key):
        if key not in pt:
            return
        cells = [
            f"{100 * pt[key][n]['accuracy']:.1f} / {pt[key][n]['normalized']:.1f}" for n in names
        ]
        mean = np.mean([pt[key][n]["normalized"] for n in names])
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {mean:.1f} |")

    lines.append(
        "| individual LoRA | "
        + " | ".join(
            f"{100 * results['single'][n]['individual_test']['estimate']:.1f} / 100" for n in names
        )
        + " | 100 |"
    )
    line("zero-shot", "zero_shot")
    line("weight average", "average")
    spaces = grid.spaces
    for row in grid.rows:
        spec = gr.METHODS[row.method]
        canon = spec.canonical_space(row.space, spaces)
        if canon != row.space:
            continue
        line(f"{spec.label} {canon}, no budget", f"{row.method}/{canon}/all")
        for r in row.budgets or grid.budgets:
            for alloc, lab in (("uniform", "Unif."), ("net_utility", "Ours")):
                line(f"{spec.label} {canon} R={r} {lab}", f"{row.method}/{canon}/R{r}/{alloc}")
    return lines


def _analyses_md(results, m_r) -> list[str]:
    an = results["analyses"]
    lines = [
        "",
        "## Budget spent with positive-only admission (TA, full space)",
        "",
        "| R | Uniform | Ours | Δ [95% CI] | used per module [seed t-interval] | unspent |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in an["budget_spent"]:
        lines.append(
            f"| {row['budget']} | {_est(row['uniform'])} | {_est(row['ours'])} | "
            f"{_dcell(row['delta'])} | {_iv(row['used'])} | {_iv(row['unspent_fraction'], pct=True)}% |"
        )
    lines += [
        "",
        f"At R = {m_r} (full capacity) the uniform allocation keeps every direction: its column "
        "is the no-budget TA.",
        "",
        "## Non-prefix kept sets (Net Utility)",
        "",
        "Share of per-(module, task) kept sets that are not a prefix of the task's spectrum, mean "
        "over seeds [t-interval]:",
        "",
        "| Merge | non-prefix |",
        "|---|---:|",
    ]
    for k, v in an["non_prefix_fraction"].items():
        lines.append(f"| {k} | {_iv(v, pct=True)}% |")
    uv = an["utility_vs_accuracy"]
    sm = uv["seed_mean"]
    lines += [
        "",
        "## Mean net utility vs relative accuracy",
        "",
        "Relative accuracy = individual LoRA accuracy - zero-shot accuracy (test), per task. "
        "Pearson r with its Fisher-z 95% interval and the exact permutation p-value:",
        "",
        "| | r | 95% CI | p | n |",
        "|---|---:|---:|---:|---:|",
    ]
    for c in uv["per_seed"]:
        lines.append(
            f"| seed {c['seed']} | {_fmt(c['r'], 2)} | [{_fmt(c['low'], 2)}, {_fmt(c['high'], 2)}] | "
            f"{_fmt(c['p'], 3)} | {c['n']} |"
        )
    lines.append(
        f"| means over seeds | {_fmt(sm['r'], 2)} | [{_fmt(sm['low'], 2)}, {_fmt(sm['high'], 2)}] | "
        f"{_fmt(sm['p'], 3)} | {sm['n']} |"
    )
    lines += [
        "",
        f"The paper reports {uv['paper']} on 7 MATH topics. With 7 tasks an interval this wide "
        "is all the data can give; read the sign only where the interval excludes 0.",
        "",
        "## Figures",
        "",
        f"- `budget_heatmap.png`: directions kept per layer x module (TA, Net Utility, "
        f"R = {an['kept_per_module']['budget']}, mean over seeds)",
        "- `deltas.png`: every Δ with its interval; `training_curves.png`: loss and validation "
        "curves per task and seed",
        "- `kept_per_task.png`, `prefix_retention.png`, `utility_distribution.png` (seed "
        "shown in the title), `utility_vs_accuracy.png`",
    ]
    return lines


def _coef_md(results, grid) -> list[str]:
    merges = results["merges"]
    seeds = list(merges)
    keys = [k for k in merges[seeds[0]]]
    lines = [
        "",
        "## Merge coefficients chosen on validation (per seed)",
        "",
        "| Merge | " + " | ".join(f"seed {s}" for s in seeds) + " | validation scores per seed |",
        "|---|" + "---:|" * len(seeds) + "---:|",
    ]
    for k in keys:
        cs = [merges[s][k]["coef"] if k in merges[s] else None for s in seeds]
        n = [len(merges[s][k]["val_scores"]) if k in merges[s] else 0 for s in seeds]
        lines.append(
            f"| {k} | " + " | ".join("–" if c is None else f"{c:g}" for c in cs)
            + f" | {', '.join(map(str, n))} |"
        )  # fmt: skip
    lines += [
        "",
        "Search: the grid 0.1, 0.2, ..., 9.9 (the Core Space code's linear search step), a ladder "
        "of doublings from the method's start (or the coefficient chosen last for the same "
        "method and space in the seed), then bisection of the bracket; scored by mean normalized "
        "accuracy on the validation texts. Test labels are never used to choose.",
    ]
    return lines


def _training_md(results) -> list[str]:
    tc = results["train_config"]
    lines = [
        "",
        "## Training",
        "",
        f"AdamW (optax), peak learning rate {tc['learning_rate']:g}, {100 * tc['warmup_fraction']:g}% "
        f"linear warmup, cosine decay to 0 at {tc['max_steps']} steps, weight decay "
        f"{tc['weight_decay']:g}; a step packs {tc['rows']} x {tc['row_len']} tokens; validation "
        f"accuracy every {tc['eval_every']} steps, the best adapter kept, early stopping after "
        f"{tc['patience']} evaluations without improvement.",
        "",
        "| Task | seed | steps | best step | best val acc | stopped early | train s | tokens/s |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for seed, per in results["training"].items():
        for name, i in per.items():
            lines.append(
                f"| {name} | {seed} | {i['steps']} | {i['best_step']} | "
                f"{100 * i['best_val_accuracy']:.1f} | {'yes' if i['stopped_early'] else 'no'} | "
                f"{i['train_seconds']:.0f} | {_fmt(i['tokens_per_second'], 0)} |"
            )
    return lines


def _timings_md(results) -> list[str]:
    tm = results["timings"]
    bb = tm["backbone"]
    hits = sum(
        r.get("cache_hit", False) for per in results["merges"].values() for r in per.values()
    )
    total = sum(len(per) for per in results["merges"].values())
    return [
        "",
        "## Timings (wall clock; other processes may share the CPUs)",
        "",
        f"- total {tm['total']:.0f} s: training {tm['training']:.0f} s, merge grid {tm['grid']:.0f} s "
        f"({total} merges, {hits} from the job cache)",
        f"- evaluation forward: {bb['passes']} passes, {bb['tokens']} real tokens "
        f"({bb['slot_tokens']} computed, packing), {_fmt(bb['tokens_per_second'], 0)} tokens/s",
        f"- machine: {results['environment']['cpus']} CPUs, {results['environment']['machine']}, "
        f"jax {results['environment']['jax']}",
        "",
    ]


# ------------------------------------------------------------------------------------ figures


def _figures(run: Any, sx: _Stats, results: Mapping[str, Any]) -> dict[str, Any]:
    import netutility_jax as nu

    names = [t.name for t in run.tasks]
    top = max(run.preset.grid.budgets)
    s0 = run.seeds[0]
    kept = results["analyses"]["kept_per_module"]["mean_over_seeds"]
    heat_masks = {}
    m_tasks = len(names)
    for m, v in kept.items():  # a mask per module whose kept count is the seed mean (rounded)
        mk = np.zeros((m_tasks, max(math.ceil(v / m_tasks) + 1, 1)), bool)
        mk.ravel()[: round(v)] = True
        heat_masks[m] = mk
    figs = {
        "budget_heatmap.png": nu.plots.budget_heatmap(
            heat_masks,
            title=f"Directions kept per layer x module (TA, Net Utility, R={top}, mean of "
            f"{len(run.seeds)} seed(s))",
        ),
        "kept_per_task.png": nu.plots.kept_per_task(
            s0.masks,
            names,
            title=f"Directions kept per task (Net Utility, R={top}, seed {s0.seed})",
        ),
        "prefix_retention.png": nu.plots.prefix_retention(
            s0.masks, s0.scores, title=f"Retention by rank (Net Utility, R={top}, seed {s0.seed})"
        ),
        "utility_distribution.png": nu.plots.utility_distribution(s0.scores, s0.masks, names),
        "utility_vs_accuracy.png": _scatter(results),
        "deltas.png": _forest(results),
        "training_curves.png": _curves(results),
    }
    return figs


def _canvas(figsize):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _scatter(results):
    uv = results["analyses"]["utility_vs_accuracy"]
    fig = _canvas((5.4, 3.8))
    ax = fig.add_subplot()
    names = list(uv["mean_net_utility"])
    for c, seed in zip(uv["per_seed"], results["seeds"], strict=True):
        x = [results["scoring"][str(seed)]["mean_net_utility"][n] for n in names]
        y = [
            100 * (results["single"][n]["individual_test_per_seed"][results["seeds"].index(seed)]
                   - results["single"][n]["zero_shot_test"])
            for n in names
        ]  # fmt: skip
        ax.scatter(x, y, s=14, alpha=0.6, label=f"seed {seed} (r = {_fmt(c['r'], 2)})")
    for n in names:
        ax.annotate(
            n, (uv["mean_net_utility"][n], 100 * uv["relative_accuracy"][n]), fontsize=6,
            xytext=(3, 3), textcoords="offset points",
        )  # fmt: skip
    sm = uv["seed_mean"]
    ax.set_xlabel("mean net utility of the task's directions")
    ax.set_ylabel("relative accuracy (LoRA - zero-shot), %")
    ax.set_title(
        f"seed means: r = {_fmt(sm['r'], 2)} [{_fmt(sm['low'], 2)}, {_fmt(sm['high'], 2)}], "
        f"p = {_fmt(sm['p'], 2)}, n = {sm['n']}",
        fontsize=8,
    )
    ax.legend(fontsize=6)
    return fig


def _forest(results):
    items = []
    for row in results["table"]:
        for r, c in row["cells"].items():
            if c["delta"] is not None:
                items.append((f"{row['space']} {row['method']} R={r}", c["delta"]))
    for row in results["controls"]["rows"].values():
        for r, c in row["cells"].items():
            if c.get("ours_minus_random") is not None:
                items.append((f"{row['label']} R={r}: Ours - Random", c["ours_minus_random"]))
    fig = _canvas((6.0, 0.25 * len(items) + 1.0))
    ax = fig.add_subplot()
    for i, (_, d) in enumerate(items):
        lo, hi = d["bootstrap_ci"]
        slo, shi = d["seed_ci"]
        y = len(items) - 1 - i
        if slo is not None and shi is not None:
            ax.plot([slo, shi], [y, y], color="0.75", lw=5, solid_capstyle="butt")
        ax.plot([lo, hi], [y, y], color="C0", lw=2)
        ax.plot(d["estimate"], y, "o", color="C3" if d["bootstrap_excludes_zero"] else "C0", ms=4)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(items)), [lab for lab, _ in reversed(items)], fontsize=6)
    ax.set_xlabel("Δ normalized accuracy, points (blue: bootstrap 95% CI; grey: seed t-interval)")
    return fig


def _curves(results):
    training = results["training"]
    seeds = list(training)
    names = list(training[seeds[0]])
    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    fig = _canvas((3.2 * cols, 2.4 * rows))
    for i, n in enumerate(names):
        ax = fig.add_subplot(rows, cols, i + 1)
        ax2 = ax.twinx()
        for j, s in enumerate(seeds):
            h = training[s][n]["history"]
            steps = [e["step"] for e in h]
            ax.plot(steps, [100 * e["val_accuracy"] for e in h], color=f"C{j}", lw=1.2)
            ax2.plot(steps, [e["train_loss"] for e in h], color=f"C{j}", lw=0.8, ls=":")
            ax2.plot(steps, [e["val_loss"] for e in h], color=f"C{j}", lw=0.8, ls="--")
            ax.axvline(training[s][n]["best_step"], color=f"C{j}", lw=0.5, alpha=0.5)
        zs = 100 * results["single"][n]["zero_shot_val"]
        ax.axhline(zs, color="k", lw=0.6, ls="-.")
        ax.set_title(n, fontsize=8)
        ax.set_xlabel("step", fontsize=7)
        ax.set_ylabel("val acc % (solid)", fontsize=7)
        ax2.set_ylabel("loss (train dotted, val dashed)", fontsize=6)
        ax.tick_params(labelsize=6)
        ax2.tick_params(labelsize=6)
    return fig


# ------------------------------------------------------------------------------------- output


def existing_results(out: pathlib.Path) -> list[pathlib.Path]:
    return [out / f for f in RESULT_FILES if (out / f).exists()]


def write_outputs(exp: Experiment, out: str | os.PathLike, *, overwrite: bool = False) -> list[str]:
    """Write results.json, results.md, predictions.npz and the figures into ``out``, each
    atomically (rendered into a temporary directory inside ``out``, then renamed into place).

    Raises:
      FileExistsError: a result file exists and ``overwrite`` is False.
    """
    out = pathlib.Path(out)
    existing = existing_results(out)
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} already exists")
    out.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".netutility-demo.", suffix=".tmp", dir=out))
    written = []
    try:
        (tmp / "results.json").write_text(json.dumps(exp.results, indent=1) + "\n")
        (tmp / "results.md").write_text(exp.markdown)
        np.savez_compressed(tmp / "predictions.npz", **exp.predictions)
        for name, fig in exp.figures.items():
            fig.savefig(tmp / name, format="png", dpi=130)
        for name in RESULT_FILES:
            if (tmp / name).exists():
                os.replace(tmp / name, out / name)
                written.append(str(out / name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return written
