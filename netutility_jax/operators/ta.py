"""Task Arithmetic of the kept directions as one compiled program over every bucket.

TA is the same in full, core and KnOTS space (the transforms are isometries on the kept spans),
and the kept part of each task's update is a sum of rank-1 terms: its kept singular directions
(:func:`netutility_jax.operators.traced.kept_directions`, ``r x r`` eigenproblems and matmuls). So
a TA merge needs no basis of any space, no QR and no per-module program: :func:`ta_program`
computes every bucket's directions in one jitted call, with the non-finite inputs and outputs
flagged, and :func:`merge_ta` reads the result once and keeps each module's live columns on the
host (the module's rank is its number of kept directions, as the in-memory engine returns it).

Inputs the program cannot take exactly (a NaN or infinite factor or scale, a coefficient outside
the dtype's normal range, a result that overflows) are left to the bucket pipeline
(:mod:`netutility_jax.pipeline._run`), which reports or handles them: :func:`merge_ta` returns None.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core import buckets as _buckets
from .._core import mesh as _mesh
from .._core import stacking as _stacking
from .._core import tree as _tree
from .._core.host import put_views
from .._core.tables import MaskTable
from ..scoring._kernels import default_rtol
from ._plan import check_coef, check_masks, check_scale_range
from .traced import kept_directions_many

__all__ = ["TaResult", "merge_ta", "ta_program"]


class _Meta(NamedTuple):
    dtype: Any
    dims: tuple[tuple[int, int, int], ...]  # per bucket (d_in, d_out, r_max)


@functools.partial(jax.jit, static_argnames=("meta",))
def ta_program(inputs, masks, coef, *, meta: _Meta):
    """Every bucket's kept directions, ``(outs, ok)``.

    Args:
      inputs: per bucket the leaves of :func:`_buckets.bucket_arrays` (scales may be stacked).
      masks: per bucket ``(n, M, r_max)`` bool, or None (every candidate: singular values above
        the default ``rtol`` of the task-module's largest, as the in-memory engine keeps them).
      coef: the merge coefficient (a normal number of the dtype).

    Returns:
      ``outs[b] = (la (n, d_in, M r_max), lb (n, M r_max, d_out), keep (n, M r_max))`` and
      ``ok`` (``()`` bool): every input and output finite.
    """
    masks = (None,) * len(inputs) if masks is None else masks
    items = []
    ok = jnp.ones((), bool)
    for x, mask, (d_in, d_out, r_max) in zip(inputs, masks, meta.dims, strict=True):
        if isinstance(x, _mesh.Stacked):  # (nu.stack_adapters)
            a, b, s = (y.astype(meta.dtype) for y in x[:3])
            rank = x.rank
        else:
            a, b, s, rank = _buckets.stack_bucket(
                *x, d_in=d_in, d_out=d_out, r_max=r_max, dtype=meta.dtype
            )
        ok = ok & jnp.all(jnp.isfinite(a)) & jnp.all(jnp.isfinite(b)) & jnp.all(jnp.isfinite(s))
        # s coef and each task-module's size s coef max|a| max|b| (as kept_directions forms
        # it) must be normal numbers or exact zeros: one flushed to zero would give zeros
        # where the bucket pipeline refuses (or merges exactly)
        tiny = jnp.finfo(meta.dtype).tiny
        sc = s * coef
        nil = (s == 0) | (coef == 0)
        ok = ok & jnp.all(jnp.where(nil, sc == 0, jnp.abs(sc) >= tiny))
        am = jnp.max(jnp.abs(a), (2, 3), initial=0)
        bm = jnp.max(jnp.abs(b), (2, 3), initial=0)
        size = sc * am * bm
        nil = nil | (am == 0) | (bm == 0)
        ok = ok & jnp.all(jnp.where(nil, size == 0, jnp.abs(size) >= tiny))
        live = jnp.arange(r_max, dtype=rank.dtype) < rank[..., None]
        items.append((a, b, sc, live if mask is None else live & mask))
    outs = []
    for (la, lb, rel), (_, _, s, keep), mask, (d_in, d_out, r_max) in zip(
        kept_directions_many(items), items, masks, meta.dims, strict=True
    ):
        n, m_tasks = s.shape
        cut = default_rtol(r_max, meta.dtype)
        keep = keep & (rel > cut) if mask is None else keep & (rel > 0)
        la = la * keep[..., None, :].astype(la.dtype)
        lb = lb * keep[..., None].astype(lb.dtype)
        ok = ok & jnp.all(jnp.isfinite(la)) & jnp.all(jnp.isfinite(lb))
        la = jnp.moveaxis(la, 1, 2).reshape(n, d_in, m_tasks * r_max)
        lb = lb.reshape(n, m_tasks * r_max, d_out)
        outs.append((la, lb, keep.reshape(n, m_tasks * r_max)))
    return tuple(outs), ok


class TaResult(NamedTuple):
    """What :func:`merge_ta` returns: ``{name: module}``, per module whether its merged update
    is exactly zero, and the directions it kept ``(M, r_max)`` (host copies, no transfer)."""

    modules: dict[str, dict[str, Any]]
    zero: dict[str, bool]
    keep: dict[str, np.ndarray]


def _bucket_masks(masks: Mapping[str, Any], bk: _tree.Bucket, m_tasks: int) -> np.ndarray:
    if isinstance(masks, MaskTable) and masks.pristine:  # nu.allocate's, on the host already
        rows = [masks.host(nm) for nm in bk.names]
    else:
        rows = jax.device_get([masks[nm] for nm in bk.names])
    return np.stack([np.asarray(r, bool).reshape(m_tasks, bk.r_max) for r in rows])


def merge_ta(
    fn: str, adapters: Sequence[Any], masks: Mapping[str, Any] | None, *, coef: Any
) -> TaResult | None:
    """TA of the kept components of concrete adapters, or None where the bucket pipeline must
    run instead (see the module docstring)."""
    names, buckets, m_tasks = _tree.collect(adapters, fn=fn)
    if masks is not None:
        masks = check_masks(fn, masks, names, buckets, m_tasks)
    dtype = _tree.compute_dtype(buckets)
    check_coef(fn, coef)
    check_scale_range(fn, buckets, dtype)
    c = float(np.asarray(coef, np.float64))
    fi = np.finfo(dtype)
    if not (c == 0 or float(fi.tiny) <= abs(c) <= float(fi.max)):
        return None
    inputs: list[Any] = []
    for bk in buckets:
        if bk.stacked is not None:  # (nu.stack_adapters)
            inputs.append(bk.stacked)
            continue
        # numpy factors (a streamed chunk) stacked on the host, device ones on their device:
        # 4 arguments (the program would stack the leaves inside: the same copy)
        st = _stacking.stacked_input(bk, dtype, cap=False)
        if st is not None:
            inputs.append(st)
            continue
        a, b, s = _buckets.bucket_arrays(bk)
        host = _buckets.host_scales(s, dtype)
        inputs.append((a, b, s if host is None else host))
    stacked = None if masks is None else tuple(_bucket_masks(masks, bk, m_tasks) for bk in buckets)
    meta = _Meta(np.dtype(dtype), tuple((bk.d_in, bk.d_out, bk.r_max) for bk in buckets))
    with np.errstate(over="ignore", invalid="ignore"):
        outs, ok = ta_program(tuple(inputs), stacked, np.asarray(c, dtype), meta=meta)
        outs, ok = jax.device_get((outs, ok))
    if not ok:
        return None
    modules: dict[str, dict[str, Any]] = {}
    zero: dict[str, bool] = {}
    kept: dict[str, np.ndarray] = {}
    views = []
    for bk, (la, lb, keep) in zip(buckets, outs, strict=True):
        for i, nm in enumerate(bk.names):
            kept[nm] = keep[i].reshape(m_tasks, bk.r_max)
            cols = np.flatnonzero(keep[i])
            va, vb = la[i][:, cols], lb[i][cols, :]
            views += [va, vb]
            zero[nm] = cols.size == 0 or not (va.any() and vb.any())
    placed = put_views(views)
    it = iter(placed)
    for bk in buckets:
        for nm in bk.names:
            modules[nm] = {"lora_a": next(it), "lora_b": next(it), "scale": 1.0}
    return TaResult({nm: modules[nm] for nm in names}, zero, {nm: kept[nm] for nm in names})
