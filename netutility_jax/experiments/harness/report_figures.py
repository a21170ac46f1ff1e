"""The report's figures: what the budget keeps, where, and every delta with its interval.

:func:`figures` draws, from a :class:`runner.Run` and its ``results`` dict
(:mod:`report_tables`): the kept directions per layer x module, per task and by rank, the
utility distribution (``nu.plots``), mean net utility against relative accuracy, every delta
with its intervals, and the training curves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .report_markdown import fmt

__all__ = ["figures"]


def figures(run: Any, results: Mapping[str, Any]) -> dict[str, Any]:
    """Every figure of the report by file name (matplotlib ``Figure`` objects)."""
    import netutility_jax as nu

    names = [t.name for t in run.tasks]
    top = max(run.preset.grid.budgets)
    # the first seed computed in this run (seeds read back from a rendered run have no masks):
    # with none, the three figures of one seed's masks are not drawn
    s0 = next((s for s in run.seeds if s.masks is not None), None)
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
        "utility_vs_accuracy.png": _scatter(results),
        "deltas.png": _forest(results),
        "training_curves.png": _curves(results),
    }
    if s0 is not None:
        figs |= {
            "kept_per_task.png": nu.plots.kept_per_task(
                s0.masks,
                names,
                title=f"Directions kept per task (Net Utility, R={top}, seed {s0.seed})",
            ),
            "prefix_retention.png": nu.plots.prefix_retention(
                s0.masks,
                s0.scores,
                title=f"Retention by rank (Net Utility, R={top}, seed {s0.seed})",
            ),
            "utility_distribution.png": nu.plots.utility_distribution(s0.scores, s0.masks, names),
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
        ax.scatter(x, y, s=14, alpha=0.6, label=f"seed {seed} (r = {fmt(c['r'], 2)})")
    for n in names:
        ax.annotate(
            n, (uv["mean_net_utility"][n], 100 * uv["relative_accuracy"][n]), fontsize=6,
            xytext=(3, 3), textcoords="offset points",
        )  # fmt: skip
    sm = uv["seed_mean"]
    ax.set_xlabel("mean net utility of the task's directions")
    ax.set_ylabel("relative accuracy (LoRA - zero-shot), %")
    ax.set_title(
        f"seed means: r = {fmt(sm['r'], 2)} [{fmt(sm['low'], 2)}, {fmt(sm['high'], 2)}], "
        f"p = {fmt(sm['p'], 2)}, n = {sm['n']}",
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
    ax.set_xlabel("Δ normalized accuracy, points\n(blue: bootstrap 95% CI; grey: seed t-interval)")
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
