"""A merge's plan before the merge: what each task keeps, the output ranks and size, the cost.

:func:`plan` scores and allocates exactly as :func:`nu.merge_adapters` (adapters in memory) or
:func:`nu.merge_adapters_streaming` (a :class:`nu.peft.AdapterSet`, read a chunk at a time)
would, and stops there: nothing is merged or written. Its :class:`Plan` says, per task (by
name), how many directions it keeps against its uniform share of the budget (see
:mod:`netutility_jax.allocation._min_share`), per module the output rank, the size of the adapter's
tensors, and a rough time and memory estimate. ``netutility merge --dry-run`` prints it.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._core import checks as _checks
from .._core import tree as _tree
from .._core.checks import size_text
from ..allocation import _min_share
from ..errors import InputError
from . import merging, streaming
from ._report import heterogeneity_or_nan
from ._request import MergeRequest

__all__ = ["LOW_SHARE", "Plan", "plan", "report_shares", "task_names"]

LOW_SHARE = 0.5
"""A task keeping less than this fraction of its uniform share is flagged (and
``netutility merge`` warns about it)."""

_TABLE_MODULES = 16  # more modules than this: the plan summarises their ranks instead of listing


def task_names(paths: Sequence[str | os.PathLike]) -> list[str]:
    """Names for the tasks of adapter folders: each folder's name, with as many parent folders as
    it takes to tell equal names apart, and ``#2``, ``#3`` ... for the same folder given twice.

    Example:
      >>> task_names(["runs/a/adapter", "runs/b/adapter", "sql/"])
      ['a/adapter', 'b/adapter', 'sql']
      >>> task_names(["x", "x"])
      ['x', 'x#2']
    """
    parts = [pathlib.PurePath(os.path.abspath(os.fspath(p))).parts for p in paths]

    def suffix(i: int, d: int) -> tuple[str, ...]:
        return parts[i][-d:]

    names = []
    for i, p in enumerate(parts):
        d = 1  # the fewest trailing parts that tell it apart from every other folder
        while d < len(p) and any(
            parts[j] != p and suffix(j, d) == suffix(i, d) for j in range(len(parts))
        ):
            d += 1
        names.append("/".join(suffix(i, d)) or os.sep)
    out, seen = [], {}
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def report_shares(report: merging.Report) -> np.ndarray | None:
    """``(M,)`` each task's uniform share of the budget of a merge's :class:`nu.Report` (see
    :mod:`netutility_jax.allocation._min_share`); None where there is no budget (``allocation="all"``)."""
    if report.allocation == "all" or report.scores is None or report.budget is None:
        return None
    return _min_share.uniform_shares(
        _min_share.candidates(report.scores),
        report.budget,
        scope=report.scope if report.allocation == "net_utility" else "local",
    )


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """What a merge would keep and write (:func:`plan`); ``str(plan)`` is a readable summary.

    Attributes:
      tasks: the tasks' names, in order.
      method, space, allocation, scope: the merge's settings (``scope`` None unless net utility).
      budget: R (None with ``allocation="all"``).
      min_share, weights: as given to :func:`plan` (None: none); weights scale the merged
        updates and change nothing in the plan but the output's values.
      lam, alpha: the interference weight and geometry the scoring used (None for ``"all"``).
      heterogeneity: ``h`` of the tasks; NaN if a task is all zero.
      kept_per_task: directions each task keeps over all modules.
      uniform_share: each task's uniform share of the budget (None for ``"all"``).
      candidates_per_task: each task's candidate directions (nonzero singular values).
      positive_per_task: each task's directions of positive utility (None for ``"all"``).
      kept: ``{module: (M,) int}`` directions kept per module and task.
      ranks: ``{module: int | None}`` each module's rank as written: the directions kept there
        (exact for ta, tsv and iso_c; an upper bound for the other methods, whose results can
        have lower rank), ``rank`` for dense results (TIES/DARE in full space; None without
        it), or the one serving rank; a module that keeps nothing is written at rank 1.
      shapes: ``{module: (d_in, d_out)}``.
      out_bytes: bytes of the written adapter's tensors in ``dtype`` (an upper bound where the
        ranks are).
      dtype: the written dtype.
      streamed: whether the adapters were read a chunk at a time (an ``AdapterSet``).
      seconds: wall time this plan took (reading, decomposing and scoring every module once).
      est_seconds: a rough estimate of the merge's time (see :func:`plan`).
      peak_memory: this process's peak resident memory so far, in bytes (None if unknown).
      est_memory: a rough estimate of the merge's peak memory, in bytes (None if unknown).
      masks: ``{module: bool (M, r_max)}`` the kept directions (``nu.merge(adapters, masks)``).
    """

    tasks: tuple[str, ...]
    method: str
    space: str
    allocation: str
    scope: str | None
    budget: int | None
    min_share: float | None
    weights: tuple[float, ...] | None
    lam: float | None
    alpha: float | None
    heterogeneity: float
    kept_per_task: tuple[int, ...]
    uniform_share: tuple[float, ...] | None
    candidates_per_task: tuple[int, ...]
    positive_per_task: tuple[int, ...] | None
    kept: dict[str, tuple[int, ...]]
    ranks: dict[str, int | None]
    shapes: dict[str, tuple[int, int]]
    out_bytes: int
    dtype: str
    streamed: bool
    seconds: float
    est_seconds: float
    peak_memory: int | None
    est_memory: int | None
    masks: dict[str, Any] = dataclasses.field(repr=False)

    def low_share(self, threshold: float = LOW_SHARE) -> tuple[str, ...]:
        """The tasks that keep less than ``threshold`` times their uniform share."""
        if self.uniform_share is None or self.allocation != "net_utility":
            return ()
        return tuple(
            t
            for t, k, s in zip(self.tasks, self.kept_per_task, self.uniform_share, strict=True)
            if k < threshold * s
        )

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (masks left out)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "masks"}
        out["kept"] = {n: list(k) for n, k in self.kept.items()}
        out["shapes"] = {n: list(s) for n, s in self.shapes.items()}
        out["low_share"] = list(self.low_share())
        return out

    def __str__(self) -> str:
        return "\n".join(self._lines())

    def _lines(self) -> list[str]:
        n_mod = len(self.kept)
        head = f"plan: {self.method} in {self.space} space, "
        if self.allocation == "all":
            head += "every direction kept (allocation all)"
        else:
            what = "net_utility" if self.allocation == "net_utility" else "uniform"
            scope = f" ({self.scope} scope)" if self.scope else ""
            head += (
                f"{what} allocation{scope}, budget {self.budget} per module x {n_mod} modules "
                f"= {self.budget * n_mod} directions"  # type: ignore[operator]
            )
            if self.min_share:
                head += f", each task at least {self.min_share:g} of its uniform share"
        lines = [head]
        if self.lam is not None:
            lines.append(
                f"lambda {self.lam:.4g}, alpha {self.alpha:g}, heterogeneity h "
                f"{self.heterogeneity:.3f}"
            )
        lines.extend(self._task_lines())
        lines.extend(self._module_lines())
        total = sum(self.kept_per_task)
        known = [r for r in self.ranks.values() if r is not None]
        if not known:
            ranks = "dense"
        elif min(known) == max(known):
            ranks = f"at rank {known[0]}"
        else:
            ranks = f"at ranks {min(known)}-{max(known)}"
        lines.append(
            f"output: {total} directions kept; about {size_text(self.out_bytes)} of adapter tensors "
            f"in {self.dtype} ({n_mod} modules {ranks})"
        )
        lines.append(
            f"estimate: about {self.est_seconds:.3g} s to merge (this plan took "
            f"{self.seconds:.3g} s to read and score every module)"
            + (
                f", about {size_text(self.est_memory)} of memory (this process's peak so far: "
                f"{size_text(self.peak_memory)})"  # type: ignore[arg-type]
                if self.est_memory is not None
                else ""
            )
        )
        return lines

    def _task_lines(self) -> list[str]:
        w = max(4, *(len(t) for t in self.tasks))
        share = self.uniform_share is not None
        header = f"  {'task':<{w}}  {'kept':>6}"
        if share:
            header += f"  {'uniform share':>13}  {'kept/share':>10}"
        header += f"  {'candidates':>10}"
        if self.positive_per_task is not None:
            header += f"  {'positive':>8}"
        if self.weights is not None:
            header += f"  {'weight':>8}"
        out = [header]
        low = set(self.low_share())
        for i, t in enumerate(self.tasks):
            line = f"  {t:<{w}}  {self.kept_per_task[i]:>6}"
            if share:
                s = self.uniform_share[i]  # type: ignore[index]
                frac = f"{self.kept_per_task[i] / s:.0%}" if s > 0 else "-"
                line += f"  {s:>13.1f}  {frac:>10}"
            line += f"  {self.candidates_per_task[i]:>10}"
            if self.positive_per_task is not None:
                line += f"  {self.positive_per_task[i]:>8}"
            if self.weights is not None:
                line += f"  {self.weights[i]:>8g}"
            if t in low:
                line += f"  <- below {LOW_SHARE:g} of its share"
            out.append(line)
        return out

    def _module_lines(self) -> list[str]:
        n_mod = len(self.kept)
        bound = "" if self.method in ("ta", "tsv", "iso_c") else " (at most)"
        if n_mod <= _TABLE_MODULES:
            w = max(6, *(len(n) for n in self.kept))
            head = "rank" + bound
            rw = max(len(head), 5)
            out = [f"  {'module':<{w}}  {head:>{rw}}  kept per task"]
            for n, k in self.kept.items():
                r = self.ranks[n]
                rank = "dense" if r is None else str(r)
                out.append(f"  {n:<{w}}  {rank:>{rw}}  {' '.join(str(x) for x in k)}")
            return out
        known = sorted(r for r in self.ranks.values() if r is not None)
        if not known:
            return [f"  {n_mod} modules, all dense (pass rank= to write them as LoRA modules)"]
        counts: dict[int, int] = {}
        for r in known:
            counts[r] = counts.get(r, 0) + 1
        common = sorted(counts.items(), key=lambda rc: (-rc[1], rc[0]))[:5]
        shown = ", ".join(f"rank {r}: {c}" for r, c in common)
        more = f" and {len(counts) - 5} other ranks" if len(counts) > 5 else ""
        top = sorted(self.ranks, key=lambda n: -(self.ranks[n] or 0))[:3]
        return [
            f"  output ranks{bound} over {n_mod} modules: min {known[0]}, median "
            f"{known[len(known) // 2]}, max {known[-1]}; most common {shown}{more}",
            "  largest: " + ", ".join(f"{_checks.short(n, 60)} ({self.ranks[n]})" for n in top),
        ]


def _peak_rss() -> int | None:
    try:
        import resource
    except ImportError:  # (not on Windows)
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if os.uname().sysname == "Darwin" else 1024)


def _written_ranks(
    fn: str,
    kept: Mapping[str, np.ndarray],
    shapes: Mapping[str, tuple[int, int]],
    *,
    low_rank: bool,
    rank: int | None,
    serving_ranks: Any,
) -> dict[str, int | None]:
    """Each module's rank as written (see :attr:`Plan.ranks`)."""
    out: dict[str, int | None] = {}
    for n, k in kept.items():
        if low_rank:
            out[n] = max(1, int(np.sum(k)))
        elif rank is not None:
            out[n] = min(rank, *shapes[n])
        else:
            out[n] = None
    if serving_ranks is not None:
        from ..peft import _write

        allowed = _write.check_serving_ranks(serving_ranks, fn=fn) or ()
        top = max((r or 0 for r in out.values()), default=0)
        fits = [r for r in allowed if r >= top]
        if fits:
            out = dict.fromkeys(out, fits[0])
    return out


def plan(
    adapters: Any,
    *,
    budget: int | None = None,
    method: str = "ta",
    space: str = "full",
    allocation: str = "net_utility",
    scope: str | None = None,
    alpha: float | str = 1.0,
    lam: float | str = "auto",
    positive_only: bool = True,
    weights: Sequence[float] | None = None,
    min_share: float | None = None,
    names: Sequence[str] | None = None,
    rank: int | None = None,
    dtype: str = "float32",
    serving_ranks: Any = None,
    chunk_bytes: int = streaming.CHUNK_BYTES,
    mesh: Any = None,
    input_moments: Sequence[Any] | None = None,
    interference: str = "overlap",
    **options: Any,
) -> Plan:
    """The plan of a merge: score and allocate as the merge would, and stop (nothing merged).

    With adapters in memory this is :func:`nu.merge_adapters`' scoring and allocation; with a
    :class:`nu.peft.AdapterSet` (:func:`nu.peft.open_adapters`) it is
    :func:`nu.merge_adapters_streaming`'s first pass (every chunk read once, ``chunk_bytes`` at
    a time), so the plan's masks are the merge's. The output ranks follow from the masks (see
    :attr:`Plan.ranks`); the size is that of the tensors of the PEFT adapter
    :func:`nu.peft.save_adapter` would write.

    The estimates are rough. Time: the merge reads and decomposes every module again (model-wide
    TIES: four more times) after a pass like this plan's, so it takes about this plan's time
    once more per pass (``allocation="all"`` has no scoring pass); elementwise methods in full
    space work on dense ``d_in x d_out`` updates and take longer. Memory: this process's peak so
    far (which the plan's own chunks set) plus the merged result, which the merge holds (less
    when it writes each chunk as it goes, as ``netutility merge`` does).

    Args:
      adapters: M adapters in memory (as for :func:`nu.merge_adapters`), or an ``AdapterSet``.
      budget, method, space, allocation, scope, alpha, lam, positive_only, weights, min_share,
        input_moments, interference, **options: as for :func:`nu.merge_adapters` (the method's
        options are checked as there; ``input_moments`` gives the data-aware merge's masks,
        ``interference="signed"`` the sign-aware one's).
      names: M task names (default: the folders' names for an ``AdapterSet``, disambiguated as
        :func:`task_names`; ``"task 0"``, ``"task 1"`` ... for adapters in memory).
      rank: the rank dense results are written at (as ``nu.peft.save_adapter(rank=)``).
      dtype: the written dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
      serving_ranks: as :func:`nu.peft.save_adapter`'s (every module at one allowed rank).
      chunk_bytes, mesh: as for :func:`nu.merge_adapters_streaming` (``mesh`` also in memory).

    Returns:
      A :class:`Plan`.

    Raises:
      InputError, InputTypeError: what the merge would raise for these arguments and adapters
        (before merging), and names that are not M distinct strings, an unknown ``dtype``.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> from netutility_jax.planning import plan
      >>> rng = np.random.default_rng(0)
      >>> ads = [{f"m{l}": {"lora_a": rng.normal(size=(32, 4)), "lora_b": rng.normal(size=(4, 16))}
      ...         for l in range(2)} for _ in range(3)]
      >>> p = plan(ads, budget=4, names=["a", "b", "c"])
      >>> _, rep = nu.merge_adapters(ads, budget=4)
      >>> p.kept_per_task == tuple(int(k) for k in rep.kept_per_task), p.tasks
      (True, ('a', 'b', 'c'))
      >>> sum(p.kept_per_task) == sum(p.ranks.values())  # TA: a module's rank is what it keeps
      True
    """
    fn = "nu.plan"
    start = time.perf_counter()
    req = MergeRequest.check(
        fn, budget=budget, method=method, space=space, allocation=allocation, scope=scope,
        alpha=alpha, lam=lam, positive_only=positive_only, min_share=min_share,
        input_moments=input_moments, options=options, weights=weights, merges=False,
        interference=interference,
    )  # fmt: skip
    _checks.check_choice(fn, "dtype", dtype, ("float32", "bfloat16", "float16"))
    rank = _check_rank(fn, rank)
    p = _scored(fn, adapters, req, chunk_bytes, mesh)
    tasks = _check_names(fn, names, p.m_tasks) if names is not None else tuple(p.default_names)
    seconds = time.perf_counter() - start
    kept = {n: np.asarray(m, bool).sum(1) for n, m in p.kept_masks.items()}
    ranks = _written_ranks(
        fn, kept, p.shapes, low_rank=req.resolved.spec.low_rank_in(space), rank=rank,
        serving_ranks=serving_ranks,
    )  # fmt: skip
    itemsize = 4 if dtype == "float32" else 2
    out_bytes = sum(
        (d_in * d_out if ranks[n] is None else ranks[n] * (d_in + d_out)) * itemsize  # type: ignore[operator]
        for n, (d_in, d_out) in p.shapes.items()
    )
    passes = 4 if req.resolved.model_wide else 1
    peak = _peak_rss()
    held = out_bytes * 4 // itemsize  # (the merged result is held in float32, then cast)
    sc = p.scores
    return Plan(
        tasks=tasks,
        method=method,
        space=space,
        allocation=allocation,
        scope=p.req.report_scope,
        budget=None if budget is None else int(budget),
        min_share=req.min_share,
        weights=p.req.weights,
        lam=None if sc is None else float(sc.lam),
        alpha=None if sc is None else float(sc.alpha),
        heterogeneity=p.h,
        **_task_counts(sc, kept, budget, allocation, req.scope),
        kept={n: tuple(int(x) for x in k) for n, k in kept.items()},
        ranks=ranks,
        shapes={n: (int(a), int(b)) for n, (a, b) in p.shapes.items()},
        out_bytes=int(out_bytes),
        dtype=dtype,
        streamed=p.streamed,
        seconds=seconds,
        est_seconds=seconds * (passes if allocation == "all" else 1 + passes),
        peak_memory=peak,
        est_memory=None if peak is None else peak + held,
        masks=dict(p.kept_masks),
    )


def _check_rank(fn: str, rank: Any) -> int | None:
    if rank is None:
        return None
    r = _checks.as_integer(rank)
    if r is None or r < 1:
        raise InputError(
            f"{fn}: rank={_checks.given(rank)}; expected a positive integer (the rank dense "
            "results are written at) or None."
        )
    return r


class _Scored(NamedTuple):
    """The plan's scoring pass (:func:`_scored`)."""

    req: MergeRequest  # with its weights checked against the tasks
    scores: Any  # None for allocation="all"
    kept_masks: Mapping[str, Any]
    h: float
    shapes: dict[str, tuple[int, int]]
    m_tasks: int
    default_names: list[str]
    streamed: bool


def _scored(fn: str, adapters: Any, req: MergeRequest, chunk_bytes: int, mesh: Any) -> _Scored:
    """Score and allocate as the merge would: streamed for an ``AdapterSet``, else in memory."""
    streamed = all(hasattr(adapters, a) for a in ("names", "shapes", "paths", "read"))
    if streamed:
        m_tasks = len(adapters.paths)
        req = req.with_tasks(m_tasks)
        sc, kept_masks, h = streaming.score_and_allocate(
            adapters, req, chunk_bytes=chunk_bytes, mesh=mesh
        )
        shapes = {n: tuple(adapters.shapes[n][:2]) for n in adapters.names}
        return _Scored(req, sc, kept_masks, h, shapes, m_tasks, task_names(adapters.paths), True)
    mod_names, buckets, m_tasks = _tree.collect(adapters, fn=fn)
    req = req.with_tasks(m_tasks)
    sc, _, kept_masks = req.allocate(adapters, mod_names, buckets, mesh)
    shapes = {n: (bk.d_in, bk.d_out) for bk in buckets for n in bk.names}
    shapes = {n: shapes[n] for n in mod_names}
    h = heterogeneity_or_nan(adapters)
    default_names = [f"task {i}" for i in range(m_tasks)]
    return _Scored(req, sc, kept_masks, h, shapes, m_tasks, default_names, False)


def _task_counts(sc: Any, kept: Mapping[str, np.ndarray], budget, allocation, scope) -> dict:
    """The plan's per-task counts: kept, uniform share, candidates, positive utilities."""
    cand = _min_share.candidates(sc) if sc is not None else kept
    uniform = None
    if allocation != "all":
        uniform = tuple(
            float(s)
            for s in _min_share.uniform_shares(
                cand, budget, scope=scope if allocation == "net_utility" else "local"
            )
        )
    positive = None
    if sc is not None:
        utilities = [(np.asarray(ms.utility) > 0).sum(1) for ms in sc.modules.values()]
        positive = tuple(int(c) for c in np.sum(utilities, axis=0))
    return {
        "kept_per_task": tuple(int(k) for k in np.sum(list(kept.values()), axis=0).astype(int)),
        "uniform_share": uniform,
        "candidates_per_task": tuple(int(c) for c in np.sum(list(cand.values()), axis=0)),
        "positive_per_task": positive,
    }


def _check_names(fn: str, names: Any, m_tasks: int) -> tuple[str, ...]:
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise InputError(f"{fn}: names={_checks.given(names)}; expected {m_tasks} strings.")
    out = tuple(names)
    if len(out) != m_tasks or not all(isinstance(n, str) and n for n in out):
        raise InputError(
            f"{fn}: names={_checks.brief(list(out))}; expected {m_tasks} non-empty strings, one "
            "per task."
        )
    if len(set(out)) != len(out):
        raise InputError(f"{fn}: names={_checks.brief(list(out))}; the names must differ.")
    return out
