"""Merge operators on task updates in some coordinate system (paper, Baselines).

Every kernel here is pure, written for stacked tasks and batched over any leading axes, so one
call merges a whole bucket of modules. Two input forms:

* **factored** tasks ``A (..., M, p, r)``, ``B (..., M, q, r)`` with task ``i``'s update
  ``X_i = A_i @ B_i^T`` (``p`` the input side, ``q`` the output side, kernel layout). Columns that
  are not kept are zero. The spectral methods (TA, TSV, Iso-C, Iso-CTS) work here and return a
  factored result ``(A_m (..., p, K), B_m (..., q, K))``: they never form a ``(p, q)`` matrix.
* **dense** tasks ``X (..., M, p, q)``: the elementwise methods (TIES, DARE, DARE-TIES) need entry
  access and return a dense ``(..., p, q)`` result.

Thin SVDs of factored matrices use QR of both factors plus a small core SVD (docs/math.md §8).
Singular values at or below ``rtol * s_max`` count as zero (``rtol`` = :func:`rank_rtol`).

References:
  Ilharco et al. 2023 (Task Arithmetic); Yadav et al. 2023 (TIES); Yu et al. 2024 (DARE);
  Gargiulo et al. 2025 (TSV-Merge); Marczak et al. 2025 (Iso-C, Iso-CTS).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core.linalg import column_norms as _column_norms
from .._core.linalg import concat_tasks as _concat_tasks
from .._core.linalg import mm as _mm
from .._core.linalg import mul_pow2, orth_qr_lazy_many, pow2_normalise, svd, svd_many
from .._core.linalg import t as _t
from ._select import digit_histogram as digit_histogram
from ._select import kth_largest as kth_largest
from ._select import kth_largest_count as kth_largest_count
from ._select import topk_count as topk_count
from ._select import trim_at as trim_at
from ._select import trim_topk as trim_topk

__all__ = [
    "FactoredSVD",
    "above_rtol",
    "dare",
    "dare_drop",
    "dare_kept",
    "dare_rescale",
    "dare_ties",
    "dare_ties_kept",
    "digit_histogram",
    "disjoint_mean",
    "factored_svd",
    "iso_c",
    "iso_cts",
    "kth_largest",
    "kth_largest_count",
    "polar",
    "polar_many",
    "qr_equilibrated",
    "rank_rtol",
    "ta",
    "ties",
    "topk_count",
    "trim_at",
    "trim_topk",
    "tsv",
]


def rank_rtol(dims: tuple[int, ...], dtype) -> float:
    """Relative singular-value cut for numerical rank: ``max(dims) * eps(dtype)`` (numpy's rule)."""
    return float(max(dims) * np.finfo(np.dtype(dtype)).eps)


class FactoredSVD(NamedTuple):
    """Thin SVD ``A B^T = U diag(s) V^T`` of a factored matrix; ``keep`` marks nonzero values.

    ``U (..., p, k)``, ``s (..., k)`` descending, ``V (..., q, k)``, ``keep (..., k)`` bool. Columns
    with ``keep = False`` are zeroed in ``U``, ``s`` and ``V``.
    """

    u: jax.Array
    s: jax.Array
    v: jax.Array
    keep: jax.Array


def above_rtol(s: jax.Array, rtol: float) -> jax.Array:
    """The singular values kept: nonzero and above ``rtol`` times the largest (``s`` sorted
    descending along its last axis)."""
    return (s > rtol * s[..., :1]) & (s > 0)


def qr_equilibrated(xs: list[jax.Array], *, rtol: float = 0.0):
    """:func:`_linalg.orth_qr_lazy_many` of each ``x (..., d, K)`` with its columns divided by
    powers of two first (exact): ``x = Q (R 2**e)`` column-wise. Returns ``(qrs, es)``, ``e
    (..., K)`` int32. A Gram of columns whose sizes differ by ``1e30`` (a task with an extreme
    LoRA scale next to ordinary ones) would under- or overflow in float32; these do not, and
    nothing else changes (a power of two rounds nothing; the first pass equilibrates anyway)."""
    ys, es = [], []
    for x in xs:
        y, e, _ = pow2_normalise(x, (-2,))
        ys.append(y)
        es.append(e)
    return orth_qr_lazy_many(ys, rtol=rtol), es


def factored_svd(a: jax.Array, b: jax.Array, *, rtol: float) -> FactoredSVD:
    """Thin SVD of ``a @ b^T`` from QR of ``a (..., p, K)`` and ``b (..., q, K)`` (docs/math.md §8).

    Cost ``O((p + q) K^2)``; the ``(p, q)`` product is never formed. Both QRs share their LAPACK
    calls (see :mod:`netutility_jax._core.linalg`). If ``p, q <= K`` (matrices already in reduced
    coordinates) the ``(p, q)`` product is no larger than the factors and is decomposed directly.
    """
    p, q, k = a.shape[-2], b.shape[-2], a.shape[-1]
    if max(p, q) <= k:  # already small (reduced coordinates): one dense SVD, no QRs
        u, s, vt = svd(_mm(a, _t(b)))
        keep = above_rtol(s, rtol)
        s = jnp.where(keep, s, 0)
        return FactoredSVD(
            jnp.where(keep[..., None, :], u, 0), s, jnp.where(keep[..., None, :], _t(vt), 0), keep
        )
    (fa, fb), (ea, eb) = qr_equilibrated([a, b], rtol=rtol)
    core = _mm(mul_pow2(fa.r, (ea + eb)[..., None, :]), _t(fb.r))
    w, s, zt = svd(core)
    keep = above_rtol(s, rtol)
    s = jnp.where(keep, s, 0)
    u = fa.q_times(jnp.where(keep[..., None, :], w, 0))
    v = fb.q_times(jnp.where(keep[..., None, :], _t(zt), 0))
    return FactoredSVD(u, s, v, keep)


def polar_many(xs: list[jax.Array], *, rtol: float) -> list[jax.Array]:
    """Polar factor ``P Q^T`` of each ``x (..., p, K)`` (same ``K``) on its nonzero spectrum.

    ``x = Q_1 R_1``, ``R_1 = W S Z^T``: the polar factor is ``Q_1 W Z^T`` restricted to ``S > rtol
    S_max``. Zero columns of ``x`` map to zero columns, so zero-padded (unkept) slots stay inert;
    nonzero columns that are linearly independent map to orthonormal columns. All inputs share
    their LAPACK calls. Inputs with ``p <= K`` are decomposed directly (no QR).
    """
    out = []
    if all(x.shape[-2] <= x.shape[-1] for x in xs):  # already small: SVD of x itself, no QR
        for w, s, zt in svd_many(xs):
            keep = above_rtol(s, rtol)
            out.append(_mm(jnp.where(keep[..., None, :], w, 0), zt))
        return out
    qrs = orth_qr_lazy_many(xs, rtol=rtol)
    for f, (w, s, zt) in zip(qrs, svd_many([f.r for f in qrs]), strict=True):
        keep = above_rtol(s, rtol)
        out.append(f.q_times(_mm(jnp.where(keep[..., None, :], w, 0), zt)))
    return out


def polar(x: jax.Array, *, rtol: float) -> jax.Array:
    """:func:`polar_many` of one matrix."""
    return polar_many([x], rtol=rtol)[0]


def _flatten(s: jax.Array, keep: jax.Array) -> jax.Array:
    """Replace the kept singular values by their mean; zeros stay zero (none kept -> all zero)."""
    n = keep.sum(-1, keepdims=True, dtype=jnp.int32)
    mean = jnp.where(keep, s, 0).sum(-1, keepdims=True) / jnp.maximum(n, 1).astype(s.dtype)
    return jnp.where(keep, mean, 0)


def ta(a: jax.Array, b: jax.Array, *, coef) -> tuple[jax.Array, jax.Array]:
    """Task Arithmetic ``coef * sum_i X_i`` on factored tasks: the factors side by side.

    Returns ``(coef * [A_1 .. A_M], [B_1 .. B_M])``, rank ``K = M r`` slots (unkept slots zero).
    """
    return coef * _concat_tasks(a), _concat_tasks(b)


def iso_c(a: jax.Array, b: jax.Array, *, coef, rtol: float) -> tuple[jax.Array, jax.Array]:
    """Iso-C: the TA sum with its nonzero singular values replaced by their mean.

    ``sum_i X_i = U diag(s) V^T`` (thin SVD from factors), result ``coef * U (mean s) V^T`` where the
    mean runs over the nonzero singular values only (the Core Space code also averages zeros in full
    space, which shrinks the result with the matrix size; we do not).
    """
    f = factored_svd(_concat_tasks(a), _concat_tasks(b), rtol=rtol)
    return coef * f.u * _flatten(f.s, f.keep)[..., None, :], f.v


def tsv(
    a: jax.Array, b: jax.Array, *, coef, rtol: float, is_svd: bool = False, isotropize: bool = False
) -> tuple[jax.Array, jax.Array]:
    """TSV-Merge: concatenate every task's singular triplets, orthogonalise each side (polar).

    Per task ``X_i = U_i diag(s_i) V_i^T`` (its kept components); ``U = [U_1 .. U_M]``,
    ``V = [V_1 .. V_M]`` are replaced by their polar factors and the result is
    ``coef * polar(U) diag(s) polar(V)^T``. With ``isotropize`` the kept ``s`` are replaced by their
    mean (the paper's "Iso-C + TSV"). ``is_svd`` says the factored tasks are already
    ``A_i = U_i diag(s_i)``, ``B_i = V_i`` with orthonormal kept columns (skips the per-task SVD).
    """
    if is_svd:
        s = _column_norms(a)
        keep = s > 0
        u = a / jnp.where(keep, s, 1)[..., None, :]
        v = b
    else:
        u, s, v, keep = factored_svd(a, b, rtol=rtol)
    u, v = _concat_tasks(u), _concat_tasks(v)
    s, keep = (
        _concat_tasks(s[..., None, :])[..., 0, :],
        _concat_tasks(keep[..., None, :])[..., 0, :],
    )
    if isotropize:
        s = _flatten(s, keep)
    pu, pv = polar_many([u, v], rtol=rtol)
    return coef * pu * s[..., None, :], pv


def iso_cts(
    a: jax.Array, b: jax.Array, *, coef, rtol: float, common_fraction: float = 0.8
) -> tuple[jax.Array, jax.Array]:
    """Iso-CTS (Marczak et al. 2025) on factored tasks.

    1. Common subspace: the top ``floor(common_fraction * D)`` singular triplets of the TA sum, where
       ``D`` is the TA sum's numerical rank (the space the low-rank tasks span; the reference uses
       ``min(d_out, d_in)``, which for LoRA updates would leave nothing task-specific).
    2. Task-specific: each task's update with the common output directions projected out,
       ``X_i (I - V_c V_c^T)``, keeps its top ``floor((D - k_c) / M)`` triplets.
    3. Concatenate, replace each side by its polar factor, and set every kept singular value to the
       mean of the concatenated ones: ``coef * polar(U) (mean s) polar(V)^T``.
    """
    m_tasks = a.shape[-3]
    f = factored_svd(_concat_tasks(a), _concat_tasks(b), rtol=rtol)
    d = f.keep.sum(-1, dtype=jnp.int32)  # (...,)
    k_c = jnp.floor(jnp.asarray(common_fraction, f.s.dtype) * d.astype(f.s.dtype)).astype(jnp.int32)
    n_t = (d - k_c) // m_tasks
    kc_mask = jnp.arange(f.s.shape[-1], dtype=jnp.int32) < k_c[..., None]
    uc = jnp.where(kc_mask[..., None, :], f.u, 0)
    sc = jnp.where(kc_mask, f.s, 0)
    vc = jnp.where(kc_mask[..., None, :], f.v, 0)
    # residual of each task outside the common output directions (projection on the q side)
    vc_t = vc[..., None, :, :]
    b_res = b - _mm(vc_t, _mm(_t(vc_t), b))
    rs = factored_svd(a, b_res, rtol=rtol)
    t_mask = (jnp.arange(rs.s.shape[-1], dtype=jnp.int32) < n_t[..., None, None]) & rs.keep
    ur = _concat_tasks(jnp.where(t_mask[..., None, :], rs.u, 0))
    vr = _concat_tasks(jnp.where(t_mask[..., None, :], rs.v, 0))
    sr = _concat_tasks(jnp.where(t_mask, rs.s, 0)[..., None, :])[..., 0, :]
    keep_r = _concat_tasks(t_mask[..., None, :])[..., 0, :]
    u = jnp.concatenate([uc, ur], -1)
    v = jnp.concatenate([vc, vr], -1)
    s = jnp.concatenate([sc, sr], -1)
    keep = jnp.concatenate([kc_mask & f.keep, keep_r], -1)
    s = _flatten(s, keep)
    pu, pv = polar_many([u, v], rtol=rtol)
    return coef * pu * s[..., None, :], pv


# ---------------------------------------------------------------------------------------------
# Elementwise methods on dense tasks
# ---------------------------------------------------------------------------------------------


def disjoint_mean(x: jax.Array) -> jax.Array:
    """TIES sign election and disjoint mean over the task axis ``-3`` of ``x (..., M, p, q)``.

    Elected sign: sign of the sum over tasks, added in task order (zero -> +, as PEFT). Each entry
    is the mean of the tasks' nonzero values that agree with it (zero if none). Where the sum is
    within rounding of zero the elected sign (and so the entry) can differ between precisions.
    """
    # a loop over the (few) tasks: XLA:CPU reduces over a non-minor axis ~100x slower than it
    # runs the same arithmetic elementwise
    xs = [x[..., i, :, :] for i in range(x.shape[-3])]
    pos = _task_sum(xs) >= 0
    tot = jnp.zeros_like(xs[0])
    cnt = jnp.zeros_like(xs[0])
    for xi in xs:
        agree = jnp.where(pos, xi > 0, xi < 0)  # nonzero and of the elected sign
        tot = tot + jnp.where(agree, xi, 0)
        cnt = cnt + agree.astype(x.dtype)
    return tot / jnp.maximum(cnt, 1)


def _task_sum(xs: list[jax.Array]) -> jax.Array:
    """Sum of the tasks' arrays in task order (elementwise adds, see :func:`disjoint_mean`)."""
    out = xs[0]
    for xi in xs[1:]:
        out = out + xi
    return out


def ties(x: jax.Array, *, coef, k) -> jax.Array:
    """TIES-Merging: trim each task to its ``k`` largest entries (``k = int(density * n)``, ties in
    flat order: :func:`trim_topk`), elect signs (:func:`disjoint_mean`), disjoint mean, times
    ``coef``."""
    return coef * disjoint_mean(trim_topk(x, k))


def dare_drop(x: jax.Array, key: jax.Array, p) -> jax.Array:
    """Drop each entry with probability ``p`` and rescale the survivors by ``1 / (1 - p)``."""
    keep = jax.random.bernoulli(key, 1.0 - jnp.asarray(p, jnp.float32), x.shape)
    return dare_rescale(x, keep, p)


def dare_rescale(x: jax.Array, keep: jax.Array, p) -> jax.Array:
    """The entries of ``x`` where ``keep``, rescaled by ``1 / (1 - p)``; zero elsewhere."""
    return jnp.where(keep, x / (1.0 - jnp.asarray(p, x.dtype)), 0)


def dare(x: jax.Array, key: jax.Array, *, coef, p) -> jax.Array:
    """DARE (linear): random drop-and-rescale per task, then ``coef * sum``."""
    return dare_kept(dare_drop(x, key, p), coef=coef)


def dare_kept(d: jax.Array, *, coef) -> jax.Array:
    """DARE's merge of the dropped-and-rescaled tasks ``d (..., M, p, q)``: ``coef * sum``."""
    return coef * _task_sum([d[..., i, :, :] for i in range(d.shape[-3])])


def dare_ties(x: jax.Array, key: jax.Array, *, coef, p) -> jax.Array:
    """DARE-TIES: random drop-and-rescale per task, then TIES sign election and disjoint mean."""
    return dare_ties_kept(dare_drop(x, key, p), coef=coef)


def dare_ties_kept(d: jax.Array, *, coef) -> jax.Array:
    """DARE-TIES's merge of the dropped-and-rescaled tasks ``d``: sign election, disjoint mean."""
    return coef * disjoint_mean(d)
