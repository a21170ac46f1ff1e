"""The numbers of the report: every table's statistics of a :class:`runner.Run`, JSON-ready.

Everything is computed from the run's per-text test correctness (:mod:`stats`): normalized
accuracies are means over seeds, each delta carries the bootstrap interval over test texts
(pooled over seeds) and the t interval over seeds. :func:`collect` assembles the ``results``
dict that ``results.json`` holds and that :mod:`report_markdown` and :mod:`report_figures`
read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import grid as gr
from . import records
from . import stats as st

__all__ = [
    "N_BOOT",
    "Stats",
    "collect",
    "eval_key_digest",
    "evaluation",
    "main_rows",
    "predictions",
    "summary_dict",
    "task_info",
    "train_config",
    "train_data_digest",
]

N_BOOT = 2000


def summary_dict(s: st.Summary | None) -> dict[str, Any] | None:
    """A :class:`stats.Summary` as a JSON-ready dict (None stays None)."""
    if s is None:
        return None
    return {
        "estimate": s.pooled.estimate,
        "bootstrap_ci": [s.pooled.low, s.pooled.high],
        "seed_ci": [s.seeds.low, s.seeds.high],
        "per_seed": s.per_seed.tolist(),
        "per_seed_bootstrap_ci": s.per_seed_ci.tolist(),
        "bootstrap_excludes_zero": s.pooled.excludes_zero(),
        "seeds_exclude_zero": s.seeds.excludes_zero(),
    }


class Stats:
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
        draw = re.compile(re.escape(prefix) + r"\d+")  # (not ``<prefix>_split1``)
        keys = sorted({k for s in self.run.seeds for k in s.correct if draw.fullmatch(k)})
        ds = [self.draws(k) for k in keys]
        if not ds or any(d is None for d in ds):
            return None
        return st.NormalizedDraws(
            np.mean([d.observed for d in ds], 0),
            np.mean([d.boot for d in ds], 0),
            np.mean([d.per_task for d in ds], 0),
        )


def main_rows(run: Any, sx: Stats) -> list[dict[str, Any]]:
    """The rows of the main table: per grid row, its label and per budget the uniform and Net
    Utility values and their delta (:class:`stats.Summary` objects)."""
    grid = run.preset.grid
    spaces = grid.spaces
    rows = []
    for row in grid.rows:
        spec = gr.METHODS[row.method]
        canon = spec.canonical_space(row.space, spaces)
        label = "all" if row.method == "ta" else gr.SPACE_LABELS[row.space]
        if any(r["key"] == row.method and r["space"] == label for r in rows):
            continue  # the same merge under the same label (TA, "all", in several spaces)
        cells = {}
        for r in row.budgets or grid.budgets:
            u, o = f"{row.method}/{canon}/R{r}/uniform", f"{row.method}/{canon}/R{r}/net_utility"
            cells[r] = {"uniform": sx.value(u), "ours": sx.value(o), "delta": sx.delta(o, u)}
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


def collect(
    run: Any, sx: Stats, rows: list[dict[str, Any]], suite: Any, *, command: str | None = None
) -> dict[str, Any]:
    """The ``results`` dict of ``run`` (``rows``: :func:`main_rows`; ``suite``: a
    ``report.SuiteReport``, which gives the suite's evaluation settings and fields; ``command``:
    what produced the run, None for a Python call).

    Every result records its suite, command, commit and versions; ``results["summary"]`` is the
    main table as flat records (what the console prints; nothing parses the markdown back)."""
    grid = run.preset.grid
    table = [
        {
            **{k: v for k, v in row.items() if k != "cells"},
            "cells": {
                str(r): {k: summary_dict(v) for k, v in c.items()} for r, c in row["cells"].items()
            },
        }
        for row in rows
    ]
    return {
        "suite": run.suite,
        "preset": run.preset.name,
        "seeds": [s.seed for s in run.seeds],
        "command": command,
        # seeds read from earlier runs (seeds.load), each with its own command and commit
        "seeds_from": list(getattr(run, "seeds_from", []) or []),
        "commit": run.commit if run.commit is not None else records.commit(),
        "versions": records.versions(),
        "summary": _summary(table, len(run.seeds), len(run.test)),
        "tasks": task_info(run),
        "train_config": train_config(run),
        "grid": records.to_jsonable(dataclasses.asdict(grid)),
        "alpha_arg": run.alpha_arg,
        # hashes of the validation and test sets (what a job's cache key holds of them), of the
        # suite's evaluation key (model weights, code versions) and of the training data
        "texts": getattr(run, "fingerprint", None),
        "eval_key": eval_key_digest(run),
        "train_data": train_data_digest(run),
        "methods": {
            m: {"label": s.label, "method": s.method, "options": dict(s.options), "start": s.start}
            for m, s in gr.METHODS.items()
        },
        "evaluation": evaluation(run, suite),
        "scoring": {str(s.seed): s.scoring for s in run.seeds},
        "single": _single(run),
        "table": table,
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
        **suite.fields(run),
    }


def _summary(table: list[dict[str, Any]], n_seeds: int, n_test: int) -> list[dict[str, Any]]:
    """The main table as one record per (row, budget): uniform and Net Utility normalized
    accuracy, their delta with its bootstrap and seed intervals, and the sizes they rest on."""
    out = []
    for row in table:
        for r, c in row["cells"].items():
            d = c["delta"]
            out.append(
                {
                    "space": row["space"],
                    "method": row["method"],
                    "budget": int(r),
                    "uniform": None if c["uniform"] is None else c["uniform"]["estimate"],
                    "net_utility": None if c["ours"] is None else c["ours"]["estimate"],
                    "delta": None if d is None else d["estimate"],
                    "bootstrap_ci": None if d is None else d["bootstrap_ci"],
                    "seed_ci": None if d is None else d["seed_ci"],
                    "bootstrap_excludes_zero": None if d is None else d["bootstrap_excludes_zero"],
                    "seeds": n_seeds,
                    "test_examples": n_test,
                }
            )
    return out


def evaluation(run: Any, suite: Any) -> dict[str, Any]:
    """``results["evaluation"]``: the texts and tokens evaluated, the bootstrap and coefficient
    grid, and the suite's own settings (``suite``: a ``report.SuiteReport``)."""
    common = {
        "val_texts": len(run.val),
        "test_texts": len(run.test),
        "val_tokens": run.val.tokens,
        "test_tokens": run.test.tokens,
        "bootstrap_resamples": N_BOOT,
        "coefficient_grid": "0.1, 0.2, ..., 9.9 (ladder of doublings, then bisection)",
    }
    return suite.evaluation(run, common)


def eval_key_digest(run: Any) -> str | None:
    """sha256 of the suite's evaluation key (``suite.eval_key``: the model's weights or files,
    code versions, evaluation settings; part of every job's cache key), or None without one."""
    key = getattr(run, "eval_key", None)
    if key is None:
        return None
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def train_data_digest(run: Any) -> str | None:
    """sha256 of every task's training texts and labels, or None when a task's training split
    is not texts (the vision suite's images; it trains nothing)."""
    h = hashlib.sha256()
    for t in run.tasks:
        split = getattr(t, "train", None)
        texts = getattr(split, "texts", None)
        if texts is None:
            return None
        h.update(json.dumps([t.name, list(texts)]).encode())
        h.update(np.ascontiguousarray(np.asarray(split.labels, np.int64)).tobytes())
    return h.hexdigest()


def train_config(run: Any) -> dict[str, Any]:
    """``results["train_config"]``: the preset's training settings, the seed left out."""
    return {k: v for k, v in dataclasses.asdict(run.preset.train).items() if k != "seed"}


def task_info(run: Any) -> list[dict[str, Any]]:
    """``results["tasks"]``: each task's name, labels, source and split sizes."""
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
        zs_seed = [s.zero_shot_test[n] for s in run.seeds]
        # each seed against its own zero-shot (the same for every seed with frozen heads; one
        # per seed where the heads are trained with the LoRA, as in language_head)
        gap = [x - z for x, z in zip(ind, zs_seed, strict=True)]
        out[n] = {
            "zero_shot_test": float(np.mean(zs_seed)),
            "zero_shot_val": float(np.mean([s.zero_shot_val[n] for s in run.seeds])),
            "zero_shot_test_per_seed": [s.zero_shot_test[n] for s in run.seeds],
            "zero_shot_val_per_seed": [s.zero_shot_val[n] for s in run.seeds],
            "individual_test": st.seed_interval(ind)._asdict(),
            "individual_test_per_seed": ind,
            "individual_val_per_seed": [s.single_val[n] for s in run.seeds],
            "gap": st.seed_interval(gap)._asdict(),
            "zero_shot_normalized": st.seed_interval(
                [100 * z / x for x, z in zip(ind, zs_seed, strict=True)]
            )._asdict(),
            "chance": 1.0 / len(next(t for t in run.tasks if t.name == n).labels),
        }
    return out


def _controls(run: Any, sx: Stats) -> dict[str, Any]:
    grid = run.preset.grid
    spaces = grid.spaces
    out: dict[str, Any] = {
        "zero_shot": summary_dict(sx.value("zero_shot")),
        "weight_average": summary_dict(sx.value("average")),
    }
    rows = {}
    pairs = (*grid.random, *grid.no_budget, *((m, s) for m, s, _ in grid.controls))
    for method, space in dict.fromkeys(pairs):
        spec = gr.METHODS[method]
        base = f"{method}/{spec.canonical_space(space, spaces)}"
        allv = sx.value(f"{base}/all")
        variants = [v for m, s, v in grid.controls if (m, s) == (method, space)]
        rows[base] = {
            "label": spec.label,
            "space": space,
            "no_budget": summary_dict(allv),
            "cells": {
                str(r): _control_cell(sx, base, r, allv is not None, variants) for r in grid.budgets
            },
        }
    out["rows"] = rows
    return out


def _control_cell(
    sx: Stats, base: str, r: int, no_budget: bool, variants: Sequence[str] = ()
) -> dict[str, Any]:
    """The controls of ``base`` (``method/space``) at budget ``r``: uniform, ours, the random
    allocation (mean of its draws) and the deltas between them and to no budget; under
    ``"variants"`` each control of ``variants`` (``grid.VARIANTS`` names) with Ours minus it and
    it minus Uniform."""
    u, o = f"{base}/R{r}/uniform", f"{base}/R{r}/net_utility"
    cell: dict[str, Any] = {"uniform": summary_dict(sx.value(u)), "ours": summary_dict(sx.value(o))}
    rnd = sx.random_mean(f"{base}/R{r}/random")
    if rnd is not None:
        cell["random"] = summary_dict(sx.bs.interval(rnd))
        cell["ours_minus_random"] = summary_dict(sx.bs.delta(sx.draws(o), rnd))
        cell["random_minus_uniform"] = summary_dict(sx.bs.delta(rnd, sx.draws(u)))
    if no_budget and sx.draws(o) is not None:
        cell["ours_minus_no_budget"] = summary_dict(sx.delta(o, f"{base}/all"))
    out = {}
    for name in variants:
        key = f"{base}/R{r}/{name}"
        d = sx.random_mean(key) if gr.VARIANTS[name].draws else sx.draws(key)
        if d is None or sx.draws(o) is None:
            continue
        out[name] = {
            "label": gr.VARIANTS[name].label,
            "value": summary_dict(sx.bs.interval(d)),
            "ours_minus": summary_dict(sx.bs.delta(sx.draws(o), d)),
            "minus_uniform": summary_dict(sx.bs.delta(d, sx.draws(u))),
        }
    if out:
        cell["variants"] = out
    return cell


def _per_task(run: Any, sx: Stats) -> dict[str, Any]:
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


def _analyses(run: Any, sx: Stats) -> dict[str, Any]:
    grid = run.preset.grid
    kept: dict[str, list[int]] = {}
    for s in run.seeds:
        for m, v in s.kept_per_module.items():
            kept.setdefault(m, []).append(v)
    return {
        "budget_spent": _budget_spent(run, sx),
        "non_prefix_fraction": _non_prefix(run),
        "utility_vs_accuracy": _utility_vs_accuracy(run),
        "kept_per_module": {
            "budget": max(grid.budgets),
            "mean_over_seeds": {m: float(np.mean(v)) for m, v in kept.items()},
            "per_seed": {str(s.seed): dict(s.kept_per_module) for s in run.seeds},
        },
        "retention_by_rank": {
            "budget": max(grid.budgets),
            "mean_over_seeds": np.mean([s.retention for s in run.seeds], 0).tolist(),
            "per_seed": {str(s.seed): list(s.retention) for s in run.seeds},
        },
    }


def _budget_spent(run: Any, sx: Stats) -> list[dict[str, Any]]:
    """TA in full space with Net Utility: the budget used (positive utilities only) at each
    budget, and at full capacity ``M r`` against the no-budget TA."""
    grid = run.preset.grid
    m_r = len(run.tasks) * run.preset.train.lora_rank
    rows = []
    for r in sorted({*grid.budgets, *([m_r] if grid.full_capacity else [])}, reverse=True):
        key = f"ta/full/R{r}/net_utility"
        if not all(key in s.records for s in run.seeds):
            continue
        used = [s.records[key]["budget_spent"] for s in run.seeds]
        ukey = f"ta/full/R{r}/uniform" if r != m_r else "ta/full/all"
        rows.append(
            {
                "budget": r,
                "used": st.seed_interval(used)._asdict(),
                "used_per_seed": used,
                "unspent_fraction": st.seed_interval([1 - u / r for u in used])._asdict(),
                "ours": summary_dict(sx.value(key)),
                "uniform": summary_dict(sx.value(ukey)),
                "uniform_key": ukey,
                "delta": summary_dict(sx.delta(key, ukey)),
            }
        )
    return rows


def _non_prefix(run: Any) -> dict[str, Any]:
    out = {}
    keys = list(dict.fromkeys(k for s in run.seeds for k in s.records))
    for k in keys:
        vals = [s.records[k].get("non_prefix_fraction") for s in run.seeds if k in s.records]
        if k.endswith("/net_utility") and all(v is not None for v in vals):
            out[k] = {"per_seed": vals, **st.seed_interval(vals)._asdict()}
    return out


def _utility_vs_accuracy(run: Any) -> dict[str, Any]:
    """Pearson r of each task's mean net utility against its relative accuracy (single LoRA
    minus zero-shot), per seed and of the means over seeds."""
    names = [t.name for t in run.tasks]
    corr = []
    for s in run.seeds:
        mnu = [s.scoring["mean_net_utility"][n] for n in names]
        rel = [s.single_test[n] - s.zero_shot_test[n] for n in names]
        corr.append({"seed": s.seed, **st.pearson(mnu, rel)._asdict()})
    mnu_mean = [np.mean([s.scoring["mean_net_utility"][n] for s in run.seeds]) for n in names]
    rel_mean = [np.mean([s.single_test[n] - s.zero_shot_test[n] for s in run.seeds]) for n in names]
    return {
        "relative_to": "zero-shot (base model with the frozen heads)",
        "per_seed": corr,
        "seed_mean": st.pearson(mnu_mean, rel_mean)._asdict(),
        "mean_net_utility": dict(zip(names, map(float, mnu_mean), strict=True)),
        "relative_accuracy": dict(zip(names, map(float, rel_mean), strict=True)),
        "paper": -0.78,
    }


def predictions(run: Any) -> dict[str, np.ndarray]:
    """``predictions.npz``: the test texts' task and label, and every merge's correctness."""
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
