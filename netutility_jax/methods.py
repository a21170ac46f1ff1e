"""Merge operators on task updates in some coordinate system (paper, Baselines).

Every kernel here is pure, written for stacked tasks and batched over any leading axes, so one
call merges a whole bucket of modules. Two input forms:

* **factored** tasks ``A (..., M, p, r)``, ``B (..., M, q, r)`` with task ``i``'s update
  ``X_i = A_i @ B_i^T`` (``p`` the input side, ``q`` the output side, kernel layout). Columns that
  are not kept are zero. The spectral methods (TA, TSV, Iso-C, Iso-CTS) work here and return a
  factored result ``(A_m (..., p, K), B_m (..., q, K))``: they never form a ``(p, q)`` matrix.
* **dense** tasks ``X (..., M, p, q)``: the elementwise methods (TIES, DARE, DARE-TIES) need entry
  access and return a dense ``(..., p, q)`` result.

Thin SVDs of factored matrices use QR of both factors plus a small core SVD (MATH.md 1, 6).
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

from ._linalg import mm as _mm
from ._linalg import mul_pow2, orth_qr_lazy_many, pow2_normalise, svd_many
from ._linalg import orth_qr as orth_qr
from ._linalg import t as _t


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
    """Thin SVD of ``a @ b^T`` from QR of ``a (..., p, K)`` and ``b (..., q, K)`` (MATH.md 1).

    Cost ``O((p + q) K^2)``; the ``(p, q)`` product is never formed. Both QRs share their LAPACK
    calls (see :mod:`netutility_jax._linalg`). If ``p, q <= K`` (matrices already in reduced
    coordinates) the ``(p, q)`` product is no larger than the factors and is decomposed directly.
    """
    p, q, k = a.shape[-2], b.shape[-2], a.shape[-1]
    if max(p, q) <= k:  # already small (reduced coordinates): one dense SVD, no QRs
        u, s, vt = jnp.linalg.svd(_mm(a, _t(b)), full_matrices=False)
        keep = above_rtol(s, rtol)
        s = jnp.where(keep, s, 0)
        return FactoredSVD(
            jnp.where(keep[..., None, :], u, 0), s, jnp.where(keep[..., None, :], _t(vt), 0), keep
        )
    (fa, fb), (ea, eb) = qr_equilibrated([a, b], rtol=rtol)
    core = _mm(mul_pow2(fa.r, (ea + eb)[..., None, :]), _t(fb.r))
    w, s, zt = jnp.linalg.svd(core, full_matrices=False)
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


def _concat_tasks(x: jax.Array) -> jax.Array:
    """``(..., M, p, r)`` -> ``(..., p, M r)``: the tasks' columns side by side."""
    *lead, m, p, r = x.shape
    return jnp.moveaxis(x, -3, -2).reshape(*lead, p, m * r)


def _flatten(s: jax.Array, keep: jax.Array) -> jax.Array:
    """Replace the kept singular values by their mean; zeros stay zero (none kept -> all zero)."""
    n = keep.sum(-1, keepdims=True, dtype=jnp.int32)
    mean = jnp.where(keep, s, 0).sum(-1, keepdims=True) / jnp.maximum(n, 1).astype(s.dtype)
    return jnp.where(keep, mean, 0)


def _column_norms(a: jax.Array) -> jax.Array:
    """Euclidean norms of the columns of ``a (..., p, k)`` without under- or overflow in the
    squares: each column is divided by its largest ``|entry|`` first (a column of tiny but
    nonzero entries has a tiny nonzero norm, not 0)."""
    m = jnp.max(jnp.abs(a), axis=-2, keepdims=True, initial=0)
    safe = jnp.where(m > 0, m, 1)
    return (m * jnp.linalg.norm(a / safe, axis=-2, keepdims=True))[..., 0, :]


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


_BLOCK = 64  # entries per packed partial count in kth_largest_count


def _uint_of(dtype):
    return {4: jnp.uint32, 8: jnp.uint64, 2: jnp.uint16}[jnp.dtype(dtype).itemsize]


def _int_of(dtype):
    return {4: jnp.int32, 8: jnp.int64, 2: jnp.int16}[jnp.dtype(dtype).itemsize]


def kth_largest(x: jax.Array, k: jax.Array) -> jax.Array:
    """Exact k-th largest entry of the non-negative ``x (..., n)`` per leading index (``k >= 1``).

    Search over the bit patterns of the floats (monotone for non-negative values), two bits per
    pass over ``x``: ``O(n * bits / 2)`` with no sort and no ``top_k`` of size ``k``.
    """
    return kth_largest_count(x, k)[0]


def kth_largest_count(x: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`kth_largest` and how many entries are at least that large (``>= k``; ``== k`` when
    the entries at the threshold all fit in the top ``k``), at no extra pass over ``x``."""
    t, ge = _kth_pattern(jax.lax.bitcast_convert_type(x, _int_of(x.dtype)), k)
    return jax.lax.bitcast_convert_type(t, x.dtype), ge


def _magnitude_pattern(x: jax.Array) -> jax.Array:
    """``|x|``'s bit patterns as signed integers (sign bit cleared): ordered like ``|x|``."""
    it = _int_of(x.dtype)
    return jax.lax.bitcast_convert_type(x, it) & jnp.iinfo(it).max


def _kth_pattern(xi: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """:func:`kth_largest_count` on the non-negative bit patterns ``xi`` of non-negative floats."""
    # Non-negative floats have the sign bit clear, so their patterns compare the same as signed
    # integers and the sign bit needs no pass: 31 bits (63 in float64) are found two at a time,
    # each pass counting the entries at or above three candidates.
    it = xi.dtype
    bits = jnp.dtype(it).itemsize * 8 - 1
    n = xi.shape[-1]
    shape = xi.shape[:-1]
    # The three counts of a block of _BLOCK entries (each at most 64: 7 bits) are packed in one
    # float32 block sum (exact below 2**24): XLA:CPU streams the compare into a float sum, while
    # an integer sum of this length becomes a reduce-window over a materialised array, and three
    # separate sums read the data three times. Zero padding counts nothing (candidates are > 0).
    nb = -(-n // _BLOCK)
    xi = jnp.pad(xi, [(0, 0)] * (xi.ndim - 1) + [(0, nb * _BLOCK - n)])
    xi = xi.reshape(*xi.shape[:-1], nb, _BLOCK)
    k = jnp.asarray(k).astype(jnp.int32)

    def counts(cands):  # (..., 3) increasing candidates -> (..., 3) counts of xi >= each
        c = [cands[..., j, None, None] for j in range(3)]
        # xi's weight 1 + 128 [xi >= c1] + 16384 [xi >= c2] if xi >= c0, as one nested select
        w = jnp.where(xi >= c[2], 16513.0, jnp.where(xi >= c[1], 129.0, 1.0))
        packed = jnp.where(xi >= c[0], w, 0.0).astype(jnp.float32).sum(-1)
        p = packed.astype(jnp.int32)
        parts = [p & 127, (p >> 7) & 127, p >> 14]
        return jnp.stack([q.sum(-1, dtype=jnp.int32) for q in parts], -1)

    big = jnp.iinfo(it).max  # a candidate no entry reaches (patterns of finite floats are less)

    def body(i, carry):
        t, ge = carry
        # pass i decides bits hi = bits - 1 - 2 i and hi - 1 (only bit 0 on an odd last pass)
        low = jnp.maximum(bits - 2 - 2 * i, 0).astype(it)
        mult = jnp.arange(1, 4, dtype=it)
        valid = (i < bits // 2) | (mult == 1)  # bits is odd: the last pass has one candidate
        cands = jnp.where(valid, t[..., None] | (mult << low), big)
        cnt = counts(cands)
        j = (cnt >= k[..., None]).sum(-1)  # the counts decrease: the candidates kept are a prefix
        at = jnp.maximum(j - 1, 0)[..., None]
        take = j > 0
        t = jnp.where(take, jnp.take_along_axis(cands, at, -1)[..., 0], t)
        ge = jnp.where(take, jnp.take_along_axis(cnt, at, -1)[..., 0], ge)
        return t, ge

    init = (jnp.zeros(shape, it), jnp.full(shape, n, jnp.int32))
    return jax.lax.fori_loop(0, -(-bits // 2), body, init)


def topk_count(density, n):
    """TIES's kept-entry count for ``n`` entries: ``int(float(density) * n)``, PEFT's rule, exactly.

    The rule (PEFT's ``magnitude_based_pruning``: ``k = int(density * tensor.numel())`` with a
    Python float ``density``): the density as a binary64 number (a float32 or any other real is
    converted to it first, exactly where it can be), the integer ``n`` converted to binary64, one
    correctly rounded binary64 product, then truncated. ``n`` is an exact integer computed first
    (never a product of floats): ``0.3`` of ``96 x 25`` entries is ``int(0.3 * 2400) = 720``,
    while the left-to-right ``0.3 * 96 * 25`` gives 719. Computed on the host (Python or numpy
    binary64 arithmetic, identical by IEEE 754), never in a traced dtype: a float32 density or
    product would give other counts. Traced code receives counts made here (see
    :func:`nu.merge`).

    Args:
      density: a real number in ``[0, 1]``.
      n: a non-negative integer, or an integer array (one count per entry).

    Returns:
      ``k`` as a Python int, or an int64 numpy array of ``n``'s shape.
    """
    d = float(density)
    if isinstance(n, (int, np.integer)):
        return int(d * int(n))
    n = np.asarray(n)
    if not np.issubdtype(n.dtype, np.integer):
        raise TypeError(f"topk_count: n has dtype {n.dtype}; expected integers.")
    return np.floor(np.float64(d) * n.astype(np.int64).astype(np.float64)).astype(np.int64)


def trim_topk(x: jax.Array, k: jax.Array | int) -> jax.Array:
    """Keep exactly ``k`` largest-magnitude entries of each task ``x (..., M, p, q)``.

    ``k`` is a scalar or ``(...)`` (one count per leading index, shared by the M tasks); TIES uses
    ``k = int(density * n)`` over the ``n`` real entries (:func:`topk_count`). ``k = 0`` keeps
    nothing.

    Selection rule (deterministic, the same in every dtype and batch layout): entries are ranked by
    ``|x|`` as computed (bit patterns of the magnitudes, so ``-0.0 == 0.0``), and entries of equal
    magnitude by their flat row-major index over ``(p, q)``, lower first; the first ``k`` are kept.
    So exactly ``k`` entries are kept, as PEFT's ``magnitude`` prune does (``torch.topk``, whose
    order among equal values is unspecified). The rule is exact on the numbers it is given: two
    entries whose magnitudes differ by less than the rounding error of the computation that
    produced them (e.g. float32 KnOTS coordinates against float64 ones) may still be ordered
    differently in two precisions.
    """
    shape = x.shape
    flat = x.reshape(*shape[:-2], -1)
    n = flat.shape[-1]
    k = jnp.minimum(jnp.asarray(k, jnp.int32), n)[..., None, None]  # (..., 1, 1) over tasks, n
    mag = _magnitude_pattern(flat)  # one materialised array for the count passes and the trim
    t, ge = _kth_pattern(mag, jnp.maximum(k[..., 0], 1))
    t, ge = t[..., None], ge[..., None]
    # usually every entry at the threshold fits (continuous data: just the k-th one, so exactly k
    # are >= t), or the threshold is 0 (keeping zeros changes nothing); the running count that
    # breaks ties in flat order is only computed otherwise (outside vmap, the cond skips it)
    fits = jnp.all((ge <= k) | (t == 0))

    def by_flat_order(mag):
        above = mag > t
        at = mag == t
        room = k - above.sum(-1, keepdims=True, dtype=jnp.int32)
        return above | (at & (jnp.cumsum(at, -1, dtype=jnp.int32) <= room))

    keep = jax.lax.cond(fits, lambda mag: mag >= t, by_flat_order, mag)
    keep = keep & (k > 0)
    return jnp.where(keep, flat, 0).reshape(shape)


def digit_histogram(x: jax.Array, hi: jax.Array, *, shift: int, width: int) -> jax.Array:
    """One radix-select pass: per task, counts of ``|x|``'s bit digit among entries matching ``hi``.

    ``x (..., M, p, q)``; the magnitudes' bit patterns (monotone for non-negative floats) are split
    into a known prefix (the bits of ``hi (M,)`` above ``shift + width``) and the digit
    ``bits[shift : shift + width]``. Returns ``(M, 2**width)`` int32 counts of each digit over
    the entries whose prefix equals the task's ``hi``.
    """
    ut = _uint_of(x.dtype)
    nbits = jnp.dtype(ut).itemsize * 8
    m = x.shape[-3]
    bits = jnp.moveaxis(jax.lax.bitcast_convert_type(jnp.abs(x), ut), -3, 0).reshape(m, -1)
    top = shift + width
    if top >= nbits:
        match = jnp.ones(bits.shape, bool)
    else:
        match = (bits >> jnp.asarray(top, ut)) == (hi.astype(ut)[:, None] >> jnp.asarray(top, ut))
    digit = ((bits >> jnp.asarray(shift, ut)) & jnp.asarray(2**width - 1, ut)).astype(jnp.int32)
    # one flat count over (task, digit) bins, unmatched entries in a spare last bin (XLA:CPU
    # scatters a 1-D bincount faster than a 2-D indexed add)
    idx = jnp.where(match, digit + (jnp.arange(m, dtype=jnp.int32) << width)[:, None], m << width)
    return jnp.bincount(idx.reshape(-1), length=(m << width) + 1)[:-1].reshape(m, 2**width)


def trim_at(x: jax.Array, t: jax.Array, room: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keep entries with ``|x| > t`` plus the first ``room`` entries with ``|x| == t``, per task.

    ``x (..., M, p, q)``; ``t (M,)`` thresholds as bit patterns of ``x``'s unsigned type;
    ``room (M,)`` int32. Ties are taken in flat order over the leading axes, then ``p``, ``q``.
    Returns ``(trimmed x, ties taken (M,))``.
    """
    ut = _uint_of(x.dtype)
    m = x.shape[-3]
    xt = jnp.moveaxis(x, -3, 0)
    bits = jax.lax.bitcast_convert_type(jnp.abs(xt), ut).reshape(m, -1)
    tt = t.astype(ut)[:, None]
    at = bits == tt
    n_at = at.sum(-1, dtype=jnp.int32)
    # the running count that breaks ties in flat order (a slow scan on CPU) only where the ties
    # here do not all fit: in one unit of a model-wide TIES at most
    take = jax.lax.cond(
        jnp.all(n_at <= room),
        lambda at: at,
        lambda at: at & (jnp.cumsum(at, -1, dtype=jnp.int32) <= room[:, None]),
        at,
    )
    keep = (bits > tt) | take
    out = jnp.where(keep.reshape(xt.shape), xt, 0)
    return jnp.moveaxis(out, 0, -3), jnp.minimum(n_at, room)


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
    return jnp.where(keep, x / (1.0 - jnp.asarray(p, x.dtype)), 0)


def dare(x: jax.Array, key: jax.Array, *, coef, p) -> jax.Array:
    """DARE (linear): random drop-and-rescale per task, then ``coef * sum``."""
    d = dare_drop(x, key, p)
    return coef * _task_sum([d[..., i, :, :] for i in range(d.shape[-3])])


def dare_ties(x: jax.Array, key: jax.Array, *, coef, p) -> jax.Array:
    """DARE-TIES: random drop-and-rescale per task, then TIES sign election and disjoint mean."""
    return coef * disjoint_mean(dare_drop(x, key, p))
