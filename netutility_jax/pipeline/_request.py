"""A merge's arguments, checked once: :class:`MergeRequest`, and the allocation it asks for.

:func:`nu.merge_adapters`, :func:`nu.merge_adapters_streaming` and :func:`nu.plan` take the same
settings (budget, method, space, allocation, scope, alpha, lam, positive_only, coef, key,
weights, min_share, input_moments and the method's options). Each checks them here, in one
order, into one frozen :class:`MergeRequest`, and passes that on: to the allocation
(:meth:`MergeRequest.allocate` in memory, :meth:`MergeRequest.select` for the streamed scores),
to the merge and to the report (:func:`netutility_jax.pipeline._report.build_report`). The names and
defaults of the three signatures are the fields of :class:`MergeRequest` (a test compares them).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from .. import registry
from .._core import buckets as _buckets
from .._core import checks as _checks
from .._core import tree as _tree
from .._core.executables import factor_bytes, small_merge
from .._core.linalg import settle
from ..allocation import _min_share
from ..errors import InputError, InputTypeError
from ..operators import _plan, _stages
from ..scoring._run import check_interference
from ..scoring.utility import score

__all__ = [
    "DEFAULTS",
    "FAST_COMPILE_METHODS",
    "MERGE_DEFAULTS",
    "MergeRequest",
    "all_candidates",
    "check_input_moments",
    "check_weights",
    "has_data",
    "sized_merge",
]

#: The settings :func:`nu.merge_adapters`, :func:`nu.merge_adapters_streaming` and :func:`nu.plan`
#: take, with their defaults (their signatures; a test compares them).
DEFAULTS: Mapping[str, Any] = {
    "budget": None,
    "method": "ta",
    "space": "full",
    "allocation": "net_utility",
    "scope": None,
    "alpha": 1.0,
    "lam": "auto",
    "positive_only": True,
    "weights": None,
    "min_share": None,
    "input_moments": None,
    "interference": "overlap",
}
#: :data:`DEFAULTS` and what only a merge takes (not a plan): the merged update's coefficient
#: and the PRNG key of the methods that draw.
MERGE_DEFAULTS: Mapping[str, Any] = {**DEFAULTS, "coef": 1.0, "key": None}


@dataclasses.dataclass(frozen=True)
class MergeRequest:
    """A merge's settings, checked (:meth:`check`): what the three entry points share.

    Attributes:
      fn: the public function called (error messages name it).
      method, space, allocation, budget, alpha, lam, positive_only, coef, key, input_moments:
        as given (checked).
      scope: the budget's scope, the method's paper default where None was given.
      weights: None, or M floats once :meth:`with_tasks` has checked them (as given before).
      min_share: the per-task floor (None: none, or 0).
      options: the method's options as given (``**options``).
      resolved: the method and space with every option checked and defaulted.
      interference: the scoring's interference term, ``"overlap"`` (the paper's), ``"signed"``
        (this project's sign-aware extension) or ``"signed_weaker"`` (its asymmetric form;
        :func:`nu.score`).
    """

    fn: str
    method: str
    space: str
    allocation: str
    scope: str
    budget: int | None
    alpha: float | str
    lam: float | str
    positive_only: bool
    coef: Any
    key: Any
    weights: Any
    min_share: float | None
    input_moments: Any
    options: Mapping[str, Any]
    resolved: registry.Resolved
    interference: str = "overlap"

    @classmethod
    def check(
        cls,
        fn: str,
        *,
        budget: Any,
        method: str,
        space: str,
        allocation: str,
        scope: str | None,
        alpha: Any,
        lam: Any,
        positive_only: Any,
        min_share: Any,
        input_moments: Any,
        options: Mapping[str, Any],
        weights: Any = None,
        coef: Any = 1.0,
        key: Any = None,
        merges: bool = True,
        interference: Any = "overlap",
    ) -> MergeRequest:
        """The settings checked, in the order every entry point reports them: the method and
        its options, the budget's arguments, ``min_share``, ``input_moments`` against the
        allocation, then (``merges``: a merge, not a plan) ``coef`` and the method's ``key``.
        ``weights`` are checked by :meth:`with_tasks`, once the tasks are counted."""
        res = registry.resolve_options(fn, method, space, dict(options))
        scope = _check_budget_args(fn, res, allocation, scope, budget, alpha, lam, positive_only)
        floor = _min_share.check_min_share(fn, min_share, allocation)
        check_input_moments(fn, input_moments, allocation)
        interference = check_interference(fn, interference)
        if interference != "overlap" and allocation != "net_utility":
            raise InputError(
                f"{fn}: interference={interference!r} with allocation={allocation!r}: only the "
                "net_utility allocation scores interference; drop interference= or use "
                "allocation='net_utility'."
            )
        if merges:
            _plan.check_coef(fn, coef)
            if res.spec.needs_key:
                _plan.check_key(fn, key, res.spec.name)
        return cls(
            fn=fn, method=method, space=space, allocation=allocation, scope=scope, budget=budget,
            alpha=alpha, lam=lam, positive_only=positive_only, coef=coef, key=key,
            weights=weights, min_share=floor, input_moments=input_moments,
            options=dict(options), resolved=res, interference=interference,
        )  # fmt: skip

    def with_tasks(self, m_tasks: int) -> MergeRequest:
        """The request with its ``weights`` checked against ``m_tasks`` (:func:`check_weights`)."""
        return dataclasses.replace(self, weights=check_weights(self.fn, self.weights, m_tasks))

    @property
    def data_aware(self) -> bool:
        """Whether the scores use input moments (:func:`has_data`)."""
        return has_data(self.input_moments)

    @property
    def zero_merge(self) -> bool:
        """``coef == 0``: a zero merge asked for (nothing to warn about); False if traced."""
        return not isinstance(self.coef, jax.core.Tracer) and (
            float(np.asarray(self.coef, np.float64)) == 0
        )

    @property
    def report_scope(self) -> str | None:
        """The scope a report or plan records: the budget's for Net Utility, else None."""
        return self.scope if self.allocation == "net_utility" else None

    def select(self, sc: Any) -> dict[str, Any]:
        """The masks of the allocation over scores ``sc`` (uniform, or Net Utility in the
        request's scope), with ``min_share``'s floor."""
        return _min_share.select(
            sc,
            self.budget,  # type: ignore[arg-type]
            allocation=self.allocation,
            scope=self.scope,
            positive_only=_checks.check_bool(self.fn, "positive_only", self.positive_only),
            min_share=self.min_share,
        )

    def allocate(
        self, adapters: Any, names: Any, buckets: Any, mesh: Any
    ) -> tuple[Any, dict[str, Any] | None, dict[str, Any]]:
        """``(scores, masks, kept masks)`` of an in-memory merge: ``allocation="all"`` scores
        nothing (``masks=None``: every candidate, which the kept masks list); otherwise
        :func:`nu.score` (data-aware with ``input_moments``) and :meth:`select`'s masks."""
        if self.allocation == "all":
            return None, None, all_candidates(self.fn, names, buckets)
        sc = score(
            adapters, alpha=self.alpha, lam=self.lam, mesh=mesh, input_moments=self.input_moments,
            interference=self.interference,
        )  # fmt: skip
        masks = self.select(sc)
        return sc, masks, masks


def _check_budget_args(fn, res, allocation, scope, budget, alpha, lam, positive_only) -> str:
    """The budget's own arguments checked; returns its scope (the paper's default for the
    method if None)."""
    _checks.check_choice(fn, "allocation", allocation, registry.ALLOCATIONS)
    if scope is not None:
        _checks.check_choice(
            fn, "scope", scope, ("global", "local"), " or None (the paper's choice per method)"
        )
    if budget is None:
        if allocation != "all":
            raise InputError(
                f"{fn}: budget=None with allocation={allocation!r}; pass budget=R, a positive "
                "integer (directions per module on average). Only allocation='all' needs none."
            )
    elif isinstance(budget, (bool, np.bool_)) or not isinstance(budget, numbers.Integral):
        raise InputTypeError(
            f"{fn}: budget={_checks.given(budget)}; expected a positive integer R (directions "
            "per module on average)."
        )
    elif budget <= 0:
        raise InputError(
            f"{fn}: budget={_checks.given(budget)}; expected a positive integer R (directions "
            "per module on average)."
        )
    _checks.check_auto(
        fn, "alpha", alpha, "a finite number >= 0 (1.0 Gram geometry, 0.0 row space) or 'auto'"
    )
    _checks.check_auto(fn, "lam", lam, "a finite number >= 0 (the interference weight) or 'auto'")
    _checks.check_bool(fn, "positive_only", positive_only)
    return res.spec.budget_scope if scope is None else scope


def check_input_moments(fn: str, input_moments: Any, allocation: str) -> None:
    """Refuse ``input_moments`` with an allocation that does not score (``"uniform"`` keeps
    spectral prefixes, ``"all"`` every candidate): the moments would be silently unused. The
    entries themselves are checked against the adapters by :func:`nu.score`."""
    if input_moments is not None and allocation != "net_utility":
        raise InputError(
            f"{fn}: input_moments was given with allocation={allocation!r}, which does not use "
            "the scores' geometry (uniform keeps each task's spectral prefix, 'all' every "
            "direction); pass allocation='net_utility' for the data-aware score, or drop "
            "input_moments."
        )


def has_data(input_moments: Any) -> bool:
    """Whether ``input_moments`` (checked by :func:`nu.score`) holds data for at least one
    task-module (every entry None, or None at every name, is the data-free score)."""
    if input_moments is None:
        return False
    return any(
        entry is not None and any(v is not None for v in entry.values()) for entry in input_moments
    )


def check_weights(fn: str, weights: Any, m_tasks: int) -> tuple[float, ...] | None:
    """``weights`` as a tuple of ``m_tasks`` finite nonzero floats (None: no weights).

    Raises:
      InputTypeError: not a sequence of real numbers.
      InputError: the wrong number of weights, or one that is zero, NaN or infinite.
    """
    if weights is None:
        return None
    _checks.check_weights_sequence(fn, weights, m_tasks)
    values = list(np.asarray(weights).ravel()) if hasattr(weights, "shape") else list(weights)
    if len(values) != m_tasks:
        raise InputError(
            f"{fn}: {len(values)} weights for {m_tasks} tasks; pass one weight per task (adapter)."
        )
    out = []
    for i, w in enumerate(values):
        v = _checks.real_option(
            fn, f"weights[{i}]", w, "a finite nonzero number (task i's update is multiplied by "
            "it; drop the adapter instead of weighting it 0)", lambda x: x != 0, traced=False,
        )  # fmt: skip
        out.append(v)
    return tuple(out)


def all_candidates(fn: str, names: Any, buckets: Any) -> dict[str, Any]:
    """``allocation="all"``: every candidate direction of every module (no scoring)."""
    dtype = _tree.compute_dtype(buckets)
    _plan.check_scale_range(fn, buckets, dtype)
    kept: dict[str, Any] = {}
    for bk in buckets:
        stacked = bk.stacked  # (nu.stack_adapters: stacked already)
        if stacked is None:
            cfg = _stages.StackConfig(bk.d_in, bk.d_out, bk.r_max, dtype)
            stacked = _stages.stage_stack(_buckets.bucket_arrays(bk), cfg=cfg)
        keep = settle(_stages.stage_keep(*stacked, r_max=bk.r_max))  # one LAPACK call at a time
        for j, nm in enumerate(bk.names):
            kept[nm] = keep[j]
    return {nm: kept[nm] for nm in names}


#: The methods whose merge programs :func:`sized_merge` lets compile for speed of compiling:
#: TA's work is sums and small products of the factors (on a 34 MB set, 2.6 s of compile instead
#: of 18 s, 0.5 s a call instead of 0.3); TSV's and Iso-C's spectral steps and the elementwise
#: methods' dense coordinates ran several times slower at LLVM's level 0
#: (benchmarks/results/fast_compile.json), so they keep XLA's defaults.
FAST_COMPILE_METHODS = ("ta",)


def sized_merge(fun: Callable) -> Callable:
    """``fun(adapters, ..., method=...)`` inside :func:`_executables.small_merge` of its
    factors' bytes when ``method`` is one of :data:`FAST_COMPILE_METHODS` (its merge programs
    may then be compiled for speed of compiling, on the CPU); any other method's with XLA's
    defaults."""

    @functools.wraps(fun)
    def sized(adapters: Any, *args: Any, **kwargs: Any) -> Any:
        fast = kwargs.get("method", "ta") in FAST_COMPILE_METHODS
        with small_merge(factor_bytes(adapters) if fast else None):
            return fun(adapters, *args, **kwargs)

    return sized
