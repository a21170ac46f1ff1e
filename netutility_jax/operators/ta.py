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

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core import buckets as _buckets
from .._core import mesh as _mesh
from .._core import stacking as _stacking
from .._core import tree as _tree
from .._core.executables import kernel
from .._core.host import put_views
from .._core.tables import MaskTable, MergedTable, StackedMasks
from ..scoring._kernels import default_rtol
from ._plan import check_coef, check_masks, check_scale_range
from .traced import kept_directions_many

__all__ = [
    "DEVICE_SLICES",
    "TaMeta",
    "TaResult",
    "merge_ta",
    "module_factors",
    "slices_on_device",
    "stacked_result",
    "ta_program",
]


class TaMeta(NamedTuple):
    """:func:`ta_program`'s static settings."""

    dtype: Any
    dims: tuple[tuple[int, int, int], ...]  # per bucket (d_in, d_out, r_max)


@kernel(static_argnames=("meta",), fast_compile="small")
def ta_program(inputs, masks, coef, *, meta: TaMeta):
    """Every bucket's kept directions, ``(outs, ok)``.

    Args:
      inputs: per bucket the leaves of :func:`_buckets.bucket_arrays` (scales may be stacked).
      masks: per bucket ``(n, M, r_max)`` bool, or None (every candidate: singular values above
        the default ``rtol`` of the task-module's largest, as the in-memory engine keeps them).
      coef: the merge coefficient (a normal number of the dtype).

    Returns:
      ``(outs, flags)``: ``outs[b] = (la (n, d_in, M r_max), lb (n, M r_max, d_out))`` with each
      row's kept columns first (in their order); ``flags`` every bucket's ``keep (n, M r_max)``
      and ``nonzero (n,)`` (whether the row's update is not exactly zero) raveled in bucket
      order, then ``ok`` (every input and output finite), in one bool vector (one read).
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
        keep = keep.reshape(n, m_tasks * r_max)
        order = jnp.argsort(~keep, axis=-1, stable=True)  # kept columns first, in order
        la = jnp.take_along_axis(la, order[:, None, :], axis=2)
        lb = jnp.take_along_axis(lb, order[:, :, None], axis=1)
        nonzero = jnp.any(la != 0, (1, 2)) & jnp.any(lb != 0, (1, 2))
        outs.append((la, lb, keep, nonzero))
    flags = [x.ravel() for _, _, keep, nonzero in outs for x in (keep, nonzero)]
    return tuple((la, lb) for la, lb, _, _ in outs), jnp.concatenate([*flags, ok[None]])


class TaResult(NamedTuple):
    """What :func:`merge_ta` returns: ``{name: module}`` (for a stacked set a
    :class:`MergedTable` whose factors stay on the device), per module whether its merged update
    is exactly zero, and the directions it kept ``(M, r_max)`` (host copies, no transfer)."""

    modules: Mapping[str, dict[str, Any]]
    zero: dict[str, bool]
    keep: dict[str, np.ndarray]


def _bucket_masks(masks: Mapping[str, Any], bk: _tree.Bucket, m_tasks: int) -> Any:
    if isinstance(masks, StackedMasks) and masks.pristine:  # a jitted nu.allocate's blocks
        block = masks.blocks().get(tuple(bk.names))
        if block is not None:  # (checked by check_masks): used where it is, no read
            return block
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
    dims = tuple((bk.d_in, bk.d_out, bk.r_max) for bk in buckets)
    done = _merge_ta_stacked(names, buckets, m_tasks, inputs, stacked, c, dtype, dims)
    if done is None or (buckets and all(bk.stacked is not None for bk in buckets)):
        return done  # (a stacked set's factors stay stacked)
    # a list's modules: sliced on an accelerator (no round trip), read back on a CPU
    modules = module_factors(
        names, done.modules, on_device=bool(buckets) and slices_on_device(buckets)
    )
    return TaResult(modules, done.zero, done.keep)


def module_factors(names, table: MergedTable, *, on_device: bool) -> dict[str, dict[str, Any]]:
    """Each module's merged factors at its rank from a compact :class:`MergedTable`, as
    :func:`merge_ta` gives a list's: sliced on the device (``on_device``), or read back in one
    transfer and placed as views (a CPU, whose host copies cost nothing)."""
    if on_device:
        return {nm: table[nm] for nm in names}
    blocks = table.blocks()
    host = jax.device_get([(la, lb) for _, la, lb in blocks])
    views, order = [], []
    for (bn, _, _), (la, lb), counts in zip(blocks, host, table.counts, strict=True):
        for i, (nm, k) in enumerate(zip(bn, counts, strict=True)):
            views += [la[i][:, :k], lb[i][:k, :]]
            order.append(nm)
    it = iter(put_views(views))
    modules = {nm: {"lora_a": next(it), "lora_b": next(it), "scale": 1.0} for nm in order}
    return {nm: modules[nm] for nm in names}


# Whether a list of device factors is merged with its results sliced on the device (each module
# by one small program per shape and rank) rather than read back and placed again; None: on
# every backend but the CPU, whose host copies cost nothing (tests set it to check the route).
DEVICE_SLICES: bool | None = None


def slices_on_device(buckets: Sequence[_tree.Bucket]) -> bool:
    """:data:`DEVICE_SLICES`'s rule, for factors that are all device arrays (numpy factors, as a
    streamed chunk gives, are merged for the host that writes them)."""
    on = jax.default_backend() != "cpu" if DEVICE_SLICES is None else DEVICE_SLICES
    return on and all(
        isinstance(m.lora_a, jax.Array) and isinstance(m.lora_b, jax.Array)
        for bk in buckets
        for row in bk.modules
        for m in row
        if m is not None
    )


def _merge_ta_stacked(names, buckets, m_tasks, inputs, masks, c, dtype, dims) -> TaResult | None:
    """A stacked set's TA: the merged factors stay on the device, stacked per bucket with each
    module's kept columns first (a :class:`MergedTable` with counts); only the kept flags, the
    zero flags and ``ok`` are read back (no factor is read, none placed)."""
    meta = TaMeta(np.dtype(dtype), dims)
    with np.errstate(over="ignore", invalid="ignore"):
        outs, flags = ta_program(tuple(inputs), masks, np.asarray(c, dtype), meta=meta)
        flags = np.asarray(jax.device_get(flags))  # the one read
    if not flags[-1]:
        return None
    return stacked_result(names, buckets, m_tasks, outs, flags)


def stacked_result(names, buckets, m_tasks: int, outs, flags: np.ndarray) -> TaResult:
    """The :class:`TaResult` of :func:`ta_program`'s compact outputs: the factors ``outs`` left
    on the device (a :class:`MergedTable` with each module's kept count), the ``flags`` read
    (every bucket's keep and nonzero, then ``ok``)."""
    zero: dict[str, bool] = {}
    kept: dict[str, np.ndarray] = {}
    counts = []
    at = 0
    for bk in buckets:
        n, w = len(bk.names), m_tasks * bk.r_max
        keep = flags[at : at + n * w].reshape(n, w)
        nonzero = flags[at + n * w : at + n * w + n]
        at += n * w + n
        counts.append(keep.sum(1).tolist())
        for i, nm in enumerate(bk.names):
            kept[nm] = keep[i].reshape(m_tasks, bk.r_max)
            zero[nm] = not bool(nonzero[i])
    blocks = [(bk.names, la, lb) for bk, (la, lb) in zip(buckets, outs, strict=True)]
    table = MergedTable(names, blocks, 1.0, counts)
    return TaResult(table, zero, {nm: kept[nm] for nm in names})
