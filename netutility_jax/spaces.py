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

References:
  Panariello et al., "Accurate and Efficient Low-Rank Model Merging in Core Space", 2025.
  Stoica et al., "Model merging with SVD to tie the KnOTS", 2024.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import methods as _m
from ._linalg import LazyQR, orth_qr_lazy_many, svd_many
from ._linalg import mm as _mm
from ._linalg import t as _t

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
    :func:`_tree.stack_bucket_cat`); both QRs share their LAPACK calls."""
    fa, fb = orth_qr_lazy_many([xa, yb], rows=[False, True], exact=True)
    n, k = fa.r.shape[0], fa.r.shape[-2]
    r = xa.shape[-1] // m_tasks
    a = jnp.moveaxis(fa.r.reshape(n, k, m_tasks, r), 2, 1)  # (n, M, K, r)
    b = _t(jnp.moveaxis(fb.r.reshape(n, k, m_tasks, r), 2, 1))  # (n, M, r, K)
    return Reduced(a, b, fa, fb)


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


def kept_components(a, b, scale, rank, mask, *, cand_rtol) -> Kept:
    """Thin SVD of every task's update and the kept slots (mask & candidate).

    Args:
      a: ``(n, M, d_in, r)``, b: ``(n, M, r, d_out)``, scale: ``(n, M)``, rank: ``(n, M)`` int,
      mask: ``(n, M, r)`` bool. cand_rtol: relative cut of candidates.
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
    kf = keep.astype(u.s.dtype)
    return Kept(u.in_dirs * kf[..., None, :], u.s * kf, u.out_dirs * kf[..., None, :], keep)


def _factor_svd(a, b, scale):
    """``nu.lora_svd``'s result (descending ``s``, ``in_dirs``, ``out_dirs``) by the Gram route.

    Same factorisation as :func:`nu.lora_svd` (``a = Q_a R_a``, ``b^T = Q_b R_b``, SVD of the
    ``r x r`` core) with both QRs from one :func:`_linalg.orth_qr_lazy_many` (Gram route: ``d``-sized
    work is matmuls, and the two sides share their LAPACK calls).
    """
    fa, fb = orth_qr_lazy_many([a, _t(b)])
    core = scale[..., None, None] * _mm(fa.r, _t(fb.r))
    w, s, zt = jnp.linalg.svd(core, full_matrices=False)
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
    qrs = orth_qr_lazy_many(xs, rtol=rtol)
    out = []
    for f, (w, s, _) in zip(qrs, svd_many([f.r for f in qrs]), strict=True):
        keep = _m.above_rtol(s, rtol)
        out.append(f.q_times(jnp.where(keep[..., None, :], w, 0)))
    return out


def full_coords(k: Kept) -> Coords:
    """Full space: ``A_i = in_dirs_i diag(s_i)``, ``B_i = out_dirs_i``."""
    return Coords(k.in_dirs * k.s[..., None, :], k.out_dirs, None, None, None)


def core_coords(k: Kept, a: jax.Array, b: jax.Array, *, rtol: float, basis: str = "svd") -> Coords:
    """Core Space bases and ``(D, D)`` core coordinates from the (kept-projected) factors.

    ``basis="svd"`` uses the left singular vectors (Core Space's reference bases; elementwise
    methods depend on them). ``basis="qr"`` uses any orthonormal basis of the same spans (one QR
    each, no SVD): the core matrices differ by rotations on both sides, which spectral methods
    (TA, TSV, Iso-C, Iso-CTS) are invariant to, so they give the same merged update cheaper.
    """
    # a_i' = P_i (P_i^T a_i): the input factor restricted to the kept input directions.
    a_p = _mm(k.in_dirs, _mm(_t(k.in_dirs), a))  # (n, M, d_in, r)
    b_p = _mm(k.out_dirs, _mm(_t(k.out_dirs), _t(b)))  # (n, M, d_out, r)
    stacked = [_m._concat_tasks(a_p), _m._concat_tasks(b_p)]
    if basis == "qr":
        left, right = (f.q for f in orth_qr_lazy_many(stacked, rtol=rtol))
    else:
        left, right = _bases(stacked, rtol)  # (n, d, D)
    ca = _mm(_t(left)[:, None], k.in_dirs) * k.s[..., None, :]  # (n, M, D, r)
    cb = _mm(_t(right)[:, None], k.out_dirs)  # (n, M, D, r)
    return Coords(ca, cb, left, right, None)


def knots_coords(k: Kept, *, rtol: float, variant: str = "core_space") -> Coords:
    """KnOTS shared output basis ``U`` from ``Z = [Q_i diag(s_i)]`` and per-task blocks."""
    z = _m._concat_tasks(k.out_dirs * k.s[..., None, :])  # (n, d_out, M r)
    (fz,) = orth_qr_lazy_many([z], rtol=rtol)
    rz = fz.r
    w, s, _ = jnp.linalg.svd(rz, full_matrices=False)  # rz: (n, M r, M r)
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
        inv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0)
        cb, rs = proj * inv[:, None, :, None], s
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
