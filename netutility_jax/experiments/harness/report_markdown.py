"""The report as markdown (``results.md``), and the wording that differs between suites.

:func:`render_markdown` writes every table of the ``results`` dict (:mod:`report_tables`): the
paper's Table 2 with an interval on every delta, the deltas per seed, the controls, the single
LoRAs, per-task numbers, the analyses, the chosen coefficients, training and timings (the
sections after the deltas are :mod:`report_sections`'). :class:`SuiteReport` is what a suite
says (and records) differently: the encoder's by default, ``language.LanguageReport`` for the
decoder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import grid as gr
from . import report_sections as rs
from . import stats as st
from .report_sections import delta_cell
from .report_sections import fmt as fmt
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
        return rs.training_md(results, self)


def _delta_cell(s: st.Summary | None) -> str:
    """``+1.2 [0.4, 2.0]``: bold if the bootstrap interval excludes 0, ``‡`` if the seed
    interval does too."""
    return delta_cell(summary_dict(s))


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
    lines += rs.controls_md(results, grid, suite)
    lines += rs.single_md(results, suite)
    lines += rs.per_task_md(results, grid)
    lines += rs.analyses_md(results)
    lines += rs.coef_md(results)
    lines += suite.training(results)
    lines += rs.timings_md(results)
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
                + f" | {delta_cell(d)} | {seed_iv} |"
            )  # fmt: skip
    return lines
