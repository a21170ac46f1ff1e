"""The per-bucket pipeline stages of :func:`nu.merge`: pure jitted functions, static configs.

A bucket is a group of modules of equal ``(d_in, d_out, r_max)`` (:class:`_tree.Bucket`); the
stages take its arrays and a frozen configuration (a ``NamedTuple`` or plain static keywords) and
nothing global, so that the layers that stream buckets from disk or shard them over devices wrap
them unchanged. The stages are shared between methods and spaces so that compiled executables are
too: reduce (the factors in the bases of their spans), coordinates (a space), the method (the
registry's kernel), decode, map back. :func:`bucket_merge` composes them (traceable as a whole).

Scale safety: the stacked factors and scales are split into powers of two and normalised numbers
per task (:func:`spaces.normalise_tasks`) before any Gram, and each module is merged in units of
``2**unit`` (:func:`spaces.module_unit`), multiplied back by the last stage. Every method is
positively homogeneous of degree one and a power of two rounds nothing, so results are those of
the unscaled computation wherever that one does not over- or underflow. The last stage also
reports, per module, whether the result is representable (:func:`range_status`): the caller
raises instead of returning an infinite or flushed-to-zero module.

The stages are kernels of :func:`_executables.kernel` (plain ``jax.jit``). On one device every
bucket of a merge is traced through them inside one program
(:mod:`netutility_jax.operators.program`); run one by one (a mesh, blocked rows, elementwise
methods in full space), host-side work between them stays on the host (numpy): an eager ``jnp``
operation on a concrete array is a program of its own, traced, lowered and loaded in every
process. Traced together, XLA fuses across what were program boundaries and may round a
multiply-add differently: the two routes agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import registry
from .._core import mesh as _mesh
from .._core import tree as _tree
from .._core.buckets import StackConfig, stage_stack  # (re-exported)
from .._core.executables import kernel
from .._core.linalg import mm as _mm
from .._core.linalg import mul_pow2
from .._core.linalg import t as _t
from .._core.tables import MaskTable
from ..scoring._kernels import default_rtol
from . import _select
from . import methods as _m
from . import spaces as _s
from ._outputs import (  # the stages' checks (re-exported)
    KERNEL_FINITE,
    KERNEL_INF,
    KERNEL_NAN,
    RANGE_KERNEL_NAN,
    check_elementwise_output,
    check_low_rank_output,
    kernel_status,
    log2_norm,
    range_status,
    with_kernel_status,
)
from ._reduce import (  # the reduction stage (re-exported)
    MODERATE_EXP,
    ReduceConfig,
    host_plain,
    reduce_bucket,
    stage_reduce,
    stage_scales,
)
from ._rows import (  # the row-block and module stages (re-exported)
    DARE_KEPT,
    apply_ties,
    block_tasks,
    coords_tasks,
    dare_block,
    dare_rows,
    elementwise,
    module_dense,
    module_dense_rows,
    module_kept_coords,
    module_tasks,
    pad_rows,
    row_blocks,
    row_units,
    stage_scale_dense,
    ties_apply,
    ties_rows,
)

__all__ = [
    "DARE_KEPT",
    "KERNEL_FINITE",
    "KERNEL_INF",
    "KERNEL_NAN",
    "MODERATE_EXP",
    "RANGE_KERNEL_NAN",
    "BucketConfig",
    "CoordsConfig",
    "LowRankConfig",
    "MapBackConfig",
    "ReduceConfig",
    "StackConfig",
    "apply_ties",
    "block_tasks",
    "bucket_merge",
    "check_elementwise_output",
    "check_low_rank_output",
    "coords_tasks",
    "dare_block",
    "dare_rows",
    "elementwise",
    "entry_counts",
    "host_plain",
    "kernel_status",
    "map_back",
    "module_dense",
    "module_dense_rows",
    "module_kept_coords",
    "module_tasks",
    "pad_rows",
    "range_status",
    "real_entries",
    "reduce_bucket",
    "row_blocks",
    "row_units",
    "stack_masks",
    "stage_coords",
    "stage_decode",
    "stage_decode_chunks",
    "stage_elementwise",
    "stage_keep",
    "stage_low_rank",
    "stage_map_back",
    "stage_reduce",
    "stage_scale_dense",
    "stage_scales",
    "stage_split",
    "stage_stack",
    "ties_apply",
    "ties_rows",
]


class CoordsConfig(NamedTuple):
    """:func:`stage_coords`: the space (``"full"`` for spectral methods in Core space, see
    :func:`bucket_merge`), KnOTS's variant, the rank tolerance, and whether the input side is
    mapped back to ``d_in`` (KnOTS with an elementwise method)."""

    space: str
    variant: str | None
    rtol: float
    ambient_in: bool


class LowRankConfig(NamedTuple):
    """:func:`stage_low_rank`: the registry's method, its static options ``((name, value),
    ...)``, the rank tolerance, and whether the tasks are already in SVD form."""

    method: str
    options: tuple[tuple[str, Any], ...]
    rtol: float
    is_svd: bool


class MapBackConfig(NamedTuple):
    """:func:`stage_map_back`: the result width mapped back, and whether the input side is
    still in reduced coordinates."""

    width: int
    expand_in: bool


class BucketConfig(NamedTuple):
    """One bucket's merge (:func:`bucket_merge`).

    Attributes:
      method: the registry method that runs (after :attr:`registry.Resolved.kernel_method`).
      space: ``"full"``, ``"core"`` or ``"knots"``.
      options: the method's static options ``((name, value), ...)``, sorted.
      variant: KnOTS's variant (None in other spaces).
      d_in, d_out, r_max, dtype: the bucket's shapes and compute dtype.
      chunk: modules per chunk of dense work (elementwise methods).
      rows: TIES, DARE and DARE-TIES: rows of one module's dense coordinates (full space: of its
        dense task updates) per block, when a module's dense tasks alone exceed the
        working-memory budget (:func:`_plan.row_block`); None: whole modules. Blocked modules find TIES's thresholds by
        streamed radix selection over the blocks (:func:`ties_rows`) and draw DARE's masks a
        block at a time (:func:`dare_rows`): memory is one block, not the module's ``M x p x q``
        tasks.
      compact: elementwise results in Core space re-factored by a thin SVD to their numerical
        rank (True), or returned as ``basis @ coordinates`` at the width of the coordinates
        (False: under a transformation, where an SVD of a rank-deficient matrix has no
        gradient).
    """

    method: str
    space: str
    options: tuple[tuple[str, Any], ...]
    variant: str | None
    d_in: int
    d_out: int
    r_max: int
    dtype: Any
    chunk: int
    rows: int | None = None
    compact: bool = True


def _coords(k, a, b, ts, *, space, variant, rtol):
    if space == "full":
        return _s.full_coords(k)
    if space == "core":
        return _s.core_coords(k, a, b, rtol=rtol, a_exp=ts.a_exp, b_exp=ts.b_exp)
    return _s.knots_coords(k, rtol=rtol, variant=variant, block_exp=_s.HEADROOM)


# The bucket pipeline is a few jitted stages (reduce, space transform, method, decode, map back) so
# that compiled stages are shared between methods and spaces; each is pure and batched over modules.
#
# Scale safety: the stacked factors and scales are split into powers of two and normalised numbers
# per task (spaces.normalise_tasks) before any Gram, and each module is merged in units of 2**unit
# (spaces.module_unit), multiplied back by the last stage. Every method is positively homogeneous
# of degree one and a power of two rounds nothing, so results are those of the unscaled
# computation wherever that one does not over- or underflow. The last stage also reports, per
# module, whether the result is representable (a range check): merge raises instead of returning
# an infinite or flushed-to-zero module.


@kernel(static_argnames=("r_max",))
def stage_keep(a, b, s, r, *, r_max: int):
    """Every candidate of a stacked bucket ``(n, M, r_max)`` (``allocation="all"``)."""
    a, b, ts, _ = _s.normalise_tasks(a, b, s, a_axes=(2, 3), b_axes=(2, 3))
    mask = jnp.ones((*ts.mant.shape, r_max), bool)
    k = _s.kept_components(a, b, ts.mant, r, mask, cand_rtol=default_rtol(r_max, a.dtype))
    return k.keep


def _expand_in(qa, x):
    """Reduced input-side columns ``x (n, [M,] K, k)`` to ``d_in``: ``Q_a x``."""
    q1, m = (qa.q1, qa.m) if x.ndim == 3 else (qa.q1[:, None], qa.m[:, None])
    return _mm(q1, _mm(m, x))


@kernel(static_argnames=("cfg",))
def stage_coords(red, ts, R, mask, unit, *, cfg: CoordsConfig):
    """Kept components of a bucket in a space's coordinates (:class:`spaces.Coords`), in units
    of ``2**unit`` (``unit (n,)``: each task's singular values get ``2**(exp_i - unit)``).

    Computed in the reduced coordinates of :class:`spaces.Reduced`; with ``ambient_in`` (KnOTS
    with an elementwise method, whose input side is entry-wise in ``d_in``) the input side is
    mapped back to ``d_in``.
    """
    space, variant, rtol, ambient_in = cfg
    k = _s.kept_components(
        red.a,
        red.b,
        ts.mant,
        R,
        mask,
        cand_rtol=default_rtol(red.a.shape[-1], red.a.dtype),
        scale_exp=ts.exp - unit[:, None],
    )
    c = _coords(k, red.a, red.b, ts, space=space, variant=variant, rtol=rtol)
    if ambient_in:
        c = c._replace(a=_expand_in(red.qa, c.a))
    return c


@kernel(static_argnames=("cfg",))
def stage_low_rank(ca, cb, coef, nums, *, cfg: LowRankConfig):
    """A spectral method (TA, TSV, Iso-C, Iso-CTS: the registry's kernel of ``cfg.method``) on
    factored coordinates ``ca (n, M, p, r)``, ``cb (n, M, q, r)``; ``nums`` holds its traced
    options. Returns ``(a (n, p, K), b (n, q, K), status (n,))``: the kernel's output, checked
    for shapes and dtypes while tracing (:func:`check_low_rank_output`), and per module its
    :func:`kernel_status`."""
    kernel = registry.METHODS[cfg.method].kernel
    out = kernel(ca, cb, coef=coef, rtol=cfg.rtol, is_svd=cfg.is_svd, **dict(cfg.options), **nums)
    am, bm = check_low_rank_output(cfg.method, ca, cb, out)
    return am, bm, jnp.maximum(kernel_status(am), kernel_status(bm))


@kernel(static_argnames=("cfg",))
def stage_map_back(la, lb, qa, qb, unit, *, cfg: MapBackConfig):
    """Reduced results in units of ``2**unit`` to ``(lora_a (n, d_in, width), lora_b (n, width,
    d_out))`` of their true size, and per module ``(code, log2)``: code 0 representable, 1 not
    finite, 2 underflow (the largest ``lora_a`` entry below the smallest normal number)."""
    width, expand_in = cfg
    la, lb = la[..., :width], lb[..., :width, :]
    fi = jnp.finfo(la.dtype)
    # Bounds of the mapped-back entries from the small sides (no d-sized pass): the module's unit
    # goes to the input side; where that side alone could overflow (the product need not: KnOTS
    # blocks carry S on the output side) it is split between both sides.
    hi_a = log2_norm(la, -2) if expand_in else jnp.log2(jnp.max(jnp.abs(la), (1, 2), initial=0))
    hi_b = log2_norm(lb, -1)
    hi_a, hi_b = hi_a.astype(jnp.float32), hi_b.astype(jnp.float32)
    u = unit.astype(jnp.float32)
    split = hi_a + u >= fi.maxexp - 1
    d = u + hi_a - hi_b
    half = jnp.where(split & jnp.isfinite(d), jnp.floor(d / 2), 0).astype(jnp.int32)
    sa, sb = unit - half, half
    la = mul_pow2(la, sa[:, None, None])
    lb = mul_pow2(lb, sb[:, None, None])
    if expand_in:
        la = _expand_in(qa, la)
    lb = qb.times_qt(lb)
    hi_a, hi_b = hi_a + sa.astype(jnp.float32), hi_b + sb.astype(jnp.float32)
    lo_a = hi_a - 0.5 * float(np.log2(la.shape[-2]))  # some entry is at least this large
    surely_fine = (
        (hi_a < fi.maxexp - 1) & (hi_b < fi.maxexp - 1) & ((lo_a >= fi.minexp) | (hi_a == -jnp.inf))
    )

    def exact(la, lb):  # one pass over the outputs, only where the bounds cannot decide
        ma = jnp.max(jnp.abs(la), axis=(1, 2), initial=0)
        mb = jnp.max(jnp.abs(lb), axis=(1, 2), initial=0)
        finite = jnp.isfinite(ma) & jnp.isfinite(mb)
        under = (hi_a > -jnp.inf) & (ma < fi.tiny)
        code = jnp.where(finite, jnp.where(under, 2, 0), 1).astype(jnp.int32)
        return code, (jnp.log2(ma) + jnp.log2(mb)).astype(jnp.float32)

    def bounded(la, lb):
        return jnp.zeros(unit.shape, jnp.int32), hi_a + hi_b

    check = jax.lax.cond(jnp.all(surely_fine), bounded, exact, la, lb)
    return la, lb, check


def map_back(la, lb, live, qa, qb, expand_in, unit):
    """Reduced results ``la (n, K|d_in, k)``, ``lb (n, k, K)`` (live columns first) in units of
    ``2**unit`` to ``d_in`` / ``d_out``: only the bucket's largest live count of columns, rounded
    up to a multiple of 16 (few compiled widths), are mapped back and returned, with the
    :func:`range_status` of each module."""
    if isinstance(live, jax.core.Tracer):
        width = live.shape[-1]
    else:
        # on the host: an eager sum and slice of the device array are programs of their own
        live = np.asarray(live)
        most = int(live.sum(-1).max(initial=0))
        width = min(live.shape[-1], -(-most // 16) * 16)
    la, lb, check = stage_map_back(la, lb, qa, qb, unit, cfg=MapBackConfig(width, expand_in))
    return la, lb, live[..., :width], check


@kernel(static_argnames=("rtol", "compact"))
def stage_decode(coords, am, bm, *, rtol: float, compact: bool):
    """A low-rank method's merged factors back to LoRA form (:func:`spaces.decode_factored`)."""
    return _s.decode_factored(coords, am, bm, rtol=rtol, compact=compact)


def entry_counts(c):
    """Per module the live rows and columns of its dense coordinates ``(p, q)``: columns of
    ``left`` (``p`` itself without ``left``) and of ``right`` that its bases span."""
    live_q = (jnp.abs(c.right).sum(-2) > 0).sum(-1, dtype=jnp.int32)
    if c.left is None:
        return jnp.full_like(live_q, c.a.shape[-2]), live_q
    return (jnp.abs(c.left).sum(-2) > 0).sum(-1, dtype=jnp.int32), live_q


def real_entries(c):
    """TIES's ``n`` in core / KnOTS: entries of each module's dense coordinates that its bases
    span (the bases may be smaller than ``D``); int64 on the host."""
    rows, cols = entry_counts(c)
    return np.asarray(rows, np.int64) * np.asarray(cols, np.int64)


@kernel(static_argnames=("chunk",))
def stage_split(coords, keys, table, *, chunk: int):
    """A bucket's coordinates cut into chunks of whole modules for :func:`stage_elementwise`:
    ``[(a, b, keys, k_top)]`` per chunk. TIES keeps ``k_top = int(density * n)`` of the ``n``
    real entries of a module's coordinates, looked up in the host-made ``table``
    (:func:`count_input`); ``table=None`` (DARE) gives zeros."""
    c = coords
    n = c.a.shape[0]
    if table is None:
        k_top = jnp.zeros((n,), jnp.int32)
    else:
        rows, cols = entry_counts(c)
        k_top = table[rows if c.left is not None else 0, cols]
    return [tuple(x[j0 : j0 + chunk] for x in (c.a, c.b, keys, k_top)) for j0 in range(0, n, chunk)]


@kernel(static_argnames=("method",))
def stage_elementwise(a, b, keys, k_top, coef, nums, *, method: str):
    """TIES / DARE on a chunk of modules' dense core or KnOTS coordinates ``a b^T``: the merged
    ``(n, p, q)`` and per module its :func:`kernel_status`."""
    xm = elementwise(_mm(a, _t(b)), keys, method=method, coef=coef, nums=nums, k_top=k_top)
    return xm, kernel_status(xm)


@kernel(static_argnames=("rtol", "compact"))
def stage_decode_chunks(coords, xms, *, rtol: float, compact: bool = True):
    """The merged chunks back to LoRA form: KnOTS blocks ``(d_in, k)`` are kept as the input
    factor, core matrices are re-factored by SVD (unless not ``compact``)."""
    xm = jnp.concatenate(xms) if len(xms) > 1 else xms[0]
    return _s.decode_dense(coords, xm, rtol=rtol, compact=compact and coords.left is not None)


# Chunks of a traced bucket written out one after another in its program; more go through one
# lax.map. Each written-out chunk is a copy of the method's code (TIES's radix selection, DARE's
# draws) that XLA compiles: on a SmolLM2-shaped set (a 59-module bucket, 59 chunks) the KnOTS TIES
# merge compiled for 46 s; mapped, the code is compiled once whatever the module count.
UNROLL_CHUNKS = 2


def _mapped_elementwise(coords, keys, table, coef, nums, method, chunk):
    """:func:`stage_elementwise` over a traced bucket's modules by one ``lax.map`` of equal chunks
    of ``chunk`` modules (the last filled up with copies of the bucket's last module, whose
    results are dropped): the merged ``(n, p, q)`` and each module's status."""
    ((a, b, kk, kt),) = stage_split(coords, keys, table, chunk=coords.a.shape[0])
    n = a.shape[0]
    k = -(-n // chunk)
    fill = np.minimum(np.arange(k * chunk), n - 1)  # (an index: keys may be typed key arrays)

    def cut(x):
        return x[fill].reshape(k, chunk, *x.shape[1:])

    def one(args):
        return stage_elementwise(*args, coef, nums, method=method)

    xm, status = jax.lax.map(one, tuple(cut(x) for x in (a, b, kk, kt)))
    return xm.reshape(k * chunk, *xm.shape[2:])[:n], status.reshape(k * chunk)[:n]


def _elementwise_bucket(
    coords, coef, keys, nums, table, *, method, rtol, chunk, rows=None, compact=True
):
    """TIES / DARE on a bucket, a chunk of whole modules per call (at most one chunk's dense
    tasks alive), or a block of ``rows`` rows of one module at a time (:func:`ties_rows`,
    :func:`dare_rows`), then decoded: ``(la, lb, live, status)``, ``status`` the registry
    kernel's :func:`kernel_status` per module (None for the blocked built-in TIES and DARE,
    which run no registry kernel). Up to :data:`UNROLL_CHUNKS` chunks a Python loop rather
    than ``lax.map`` (XLA:CPU writes a mapped output through an in-place update that it emits
    as scalar code, ~4 ms per KnOTS module); more chunks of a traced bucket go through one
    ``lax.map`` (:func:`_mapped_elementwise`), so that its program holds one copy of the
    method's code, not one per chunk. Untraced (each stage its own program), the loop
    dispatches the same program per chunk."""
    status = None
    if rows is not None and table is None:
        xms = [
            dare_rows(a, b, kk, coef, nums, method=method, rows=rows)
            for a, b, kk, _ in stage_split(coords, keys, table, chunk=1)
        ]
    elif rows is not None:
        xms = [
            ties_rows(a, b, kt, coef, rows=rows)
            for a, b, _, kt in stage_split(coords, keys, table, chunk=1)
        ]
    elif isinstance(coords.a, jax.core.Tracer) and -(-coords.a.shape[0] // chunk) > UNROLL_CHUNKS:
        xm, status = _mapped_elementwise(coords, keys, table, coef, nums, method, chunk)
        xms = [xm]
    else:
        outs = [
            stage_elementwise(a, b, kk, kt, coef, nums, method=method)
            for a, b, kk, kt in stage_split(coords, keys, table, chunk=chunk)
        ]
        xms = [xm for xm, _ in outs]
        sts = [st for _, st in outs]
        if len(sts) == 1:
            status = sts[0]
        elif any(isinstance(st, jax.core.Tracer) for st in sts):
            status = jnp.concatenate(sts)
        else:  # on the host: an eager concatenation is a program per count of chunks
            status = np.concatenate([np.asarray(st) for st in sts])
    return (*stage_decode_chunks(coords, xms, rtol=rtol, compact=compact), status)


def count_input(cfg: BucketConfig, options: Mapping[str, Any], m_tasks: int) -> np.ndarray | None:
    """The count table a bucket's elementwise merge takes as data: for a method that keeps
    top entries (TIES's ``density``, the registry's ``keeps_top``) in core or KnOTS space,
    :func:`_select.count_table_np` for every entry count its coordinates can have (core:
    ``(M r_max, M r_max)`` with a ``left`` basis; KnOTS: ``(d_in, M r_max)``, one row);
    None otherwise. Made on the host from the resolved ``options`` (the kernel method's), not
    from ``cfg``, which does not hold the option: a merge at another density runs the compiled
    program again instead of compiling a new one."""
    spec = registry.METHODS[cfg.method]
    if spec.kind != "elementwise" or not spec.keeps_top or cfg.space == "full":
        return None
    rq = m_tasks * cfg.r_max
    p = rq if cfg.space == "core" else cfg.d_in
    return _select.count_table_np(float(options[spec.keeps_top]), p, rq, cfg.space == "core")


def bucket_merge(
    leaves, mask, coef, keys, nums, counts=None, *, cfg: BucketConfig, plain: bool = False
):
    """One bucket, every method except elementwise-in-full: ``(lora_a, lora_b, live, check,
    bad)``, the factors padded, ``check`` the :func:`range_status` of each module and ``bad``
    the inputs' non-finite counts ``(n, M, 3)``. ``counts``: the :func:`count_input` of a
    method that keeps top entries (required for it, None for the others); ``plain``: the
    factors are known to take the plain reduction (:func:`host_plain`).

    Composes the jitted stages (traceable as a whole, e.g. by ``jax.make_jaxpr``, unless
    ``cfg.rows`` is set: row-blocked TIES finds its thresholds on the host).
    """
    spec = registry.METHODS[cfg.method]
    m_tasks = leaves.a.shape[1] if isinstance(leaves, _mesh.Stacked) else len(leaves[0][0])
    red, ts, R, bad, unit = reduce_bucket(
        leaves, cfg=ReduceConfig(cfg.d_in, cfg.d_out, cfg.r_max, cfg.dtype, m_tasks, plain)
    )
    rtol = _m.rank_rtol((cfg.d_in, cfg.d_out, m_tasks * cfg.r_max), cfg.dtype)
    elementwise = spec.kind == "elementwise"
    ambient_in = elementwise and cfg.space == "knots"
    # Spectral methods are invariant to the orthonormal bases they run in, as long as the bases
    # span the kept components; the reduced coordinates are such bases (Core Space's reference
    # bases up to a rotation), so Core Space's bases and core matrices would change nothing:
    # core-space TA / TSV / Iso-C / Iso-CTS run in the reduced coordinates directly.
    cspace = "full" if cfg.space == "core" and not elementwise else cfg.space
    c = stage_coords(
        red, ts, R, mask, unit, cfg=CoordsConfig(cspace, cfg.variant, rtol, ambient_in)
    )
    if elementwise:
        table = None
        if spec.keeps_top:
            table = _count_table(counts, c, cfg)
        la, lb, live, status = _elementwise_bucket(
            c, coef, keys, nums, table, method=cfg.method, rtol=rtol, chunk=cfg.chunk,
            rows=cfg.rows, compact=cfg.compact,
        )  # fmt: skip
        expand_in = not ambient_in
    else:
        am, bm, status = stage_low_rank(
            c.a, c.b, coef, nums, cfg=LowRankConfig(cfg.method, cfg.options, rtol, cspace == "full")
        )
        # the result's factors are exact as they come (live columns = the nonzero ones)
        la, lb, live = stage_decode(c, am, bm, rtol=rtol, compact=False)
        expand_in = True
    # a kernel's NaN or inf would otherwise decode to rank-0 modules (no singular value is
    # above the cut), silently; its status is read where map_back reads the ranks anyway
    la, lb, live, check = map_back(la, lb, live, red.qa, red.qb, expand_in, unit)
    check = with_kernel_status(status, bad, check)
    return la, lb, live, check, bad


def _count_table(counts, c, cfg: BucketConfig):
    """``counts`` (:func:`count_input`) checked against the coordinates ``c`` it indexes."""
    has_left = c.left is not None
    p, q = c.a.shape[-2], c.b.shape[-2]
    want = (p + 1 if has_left else 1, q + 1)
    if counts is None or tuple(counts.shape) != want:
        got = None if counts is None else tuple(counts.shape)
        raise ValueError(
            f"bucket_merge: {cfg.method} in {cfg.space} space keeps top entries of ({p}, {q}) "
            f"coordinates and takes their count table of shape {want} (count_input), got {got}."
        )
    return counts


def stack_masks(masks, bk: _tree.Bucket, m_tasks: int) -> np.ndarray:
    """A bucket's stacked masks ``(n, M, r_max)`` (all True without masks), stacked on the host:
    an eager ``jnp.stack`` (or ``jnp.ones``) is a program of its own per bucket shape, traced,
    lowered and loaded in every process; the jitted stages take the numpy array as it is."""
    if masks is None:
        return np.ones((len(bk.names), m_tasks, bk.r_max), bool)
    get = (
        masks.host if isinstance(masks, MaskTable) and masks.pristine else masks.__getitem__
    )  # (no transfer)
    return np.stack([np.asarray(get(nm), bool) for nm in bk.names])
