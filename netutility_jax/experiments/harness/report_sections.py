"""The report's sections after its headline tables, as markdown lines (``results.md``): the
controls, the single LoRAs against zero-shot, per-task numbers, the analyses (budget spent,
non-prefix kept sets, net utility against accuracy, the figures), the coefficients and options
chosen on validation, training and timings; and the cells they are written with (:func:`fmt`,
:func:`delta_cell`).

:func:`report_markdown.render_markdown` puts them together; what differs between suites comes in
as a ``report_markdown.SuiteReport`` (``suite``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from . import grid as gr

__all__ = [
    "analyses_md",
    "coef_md",
    "controls_md",
    "delta_cell",
    "fmt",
    "options_md",
    "per_task_md",
    "single_md",
    "timings_md",
    "training_md",
]


def fmt(x: float | None, nd: int = 1) -> str:
    """``x`` with ``nd`` decimals; ``–`` for None or a non-finite value."""
    return "–" if x is None or not np.isfinite(x) else f"{x:.{nd}f}"


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
        return fmt(k * est, nd)
    return f"{fmt(k * est, nd)} [{fmt(k * lo, nd)}, {fmt(k * hi, nd)}]"


def _est(d: Mapping[str, Any] | None, nd: int = 1) -> str:
    return "–" if d is None else fmt(d["estimate"], nd)


def delta_cell(d: Mapping[str, Any] | None) -> str:
    """``+1.2 [+0.4, +2.0]`` of a delta (a ``report_tables.summary_dict``): bold if its bootstrap
    interval excludes 0, ``‡`` if its seed interval does too; ``–`` for None."""
    if d is None:
        return "–"
    lo, hi = d["bootstrap_ci"]
    text = f"{d['estimate']:+.1f} [{lo:+.1f}, {hi:+.1f}]"
    if d["bootstrap_excludes_zero"]:
        text = f"**{text}**"
    if d["seeds_exclude_zero"]:
        text += " ‡"
    return text


def controls_md(results, grid, suite: Any) -> list[str]:
    """The controls: zero-shot, weight average, and per row no budget, random and each
    control variant against uniform and Net Utility."""
    c = results["controls"]
    lines = ["", "## Controls: what the budget does", ""]
    zs, avg = c["zero_shot"], c["weight_average"]
    lines.append(
        f"Zero-shot model ({suite.zero_shot_model}, no adapter): {_est(zs)} normalized. Weight average (TA "
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
                f"{_est(cell.get('ours'))} | {delta_cell(cell.get('ours_minus_random'))} | "
                f"{delta_cell(cell.get('random_minus_uniform'))} | "
                f"{delta_cell(cell.get('ours_minus_no_budget'))} |"
            )
        variants = [
            (r, v) for r, cell in row["cells"].items() for v in cell.get("variants", {}).values()
        ]
        if variants:
            lines += [
                "",
                "| R | Control | Normalized | Ours - Control | Control - Uniform |",
                "|---:|---|---:|---:|---:|",
                *(
                    f"| {r} | {v['label']} | {_est(v['value'])} | {delta_cell(v['ours_minus'])} | "
                    f"{delta_cell(v['minus_uniform'])} |"
                    for r, v in variants
                ),
            ]
    named = {n for row in c["rows"].values() for cell in row["cells"].values()
             for n in cell.get("variants", {})}  # fmt: skip
    for name in sorted(named):
        var = gr.VARIANTS[name]
        lines += ["", f"{var.label}: {var.what}."]
    if any("random" in cell for row in c["rows"].values() for cell in row["cells"].values()):
        lines += [
            "",
            f"Random: {grid.random_draws} draw(s) per seed and budget, averaged; the draws differ "
            "between seeds. Intervals as in the main table.",
        ]
    return lines


def single_md(results, suite: Any) -> list[str]:
    """Each task's own LoRA against the zero-shot model (test accuracy)."""
    lines = [
        "",
        "## Single LoRAs against zero-shot (test accuracy, %)",
        "",
        "| Task | labels (chance) | zero-shot, mean over seeds | individual LoRA, mean over seeds "
        "[t-interval] | gap | zero-shot normalized |",
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
        "Gap and zero-shot normalized: each seed's individual LoRA against that seed's own "
        "zero-shot accuracy (a suite whose zero-shot model depends on the seed, such as trained "
        "heads, has one per seed), then the mean and t interval over seeds.",
        "",
        suite.heads(results),
    ]
    return lines


def per_task_md(results, grid) -> list[str]:
    """Each task's accuracy and normalized accuracy under every merge of the main table."""
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


def analyses_md(results) -> list[str]:
    """The analyses: budget spent with positive-only admission, non-prefix kept sets, mean net
    utility against relative accuracy, and the figures."""
    an = results["analyses"]
    m_r = len(results["tasks"]) * results["train_config"]["lora_rank"]
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
            f"{delta_cell(row['delta'])} | {_iv(row['used'])} | {_iv(row['unspent_fraction'], pct=True)}% |"
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
            f"| seed {c['seed']} | {fmt(c['r'], 2)} | [{fmt(c['low'], 2)}, {fmt(c['high'], 2)}] | "
            f"{fmt(c['p'], 3)} | {c['n']} |"
        )
    lines.append(
        f"| means over seeds | {fmt(sm['r'], 2)} | [{fmt(sm['low'], 2)}, {fmt(sm['high'], 2)}] | "
        f"{fmt(sm['p'], 3)} | {sm['n']} |"
    )
    lines += [
        "",
        f"The paper reports {uv['paper']} on 7 MATH topics. With {sm['n']} tasks an interval "
        "this wide is all the data can give; read the sign only where the interval excludes 0.",
        "",
        "## Figures",
        "",
        f"- `budget_heatmap.png`: directions kept per layer x module (TA, Net Utility, "
        f"R = {an['kept_per_module']['budget']}, mean over seeds)",
        "- `deltas.png`: every Δ with its interval; `training_curves.png`: loss and validation "
        "curves per task and seed",
        *(
            [
                "- `kept_per_task.png`, `prefix_retention.png`, `utility_distribution.png` (seed "
                "shown in the title), `utility_vs_accuracy.png`"
            ]
            if _computed_seeds(results)
            else [
                "- `utility_vs_accuracy.png`; every seed was read from an earlier run, which "
                "keeps no masks, so the figures of one seed's masks (kept per task, retention by "
                "rank, the utility distribution) are in each source's own directory"
            ]
        ),
    ]
    return lines


def _computed_seeds(results: Mapping[str, Any]) -> list[int]:
    """The seeds this run computed (those not read from ``results["seeds_from"]``)."""
    read = {s for src in results.get("seeds_from") or [] for s in src["seeds"]}
    return [s for s in results["seeds"] if s not in read]


def coef_md(results) -> list[str]:
    """The merge coefficients (and method options) chosen on validation, per seed."""
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
    return lines + options_md(results)


def options_md(results) -> list[str]:
    """The options chosen on validation per merge (``GridConfig.search``), if any."""
    merges = results["merges"]
    seeds = list(merges)
    keys = [k for k in merges[seeds[0]] if "option_search" in merges[seeds[0]][k]]
    if not keys:
        return []
    lines = [
        "",
        "## Method options chosen on validation (per seed)",
        "",
        "| Merge | option | " + " | ".join(f"seed {s}" for s in seeds)
        + " | best validation score per candidate (seed " + seeds[0] + ") |",
        "|---|---|" + "---:|" * len(seeds) + "---|",
    ]  # fmt: skip
    for k in keys:
        name = merges[seeds[0]][k]["option_search"]["option"]
        chosen = [merges[s][k]["options"][name] if k in merges[s] else None for s in seeds]
        val = merges[seeds[0]][k]["option_search"]["validation"]
        lines.append(
            f"| {k} | {name} | " + " | ".join("–" if c is None else f"{c:g}" for c in chosen)
            + " | " + ", ".join(f"{v}: {x:.1f}" for v, x in val.items()) + " |"
        )  # fmt: skip
    lines += [
        "",
        "Each candidate is merged, its coefficient searched on validation as above; the candidate "
        "with the best validation score is evaluated once on test (the paper searches TIES's "
        "pruning rate; the candidates are this project's).",
    ]
    return lines


def training_md(results, suite: Any) -> list[str]:
    """The training section of a suite that trains its LoRAs (optimizer, schedule, early
    stopping, and per task and seed its steps and best validation accuracy)."""
    tc = results["train_config"]
    lines = [
        "",
        "## Training",
        "",
        f"AdamW (optax), peak learning rate {tc['learning_rate']:g}, {100 * tc['warmup_fraction']:g}% "
        f"linear warmup, {suite.schedule(tc)}, weight decay "
        f"{tc['weight_decay']:g}; {suite.step(tc)}; validation "
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
                f"{i['train_seconds']:.0f} | {fmt(i['tokens_per_second'], 0)} |"
            )
    return lines


def timings_md(results) -> list[str]:
    """Wall and CPU time, the job cache's hits, the evaluation forward and the machine."""
    tm = results["timings"]
    bb = tm["backbone"]
    computed = set(_computed_seeds(results))
    read = set(results["seeds"]) - computed
    total = sum(len(per) for seed, per in results["merges"].items() if int(seed) in computed)
    hits = sum(
        r.get("cache_hit", False)
        for seed, per in results["merges"].items()
        if int(seed) in computed
        for r in per.values()
    )
    return [
        "",
        "## Timings (wall clock; other processes may share the CPUs)",
        "",
        f"- total {tm['total']:.0f} s: training {tm['training']:.0f} s, merge grid {tm['grid']:.0f} s "
        f"({total} merges, {hits} from the job cache"
        + (f"; seed(s) {', '.join(map(str, sorted(read)))} read from earlier runs" if read else "")
        + ")",
        *(
            [
                f"- CPU time of this process (every thread) {tm['total_cpu'] / 3600:.2f} h: "
                f"training {tm['training_cpu'] / 3600:.2f} h, merge grid "
                f"{tm['grid_cpu'] / 3600:.2f} h"
            ]
            if "total_cpu" in tm
            else []
        ),
        f"- evaluation forward: {bb['passes']} passes, {bb['tokens']} real tokens "
        f"({bb['slot_tokens']} computed, packing), {fmt(bb['tokens_per_second'], 0)} tokens/s",
        f"- machine: {results['environment']['cpus']} CPUs, {results['environment']['machine']}, "
        f"jax {results['environment']['jax']}",
        "",
    ]
