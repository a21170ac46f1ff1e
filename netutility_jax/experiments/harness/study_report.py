"""The regime study's report: ``study.md`` (:func:`markdown`) and ``study.png``
(:func:`figure`), from the results and cells :func:`study.render` has.

The markdown has one row per cell (the data-free indices, the merge regime and Net Utility's
deltas with their bootstrap intervals over test texts), what the indices mean, the deltas seed
by seed with the t interval over seeds, and each task's delta against its energy share; the
figure plots the deltas against the indices.

Part of the harness; imports no model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["figure", "markdown"]


def _iv(d: Mapping[str, Any] | None) -> str:
    if not d:
        return "n/a"
    lo, hi = d["bootstrap_ci"]
    mark = "*" if d.get("bootstrap_excludes_zero") else ""
    return f"{d['estimate']:+.1f} [{lo:+.1f}, {hi:+.1f}]{mark}"


def _times(x: Any, m: int) -> Any:
    return None if x is None else x * m


def _num(x: Any, nd: int = 2) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{nd}f}"


def markdown(results: Mapping[str, Any], low: int) -> str:
    """``study.md`` of a study's results (``study.render``); ``low``: its tightest budget."""
    budgets = results["design"]["budgets"]
    data = bool(results["design"].get("data_aware"))
    lines = [
        *_cells_table(results, budgets, low, data),
        *_notes(results, data),
        *_across_seeds(results, budgets, low, data),
        *_per_task(results, low),
        *_footer(results),
    ]
    return "\n".join(lines)


def _cells_table(
    results: Mapping[str, Any], budgets: Sequence[int], low: int, data: bool
) -> list[str]:
    """The title, what the study is, its centre, and one row per cell: the indices, the merge
    regime and Net Utility's deltas (and the data-aware ones, with ``data``)."""
    centre = results["design"]["centre"]
    lines = [
        f"# Regime study ({results['study']})",
        "",
        "Where does Net Utility's budget-aware allocation help? One factor of the training regime "
        "is moved at a time around a centre (one shared LoRA initialisation, the paper's "
        "codebase's regime; equal training; all tasks; rank 16). The design, the cells and the "
        "indices are this project's, not the paper's. Normalized accuracy (% of each task's own "
        "LoRA), means over seeds; deltas in points with the paired bootstrap 95% interval over "
        "test texts pooled over seeds (`*`: it excludes 0).",
        "",
        f"Centre: {len(centre['tasks'])} tasks, seeds {', '.join(map(str, centre['seeds']))}, "
        f"up to {centre['n_test']} test texts per task.",
        "",
        "| cell | tasks | overlap / chance | h | eff. rank | lambda | keep-all TA | Iso-C - TA "
        f"| uniform R{low} - keep-all | "
        + " | ".join(f"NU - uniform R{r}" for r in budgets)
        + f" | NU - energy R{low} |"
        + "".join(f" NU(data) - uniform R{r} | NU(data) - NU R{r} |" for r in budgets if data),
        "|" + "---|" * (9 + len(budgets) + (2 * len(budgets) if data else 0)),
    ]
    for c in results["cells"]:
        ix, rg, al = c["indices"], c["regime"], c["allocation"]
        keep = "n/a" if not rg["keep_all_ta"] else f"{rg['keep_all_ta']['estimate']:.1f}"
        lines.append(
            f"| {c['cell']} | {len(c['tasks'])} | {_num(ix['overlap_vs_chance'], 1)} | "
            f"{_num(ix['heterogeneity'])} | {_num(ix['effective_rank'], 1)} | "
            f"{_num(ix['lam'], 3)} | {keep} | "
            f"{_iv(rg['iso_c_minus_ta'])} | {_iv(rg['uniform_minus_keep_all'])} | "
            + " | ".join(_iv(al[str(r)]["net_utility_minus_uniform"]) for r in budgets)
            + f" | {_iv(al[str(low)]['net_utility_minus_energy'])} |"
            + "".join(
                f" {_iv(al[str(r)].get('net_utility_data_minus_uniform'))} |"
                f" {_iv(al[str(r)].get('net_utility_data_minus_net_utility'))} |"
                for r in budgets
                if data
            )
        )
    return lines


def _notes(results: Mapping[str, Any], data: bool) -> list[str]:
    """What the indices are (and, with ``data``, what the data-aware Net Utility is)."""
    lines = [
        "",
        "Overlap / chance: the mean normalised overlap of the tasks' input subspaces over its "
        "value for random subspaces (1 = chance). h: the variance of the tasks' log energies "
        "(the paper's heterogeneity). Eff. rank: exp of the entropy of each task's spectrum, "
        "mean over tasks and modules.",
        "",
    ]
    if data:
        lines += [
            "NU(data): Net Utility scored with each task's input second moments as its "
            "geometry G_i (`nu.score(..., input_moments=...)`; docs/input_moments.md), "
            "estimated from the LoRA-target inputs of "
            f"{results['design']['moment_texts']} unlabelled training "
            "texts per task under the base model (padding dropped), the same global top-K. "
            "This variant is this project's answer to the limitation the paper states (its "
            "geometry is data-free because G_i cannot be estimated without task data), not "
            "the paper's method. NU(data) - NU compares it with the data-free score.",
            "",
        ]
    return lines


def _per_task(results: Mapping[str, Any], low: int) -> list[str]:
    """Each task's Net Utility - uniform delta at the tightest budget against its energy share,
    with their Pearson correlation pooled over cells."""
    corr = results["per_task_delta_vs_energy"]["pearson"]
    lines = [
        f"## Per task: Net Utility minus uniform at R={low} against the task's energy",
        "",
        f"Pooled over cells (each task of each cell one point, its delta a mean over seeds): "
        f"Pearson r = {_num(corr['r'])} (95% interval {_num(corr['low'])} to "
        f"{_num(corr['high'])}, permutation p = {_num(corr['p'], 3)}, n = {corr['n']}). "
        "Energy share x tasks: 1 is an equal share.",
        "",
        "| cell | task | energy share x tasks | kept / uniform share | delta |",
        "|---|---|---|---|---|",
    ]
    for c in results["cells"]:
        m = len(c["tasks"])
        for n, t in c["per_task"].items():
            delta = "n/a" if t["delta"] is None else f"{t['delta']:+.1f}"
            lines.append(
                f"| {c['cell']} | {n} | {_num(_times(t['energy_share'], m))} | "
                f"{_num(t['kept_vs_uniform'])} | {delta} |"
            )
    return lines


def _footer(results: Mapping[str, Any]) -> list[str]:
    """The wall and CPU time over the cells, the command and the commit."""
    seconds = sum(c["seconds"].get("total", 0.0) for c in results["cells"])
    cpu = [c["seconds"].get("total_cpu") for c in results["cells"]]
    cpu_text = (
        f", CPU time {sum(cpu) / 3600:.2f} h (this process, every thread)"
        if cpu and None not in cpu
        else ""
    )
    commit = results.get("commit") or {}
    return [
        "",
        f"Wall time {seconds / 3600:.2f} h{cpu_text} (cached jobs count as their load time). "
        f"Command: "
        f"`{results.get('command') or 'a Python call'}`; commit {commit.get('head', 'unknown')}"
        f"{' (uncommitted changes)' if commit.get('dirty') else ''}.",
        "",
    ]


def _seeds_iv(d: Mapping[str, Any] | None) -> tuple[str, str, int]:
    """``(per-seed values, t interval over seeds, intervals that exclude 0)`` of one delta."""
    if not d:
        return "n/a", "n/a", 0
    lo, hi = d["seed_ci"]
    mark = "*" if d.get("seeds_exclude_zero") else ""
    seeds = (
        "n/a" if lo is None or not (math.isfinite(lo) and math.isfinite(hi))
        else f"[{lo:+.1f}, {hi:+.1f}]{mark}"
    )  # fmt: skip
    return ", ".join(f"{v:+.1f}" for v in d["per_seed"]), seeds, int(bool(mark))


def _across_seeds(
    results: Mapping[str, Any], budgets: Sequence[int], low: int, data: bool
) -> list[str]:
    """The Net Utility deltas seed by seed, with the t interval over seeds: the main table's
    bootstrap resamples test texts and does not see how much a new training seed moves a delta."""
    cells = results["cells"]
    if len(results["design"]["centre"]["seeds"]) < 2:
        return []
    rows = [(f"NU - uniform R{r}", r, "net_utility_minus_uniform") for r in budgets]
    rows.append((f"NU - energy R{low}", low, "net_utility_minus_energy"))
    if data:
        rows += [(f"NU(data) - uniform R{r}", r, "net_utility_data_minus_uniform") for r in budgets]
        rows += [(f"NU(data) - NU R{r}", r, "net_utility_data_minus_net_utility") for r in budgets]
    lines = [
        "## Across seeds",
        "",
        "Each delta seed by seed, and the 95% t interval over seeds (`*`: it excludes 0). The "
        "intervals above resample test texts and do not cover seed-to-seed variation; these do, "
        "from few seeds, so they are wide.",
        "",
        "| cell | comparison | per seed | over seeds | over texts |",
        "|---|---|---|---|---|",
    ]
    boot = seeds_ex = total = 0
    for c in cells:
        for label, r, key in rows:
            d = c["allocation"][str(r)].get(key)
            per_seed, over, ex = _seeds_iv(d)
            lines.append(f"| {c['cell']} | {label} | {per_seed} | {over} | {_iv(d)} |")
            if d:
                total += 1
                seeds_ex += ex
                boot += int(bool(d.get("bootstrap_excludes_zero")))
    lines += [
        "",
        f"Of these {total} comparisons, {boot} intervals over texts and {seeds_ex} over seeds "
        "exclude 0; were no allocation different from another, a calibrated 95% interval would "
        f"exclude 0 in about {0.05 * total:.1f} of them.",
        "",
    ]
    return lines


def figure(cells: Sequence[Any], low: int, xs: Sequence[float], ys: Sequence[float]) -> Any:
    """``study.png``: Net Utility - uniform at ``low`` against the input overlap and the
    heterogeneity, per cell (``study.CellResult``), and each task's delta against its energy
    share (``xs``, ``ys``, pooled over cells)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4))
    axes = fig.subplots(1, 3)
    for ax, key, label in (
        (axes[0], "overlap_vs_chance", "input overlap / chance"),
        (axes[1], "heterogeneity", "heterogeneity h"),
    ):
        for c in cells:
            d = c.allocation[str(low)]["net_utility_minus_uniform"]
            x = c.indices[key]
            if d is None or not math.isfinite(x):
                continue
            lo, hi = d["bootstrap_ci"]
            ax.errorbar(
                x, d["estimate"], yerr=[[d["estimate"] - lo], [hi - d["estimate"]]], fmt="o",
                capsize=3,
            )  # fmt: skip
            ax.annotate(c.cell.name, (x, d["estimate"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")  # fmt: skip
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel(f"NU - uniform at R={low} (points)")
    axes[0].set_xscale("log")
    ax = axes[2]
    for c in cells:
        pts = [
            (t["energy_share"] * len(c.tasks), t["delta"])
            for t in c.per_task.values()
            if t["delta"] is not None and math.isfinite(t["energy_share"])
        ]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=14, label=c.cell.name)
    ax.axhline(0, color="grey", lw=0.8)
    ax.axvline(1, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("task energy share x tasks")
    ax.set_ylabel("per-task delta (points)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    return fig
