"""The report as markdown (``results.md``), and the wording that differs between suites.

:func:`render_markdown` writes every table of the ``results`` dict (:mod:`report_tables`): the
paper's Table 2 with an interval on every delta, the deltas per seed, the controls, the single
LoRAs, per-task numbers, the analyses, the chosen coefficients, training and timings.
:class:`SuiteReport` is what a suite says (and records) differently: the encoder's by default,
``language.LanguageReport`` for the decoder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import grid as gr
from . import stats as st
from .report_tables import N_BOOT, summary_dict

__all__ = ["SuiteReport", "console_summary", "fmt", "format_main_table", "render_markdown"]


class SuiteReport:
    """What the report says (and records) differently per suite; this one is the encoder's
    (MiniLM with frozen zero-shot heads). A suite with another model subclasses it
    (``language.LanguageReport``) and passes it to ``report.render``.

    Attributes:
      unit: what a test example is called (``"texts"``, ``"prompts"``).
      layers: which layers the LoRA adapts (``"6 layers"``).
      zero_shot_model: what the zero-shot model is, in "Zero-shot model (..., no adapter)".
      trained: the suite trains its task LoRAs (False: they are given, e.g. the vision suite's
        PEFT folders; the report then says so instead of describing training).
    """

    unit = "texts"
    layers = "6 layers"
    zero_shot_model = "frozen heads"
    trained = True

    def evaluation(self, run: Any, common: dict[str, Any]) -> dict[str, Any]:
        """``results["evaluation"]``: the suite's evaluation settings with ``common`` (the
        sizes, the bootstrap and the coefficient grid); the encoder's ``row_len`` and
        ``temperature`` from its ``eval_key`` (``runner.Run.eval_key``)."""
        key = getattr(run, "eval_key", None) or {}
        return {k: key[k] for k in ("row_len", "temperature") if k in key} | common

    def fields(self, run: Any) -> dict[str, Any]:
        """Entries added at the end of ``results`` (none for the encoder)."""
        return {}

    def title(self, results: Mapping[str, Any]) -> str:
        return f"# netutility demo ({results['preset']})"

    def model(self, results: Mapping[str, Any]) -> str:
        """The model and how it answers, in the first paragraph."""
        return (
            "MiniLM-L6 with frozen zero-shot heads (cosine similarity to the base model's "
            "embeddings of the label descriptions, temperature "
            f"{results['evaluation']['temperature']:g})"
        )

    def heads(self, results: Mapping[str, Any]) -> str:
        """The line under the single-LoRA table: what each task's head is."""
        heads = [
            f"{t['name']}: "
            + ", ".join(
                f"{lab} = {txt!r}" for lab, txt in zip(t["labels"], t["label_texts"], strict=True)
            )
            for t in results["tasks"]
        ]
        return f"Zero-shot heads (label descriptions): {'; '.join(heads)}."

    def step(self, train_config: Mapping[str, Any]) -> str:
        """What a training step holds."""
        return f"a step packs {train_config['rows']} x {train_config['row_len']} tokens"

    def schedule(self, train_config: Mapping[str, Any]) -> str:
        """The learning-rate schedule after the warmup (``fitting.TrainConfigBase.schedule``:
        cosine; a suite whose config schedules otherwise says so)."""
        return f"cosine decay to 0 at {train_config['max_steps']} steps"

    def training(self, results: Mapping[str, Any]) -> list[str]:
        """The report's training section (a suite whose adapters are given says where from)."""
        return _training_md(results, self)


def fmt(x: float | None, nd: int = 1) -> str:
    """``x`` with ``nd`` decimals; ``–`` for None or a non-finite value."""
    return "–" if x is None or not np.isfinite(x) else f"{x:.{nd}f}"


def _delta_cell(s: st.Summary | None) -> str:
    """``+1.2 [0.4, 2.0]``: bold if the bootstrap interval excludes 0, ``‡`` if the seed
    interval does too."""
    return _dcell(summary_dict(s))


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
                fmt(None if u is None else u.pooled.estimate),
                fmt(None if o is None else o.pooled.estimate),
                _delta_cell(c["delta"]),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


def console_summary(results: Mapping[str, Any]) -> str:
    """The headline of ``results`` for the terminal, from ``results["summary"]``: per method,
    space and budget the uniform and Net Utility normalized accuracy and their delta with its
    95% bootstrap interval (``*``: the interval excludes 0).

    Example:
      >>> print(console_summary({"suite": "toy", "preset": "quick", "summary": [
      ...     {"space": "Full", "method": "TA", "budget": 16, "uniform": 90.0,
      ...      "net_utility": 91.5, "delta": 1.5, "bootstrap_ci": [0.5, 2.5],
      ...      "bootstrap_excludes_zero": True, "seeds": 1, "test_examples": 300}]}))
      toy suite, quick preset: normalized accuracy (%, test; 1 seed(s), 300 examples)
      Space  Method  R   Unif.  Ours  Δ [95% CI]
      Full   TA      16  90.0   91.5  +1.5 [+0.5, +2.5] *
      *: the interval excludes 0.
    """
    recs = results["summary"]
    head = ["Space", "Method", "R", "Unif.", "Ours", "Δ [95% CI]"]
    rows = []
    for r in recs:
        if r["delta"] is None:
            delta = "–"
        else:
            lo, hi = r["bootstrap_ci"]
            delta = f"{r['delta']:+.1f} [{lo:+.1f}, {hi:+.1f}]"
            delta += " *" if r["bootstrap_excludes_zero"] else ""
        rows.append(
            [r["space"], r["method"], str(r["budget"]), fmt(r["uniform"]), fmt(r["net_utility"]),
             delta]
        )  # fmt: skip
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    n_seeds = recs[0]["seeds"] if recs else 0
    n_test = recs[0]["test_examples"] if recs else 0
    return "\n".join(
        [
            f"{results['suite']} suite, {results['preset']} preset: normalized accuracy (%, test; "
            f"{n_seeds} seed(s), {n_test} examples)",
            line(head),
            *(line(r) for r in rows),
            "*: the interval excludes 0.",
        ]
    )


def render_markdown(
    results: Mapping[str, Any],
    main_rows: Sequence[Any],
    grid: gr.GridConfig,
    suite: SuiteReport | None = None,
) -> str:
    """The results as markdown (every table computed by ``report.render``), in the wording of
    ``suite`` (default the encoder's)."""
    suite = SuiteReport() if suite is None else suite
    n_seeds = len(results["seeds"])
    lines = [
        suite.title(results),
        "",
        _intro(results, suite),
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
    ]
    lines += _seeds_from_md(results)
    lines += _deltas_md(results)
    lines += _controls_md(results, grid, suite)
    lines += _single_md(results, suite)
    lines += _per_task_md(results, grid)
    lines += _analyses_md(results)
    lines += _coef_md(results)
    lines += suite.training(results)
    lines += _timings_md(results)
    return "\n".join(lines) + "\n"


def _seeds_from_md(results: Mapping[str, Any]) -> list[str]:
    """Where the seeds read back from earlier runs came from (``results["seeds_from"]``)."""
    out = []
    for src in results.get("seeds_from") or []:
        commit = (src.get("commit") or {}).get("head") or "unknown"
        out.append(
            f"- seed(s) {', '.join(map(str, src['seeds']))}: read from `{src['directory']}`, "
            f"computed there by `{src.get('command') or 'a Python call'}` at commit {commit[:12]}"
        )
    if not out:
        return []
    return [
        "",
        "Seeds from earlier runs (their merges and test predictions, as rendered there):",
        "",
        *out,
    ]


def _intro(results: Mapping[str, Any], suite: SuiteReport) -> str:
    """The paragraph under the title: tasks, model, LoRA, seeds, data, geometry and lambda."""
    names = [t["name"] for t in results["tasks"]]
    tc, evl, seeds = results["train_config"], results["evaluation"], results["seeds"]
    sc = results["scoring"]
    lams = [v["lam"] for v in sc.values()]
    alphas = sorted({v["alpha"] for v in sc.values()})
    hs = [v["heterogeneity"] for v in sc.values()]
    m_r = len(names) * tc["lora_rank"]
    unit = suite.unit
    lora = "only the LoRA trains" if suite.trained else "the task LoRAs are given, not trained"
    return (
        f"{len(names)} tasks: {', '.join(names)}. {suite.model(results)}; {lora} "
        f"(r={tc['lora_rank']}, alpha={tc['lora_alpha']:g} on q, k, v, o of {suite.layers}; "
        f"full capacity M r = {m_r}). {len(seeds)} training seed(s) "
        f"({', '.join(map(str, seeds))}); the same data splits for every seed. Test: "
        f"{evl['test_texts']} {unit} ({', '.join(str(t['test']) for t in results['tasks'])} per "
        f"task); validation: {evl['val_texts']} {unit} (coefficient search"
        f"{', early stopping' if suite.trained else ''}). "
        f"Geometry: h = {np.mean(hs):.2f} -> alpha = {', '.join(f'{a:g}' for a in alphas)}; "
        f"lambda = {np.mean(lams):.3g} (median rule; per seed {', '.join(f'{x:.3g}' for x in lams)})."
    )


def _deltas_md(results: Mapping[str, Any]) -> list[str]:
    """Every delta of the main table per seed, with its bootstrap and seed intervals."""
    seeds = results["seeds"]
    lines = [
        "",
        "### Deltas per seed",
        "",
        "| Method | R | " + " | ".join(f"seed {s}" for s in seeds) + " | mean [bootstrap CI] | "
        "mean [seed t-interval] |",
        "|---|---:|" + "---:|" * (len(seeds) + 2),
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
                if lo_s is not None and np.isfinite(lo_s) and np.isfinite(hi_s)
                else f"{d['estimate']:+.1f}"  # one seed: no interval over seeds
            )
            lines.append(
                f"| {row['space']} {row['method']} | {r} | " + " | ".join(per)
                + f" | {_dcell(d)} | {seed_iv} |"
            )  # fmt: skip
    return lines


def _controls_md(results, grid, suite: SuiteReport) -> list[str]:
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
                f"{_est(cell.get('ours'))} | {_dcell(cell.get('ours_minus_random'))} | "
                f"{_dcell(cell.get('random_minus_uniform'))} | "
                f"{_dcell(cell.get('ours_minus_no_budget'))} |"
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
                    f"| {r} | {v['label']} | {_est(v['value'])} | {_dcell(v['ours_minus'])} | "
                    f"{_dcell(v['minus_uniform'])} |"
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


def _single_md(results, suite: SuiteReport) -> list[str]:
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


def _analyses_md(results) -> list[str]:
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


def _coef_md(results) -> list[str]:
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
    return lines + _options_md(results)


def _options_md(results) -> list[str]:
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


def _training_md(results, suite: SuiteReport) -> list[str]:
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


def _timings_md(results) -> list[str]:
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
