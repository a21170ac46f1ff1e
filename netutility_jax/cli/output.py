"""What ``netutility merge`` writes, and how: the output folder assembled in a staging folder
beside ``--out`` and renamed into place (:func:`write_merge`), holding the PEFT adapter
(:func:`write_output`), the JSON report (:func:`report_dict`, :data:`REPORT_NAME`), the model
card (:func:`model_card`) and the plots (:func:`write_plots`); the progress bar of its steps.
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._core import io as _io
from ..errors import NetUtilityError
from .common import PROG, UsageError
from .job import MergeJob
from .paths import staging_name, stat_of, write_error

__all__ = [
    "REPORT_NAME",
    "Merged",
    "chunk_steps",
    "finish_output",
    "model_card",
    "progress",
    "report_dict",
    "step",
    "uniform_rank",
    "write_extras",
    "write_merge",
    "write_output",
    "write_plots",
]


REPORT_NAME = "netutility_report.json"


def progress(total: int, desc: str, quiet: bool):
    """A progress bar of ``total`` steps on stderr; None if ``quiet`` or tqdm is missing."""
    if quiet:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)


def chunk_steps(bar, what: str) -> Callable[[int, int], None] | None:
    """The streamed merge's ``progress`` callback (:func:`nu.merge_adapters_streaming`) on
    ``bar``: the chunk reads it announces (``done=0``) are added to the bar's total, then the
    bar advances one step per chunk read and scored or merged; None without a bar."""
    if bar is None:
        return None
    seen = [0]

    def report(done: int, total: int) -> None:
        if done == 0:
            bar.total += total
            bar.refresh()
        elif done > seen[0]:
            bar.update(done - seen[0])
            seen[0] = done
        bar.set_postfix_str(f"{what}: chunk {done} of {total}")

    return report


def step(bar, done: str, next_step: str = "") -> None:
    """Mark a step done and name the one now running."""
    if bar is not None:
        bar.update(1)
        bar.set_postfix_str(next_step or done)


def report_dict(
    report: Any,
    *,
    adapters: Sequence[str],
    options: dict[str, Any],
    coverage: Mapping[str, Sequence[int]] | None = None,
    names: Sequence[str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> dict:
    """A JSON-ready dict of a :class:`nu.Report` (masks and scores left out; NaN -> null;
    ``zeroed``: the modules whose merged update is exactly zero), with the per-module task
    coverage ``{module: [tasks that have it]}`` if given (by name with ``names``, else by
    index). With ``names``: ``tasks``, per task its name, folder, weight, kept directions,
    uniform share of the budget (None with allocation all) and candidates. ``config``: the
    resolved configuration that replays the merge (``netutility merge --config``). Always:
    ``netutility_version`` and ``created_utc`` (ISO 8601, UTC)."""
    import datetime

    from .. import __version__
    from ..pipeline.planning import report_shares

    keep = (
        "method", "space", "allocation", "scope", "budget", "budget_spent", "lam", "alpha",
        "heterogeneity", "non_prefix_fraction", "kept_per_task", "kept", "ranks", "zeroed",
        "weights", "min_share", "data_aware", "interference",
    )  # fmt: skip
    out = {k: _io.to_jsonable(getattr(report, k, None)) for k in keep}
    label = (lambda i: int(i)) if names is None else (lambda i: names[int(i)])
    if coverage is not None:
        out["coverage"] = {str(n): [label(i) for i in t] for n, t in coverage.items()}
    head: dict[str, Any] = {
        "netutility_version": __version__,
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "adapters": list(adapters),
    }
    if names is not None:
        shares = report_shares(report)
        cand = None
        if report.masks is not None:
            from ..allocation._min_share import candidates

            counts = candidates(report.scores if report.scores is not None else report.masks)
            cand = np.sum(list(counts.values()), axis=0)
        weights = report.weights or (1.0,) * len(names)
        head["tasks"] = [
            {
                "name": n,
                "path": p,
                "weight": float(weights[i]),
                "kept": int(report.kept_per_task[i]),
                "uniform_share": None if shares is None else float(shares[i]),
                "candidates": None if cand is None else int(cand[i]),
            }
            for i, (n, p) in enumerate(zip(names, adapters, strict=True))
        ]
    out = {**head, "options": _io.to_jsonable(options), **out}
    if config is not None:
        out["config"] = _io.to_jsonable(dict(config))
    return out


def model_card(rep: Mapping[str, Any], base_config: Mapping[str, Any] | None) -> str:
    """The merged adapter's ``README.md``, as PEFT writes one: YAML front matter
    (``library_name: peft``, ``base_model`` if the adapters name one, tags), then what was
    merged (the tasks, their weights and kept directions), how (method, space, allocation,
    budget), and the library's version. ``rep``: :func:`report_dict`'s dict."""
    base = (base_config or {}).get("base_model_name_or_path")
    front = ["---", "library_name: peft"]
    if isinstance(base, str) and base:
        front.append(f"base_model: {json.dumps(base)}")
    front += ["tags:", "- lora", "- merge", "- netutility-jax", "---", ""]
    tasks = rep.get("tasks") or [
        {"name": a, "path": a, "weight": 1.0, "kept": k, "uniform_share": None}
        for a, k in zip(rep["adapters"], rep["kept_per_task"], strict=True)
    ]
    how = f"method `{rep['method']}` in `{rep['space']}` space"
    if rep["allocation"] == "all":
        how += ", every singular direction of every task kept (allocation `all`)"
    else:
        scope = f", {rep['scope']} scope" if rep.get("scope") else ""
        how += (
            f", allocation `{rep['allocation']}`{scope} with a budget of {rep['budget']} "
            f"directions per module on average ({rep['budget_spent']:.2f} spent)"
        )
        if rep.get("min_share"):
            how += f", each task at least {rep['min_share']:g} of its uniform share"
    lines = [
        "# Merged LoRA adapter",
        "",
        f"A merge of {len(tasks)} LoRA adapter{'s' if len(tasks) != 1 else ''}"
        + (f" of `{base}`" if isinstance(base, str) and base else "")
        + f" made with netutility-jax {rep.get('netutility_version', '')}: {how}.",
        "",
        "| task | adapter | weight | kept directions | uniform share |",
        "|---|---|---|---|---|",
    ]
    for t in tasks:
        share = "" if t.get("uniform_share") is None else f"{t['uniform_share']:.1f}"
        lines.append(f"| {t['name']} | `{t['path']}` | {t['weight']:g} | {t['kept']} | {share} |")
    lines += [
        "",
        "Load it with PEFT:",
        "",
        "```python",
        "from peft import PeftModel",
        "",
        'model = PeftModel.from_pretrained(base_model, "path/to/this/folder")',
        "```",
        "",
        f"`{REPORT_NAME}` holds the full report and the configuration: "
        f"`netutility merge --config {REPORT_NAME} --out NEW_DIR` replays the merge.",
        "",
        "### Framework versions",
        "",
        f"- netutility-jax {rep.get('netutility_version', '')}",
        "",
    ]
    return "\n".join(front + lines)


class Merged(NamedTuple):
    """What the loading and merging steps of ``netutility merge`` made, for the writing step."""

    loaded: Any  # peft.load_adapters' result: the adapters, their base config and coverage
    merged: Any  # the merged adapter
    report: Any  # its nu.Report
    key: Any  # the PRNG key of the method's random choices, or None
    options: dict[str, Any]  # the method and space options from the flags
    processes: int = 1  # how many processes merged (--distributed)


def write_merge(
    out: pathlib.Path, job: MergeJob, result: Merged | None, bar,
    fill: Callable[[pathlib.Path], Any] | None = None,
) -> Any:  # fmt: skip
    """The writing step: ``out`` assembled in a staging folder beside it and renamed into place
    (complete or not at all); a failed write is the library's :class:`FileAccessError`. The
    folder is filled by :func:`write_output` from ``result``, or by ``fill(folder)`` (a merge
    that writes as it goes: :func:`.merge._merge_writing`), whose result is returned."""
    if fill is None:

        def fill(tmp: pathlib.Path) -> None:
            write_output(tmp, job, result, bar)

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_name(out)
    except OSError as e:
        raise write_error(job.out, e) from e
    try:
        with _io.atomic_directory(out, fn=f"{PROG} merge", staging=staging) as tmp:
            filled = fill(tmp)
            if stat_of(out, f"--out {job.out}", follow=False) is not None:
                raise UsageError(f"--out {job.out}: appeared while merging; nothing was written.")
        step(bar, "done")
        return filled
    except OSError as e:
        if not isinstance(e, NetUtilityError):
            raise write_error(job.out, e) from e
        raise


def write_output(tmp: pathlib.Path, job: MergeJob, result: Merged, bar) -> None:
    """The merge's output folder, assembled in ``tmp``: the PEFT adapter, the JSON report and
    the plots."""
    import netutility_jax as nu

    adapter_dir = tmp / "adapter"
    if job.serving_ranks is not None:  # (refused in the flag's terms, not save_adapter's)
        uniform_rank(job.serving_ranks, result.report.ranks)
    nu.peft.save_adapter(
        result.merged,
        adapter_dir,
        rank=job.rank,
        base_config=result.loaded.config,
        dtype=job.dtype,
        serving_ranks=job.serving_ranks,
    )
    finish_output(tmp, job, result, bar)


def finish_output(tmp: pathlib.Path, job: MergeJob, result: Merged, bar) -> None:
    """The adapter written in ``tmp / "adapter"`` moved up into ``tmp``, then the extras."""
    adapter_dir = tmp / "adapter"
    for f in adapter_dir.iterdir():
        f.rename(tmp / f.name)
    adapter_dir.rmdir()
    step(bar, "saved adapter", "writing the report")
    write_extras(tmp, job, result, bar)


def write_extras(tmp: pathlib.Path, job: MergeJob, result: Merged, bar) -> None:
    """The JSON report, the model card (``README.md``) and the plots, in ``tmp``."""
    from .. import registry
    from .config import recorded_config

    run = _run_options(job, result)
    names = _task_names(job)
    resolved = registry.resolve_options(
        f"{PROG} merge", job.method, job.space, dict(result.options)
    ).options
    rep = report_dict(
        result.report, adapters=job.adapters, options=run, coverage=result.loaded.coverage,
        names=names, config=recorded_config(job, resolved, digests=True),
    )  # fmt: skip
    _io.write_json(tmp / REPORT_NAME, rep)
    with _io.atomic_file(tmp / "README.md", "w") as f:
        f.write(model_card(rep, result.loaded.config))
    step(bar, "wrote report", "plotting")
    if not job.no_plots:
        write_plots(tmp / "plots", result.report, len(job.adapters), names=names)
        step(bar, "plots", "moving into place")


def _task_names(job: MergeJob) -> list[str]:
    """The tasks' names (``job.names``)."""
    return list(job.names)


def _run_options(job: MergeJob, result: Merged) -> dict[str, Any]:
    """The report's ``options``: the flags the merge ran with."""
    return {
        "command": "merge",
        "budget": job.budget,
        "coef": job.coef,
        "seed": job.seed if result.key is not None else None,
        "rank": job.rank,
        "serving_ranks": job.serving_ranks,
        "positive_only": not job.keep_nonpositive,
        "strict_targets": job.strict_targets,
        "allow_different_base": job.allow_different_base,
        "skip_non_lora": job.skip_non_lora,
        "streamed": hasattr(result.loaded, "read"),
        "chunk_mb": job.chunk_mb,
        "processes": result.processes,
        "keep_shards": job.keep_shards,
        "weights": None if job.weights is None else list(job.weights),
        "min_share": job.min_share,
        **result.options,
    }


def write_plots(
    folder: pathlib.Path, report: Any, m_tasks: int, *, names: Sequence[str] | None = None
) -> None:
    """The merge's plots in ``folder``, the tasks by ``names`` (default ``task 0`` ...)."""
    from .. import plots

    folder.mkdir()
    names = [f"task {i}" for i in range(m_tasks)] if names is None else list(names)
    plots.budget_heatmap(report.masks, path=folder / "budget_heatmap.png")
    plots.kept_per_task(report.masks, names, path=folder / "kept_per_task.png")
    if report.scores is not None:
        plots.prefix_retention(report.masks, report.scores, path=folder / "prefix_retention.png")
        plots.utility_distribution(
            report.scores, report.masks, names, path=folder / "utility_distribution.png"
        )


def uniform_rank(serving_ranks: Any, ranks: Mapping[str, int | None]) -> int | None:
    """``--serving-ranks``' rank for the merged ``ranks`` of every module, as
    :func:`nu.peft.save_adapter` picks it (a rank-0 module is written at rank 1)."""
    from .. import peft

    allowed = peft.serving_ranks(serving_ranks, fn=f"{PROG} merge") or ()
    top = max(max(1, r or 0) for r in ranks.values())
    fits = [r for r in allowed if r >= top]
    if allowed and not fits:
        raise UsageError(
            f"--serving-ranks: a merged module has rank {top}, above every allowed serving rank "
            f"{allowed}; lower --budget (or --rank) or allow a larger rank."
        )
    return fits[0] if fits else None
