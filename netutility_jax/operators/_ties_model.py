"""TIES with ``trim_scope="model"``: one top-k over the whole model, streamed.

Each task keeps its ``int(density * N)`` largest entries over the whole model (``N`` = entries of
all modules in the space's coordinates), as the original TIES and KnOTS. The per-task threshold is
found by radix selection over the magnitudes' bit patterns (:func:`_select.radix_threshold`), 16
bits per pass, each pass streaming the modules (full space) or chunks of modules (core, KnOTS)
with only the counts kept: memory stays at one unit's dense tasks, like the per-module scope.
Magnitudes are compared across modules, so every module is merged in one common unit (the
largest).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import buckets as _buckets
from .._core.linalg import settle
from . import _plan, _stages
from . import methods as _m
from ._plan import MergePlan
from ._results import raise_nonfinite, raise_range
from ._select import radix_threshold, topk_count
from ._stages import ties_apply

__all__ = ["ties_apply", "ties_model", "ties_model_streamed"]


def _stage_inputs(plan: MergePlan, space: str) -> tuple[list, list[int]]:
    """Every piece's first stage (inputs checked), and the live modules' units (the common unit
    is their largest)."""
    staged, units = [], []
    dtype, m_tasks = plan.dtype, plan.m_tasks
    for job in plan.jobs:
        bk = job.bucket
        leaves = _buckets.bucket_arrays(bk)
        if space == "full":
            st = _stages.stage_stack(
                leaves, cfg=_stages.StackConfig(bk.d_in, bk.d_out, bk.r_max, dtype)
            )
            ts, unit, bad = _stages.stage_scales(*st[:3])
        else:
            st = _stages.stage_reduce(
                leaves, cfg=_stages.ReduceConfig(bk.d_in, bk.d_out, bk.r_max, dtype, m_tasks)
            )
            ts, bad, unit = st[1], st[3], st[4]
        raise_nonfinite(plan.fn, [bk], [bad], dtype)
        live = np.asarray(ts.mant).any(-1)
        units.extend(np.asarray(unit)[live].tolist())
        staged.append(st)
    return staged, units


def _common_unit(units: list[int]) -> jax.Array:
    return jnp.asarray(max(units, default=0), jnp.int32)


def _full_units(plan: MergePlan, bk, mk, st, unit, results, checks):
    """Full space: one unit per module, ``(produce dense tasks, finish with the merge)``, or
    units of rows of a module whose dense tasks exceed the working memory (:func:`_plan.row_block`;
    the module's kept components, factor-sized, are computed once for its units)."""
    itemsize = jnp.dtype(plan.dtype).itemsize
    rows = _plan.row_block(plan.resolved, bk.d_in, bk.d_out, plan.m_tasks, itemsize)
    a, b, s, r = st[:4]
    work = []
    for j, nm in enumerate(bk.names):

        def finish(xm, nm=nm):
            delta, check = _stages.stage_scale_dense(xm[0], unit)
            results[nm] = {"delta": settle(delta)}
            checks.append(((nm,), check))

        if rows is None:

            def produce(j=j):
                return _stages.module_tasks(a[j], b[j], s[j], r[j], mk[j], unit, r_max=bk.r_max)

            work.append((produce, finish))
        else:
            ca, cb, _ = _stages.module_kept_coords(
                a[j], b[j], s[j], r[j], mk[j], unit, r_max=bk.r_max
            )
            work.extend(_stages.row_units(ca, cb, rows, finish))
    return work, len(bk.names) * bk.d_in * bk.d_out


def _coord_units(plan: MergePlan, bk, mk, st, unit, results, checks):
    """Core / KnOTS: chunks of modules' dense coordinates as units."""
    space, m_tasks = plan.resolved.space, plan.m_tasks
    red, ts, R = st[0], st[1], st[2]
    rtol = _m.rank_rtol((bk.d_in, bk.d_out, m_tasks * bk.r_max), plan.dtype)
    ambient_in = space == "knots"
    units_b = jnp.full((len(bk.names),), unit)
    variant = plan.resolved.options.get("variant")
    c = settle(
        _stages.stage_coords(
            red, ts, R, mk, units_b, cfg=_stages.CoordsConfig(space, variant, rtol, ambient_in)
        )
    )
    qa, qb = red.qa, red.qb
    del red
    n = int(_stages.real_entries(c).sum())
    p, q = c.a.shape[-2], c.b.shape[-2]
    itemsize = jnp.dtype(plan.dtype).itemsize
    rows = _plan.row_block(plan.resolved, p, q, m_tasks, itemsize)
    chunk = 1 if rows else _plan.chunk_size(m_tasks, p, q, itemsize, len(bk.names))
    work = []
    for j0 in range(0, len(bk.names), chunk):
        sl, sqa, sqb, su = jax.tree.map(lambda x, j0=j0: x[j0 : j0 + chunk], (c, qa, qb, units_b))

        def store(xm, sl=sl, sqa=sqa, sqb=sqb, su=su, j0=j0):
            la, lb, live, check = _stages.map_back(
                *_stages.stage_decode_chunks(sl, [xm], rtol=rtol), sqa, sqb, not ambient_in, su
            )
            names = bk.names[j0 : j0 + len(live)]
            checks.append((names, check))
            for jj, rk in enumerate(np.asarray(live.sum(-1))):
                rk = int(rk)
                results[names[jj]] = {
                    "lora_a": la[jj, :, :rk],
                    "lora_b": lb[jj, :rk, :],
                    "scale": 1.0,
                }

        if rows is None:
            work.append((functools.partial(_stages.coords_tasks, sl.a, sl.b), store))
        else:  # a module too large for one unit: units of rows, in flat (row) order
            work.extend(_stages.row_units(sl.a, sl.b, rows, store))
    return work, n


def _units(plan: MergePlan, staged: list, unit: jax.Array, results: dict, checks: list):
    """``(work, n)``: the plan's units ``(produce dense tasks, finish with the merge)`` in flat
    module order, and how many real entries they hold."""
    work, n_total = [], 0
    for job, st in zip(plan.jobs, staged, strict=True):
        mk = _stages.stack_masks(plan.masks, job.bucket, plan.m_tasks)
        if plan.resolved.space == "full":
            w, n = _full_units(plan, job.bucket, mk, st, unit, results, checks)
        else:
            w, n = _coord_units(plan, job.bucket, mk, st, unit, results, checks)
        work.extend(w)
        n_total += n
    return work, n_total


def ties_model(plan: MergePlan, *, coef: jax.Array, checks: list) -> dict[str, Any]:
    """TIES over the whole model (see the module docstring); returns ``{name: module}`` and
    appends each module's :func:`_stages.range_status` to ``checks``."""
    staged, units = _stage_inputs(plan, plan.resolved.space)
    results: dict[str, Any] = {}
    work, n_total = _units(plan, staged, _common_unit(units), results, checks)
    k = topk_count(plan.resolved.options["density"], n_total)
    t, room, at = radix_threshold(work, plan.m_tasks, k, plan.dtype)
    _stages.apply_ties(work, jnp.asarray(t), room, bool(np.any(at > room)), coef)
    return results


class _Reread:
    """The units of every chunk, staged again from a fresh read on each iteration (one chunk in
    memory at a time); counts their real entries as it goes."""

    def __init__(self, plans: Callable[[], Iterator[tuple[MergePlan, Any]]], unit: jax.Array):
        self.plans, self.unit, self.n = plans, unit, 0

    def __iter__(self) -> Iterator[tuple[Callable, Callable]]:
        self.n = 0
        for plan, _ in self.plans():
            staged, _ = _stage_inputs(plan, plan.resolved.space)
            work, n = _units(plan, staged, self.unit, {}, [])
            self.n += n
            yield from work


def ties_model_streamed(
    plans: Callable[[], Iterator[tuple[MergePlan, Callable[[dict[str, Any]], None]]]],
    *,
    m_tasks: int,
    dtype: Any,
    density: float,
    coef: jax.Array,
) -> None:
    """:func:`ties_model` over chunks read from disk: ``plans()`` reads every chunk again, in flat
    module order, and yields its plan with a sink for its merged modules. Reads: the common unit
    (the largest over every live module), one per 16-bit radix pass (the count of entries, for
    ``k``, comes with the first), and the merge, each sink called once with range-checked
    modules. The same units, thresholds and tie order as in memory, so the same merge."""
    units: list[int] = []
    for plan, _ in plans():
        units.extend(_stage_inputs(plan, plan.resolved.space)[1])
    unit = _common_unit(units)
    reread = _Reread(plans, unit)
    t, room, at = radix_threshold(reread, m_tasks, lambda: topk_count(density, reread.n), dtype)
    t, flat_ties = jnp.asarray(t), bool(np.any(at > room))
    for plan, sink in plans():
        staged, _ = _stage_inputs(plan, plan.resolved.space)
        results: dict[str, Any] = {}
        checks: list = []
        work, _ = _units(plan, staged, unit, results, checks)
        room = _stages.apply_ties(work, t, room, flat_ties, coef)
        raise_range(plan.fn, checks, plan.dtype)
        sink(results)
