"""Merge spaces as transforms of each task's kept components: full, Core Space and KnOTS.

A space turns task ``i``'s kept update ``dK_i`` (kernel layout, ``(d_in, d_out)``) into coordinates
``X_i = A_i B_i^T`` of shape ``(p, q)``, in which a merge method runs, and maps a merged ``X`` back:
``dK = left @ X @ right^T``. All three transforms are computed from the factors (QR of stacked
``(d, M r)`` factors plus ``(M r)``-sized SVDs), never from a dense ``(d_in, d_out)`` matrix, and are
batched over the modules of a bucket: every array has a leading module axis ``n``.

* **full**: ``X_i = dK_i``; ``A_i = in_dirs_i diag(s_i)``, ``B_i = out_dirs_i`` (already an SVD).
* **core** (Panariello et al. 2025): reference bases are the left singular vectors ``L (d_in, D)``
  of the task-stacked input factors ``[a_1 .. a_M]`` and ``R (d_out, D)`` of the stacked output
  factors ``[b_1^T .. b_M^T]``; core matrices ``X_i = L^T dK_i R`` are ``(D, D)``, ``D <= M r``
  (the paper's ``M_i = U_ref^T B_i A_i V_ref``, transposed). Lossless: ``L L^T dK_i R R^T = dK_i``.
  With a selection, each task's factors are first projected on its kept directions
  (``a_i' = P_i P_i^T a_i``, ``b_i'^T = Q_i Q_i^T b_i^T``, so ``s_i a_i' b_i' = `` the kept update,
  and with everything kept ``a_i' = a_i``): the bases span exactly the kept components.
  The bases come from the unscaled factors, as in the Core Space code.
* **knots** (Stoica et al. 2024): the SVD ``U diag(S) [V_1 .. V_M]`` of the task concatenation
  ``[dW_1 .. dW_M]`` (paper layout). Its shared output basis ``U (d_out, k)`` and ``S`` are the left
  singular vectors and values of ``Z = [Q_1 diag(s_1) .. Q_M diag(s_M)]`` (``d_out, M r``), since
  ``sum_i dW_i dW_i^T = Z Z^T``; so one QR of ``Z`` and a ``(M r)``-sized SVD suffice. Task blocks
  in kernel layout are ``X_i = dK_i U S^-1 = V_i^T`` (``(d_in, k)``, the Core Space code's variant,
  default) or ``X_i = dK_i U = (S V_i)^T`` (``variant="original"``, KnOTS's scaled blocks); the
  merged block maps back by ``S U^T`` or ``U^T``. Singular values ``S <= rtol S_max`` are dropped.

Reduced coordinates (:class:`Reduced`): :func:`nu.merge` first factors a bucket's task-stacked
factors, ``[a_1 .. a_M] = Q_a R_a`` and ``[b_1; ..; b_M]^T = Q_b R_b`` (``M r`` columns), and
runs everything above on the ``(M r)``-sized ``R`` blocks: every transform and every spectral
method is equivariant under the orthonormal ``Q``'s, so the result is the same, and only one
``d``-sized product per side maps it back. In these coordinates Core Space's bases are rotations
of the reduced ones, which spectral methods cannot see: :func:`nu.merge` runs core-space TA, TSV,
Iso-C and Iso-CTS there directly and builds Core Space's SVD bases only for the elementwise
methods (which do depend on the basis). KnOTS elementwise merges map the input side back first
(their entries live in ``d_in`` coordinates).

Components: task ``i``'s thin SVD from :func:`nu.lora_svd`; slot ``k`` is its k-th largest singular
direction. A slot is kept where the mask says so and it is a candidate (inside the task's rank and
``s > rtol_cand * s_max``, the rule of :func:`nu.score`).

Scale safety (:class:`TaskScales`): every task's factors and scale are split into powers of two and
normalised numbers (:func:`normalise_tasks`) before any Gram or norm is formed, each module is
merged in units of ``2**unit`` (:func:`module_unit`) that :func:`nu.merge` multiplies back at the
end, and every QR equilibrates its columns by powers of two (:func:`methods.qr_equilibrated`).
Every method is positively homogeneous of degree one in the updates and multiplying by a power of
two rounds nothing, so this changes no result; it keeps every intermediate within the dtype's
range whatever ``lora_alpha`` or the factors' size (a scale of ``1e30`` in float32 would otherwise
overflow the Grams), and tasks far weaker than the strongest nonzero.

References:
  Panariello et al., "Accurate and Efficient Low-Rank Model Merging in Core Space", 2025.
  Stoica et al., "Model merging with SVD to tie the KnOTS", 2024.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .._core.linalg import LazyQR, concat_tasks, mul_pow2, orth_qr_lazy_many, svd, svd_many
from .._core.linalg import mm as _mm
from .._core.linalg import t as _t
from . import methods as _m

__all__ = [
    "HEADROOM",
    "KNOTS_VARIANTS",
    "SPACES",
    "Coords",
    "Kept",
    "Reduced",
    "TaskScales",
    "core_coords",
    "decode_dense",
    "decode_factored",
    "dense_tasks",
    "full_coords",
    "kept_components",
    "knots_coords",
    "leaf_scales",
    "module_unit",
    "normalise_tasks",
    "reduce_factors",
    "scale_leaves",
    "split_pow2",
]

SPACES = ("full", "core", "knots")
KNOTS_VARIANTS = ("core_space", "original")


class Reduced(NamedTuple):
    """A bucket's factors in the orthonormal bases of their own spans (exact, no truncation).

    ``[a_1 .. a_M] = Q_a R_a`` and ``[b_1; ..; b_M]^T = Q_b R_b`` with ``Q_a (n, d_in, K)``,
    ``Q_b (n, d_out, K)`` orthonormal, ``K = M r``. Task ``i``'s update is ``Q_a (a_i' b_i')
    Q_b^T`` with ``a_i' = R_a[:, i]`` and ``b_i' = R_b[:, i]^T``: every spectral quantity of the
    updates (their SVDs, Grams, the Core Space and KnOTS bases, polar factors, TA/TSV/Iso sums) is
    the same in these ``K``-dimensional coordinates, so a bucket is merged there and mapped back by
    one ``d``-sized product per side. This keeps the ``d``-sized work of every low-rank merge at
    two Grams and two products per side.

    Attributes:
      a: ``(n, M, K, r)`` reduced input factors; b: ``(n, M, r, K)`` reduced output factors.
      qa: :class:`_linalg.LazyQR` of ``[a_1 .. a_M]`` (``Q_a x = qa.q_times(x)``).
      qb: :class:`_linalg.LazyQR` of ``[b_1; ..; b_M]^T`` built from rows (``y Q_b^T =
        qb.times_qt(y)``).
    """

    a: jax.Array
    b: jax.Array
    qa: LazyQR
    qb: LazyQR


def reduce_factors(xa: jax.Array, yb: jax.Array, m_tasks: int) -> Reduced:
    """:class:`Reduced` from ``xa (n, d_in, M r)`` and ``yb (n, M r, d_out)`` (see
    :func:`_buckets.stack_bucket_cat`); both QRs share their LAPACK calls."""
    fa, fb = orth_qr_lazy_many([xa, yb], rows=[False, True], exact=True)
    n, k = fa.r.shape[0], fa.r.shape[-2]
    r = xa.shape[-1] // m_tasks
    a = jnp.moveaxis(fa.r.reshape(n, k, m_tasks, r), 2, 1)  # (n, M, K, r)
    b = _t(jnp.moveaxis(fb.r.reshape(n, k, m_tasks, r), 2, 1))  # (n, M, r, K)
    return Reduced(a, b, fa, fb)


class TaskScales(NamedTuple):
    """Each task's update split into powers of two: ``scale_i a_i b_i = mant_i 2**exp_i a_i' b_i'``.

    ``a_i' = a_i 2**-a_exp_i`` and ``b_i' = b_i 2**-b_exp_i`` have their largest ``|entry|`` in
    ``[0.5, 1)`` (exact: a power of two rounds nothing), ``mant_i`` is the scale's mantissa, in
    ``[0.5, 1)`` up to sign, and ``exp_i = a_exp_i + b_exp_i +`` the scale's exponent. A task whose
    update is zero (a zero factor or scale, or no module) has ``mant_i = 0``.

    Attributes:
      mant: ``(n, M)``; exp, a_exp, b_exp: ``(n, M)`` int32.
    """

    mant: jax.Array
    exp: jax.Array
    a_exp: jax.Array
    b_exp: jax.Array


def split_pow2(x: jax.Array, axes: tuple[int, ...]):
    """``x = y 2**e`` per slice over ``axes`` with the slice's largest ``|y|`` in ``[0.5, 1)``.

    Returns ``(y, e, nonzero, bad)``: ``e`` int32 (0 for an all-zero slice), ``nonzero`` bool and
    ``bad`` (count of non-finite entries, set to 0 in ``y``) with ``axes`` reduced.
    """
    ok = jnp.isfinite(x)
    x = jnp.where(ok, x, jnp.zeros((), x.dtype))
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True, initial=0)
    e = jnp.where(amax > 0, jnp.frexp(amax)[1], 0).astype(jnp.int32)
    y = mul_pow2(x, -e)
    bad = jnp.sum(~ok, axis=axes, dtype=jnp.int32)
    return y, jnp.squeeze(e, axes), jnp.squeeze(amax > 0, axes), bad


def _combine(ea, eb, nza, nzb, scale):
    """:class:`TaskScales` and the scale's non-finite flag from the factors' exponents."""
    ok = jnp.isfinite(scale)
    mant, es = jnp.frexp(jnp.where(ok, scale, jnp.zeros((), scale.dtype)))
    live = nza & nzb & (mant != 0)
    mant = jnp.where(live, mant, jnp.zeros((), mant.dtype))
    exp = jnp.where(live, es.astype(jnp.int32) + ea + eb, 0)
    return TaskScales(mant, exp, ea, eb), (~ok).astype(jnp.int32)


def normalise_tasks(
    a, b, scale, *, a_axes, b_axes
) -> tuple[jax.Array, jax.Array, TaskScales, jax.Array]:
    """Power-of-two normalisation of a bucket's stacked factors, per (module, task).

    Args:
      a, b: stacked factors of any layout; reducing ``a`` over ``a_axes`` (``b`` over ``b_axes``)
        leaves ``(n, M)``: one slice per module and task.
      scale: ``(n, M)``.

    Returns:
      ``(a', b', TaskScales, bad)``; ``bad (n, M, 3)`` int32 counts the non-finite entries of
      ``lora_a``, ``lora_b`` and ``scale`` of each module and task (zeroed in the outputs).
    """
    a, ea, nza, bad_a = split_pow2(a, a_axes)
    b, eb, nzb, bad_b = split_pow2(b, b_axes)
    ts, bad_s = _combine(ea, eb, nza, nzb, scale)
    return a, b, ts, jnp.stack([bad_a, bad_b, bad_s], -1)


def leaf_scales(a, b, s, dtype) -> tuple[TaskScales, jax.Array]:
    """:func:`normalise_tasks`'s exponents from a bucket's leaves (``_buckets.bucket_arrays``: per
    module a tuple of per-task factors, None where a task lacks the module), one read of each
    leaf, nothing scaled yet (:func:`scale_leaves`): ``(TaskScales (n, M), bad (n, M, 3))``."""
    zero_i = jnp.zeros((), jnp.int32)
    rows = []
    for row_a, row_b, row_s in zip(a, b, s, strict=True):
        cols = []
        for x, y, sc in zip(row_a, row_b, row_s, strict=True):
            if x is None:
                cols.append((jnp.zeros((), dtype), zero_i, zero_i, zero_i, zero_i, zero_i, zero_i))
                continue
            ea, nza, bad_a = _leaf_exponent(jnp.asarray(x, dtype))
            eb, nzb, bad_b = _leaf_exponent(jnp.asarray(y, dtype))
            ts, bad_s = _combine(ea, eb, nza, nzb, jnp.asarray(sc, dtype))
            cols.append((*ts, bad_a, bad_b, bad_s))
        rows.append(cols)
    f = [jnp.stack([jnp.stack([c[k] for c in row]) for row in rows]) for k in range(7)]
    return TaskScales(*f[:4]), jnp.stack(f[4:], -1)


def _leaf_exponent(x):
    ok = jnp.isfinite(x)
    amax = jnp.max(jnp.where(ok, jnp.abs(x), 0), initial=0)
    e = jnp.where(amax > 0, jnp.frexp(amax)[1], 0).astype(jnp.int32)
    return e, amax > 0, jnp.sum(~ok, dtype=jnp.int32)


def scale_leaves(a, b, ts: TaskScales, dtype) -> tuple[tuple, tuple]:
    """The leaves divided by their powers of two (:func:`leaf_scales`), non-finite entries
    zeroed: what :func:`normalise_tasks` gives, before stacking."""

    def scale(x, e):
        if x is None:
            return None
        x = jnp.asarray(x, dtype)
        return mul_pow2(jnp.where(jnp.isfinite(x), x, jnp.zeros((), dtype)), -e)

    out_a = tuple(
        tuple(scale(x, ts.a_exp[j, i]) for i, x in enumerate(row)) for j, row in enumerate(a)
    )
    out_b = tuple(
        tuple(scale(y, ts.b_exp[j, i]) for i, y in enumerate(row)) for j, row in enumerate(b)
    )
    return out_a, out_b


HEADROOM = 64  # a module's strongest task sits at about 2**HEADROOM in its working units


def module_unit(ts: TaskScales, axis: int | tuple[int, ...] = -1) -> jax.Array:
    """The exponent ``unit`` a module is merged in: the largest ``exp_i`` of its live tasks minus
    :data:`HEADROOM` (0 if none is live).

    In units of ``2**unit`` the strongest task's singular values are ``2**HEADROOM`` times its
    normalised ones (at most ``r sqrt(d_in d_out)``), which leaves room above for sums over tasks
    and ``coef`` even in float32, and keeps tasks down to about ``2**-(HEADROOM + 126)`` of the
    strongest normal numbers: their entries stay nonzero, which TIES's disjoint mean counts.
    Nothing squares working values outside LAPACK (every Gram is of equilibrated columns:
    :func:`methods.qr_equilibrated`).
    """
    lo = jnp.iinfo(jnp.int32).min
    u = jnp.max(jnp.where(ts.mant != 0, ts.exp, lo), axis=axis)
    return jnp.where(u == lo, 0, u - HEADROOM).astype(jnp.int32)


class Kept(NamedTuple):
    """Kept components of a bucket, zero where not kept.

    Attributes:
      in_dirs: ``(n, M, d_in, r)`` orthonormal input directions.
      s: ``(n, M, r)`` singular values.
      out_dirs: ``(n, M, d_out, r)`` orthonormal output directions.
      keep: ``(n, M, r)`` bool.
    """

    in_dirs: jax.Array
    s: jax.Array
    out_dirs: jax.Array
    keep: jax.Array


def kept_components(a, b, scale, rank, mask, *, cand_rtol, scale_exp=None) -> Kept:
    """Thin SVD of every task's update and the kept slots (mask & candidate).

    Args:
      a: ``(n, M, d_in, r)``, b: ``(n, M, r, d_out)``, scale: ``(n, M)``, rank: ``(n, M)`` int,
      mask: ``(n, M, r)`` bool. cand_rtol: relative cut of candidates.
      scale_exp: ``(n, M)`` int, or None: task ``i``'s update is ``scale_i 2**scale_exp_i a_i b_i``
        (:class:`TaskScales` relative to a module's unit); the power of two is applied to the
        singular values after the SVD, so the SVD sees normalised numbers.
    """
    u = _factor_svd(a, b, scale)
    r = a.shape[-1]
    smax = u.s[..., :1]
    keep = (
        mask
        & (jnp.arange(r, dtype=jnp.int32) < rank.astype(jnp.int32)[..., None])
        & (u.s > cand_rtol * smax)
        & (smax > 0)
    )
    s = u.s if scale_exp is None else mul_pow2(u.s, jnp.asarray(scale_exp)[..., None])
    kf = keep.astype(u.s.dtype)
    return Kept(u.in_dirs * kf[..., None, :], s * kf, u.out_dirs * kf[..., None, :], keep)


def _factor_svd(a, b, scale):
    """``nu.lora_svd``'s result (descending ``s``, ``in_dirs``, ``out_dirs``) by the Gram route.

    Same factorisation as :func:`nu.lora_svd` (``a = Q_a R_a``, ``b^T = Q_b R_b``, SVD of the
    ``r x r`` core) with both QRs from one :func:`_linalg.orth_qr_lazy_many` (Gram route: ``d``-sized
    work is matmuls, and the two sides share their LAPACK calls).
    """
    (fa, fb), (ea, eb) = _m.qr_equilibrated([a, _t(b)])
    core = scale[..., None, None] * _mm(mul_pow2(fa.r, (ea + eb)[..., None, :]), _t(fb.r))
    w, s, zt = svd(core)
    return _SVD(fa.q_times(w), s, fb.q_times(_t(zt)))


class _SVD(NamedTuple):
    in_dirs: jax.Array
    s: jax.Array
    out_dirs: jax.Array


class Coords(NamedTuple):
    """Tasks in a space's coordinates, ``X_i = a_i b_i^T`` of shape ``(p, q)``.

    Attributes:
      a: ``(n, M, p, r)``; b: ``(n, M, q, r)``.
      left: ``(n, d_in, p)`` orthonormal map of the input side back to ``d_in``, or None (identity).
      right: ``(n, d_out, q)`` map of the output side back to ``d_out``, or None (identity).
      right_scale: ``(n, q)`` diagonal applied before ``right`` when mapping back, or None.
    """

    a: jax.Array
    b: jax.Array
    left: jax.Array | None
    right: jax.Array | None
    right_scale: jax.Array | None


def _bases(xs: list[jax.Array], rtol: float) -> list[jax.Array]:
    """Left singular vectors of each ``x (..., d, K)`` (QR, then SVD of R), zeroed past its rank.

    All inputs (same ``K``) share their LAPACK calls.
    """
    qrs, es = _m.qr_equilibrated(xs, rtol=rtol)
    rs = [mul_pow2(f.r, e[..., None, :]) for f, e in zip(qrs, es, strict=True)]
    out = []
    for f, (w, s, _) in zip(qrs, svd_many(rs), strict=True):
        keep = _m.above_rtol(s, rtol)
        out.append(f.q_times(jnp.where(keep[..., None, :], w, 0)))
    return out


def full_coords(k: Kept) -> Coords:
    """Full space: ``A_i = in_dirs_i diag(s_i)``, ``B_i = out_dirs_i``."""
    return Coords(k.in_dirs * k.s[..., None, :], k.out_dirs, None, None, None)


def core_coords(
    k: Kept,
    a: jax.Array,
    b: jax.Array,
    *,
    rtol: float,
    basis: str = "svd",
    a_exp: jax.Array | None = None,
    b_exp: jax.Array | None = None,
) -> Coords:
    """Core Space bases and ``(D, D)`` core coordinates from the (kept-projected) factors.

    ``basis="svd"`` uses the left singular vectors (Core Space's reference bases; elementwise
    methods depend on them). ``basis="qr"`` uses any orthonormal basis of the same spans (one QR
    each, no SVD): the core matrices differ by rotations on both sides, which spectral methods
    (TA, TSV, Iso-C, Iso-CTS) are invariant to, so they give the same merged update cheaper.
    ``a_exp``, ``b_exp`` ``(n, M)``: the factors' power-of-two exponents (:class:`TaskScales`)
    when ``a``, ``b`` are normalised per task: the SVD bases depend on the factors' relative
    sizes, which are restored (relative to the largest, so nothing overflows).
    """
    if a_exp is not None:
        a = mul_pow2(a, _relative(a_exp, k.keep)[..., None, None])
    if b_exp is not None:
        b = mul_pow2(b, _relative(b_exp, k.keep)[..., None, None])
    # a_i' = P_i (P_i^T a_i): the input factor restricted to the kept input directions.
    a_p = _mm(k.in_dirs, _mm(_t(k.in_dirs), a))  # (n, M, d_in, r)
    b_p = _mm(k.out_dirs, _mm(_t(k.out_dirs), _t(b)))  # (n, M, d_out, r)
    stacked = [concat_tasks(a_p), concat_tasks(b_p)]
    if basis == "qr":
        left, right = (f.q for f in orth_qr_lazy_many(stacked, rtol=rtol))
    else:
        left, right = _bases(stacked, rtol)  # (n, d, D)
    ca = _mm(_t(left)[:, None], k.in_dirs) * k.s[..., None, :]  # (n, M, D, r)
    cb = _mm(_t(right)[:, None], k.out_dirs)  # (n, M, D, r)
    return Coords(ca, cb, left, right, None)


def _relative(e: jax.Array, keep: jax.Array) -> jax.Array:
    """``e (n, M)`` minus its largest value over the tasks with a kept slot (``<= 0`` there)."""
    live = keep.any(-1)
    top = jnp.max(jnp.where(live, e, jnp.iinfo(jnp.int32).min), axis=-1, keepdims=True)
    return jnp.where(live, e - top, 0)


def knots_coords(
    k: Kept, *, rtol: float, variant: str = "core_space", block_exp: int = 0
) -> Coords:
    """KnOTS shared output basis ``U`` from ``Z = [Q_i diag(s_i)]`` and per-task blocks.

    ``block_exp``: the unscaled blocks (``variant="core_space"``) are returned times
    ``2**block_exp`` and ``right_scale`` divided by it, which leaves every product the same.
    The blocks ``V_i`` are dimensionless (the strongest task's are of order one), so a task
    ``2**120`` weaker has blocks near float32's smallest normal number; :func:`nu.merge` passes
    :data:`HEADROOM`, which keeps them as far from it as the scaled blocks are in working units.
    """
    z = concat_tasks(k.out_dirs * k.s[..., None, :])  # (n, d_out, M r)
    (fz,), (ez,) = _m.qr_equilibrated([z], rtol=rtol)
    rz = mul_pow2(fz.r, ez[..., None, :])
    w, s, _ = svd(rz)  # rz: (n, M r, M r)
    keep = _m.above_rtol(s, rtol)
    s = jnp.where(keep, s, 0)
    u = fz.q_times(jnp.where(keep[..., None, :], w, 0))  # (n, d_out, k)
    # U^T Q_i diag(s_i) = W^T Rz_i: per task a (k, r) block, no d-sized work.
    m_tasks, r = k.s.shape[-2], k.s.shape[-1]
    proj = _mm(jnp.where(keep[..., :, None], _t(w), 0), rz)  # (n, k, M r)
    proj = jnp.moveaxis(proj.reshape(*proj.shape[:-1], m_tasks, r), -2, -3)  # (n, M, k, r)
    if variant == "original":
        cb, rs = proj, None
    else:
        # blocks times 2**block_exp, divided back out of right_scale (exact): 1 / S is taken
        # of S 2**-block_exp so no weak task's block is formed below the normal range first
        rs = mul_pow2(s, -block_exp) if block_exp else s
        inv = jnp.where(keep, 1 / jnp.where(keep, rs, 1), 0)
        cb = proj * inv[:, None, :, None]
    # X_i = in_dirs_i (U^T Q_i diag(s_i) [S^-1])^T: the task's kept in_dirs times a (k, r) block
    return Coords(k.in_dirs, cb, None, u, rs)


def dense_tasks(c: Coords) -> jax.Array:
    """``X_i = a_i b_i^T`` for every task: ``(n, M, p, q)`` (only for elementwise methods)."""
    return _mm(c.a, _t(c.b))


def decode_factored(c: Coords, am: jax.Array, bm: jax.Array, *, rtol: float, compact: bool):
    """Map a factored merge ``X = am bm^T`` (``am (n, p, K)``, ``bm (n, q, K)``) back to LoRA form.

    Returns ``(lora_a (n, d_in, K'), lora_b (n, K', d_out), live (n, K'))`` with the live columns
    first; ``live.sum(-1)`` is each module's rank. With ``compact`` the result is re-factored by a
    thin SVD (its numerical rank), otherwise live columns are the nonzero ones.
    """
    if c.right_scale is not None:
        bm = bm * c.right_scale[:, :, None]
    if compact:
        f = _m.factored_svd(am, bm, rtol=rtol)
        am, bm, live = f.u * f.s[..., None, :], f.v, f.keep
    else:
        live = (jnp.abs(am).sum(-2) > 0) & (jnp.abs(bm).sum(-2) > 0)
    if c.left is not None:
        am = _mm(c.left, am)
    if c.right is not None:
        bm = _mm(c.right, bm)
    order = jnp.argsort(~live, axis=-1, stable=True)
    am = jnp.take_along_axis(am, order[:, None, :], -1)
    bm = jnp.take_along_axis(bm, order[:, None, :], -1)
    live = jnp.take_along_axis(live, order, -1)
    return jnp.where(live[:, None, :], am, 0), _t(jnp.where(live[:, None, :], bm, 0)), live


def decode_dense(c: Coords, x: jax.Array, *, rtol: float, compact: bool = True):
    """Map a dense merge in coordinates ``x (n, p, q)`` back to LoRA form.

    With ``compact`` by a thin SVD of ``x`` (its numerical rank); otherwise ``x`` itself is the
    input factor (rank = its nonzero columns, at most ``q``): for KnOTS blocks ``(d_in, k)``, whose
    merge is full rank ``k`` but for degenerate cases, this skips a ``d_in``-sized SVD per module.
    """
    q = x.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(q, dtype=x.dtype), (x.shape[0], q, q))
    return decode_factored(c, x, eye, rtol=rtol, compact=compact)
