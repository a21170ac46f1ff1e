"""The elementwise methods (TIES, DARE, DARE-TIES) a block of rows or a module at a time: when
one module's dense task updates exceed the working memory (:func:`row_blocks`, :func:`ties_rows`,
:func:`dare_rows`), and in full space module by module (:func:`module_dense`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import registry
from .._core.executables import kernel
from .._core.linalg import mm as _mm
from .._core.linalg import mul_pow2
from .._core.linalg import t as _t
from ..scoring._kernels import default_rtol
from . import _rng, _select
from . import methods as _m
from . import spaces as _s
from ._outputs import (
    KERNEL_NAN,
    RANGE_KERNEL_NAN,
    check_elementwise_output,
    kernel_status,
    range_status,
)

__all__ = [
    "DARE_KEPT",
    "apply_ties",
    "block_tasks",
    "coords_tasks",
    "dare_block",
    "dare_rows",
    "elementwise",
    "module_dense",
    "module_dense_rows",
    "module_kept_coords",
    "module_tasks",
    "pad_rows",
    "row_blocks",
    "row_units",
    "stage_scale_dense",
    "ties_apply",
    "ties_rows",
]


@kernel(static_argnames=("rows",))
def pad_rows(a, *, rows: int):
    """``a (..., p, r)`` zero-padded to a whole number of ``rows``-row blocks."""
    p = a.shape[-2]
    return jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, -p % rows), (0, 0)])


@kernel(static_argnames=("rows",))
def block_tasks(a, b, j0, *, rows: int):
    """Rows ``j0 : j0 + rows`` of the dense coordinates ``a b^T`` (``a`` from :func:`pad_rows`)."""
    return _mm(jax.lax.dynamic_slice_in_dim(a, j0, rows, axis=-2), _t(b))


def row_blocks(a, b, rows: int) -> list:
    """One module's dense coordinates ``a b^T`` (``a (1, M, p, r)``, ``b (1, M, q, r)``) as
    ``rows``-row blocks in row order: ``[(produce, (j0, live rows))]``, ``produce()`` giving the
    block ``(1, M, rows, q)``. Padding rows are zero: zero entries, which TIES's trim never needs
    (a threshold of zero keeps zeros, which changes nothing)."""
    p = a.shape[-2]
    ap = pad_rows(a, rows=rows)
    return [
        (lambda j0=j0: block_tasks(ap, b, jnp.int32(j0), rows=rows), (j0, min(rows, p - j0)))
        for j0 in range(0, p, rows)
    ]


@kernel(static_argnames=("flat_ties",))
def ties_apply(x, t, room, coef, *, flat_ties):
    """Trim at the thresholds ``t`` and take the disjoint mean. Without ``flat_ties`` every entry
    at a task's threshold is known to fit (``room`` = their count), so the running count that
    breaks ties in flat order (a slow scan on CPU) is skipped."""
    if flat_ties:
        trimmed, used = _select.trim_at(x, t, room)
    else:
        xt = jnp.moveaxis(x, -3, 0)
        bits = jax.lax.bitcast_convert_type(jnp.abs(xt), t.dtype)
        keep = bits >= t.reshape(-1, *([1] * (bits.ndim - 1)))
        trimmed, used = jnp.moveaxis(jnp.where(keep, xt, 0), 0, -3), room
    return coef * _m.disjoint_mean(trimmed), used


def ties_rows(a, b, k_top, coef, *, rows: int):
    """TIES on one module's dense coordinates ``a b^T`` a block of ``rows`` rows at a time:
    ``(1, p, q)``, the same as :func:`elementwise` on the whole ``(1, M, p, q)`` (the same
    thresholds and, at a threshold, ties kept in the same flat order; the blocks are rows of the
    same products). Each task's threshold comes from two 16-bit radix passes over the blocks
    (:func:`_select.radix_threshold`), then a third pass trims and takes the disjoint mean.
    Memory: one block of every task's coordinates; the blocks are recomputed per pass (``r``
    multiply-adds an entry, less than a pass of the in-memory threshold search)."""
    merged: list = []
    work = row_units(a, b, rows, merged.append)
    k = int(np.asarray(k_top).reshape(-1)[0])
    t, room, at = _select.radix_threshold(work, a.shape[1], k, a.dtype)
    # ties at a nonzero threshold that do not all fit are kept in flat order (a running count);
    # at a zero threshold keeping every zero changes nothing
    flat_ties = bool(np.any((at > room) & (t != 0)))
    apply_ties(work, jnp.asarray(t), room, flat_ties, coef)
    return merged[0]


#: the row-blocked DARE operators (``registry.MethodSpec.blocked``) :func:`dare_rows` runs: their
#: merge of the dropped tasks, entry by entry
DARE_KEPT = {"dare": _m.dare_kept, "dare_ties": _m.dare_ties_kept}


@kernel(static_argnames=("method", "shape"))
def dare_block(x, key, j0, coef, nums, *, method: str, shape: tuple[int, int, int]):
    """DARE / DARE-TIES on rows ``j0 :`` of one module's dense coordinates, ``x (1, M, rows, q)``
    from :func:`row_blocks`, ``shape = (M, p, q)`` the whole module's: ``(1, rows, q)``. The drop
    mask is those rows of the whole module's (:func:`_rng.bernoulli_rows`)."""
    p = nums["p"]
    keep = _rng.bernoulli_rows(key, 1.0 - jnp.asarray(p, jnp.float32), shape, j0, x.shape[-2])
    return DARE_KEPT[registry.METHODS[method].blocked](_m.dare_rescale(x[0], keep, p), coef=coef)[
        None
    ]


def dare_rows(a, b, keys, coef, nums, *, method: str, rows: int):
    """DARE / DARE-TIES on one module's dense coordinates ``a b^T`` a block of ``rows`` rows at a
    time: ``(1, p, q)``, the same as :func:`elementwise` on the whole ``(1, M, p, q)``: the same
    drop mask (:func:`_rng.bernoulli_rows`, for keys that :func:`_rng.blockable` accepts; the
    plan keeps whole modules otherwise), and both methods combine each entry's tasks alone.
    Memory: one block of every task's coordinates, and the merged module."""
    shape = (a.shape[1], a.shape[2], b.shape[2])
    parts = []
    for produce, (j0, live) in row_blocks(a, b, rows):
        xm = dare_block(produce(), keys[0], jnp.int32(j0), coef, nums, method=method, shape=shape)
        parts.append(xm if live == rows else xm[:, :live])
    return jnp.concatenate(parts, axis=-2) if len(parts) > 1 else parts[0]


def row_units(a, b, rows: int, store) -> list:
    """One module's dense coordinates as TIES units ``(produce, finish)`` of ``rows`` rows
    (:func:`row_blocks`); the last unit's finish joins the merged blocks and ``store``s the
    module ``(1, p, q)``."""
    blocks = row_blocks(a, b, rows)
    parts: list = []

    def finish(xm, live, last):
        parts.append(xm if live == rows else xm[:, :live])
        if last:
            store(jnp.concatenate(parts, axis=-2) if len(parts) > 1 else parts[0])

    return [
        (produce, functools.partial(finish, live=live, last=i == len(blocks) - 1))
        for i, (produce, (_, live)) in enumerate(blocks)
    ]


def apply_ties(work, t, room, flat_ties: bool, coef) -> np.ndarray:
    """Trim each unit ``(produce, finish)`` of ``work`` at the thresholds ``t`` and merge it, in
    flat order (ties at a threshold taken while ``room`` lasts); returns the ties still to keep."""
    for produce, finish in work:
        xm, used = ties_apply(
            produce(), t, jnp.asarray(np.minimum(room, 2**31 - 1), jnp.int32), coef,
            flat_ties=flat_ties,
        )  # fmt: skip
        room = room - np.asarray(used, np.int64)
        finish(xm)
    return room


def elementwise(x, keys, *, method, coef, nums, k_top):
    """An elementwise method (the registry's kernel) on a batch of modules: ``x (n, M, p, q)``,
    ``keys (n,)``, ``k_top (n,)``, traced options ``nums``; its output checked for shape and
    dtype while tracing (:func:`check_elementwise_output`)."""
    out = registry.METHODS[method].kernel(x, keys, coef=coef, k_top=k_top, **nums)
    return check_elementwise_output(method, x, out)


def _kept_coords(a, b, s, r, mask, unit, *, r_max):
    """One module's kept task updates as full-space coordinates ``(ca (1, M, d_in, r), cb (1, M,
    d_out, r))``, the dense tasks being ``ca cb^T`` in units of ``2**unit`` (the module's own
    unit if None), and that unit; ``a (M, d_in, r)``, ``b (M, r, d_out)``, ``s (M,)`` as stacked
    (normalised here)."""
    a, b, ts, _ = _s.normalise_tasks(a[None], b[None], s[None], a_axes=(2, 3), b_axes=(2, 3))
    if unit is None:
        unit = _s.module_unit(ts)[0]
    k = _s.kept_components(
        a,
        b,
        ts.mant,
        r[None],
        mask[None],
        cand_rtol=default_rtol(r_max, a.dtype),
        scale_exp=ts.exp - unit,
    )
    c = _s.full_coords(k)
    return c.a, c.b, unit


def _dense_kept(a, b, s, r, mask, unit, *, r_max):
    """One module's kept dense task updates ``(1, M, d_in, d_out)`` in units of ``2**unit`` (the
    module's own unit if None) and that unit (:func:`_kept_coords`)."""
    ca, cb, unit = _kept_coords(a, b, s, r, mask, unit, r_max=r_max)
    return _mm(ca, _t(cb)), unit


def _scale_dense(x, unit):
    """A dense merged update ``x (d_in, d_out)`` in units of ``2**unit`` back to its size, and
    its :func:`range_status` (one module)."""
    y = mul_pow2(x, unit)
    code, log2 = range_status(x[None], y[None], unit[None], (1, 2))
    return y, (code, log2)


@kernel(static_argnames=("method", "r_max"))
def module_dense(a, b, s, r, mask, coef, key, nums, k_top, *, method: str, r_max: int):
    """One module, elementwise method in full space: dense ``(d_in, d_out)`` merged update and
    its :func:`range_status`."""
    x, unit = _dense_kept(a, b, s, r, mask, None, r_max=r_max)
    xm = elementwise(x, key[None], method=method, coef=coef, nums=nums, k_top=k_top[None])
    y, (code, log2) = _scale_dense(xm[0], unit)
    # a NaN from the kernel itself (the inputs are checked finite before): not an overflow
    code = jnp.where(kernel_status(xm) == KERNEL_NAN, RANGE_KERNEL_NAN, code).astype(code.dtype)
    return y, (code, log2)


#: One module's kept task updates as full-space coordinates (jitted :func:`_kept_coords`).
module_kept_coords = kernel(_kept_coords, static_argnames=("r_max",))


def module_dense_rows(a, b, s, r, mask, coef, key, nums, k_top, *, method: str, r_max: int, rows):
    """:func:`module_dense` a block of ``rows`` rows of ``d_in`` at a time (TIES:
    :func:`ties_rows`, DARE / DARE-TIES: :func:`dare_rows`): the same merge, holding one block of
    every task's dense update and the merged module instead of the module's ``M`` dense tasks."""
    ca, cb, unit = module_kept_coords(a, b, s, r, mask, None, r_max=r_max)
    if registry.METHODS[method].blocked in DARE_KEPT:
        xm = dare_rows(ca, cb, key[None], coef, nums, method=method, rows=rows)
    else:
        xm = ties_rows(ca, cb, k_top[None], coef, rows=rows)
    return stage_scale_dense(xm[0], unit)


@kernel(static_argnames=("r_max",))
def module_tasks(a, b, s, r, mask, unit, *, r_max: int):
    """One module's kept dense task updates, full space, in units of ``2**unit``:
    ``(1, M, d_in, d_out)``."""
    return _dense_kept(a, b, s, r, mask, unit, r_max=r_max)[0]


#: A dense merged update back to its size, and its range status (model-wide TIES).
stage_scale_dense = kernel(_scale_dense)


@kernel
def coords_tasks(ca, cb):
    """Dense task coordinates ``a b^T`` of a chunk of modules (model-wide TIES)."""
    return _mm(ca, _t(cb))
