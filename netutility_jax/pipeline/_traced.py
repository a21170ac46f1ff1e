"""Merges inside a JAX transformation (``jax.jit``, ``jax.grad``, ``jax.vmap``): what
:func:`nu.merge` and :func:`nu.merge_adapters` do when an input is traced.

TA runs as :func:`..operators.traced.merge_traced` (its own directions, no space basis); the
other methods as the bucket pipeline's stages traced in one program
(:func:`..operators.program.merge_traced`). Scores, masks and report stay arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._core import tree as _tree
from ..errors import InputError, InputTypeError
from ..operators import _plan, program, traced
from ..scoring.utility import heterogeneity, score
from ._report import Report
from ._request import MergeRequest

__all__ = ["merge_adapters_traced", "merge_traced", "refuse_traced_mesh"]


def merge_traced(
    fn: str, adapters, masks, res: Any, *, coef: Any, key: Any, weights: Any = None
) -> dict[str, Any]:
    """A merge under a transformation: TA by :func:`traced.merge_traced` (its own directions,
    no space basis), the other methods as the bucket pipeline's stages traced in one program
    (:func:`program.merge_traced`)."""
    if res.kernel_method == "ta":
        return traced.merge_traced(fn, adapters, masks, coef=coef, weights=weights)
    if res.spec.needs_key:
        _plan.check_key(fn, key, res.spec.name)
    return program.merge_traced(fn, adapters, masks, res=res, coef=coef, key=key, weights=weights)


def refuse_traced_mesh(fn: str, mesh: Any) -> None:
    if mesh is not None:
        raise InputError(
            f"{fn}: mesh= stacks the factors on the host, so it cannot run inside jax.jit, "
            "jax.grad or jax.vmap: shard the inputs of the jitted function yourself and leave "
            "mesh=None."
        )


def merge_adapters_traced(
    adapters: Sequence[Any],
    *,
    weights: Any,
    coef: Any,
    mesh: Any,
    options: Mapping[str, Any],
    **settings: Any,
) -> tuple[Any, Report]:
    """:func:`nu.merge_adapters` inside a JAX transformation (see :mod:`..operators.traced`):
    the scores, masks and merge as one traceable computation, each module at rank ``M r_max``,
    and a :class:`Report` whose numbers are arrays (``zeroed`` is empty: it needs the values).
    The merged modules come back by name (the caller puts them in the adapters' tree)."""
    fn = "nu.merge_adapters"
    req = MergeRequest.check(fn, options=options, coef=1.0, **settings)
    traced.refuse_untraceable(fn, req.resolved, options)
    refuse_traced_mesh(fn, mesh)
    if req.min_share is not None:
        raise InputTypeError(
            f"{fn}: min_share cannot run inside jax.jit, jax.grad or jax.vmap (its floors are "
            "counted on the host); call it outside the transformation."
        )
    names, _, m_tasks = _tree.collect(adapters, fn=fn)
    w = traced.check_traced_weights(fn, weights, m_tasks)
    if req.allocation == "all":  # every candidate: the directions with a nonzero sigma
        sc = None
        masks = {nm: ms.sigma > 0 for nm, ms in score(adapters, lam=0.0).modules.items()}
    else:
        sc = score(
            adapters, alpha=req.alpha, lam=req.lam, input_moments=req.input_moments,
            interference=req.interference,
        )  # fmt: skip
        masks = req.select(sc)
    merged = merge_traced(fn, adapters, masks, req.resolved, coef=coef, key=req.key, weights=w)
    counts = traced.traced_report_fields(masks, names)
    report = Report(
        lam=None if sc is None else sc.lam,
        alpha=None if sc is None else sc.alpha,
        budget=req.budget,
        heterogeneity=heterogeneity(adapters),
        ranks=merged.ranks(),  # (static widths; no module sliced)
        method=req.method,
        space=req.space,
        allocation=req.allocation,
        scope=req.report_scope,
        masks=masks,
        scores=sc,
        weights=w,
        data_aware=req.data_aware,
        interference=req.interference,
        **counts,
    )
    return merged, report
