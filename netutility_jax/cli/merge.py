"""``netutility merge``: check, load, merge, write ``--out``, and ``--dry-run``.

:func:`cmd_merge` runs in steps: complete its arguments from ``--config`` (:mod:`.config`),
check everything the user gave before anything is loaded (:func:`_check_merge`), load or open
the adapters (:mod:`.load`), merge (:func:`_merge`, or streamed: :func:`_merge_streaming`,
writing each chunk as it comes: :func:`_merge_writing`), and write the output folder
atomically (:func:`.output.write_merge`: a staging folder renamed into place); then warn about
tasks that keep less than half their uniform share of the budget. ``merge --dry-run`` stops
after scoring and allocating and prints the plan (:func:`_dry_run`,
:func:`nu.planning.plan`). ``merge --distributed`` runs the same steps in every process of a
``jax.distributed`` run (:mod:`.distributed`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import pathlib
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..peft import weight_shapes
from ..pipeline import _supervise
from .args import method_options
from .common import PROG, UsageError, check_extras, say
from .config import resolve
from .distributed import agreed_facts, check_join, join, write_distributed
from .job import MergeJob
from .load import load, load_moments, open_streamed
from .output import Merged, chunk_steps, finish_output, progress, step, write_merge
from .paths import (
    OUT_MARGIN,
    check_adapter_dir,
    check_out,
    check_space,
    clean_staging,
    estimate_out_bytes,
)

__all__ = ["cmd_merge"]

_FN = f"{PROG} merge"


def cmd_merge(args: argparse.Namespace) -> int:
    """``netutility merge``: check, load, merge, write ``--out``; print one line. With
    ``--config``, the file's settings first (:func:`.config.resolve`), then the arguments are
    frozen into a :class:`.job.MergeJob` that every step reads; with ``--dry-run``, the plan only
    (:func:`_dry_run`)."""
    resolve(args)
    job = MergeJob.of(args)
    if job.dry_run:
        with _in_flag_terms(job):
            return _dry_run(job)
    if check_join(job) and not _supervise.is_child() and job.argv:
        # the flags are checked; the run itself goes to a supervised child, so that a peer's
        # death ends this process with one line rather than JAX's C++ abort
        return _supervise.run(list(job.argv), f"{PROG} merge")
    ex = join(job)
    out = ex.check(_FN, lambda: _check_merge(job, output=ex.index == 0 or job.keep_shards))
    # every process has its inputs; now they must be the same ones, with the same settings
    ex.agree(_FN, agreed_facts(job))
    options = method_options(job)
    key = _merge_key(job)
    bar = progress(5 if job.no_plots else 6, _FN, job.quiet or ex.index > 0)
    if bar is not None:
        bar.set_postfix_str("loading adapters")
    from ..pipeline.merging import ZeroUpdateWarning

    with warnings.catch_warnings(), _in_flag_terms(job):  # (said below, from the report)
        warnings.simplefilter("ignore", ZeroUpdateWarning)
        report = _merge_and_write(job, ex, out, options, key, bar)
    if ex.index == 0:
        _warn_zeroed(job, report, options)
        zero = _zero_tasks(report)
        _warn_zero_tasks(job, zero)
        _warn_low_share(job, report, skip=zero)
        _note_single(job)
        print(_merge_line(job, report, out))
    return 0


@contextlib.contextmanager
def _in_flag_terms(job: MergeJob):
    """The library's refusal of ``alpha="auto"`` on a set with an all-zero adapter (an
    :class:`InputError` carrying ``argument`` and ``task_index``) said in the command's terms:
    ``--alpha`` and the adapter's name and path."""
    from ..errors import InputError

    try:
        yield
    except InputError as err:
        i = getattr(err, "task_index", None)
        if getattr(err, "argument", None) != "alpha" or i is None or not 0 <= i < len(job.names):
            raise
        raise UsageError(
            f"--alpha auto: adapter {job.names[i]} ({job.adapters[i]}) has a zero update in "
            "every module (no energy), so the heterogeneity h that the rule needs is undefined; "
            "give --alpha 0 or 1, or drop that adapter (it contributes nothing to a merge)."
        ) from err


def _note_single(job: MergeJob) -> None:
    """One adapter is not an error, but nothing is merged across tasks: say so."""
    if len(job.adapters) == 1:
        say(
            "merge",
            "note",
            f"one adapter given ({job.names[0]}): nothing is merged across tasks; its own "
            "directions are selected and written as one adapter",
        )


def _zero_tasks(report: Any) -> set[int]:
    """The tasks whose update is zero in every module (no direction to keep: no singular value
    above zero anywhere, so they keep nothing and ``h`` is undefined)."""
    kept = np.asarray(report.kept_per_task)
    if report.scores is None:  # (allocation "all": every candidate kept, so none is zero)
        return {int(i) for i in np.flatnonzero(kept == 0)}
    live = np.zeros(len(kept), bool)
    for ms in report.scores.modules.values():
        live |= np.asarray(ms.sigma).max(-1, initial=0) > 0
    return {int(i) for i in np.flatnonzero(~live)}


def _warn_zero_tasks(job: MergeJob, zero: set[int]) -> None:
    """One warning line per adapter whose update is zero in every module: it is merged as
    nothing (a missing task, not a small one) and ``h`` is undefined."""
    for i in sorted(zero):
        say(
            "merge",
            "warning",
            f"{job.names[i]} has a zero update in every module (its lora_B or lora_A is all "
            "zeros, e.g. saved before training): it contributes nothing to the merge and h is "
            "undefined (nan); drop it, or check that it is the trained adapter",
        )


def _warn_low_share(job: MergeJob, report: Any, skip: set[int] = frozenset()) -> None:
    """One warning line per task that keeps less than half its uniform share (net_utility);
    ``skip``: tasks already warned of (zero everywhere)."""
    from ..pipeline.planning import report_shares

    shares = report_shares(report)
    if shares is None or report.allocation != "net_utility":
        return
    positive = np.sum(
        [(np.asarray(ms.utility) > 0).sum(1) for ms in report.scores.modules.values()], axis=0
    )
    _say_low_share(
        job, report.kept_per_task, shares, positive, report.min_share, "keeps", skip=skip
    )


def _say_low_share(job, kept, shares, positive, min_share, verb: str, skip=frozenset()) -> None:
    """The warning of each task below :data:`nu.planning.LOW_SHARE` of its uniform share (one
    line naming it, with the remedy)."""
    from ..pipeline.planning import LOW_SHARE

    for i, name in enumerate(job.names):
        if i in skip:
            continue
        k, share = int(kept[i]), float(shares[i])
        if not k < LOW_SHARE * share:
            continue
        hint = (
            f"--min-share {LOW_SHARE:g} keeps at least half of each task's share"
            if not min_share
            else f"--min-share {min_share:g} guarantees it int({min_share:g} x share) = "
            f"{int(min_share * share)} (raise it for more)"
        )
        if not job.keep_nonpositive and positive[i] < LOW_SHARE * share:
            hint += (
                f"; only {int(positive[i])} of its directions have positive utility "
                "(--keep-nonpositive admits the others)"
            )
        say(
            "merge",
            "warning",
            f"{name} {verb} {k} directions, {k / share:.0%} of its uniform share of "
            f"{share:.1f} (an equal split of the budget between the tasks); {hint}",
        )


def _dry_run(job: MergeJob) -> int:
    """``--dry-run``: everything checked, the adapters' headers and factors read, scored and
    allocated as the merge would (:func:`nu.planning.plan`); the plan printed, nothing
    written (``--out``, if given, is checked and left alone)."""
    from .. import registry
    from ..pipeline.planning import plan

    if job.distributed:
        raise UsageError("--dry-run plans in one process; drop --distributed.")
    _check_merge(job, output=job.out is not None, dry_run=True)
    options = method_options(job)
    if _streams(job):
        adapters = open_streamed(job.adapters, job)
    else:
        adapters = load(job.adapters, job, "merge").adapters
    low_rank = registry.METHODS[job.method].low_rank_in(job.space)
    p = plan(
        adapters, budget=job.budget, method=job.method, space=job.space,
        allocation=job.allocation, scope=job.scope, alpha=job.alpha, lam=job.lam,
        interference=job.interference, positive_only=not job.keep_nonpositive,
        weights=job.weights,
        min_share=job.min_share, names=list(job.names), rank=None if low_rank else job.rank,
        dtype=job.dtype, serving_ranks=job.serving_ranks,
        chunk_bytes=max(1, int(job.chunk_mb * 2**20)), mesh=_mesh_of(job),
        input_moments=load_moments(job, adapters), **options,
    )  # fmt: skip
    print(p, flush=True)
    if p.allocation == "net_utility":
        _say_low_share(
            job, p.kept_per_task, p.uniform_share, p.positive_per_task, p.min_share,
            "would keep",
        )  # fmt: skip
    _note_single(job)
    where = f"; --out {job.out} was checked and not created" if job.out else ""
    print(f"dry run: nothing merged or written{where}")
    return 0


def _warn_zeroed(job: MergeJob, report: Any, options: dict[str, Any]) -> None:
    """One line on stderr naming the modules whose merged update is exactly zero."""
    from ..pipeline.merging import zeroed_text

    if report.zeroed:
        total = len(report.ranks)
        say("merge", "warning", zeroed_text(report.zeroed, total, job.method, options))


def _merge_and_write(job, ex, out: pathlib.Path, options, key, bar) -> Any:
    """``netutility merge``'s loading, merging and writing steps; returns the report."""
    try:
        if _writes_as_it_goes(job):
            loaded = open_streamed(job.adapters, job)
            step(bar, "opened", "scoring, merging and writing (streamed)")
            report = write_merge(
                out, job, None, bar,
                fill=lambda tmp: _merge_writing(tmp, loaded, job, key, options, bar),
            )  # fmt: skip
        elif job.distributed or _streams(job):
            loaded = ex.check(_FN, lambda: open_streamed(job.adapters, job, notes=ex.index == 0))
            step(bar, "opened", "scoring and merging (streamed)")
            merged, report = _merge_streaming(loaded, job, key, options, bar)
        else:
            loaded = load(job.adapters, job, "merge")
            step(bar, "loaded", "scoring and merging")
            merged, report = _merge(loaded.adapters, job, key, options)
        if not _writes_as_it_goes(job):
            step(bar, "merged", "writing the PEFT adapter")
            _check_dense(job, report)
            result = Merged(loaded, merged, report, key, options, ex.count)
            if job.distributed:
                write_distributed(out, job, result, bar, ex)
            else:
                write_merge(out, job, result, bar)
    finally:
        if bar is not None:
            bar.close()
    return report


def _check_merge(
    job: MergeJob, *, output: bool = True, dry_run: bool = False
) -> pathlib.Path | None:
    """Everything the user gave, checked before anything is loaded (and stale staging folders
    of killed merges removed); returns ``--out`` as a path. ``output=False``: not ``--out``
    (a process of a distributed merge that does not write; it may not see that folder; or a
    dry run without one). ``dry_run``: nothing is removed (the staging folders stay)."""
    from .. import registry

    for p in job.adapters:
        check_adapter_dir(p)
    if not output:
        out, existing = (None if job.out is None else pathlib.Path(job.out)), None
    else:
        out, existing = check_out(job.out, job.adapters)
    check_extras(not job.no_plots)
    method_options(job)
    if job.interference != "overlap" and job.allocation != "net_utility":
        raise UsageError(
            f"--interference {job.interference} with --allocation {job.allocation}: only the "
            "net_utility allocation scores interference; drop --interference or use "
            "--allocation net_utility."
        )
    if job.rank is None and not registry.METHODS[job.method].low_rank_in(job.space):
        raise UsageError(
            f"method {job.method} in full space gives dense updates; pass --rank K to write "
            "them as rank-K LoRA modules (truncated SVD), or use --space core or knots."
        )
    if existing is not None and out is not None and existing == out.parent and not dry_run:
        clean_staging(existing)
    shapes = [weight_shapes(p) for p in job.adapters]
    if existing is not None and all(s is not None for s in shapes):  # (else the loader says)
        dense = not registry.METHODS[job.method].low_rank_in(job.space)
        est = estimate_out_bytes(
            shapes,  # type: ignore[arg-type]
            rank=job.rank if dense else None,
            dtype=job.dtype,
            serving_ranks=job.serving_ranks,
        )
        if _writes_as_it_goes(job):  # the tensors' side file and the final file, for a moment
            est = est._replace(bytes=2 * est.bytes - OUT_MARGIN)
        check_space(job.out, existing, est, job.dtype)
    return out


def _merge_key(job: MergeJob):
    """The PRNG key of ``--seed`` if the method draws random masks, else None."""
    import jax

    from .. import registry

    return jax.random.key(job.seed) if registry.METHODS[job.method].needs_key else None


def _merge(adapters: Sequence[Any], job: MergeJob, key, options: dict[str, Any]):
    """The merging step: :func:`nu.merge_adapters` with the flags; ``(merged, report)``."""
    import netutility_jax as nu

    return nu.merge_adapters(
        adapters, **_merge_settings(job, key), input_moments=load_moments(job, adapters),
        **options,
    )  # fmt: skip


def _merge_settings(job: MergeJob, key) -> dict[str, Any]:
    """The flags as :func:`nu.merge_adapters`' (and the streamed merge's) keyword arguments."""
    return {
        "budget": job.budget,
        "method": job.method,
        "space": job.space,
        "allocation": job.allocation,
        "scope": job.scope,
        "alpha": job.alpha,
        "lam": job.lam,
        "interference": job.interference,
        "positive_only": not job.keep_nonpositive,
        "coef": job.coef,
        "key": key,
        "mesh": _mesh_of(job),
        "weights": job.weights,
        "min_share": job.min_share,
    }


def _mesh_of(job: MergeJob):
    """``--devices``: a mesh of this process's first N (or all) devices, or None for one."""
    import jax

    import netutility_jax as nu

    local = jax.local_devices()
    n = len(local) if job.devices == "all" else job.devices
    if n > len(local):
        raise UsageError(
            f"--devices {n}: this process has {len(local)} device(s) "
            f"({local[0].platform}); pass --devices all or at most {len(local)}."
        )
    return None if n == 1 else nu.module_mesh(local[:n])


def _streams(job: MergeJob) -> bool:
    """Whether the merge streams from disk: by default, unless ``--in-memory``. (Model-wide TIES
    streams too: it reads the adapters once per pass of its threshold search.)"""
    return not job.in_memory


def _merge_streaming(source: Any, job: MergeJob, key, options: dict[str, Any], bar=None):
    """The merging step, streamed (:func:`nu.merge_adapters_streaming`); with ``--rank``, dense
    results are truncated chunk by chunk exactly as :func:`nu.peft.save_adapter` would (so
    memory stays bounded and the written adapter is the same)."""
    import netutility_jax as nu

    from .. import registry
    from ..pipeline.streaming import bound_heap

    bound_heap()  # (the command's choice for its process; the library never sets it)
    on_chunk = None
    if job.rank is not None and not registry.METHODS[job.method].low_rank_in(job.space):
        on_chunk = functools.partial(_truncate_dense, rank=job.rank)
    return nu.merge_adapters_streaming(
        source,
        **_merge_settings(job, key),
        chunk_bytes=max(1, int(job.chunk_mb * 2**20)),
        on_chunk=on_chunk,
        distributed=job.distributed,
        progress=chunk_steps(bar, "scoring and merging"),
        input_moments=load_moments(job, source),
        **options,
    )


def _writes_as_it_goes(job: MergeJob) -> bool:
    """Whether the merge writes each chunk's modules as they come (:func:`_merge_writing`): a
    streamed merge in one process, at each module's own rank. ``--serving-ranks`` (one rank for
    every module, known only at the end) and ``--distributed`` write at the end."""
    return _streams(job) and not job.distributed and job.serving_ranks is None


def _merge_writing(tmp: pathlib.Path, source: Any, job, key, options, bar) -> Any:
    """The streamed merge writing its adapter chunk by chunk into ``tmp`` (the output's staging
    folder, :class:`nu.peft.AdapterWriter`), then the report and plots; returns the report.
    Memory: one chunk, whatever the size of the merged adapter."""
    import netutility_jax as nu

    from .. import peft
    from ..pipeline.streaming import bound_heap

    bound_heap()  # (the command's choice for its process; the library never sets it)
    with peft.AdapterWriter(
        tmp / "adapter", rank=job.rank, base_config=source.config, dtype=job.dtype,
        names=source.names,
    ) as writer:  # fmt: skip
        merged, report = nu.merge_adapters_streaming(
            source,
            **_merge_settings(job, key),
            chunk_bytes=max(1, int(job.chunk_mb * 2**20)),
            on_chunk=functools.partial(_write_chunk, writer),
            input_moments=load_moments(job, source),
            progress=chunk_steps(bar, "scoring, merging and writing"),
            **options,
        )
    step(bar, "merged and written", "writing the report")
    _check_dense(job, report)
    finish_output(tmp, job, Merged(source, merged, report, key, options), bar)
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
    from .. import peft

    return peft.truncate_dense(modules, rank, fn="netutility merge")


def _check_dense(job: MergeJob, report: Any) -> None:
    """Refuse dense merged modules without ``--rank`` (a PEFT adapter holds LoRA factors)."""
    dense = sorted(n for n, r in report.ranks.items() if r is None)
    if dense and job.rank is None:
        raise UsageError(
            f"method {job.method} in {job.space} space gives dense updates ({dense[0]}"
            f"{' and more' if len(dense) > 1 else ''}); pass --rank K to write them as "
            "rank-K LoRA modules (truncated SVD)."
        )


def _merge_line(job: MergeJob, report: Any, out: pathlib.Path) -> str:
    """The line ``netutility merge`` prints when done (tasks by name; no budget, lambda or
    alpha with ``--allocation all``, which has none)."""
    per_task = np.asarray(report.kept_per_task)
    kept = ", ".join(f"{n} {int(k)}" for n, k in zip(job.names, per_task, strict=True))
    m = len(job.adapters)
    what = f"merged {m} adapter{'s' if m != 1 else ''} ({job.method}, {job.space} space, "
    if report.allocation == "all":
        return (
            f"{what}every direction kept): {int(per_task.sum())} directions, "
            f"{report.budget_spent:.2f} per module, kept per task [{kept}], "
            f"h {report.heterogeneity:.3f} -> {out}"
        )
    lam = "n/a" if report.lam is None else f"{report.lam:.4g}"
    alpha = "n/a" if report.alpha is None else f"{report.alpha:g}"
    if report.interference != "overlap":  # (this project's extension: said where it ran)
        alpha += f", {report.interference} interference"
    return (
        f"{what}{job.allocation}): budget {job.budget}, spent {report.budget_spent:.2f} per "
        f"module, kept per task [{kept}], lambda {lam}, alpha {alpha}, h "
        f"{report.heterogeneity:.3f}, non-prefix {report.non_prefix_fraction:.2f} -> {out}"
    )
