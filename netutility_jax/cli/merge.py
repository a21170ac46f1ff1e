"""``netutility merge``: flags -> configuration -> one call, and ``--dry-run``.

:func:`cmd_merge` makes the merge's one :class:`nu.MergeConfig` from its flags and
``--config`` (:func:`.config.resolve`: a flag given, else the file's key, else the default),
holds it with the arguments about the run (:meth:`.job.MergeJob.of`), checks everything the
user gave in the flags' terms before anything is loaded (:func:`_check_merge`), and calls
:func:`nu.merge_folders`, which reads the adapters, merges and writes the output folder
atomically (a staging folder renamed into place); then it prints one line and warns about
what the report shows (zero tasks and modules, tasks that keep less than half their uniform
share). ``merge --dry-run`` stops after scoring and allocating and prints the plan
(:func:`_dry_run`, :func:`nu.planning.plan`). ``merge --distributed`` joins the processes of a
``jax.distributed`` run (:mod:`.distributed`) and makes the same call in each.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import warnings
from typing import Any

import numpy as np

from ..folders import Terms, merge_folders, mesh_of, read_moments, writes_as_it_goes
from ..peft import weight_shapes
from ..pipeline import _supervise, streaming
from .common import PROG, UsageError, check_extras, flag, say
from .config import resolve
from .digests import taken_digests
from .distributed import agreed_facts, check_join, join
from .job import MergeJob
from .load import load, open_streamed
from .output import progress
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
    """``netutility merge``: flags -> configuration -> one call. The flags (and ``--config``'s
    settings under them) become the merge's :class:`nu.MergeConfig` (:func:`.config.resolve`),
    held with the arguments about the run (:meth:`.job.MergeJob.of`); everything the user gave
    is checked in the flags' terms before anything is loaded (:func:`_check_merge`), and
    :func:`nu.merge_folders` merges with that config and writes ``--out``; then one line, and
    the warnings the report calls for. With ``--dry-run``, the plan only (:func:`_dry_run`)."""
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
    cfg = job.settings
    bar = progress(5 if cfg.no_plots else 6, _FN, job.quiet or ex.index > 0)
    if bar is not None:
        bar.set_postfix_str("loading adapters")
    if not cfg.in_memory:
        streaming.bound_heap()  # (the command's choice for its process; the library never sets it)
    from ..pipeline.merging import ZeroUpdateWarning

    with warnings.catch_warnings(), _in_flag_terms(job):  # (said below, from the report)
        warnings.simplefilter("ignore", ZeroUpdateWarning)
        try:
            report = merge_folders(
                job.adapters, job.out, cfg, progress=bar, terms=TERMS,
                say=lambda kind, text: say("merge", kind, text),
                exchange=ex if job.distributed else None, keep_shards=job.keep_shards,
                digests=taken_digests(job.adapters),
            )  # fmt: skip
        finally:
            if bar is not None:
                bar.close()
    if ex.index == 0:
        _warn_zeroed(job, report)
        zero = _zero_tasks(report)
        _warn_zero_tasks(job, zero)
        _warn_low_share(job, report, skip=zero)
        _note_single(job)
        print(_merge_line(job, report, out))
    return 0


TERMS = Terms(_FN, flag)
"""How :func:`nu.merge_folders` words its refusals for the command: by the flags."""


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
        if not job.settings.keep_nonpositive and positive[i] < LOW_SHARE * share:
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
    from ..pipeline.planning import plan

    if job.distributed:
        raise UsageError("--dry-run plans in one process; drop --distributed.")
    _check_merge(job, output=job.out is not None, dry_run=True)
    cfg = job.settings
    if not cfg.in_memory:
        adapters = open_streamed(job.adapters, cfg)
    else:
        adapters = load(job.adapters, cfg, "merge").adapters
    moments, _ = read_moments(cfg.input_moments, adapters, job.names, spell=flag)
    p = plan(
        adapters, budget=cfg.budget, method=cfg.method, space=cfg.space,
        allocation=cfg.allocation, scope=cfg.scope, alpha=cfg.alpha, lam=cfg.lam,
        interference=cfg.interference, positive_only=not cfg.keep_nonpositive,
        weights=cfg.weights, min_share=cfg.min_share, names=list(job.names),
        rank=cfg.rank if cfg.dense else None, dtype=cfg.dtype, serving_ranks=cfg.serving_ranks,
        chunk_bytes=cfg.chunk_bytes, mesh=mesh_of(cfg.devices, spell=flag),
        input_moments=moments, **cfg.method_options,
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


def _warn_zeroed(job: MergeJob, report: Any) -> None:
    """One line on stderr naming the modules whose merged update is exactly zero."""
    from ..pipeline.merging import zeroed_text

    if report.zeroed:
        total = len(report.ranks)
        say(
            "merge", "warning",
            zeroed_text(report.zeroed, total, job.settings.method, job.settings.method_options),
        )  # fmt: skip


def _check_merge(
    job: MergeJob, *, output: bool = True, dry_run: bool = False
) -> pathlib.Path | None:
    """Everything the user gave, checked before anything is loaded (and stale staging folders
    of killed merges removed); returns ``--out`` as a path. ``output=False``: not ``--out``
    (a process of a distributed merge that does not write; it may not see that folder; or a
    dry run without one). ``dry_run``: nothing is removed (the staging folders stay)."""
    cfg = job.settings
    for p in job.adapters:
        check_adapter_dir(p)
    if not output:
        out, existing = (None if job.out is None else pathlib.Path(job.out)), None
    else:
        out, existing = check_out(job.out, job.adapters)
    check_extras(not cfg.no_plots)
    if cfg.interference != "overlap" and cfg.allocation != "net_utility":
        raise UsageError(
            f"--interference {cfg.interference} with --allocation {cfg.allocation}: only the "
            "net_utility allocation scores interference; drop --interference or use "
            "--allocation net_utility."
        )
    if cfg.rank is None and cfg.dense:
        raise UsageError(
            f"method {cfg.method} in full space gives dense updates; pass --rank K to write "
            "them as rank-K LoRA modules (truncated SVD), or use --space core or knots."
        )
    if existing is not None and out is not None and existing == out.parent and not dry_run:
        clean_staging(existing)
    shapes = [weight_shapes(p) for p in job.adapters]
    if existing is not None and all(s is not None for s in shapes):  # (else the loader says)
        est = estimate_out_bytes(
            shapes,  # type: ignore[arg-type]
            rank=cfg.rank if cfg.dense else None,
            dtype=cfg.dtype,
            serving_ranks=cfg.serving_ranks,
        )
        # the tensors' side file and the final file, for a moment
        if writes_as_it_goes(cfg, distributed=job.distributed):
            est = est._replace(bytes=2 * est.bytes - OUT_MARGIN)
        check_space(job.out, existing, est, cfg.dtype)
    return out


def _merge_line(job: MergeJob, report: Any, out: pathlib.Path) -> str:
    """The line ``netutility merge`` prints when done (tasks by name; no budget, lambda or
    alpha with ``--allocation all``, which has none)."""
    per_task = np.asarray(report.kept_per_task)
    kept = ", ".join(f"{n} {int(k)}" for n, k in zip(job.names, per_task, strict=True))
    m = len(job.adapters)
    what = f"merged {m} adapter{'s' if m != 1 else ''} ({job.settings.method}, {job.settings.space} space, "
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
        f"{what}{job.settings.allocation}): budget {job.settings.budget}, spent {report.budget_spent:.2f} per "
        f"module, kept per task [{kept}], lambda {lam}, alpha {alpha}, h "
        f"{report.heterogeneity:.3f}, non-prefix {report.non_prefix_fraction:.2f} -> {out}"
    )
