"""Net Utility of every singular direction of every task's LoRA update (paper Eq. net-utility).

The pipeline is bucketed: modules of equal ``(d_in, d_out, r_max)`` are stacked and scored by one
batched kernel (:func:`score_buckets`), which reads each factor once, through two Grams:

* ``G = X^T X`` with ``X = [a_1 ... a_M]`` the task-stacked input factors ``(d_in, M r)``;
* ``H_i = b_i b_i^T`` per task ``(r, r)``.

Everything after that is ``(M r)``-sized: with ``H_i = R_i^T R_i`` (``R_i^T = F Phi^(1/2)`` from
``eigh(H_i)``), task i's squared singular values and right vectors ``Z_i`` come from the ``r x r``
eigenproblem of ``scale_i^2 R_i G_ii R_i^T``; its input directions are ``in_dirs_i = a_i T_i`` with
``T_i = scale_i R_i^T Z_i S_i^-1``, so every cross-task overlap is ``in_dirs_j^T in_dirs_i =
T_j^T G_ji T_i``. No d-sized QR, no inverse of ``G``; ``S^-1`` is applied to candidates only.

Precision: Gram routes square the conditioning, so a singular value ``s_k`` carries an absolute error
near ``eps * s_max^2 / s_k``. Directions with ``s_k <= rtol * s_max`` of their own task-module are
not candidates; the default ``rtol = sqrt(10 * r_max * eps)`` (4.4e-3 in float32 at r = 16,
2e-7 in float64) sits above that noise. Such directions carry less than ``rtol^2`` of the task's
energy. Enable x64 and pass float64 factors for a tighter cut, or set ``rtol``.

Scale safety: before the Grams, each task-module's ``lora_a``, ``lora_b`` and ``scale`` are divided
by powers of two (exact) so that their largest entries are in ``[0.5, 1)``; the Grams and every
``(M r)``-sized step then see numbers of order one, whatever ``lora_alpha`` or the factors' size.
The update's size is carried as an integer exponent ``E_i`` per task-module (``s = s' 2^E_i``).
Benefits and overlaps are free of it; the interference, which mixes tasks as ``(s_jk / s_max_i)^2``,
gets its power of two ``2^(2 (E_j - E_i))`` exactly, term by term. So the result equals a float64
computation of the same input to float32 rounding, for any scale, as long as every returned
quantity (sigma, interference, utility, lambda) is itself a normal float32 number; where one is not
(for example one task 1e20 times larger than another: its interference is 1e40), :func:`score`
refuses with :class:`InputError` instead of returning zeros, infinities or NaN.

Data-aware geometry (``score(..., input_moments=...)``, docs/input_moments.md): one more
``d``-sized product per task-module, ``a^T S a = (F a)^T (F a)`` from the input-moment factor ``F``
(:func:`moment_grams`), in the same bucketed kernel; then ``C_i = T_i^T (a^T S a) T_i`` is
``(M r)``-sized like the rest. Without moments the kernel is the data-free one, unchanged.

References:
  Amballa et al., "Not All Ranks Are Equal: Budget-Aware LoRA Merging Across Tasks": Eq.
  net-utility (alpha = 1), App. A.4 (alpha = 0), Hyperparameters (lambda, h).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _buckets, _mesh, _tree, moments
from ._buckets import Leaves
from ._checks import brief, check_auto, check_bool, check_real, real_option, real_value
from ._executables import kernel
from ._grams import PER_TASK, ROUTES, Grams, grams, moment_grams, safe_grams
from ._host import host_constant as host_constant
from ._host import put_views as put_views
from ._linalg import eigh_batched as eigh_batched
from ._linalg import mul_pow2, settle
from ._score_errors import (
    X64_HINT,
    checkify_score,
    raise_blind_moments,
    raise_unrepresentable,
    range_text,
)
from .errors import InputError

__all__ = [
    "ROUTES",
    "BucketStats",
    "ModuleScores",
    "Scores",
    "default_rtol",
    "heterogeneity",
    "lam_auto",
    "score",
    "score_buckets",
    "task_energies",
    "unstack",
]

_HI = jax.lax.Precision.HIGHEST


class ModuleScores(NamedTuple):
    """Scores of one module, each ``(M, r_max)``; slot ``k`` of task ``j`` is its k-th direction.

    Attributes:
      sigma: singular values, descending per task; 0 on non-candidates.
      benefit: ``s^(2+2a) / w_j``, ``w_j = sum_n s_jn^(2+2a)`` (the task's energy share).
      interference: ``s_jk^2 sum_{i!=j} sum_n s_in^(2a) / w_i (v_jk . v_in)^2`` (before lambda).
        (With ``input_moments`` both terms are the data-aware ones of :func:`score`.)
      utility: ``benefit - lam * interference``; ``-inf`` on non-candidates.
    """

    sigma: jax.Array
    benefit: jax.Array
    interference: jax.Array
    utility: jax.Array


class Scores(NamedTuple):
    """Net-utility scores of M adapters.

    Attributes:
      modules: ``{name: ModuleScores}`` in the adapters' module order.
      lam: the interference weight used (the ``"auto"`` median ratio, or the given float).
      alpha: the geometry exponent used (1 Gram, 0 row space).
    """

    modules: dict[str, ModuleScores]
    lam: jax.Array
    alpha: jax.Array


class BucketStats(NamedTuple):
    """Per-bucket output of :func:`score_buckets`, each ``(n, M, r_max)`` unless noted."""

    sigma: jax.Array
    benefit: jax.Array
    interference: jax.Array
    candidate: jax.Array  # bool
    nonfinite: jax.Array  # int32 (n, M, 3): NaN/Inf entries of lora_a, lora_b, scale
    log10_smax: jax.Array  # (n, M): log10 of each task's largest singular value (-inf if none)
    raw_ok: jax.Array  # () bool: False if the "raw" route must be redone (see _safe_grams)
    # (n, M) bool: a candidate's interference is positive but below the dtype's normal numbers
    # (it underflowed to zero or a subnormal: refused like one too large)
    under: jax.Array


def default_rtol(r_max: int, dtype: Any) -> float:
    """Relative singular-value cut of the Gram route: ``sqrt(10 * r_max * eps(dtype))``."""
    return float(np.sqrt(10.0 * r_max * np.finfo(np.dtype(dtype)).eps))


def _safe_div(x: jax.Array, y: jax.Array) -> jax.Array:
    ok = y > 0
    return jnp.where(ok, x / jnp.where(ok, y, 1), 0)


def _cores(gr: Grams, phi: jax.Array, f: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Stage 2: ``R_b^T = F Phi^(1/2)`` (r, K) from ``eigh(H)``, and the (K, K) cores."""
    r = gr.h.shape[-1]
    rbt = f[..., :r, :] * jnp.sqrt(jnp.clip(phi, 0))[..., None, :]
    core = (gr.scale**2)[..., None, None] * jnp.einsum(
        "nika,nikl,nilb->niab", rbt, gr.gii, rbt, precision=_HI
    )
    return rbt, 0.5 * (core + jnp.swapaxes(core, -1, -2))


def _finish(
    gr: Grams,
    rbt: jax.Array,
    ev: jax.Array,
    z: jax.Array,
    rank: jax.Array,
    alphas: Sequence[jax.Array | float],
    rtol: jax.Array | float,
    moments: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> list[BucketStats]:
    """Stage 3: singular values, input directions ``a_i T_i``, overlaps, then for each alpha of
    ``alphas`` the benefit and interference (the overlaps, the costly part, are shared).

    Everything is in each task's normalised units (``s = s' 2^E``) until the end: benefits and
    overlaps do not depend on ``E``; sigma and the cross-task ratios get it back exactly.

    ``moments``: ``(q (n, M, r, r), tr (n, M), iso (n, M))``, each task-module's ``a^T S a`` and
    ``tr(S)`` (:func:`moment_grams`) and whether it has no data (the data-free geometry, ``S =
    I``): the data-aware score (:func:`score`, ``input_moments``). None: the data-free score.
    """
    r = gr.h.shape[-1]
    m_tasks = gr.h.shape[1]
    k = ev.shape[-1]
    ev, z = ev[..., ::-1], z[..., ::-1]  # descending
    sig = jnp.sqrt(jnp.clip(ev, 0))
    smax = sig[..., 0]
    slot = jnp.arange(k, dtype=rank.dtype) < rank[..., None]
    cand = slot & (sig > rtol * smax[..., None]) & (smax[..., None] > 0)
    sig = jnp.where(cand, sig, 0)
    inv = jnp.where(cand, 1 / jnp.where(cand, sig, 1), 0)
    t_in = gr.scale[..., None, None] * jnp.matmul(rbt, z, precision=_HI) * inv[..., None, :]
    gt = jnp.einsum("njaib,nibm->njaim", gr.g, t_in, precision=_HI)
    ov = jnp.einsum("njak,njaim->njkim", t_in, gt, precision=_HI)  # v_jk . v_im
    rel = _safe_div(sig, smax[..., None])  # s / s_max: scale-free powers, no underflow
    ratio2 = _safe_div(sig[..., None], smax[:, None, None, :]) ** 2  # (s'_jk / s'_max_i)^2
    off = 1 - jnp.eye(m_tasks, dtype=sig.dtype)
    # (s_jk / s_max_i)^2 = ratio2 * 2^(2 (E_j - E_i)), applied exactly, term by term
    d_exp = 2 * (gr.exp[:, :, None, None] - gr.exp[:, None, None, :])
    sigma = jnp.where(cand, mul_pow2(sig, gr.exp[..., None]), 0)
    log10_smax = jnp.where(
        smax > 0,
        (jnp.log2(jnp.where(smax > 0, smax, 1)) + gr.exp.astype(sig.dtype)) * np.log10(2.0),
        -jnp.inf,
    ).astype(sig.dtype)
    if moments is not None:
        cm = _moment_cores(moments, t_in, cand)
    out = []
    for alpha in alphas:
        if moments is None:
            p = jnp.where(cand, rel ** (2 + 2 * alpha), 0)
            wt = p.sum(-1)
            benefit = _safe_div(p, wt[..., None])
            # c_in = s_in^(2a) / w_i, in units of s_max_i^-2 (put back through ratio2)
            c = _safe_div(jnp.where(cand, rel ** (2 * alpha), 0), wt[..., None])
            per_task = jnp.einsum("njkim,nim->njki", ov**2, c)  # (n, M_j, K, M_i)
        else:
            benefit, per_task = _data_aware(cm, ov, rel, cand, alpha)
        unscaled = ratio2 * per_task * off[None, :, None, :]
        terms = mul_pow2(unscaled, d_exp)
        interference = jnp.where(cand, terms.sum(-1), 0)
        # positive, yet lost below the normal range by the tasks' power of two 2^(2 (E_j - E_i))
        under = cand & (unscaled > 0).any(-1) & (interference < jnp.finfo(sig.dtype).tiny)
        # at most r nonzero singular values per task: the slots past r are never candidates
        out.append(
            BucketStats(
                sigma[..., :r],
                benefit[..., :r],
                interference[..., :r],
                cand[..., :r],
                gr.nonfinite,
                log10_smax,
                gr.raw_ok,
                under[..., :r].any(-1),
            )
        )
    return out


def _moment_cores(
    moments: tuple[jax.Array, jax.Array, jax.Array], t_in: jax.Array, cand: jax.Array
) -> jax.Array:
    """``C_i = V_i^T S_i V_i`` ``(n, M, K, K)`` up to a positive factor per task-module, from
    ``q = a'^T S a'`` and ``V_i = a'_i T_i``; the identity where a task-module has no data (the
    data-free geometry exactly), zero outside the candidates.

    A task-module whose inputs put at most ``16 eps^2`` of their energy ``tr(S)`` along every
    one of its directions is orthogonal to them up to rounding (measured: about 1e-16 in
    float32 for exactly orthogonal inputs, at d_in 12 to 4096; real inputs along a direction are
    orders of magnitude above): its ``C`` is set to 0, so its energy share is 0 / 0, which
    :func:`score` refuses (:func:`raise_blind_moments`) rather than rank rounding noise."""
    q, tr, iso = moments
    k = t_in.shape[-1]
    cm = jnp.einsum("niak,niab,nibl->nikl", t_in, q, t_in, precision=_HI)
    cm = 0.5 * (cm + jnp.swapaxes(cm, -1, -2))
    eps = jnp.finfo(cm.dtype).eps
    along = jnp.max(jnp.where(cand, jnp.einsum("nikk->nik", cm), 0), axis=-1)
    blind = along <= 16 * eps * eps * tr
    cm = jnp.where(blind[..., None, None], 0, cm)
    cm = jnp.where(iso[..., None, None], jnp.eye(k, dtype=cm.dtype), cm)
    return jnp.where(cand[..., :, None] & cand[..., None, :], cm, 0)


def _data_aware(
    cm: jax.Array, ov: jax.Array, rel: jax.Array, cand: jax.Array, alpha: jax.Array | float
) -> tuple[jax.Array, jax.Array]:
    """Benefit and per-task interference of the data-aware geometry ``G_i = M_i S_i M_i``,
    ``M_i = V_i Sigma_i^a V_i^T`` (docs/input_moments.md), in the units of :func:`_finish`.

    ``benefit_jk = s_jk^(2+2a) C_j[k,k] / W_j``, ``W_j = sum_n s_jn^(2+2a) C_j[n,n]``; task i's
    part of the interference of ``(j, k)``: ``s_jk^2 y^T C_i y / W_i`` with ``y_m = s_im^a
    (v_jk . v_im)``. Scale-free in each ``C_i`` (it cancels against ``W_i``); with ``C_i = I`` it
    is the data-free formula term for term.
    """
    dg = jnp.clip(jnp.einsum("nikk->nik", cm), 0)
    p = jnp.where(cand, rel ** (2 + 2 * alpha) * dg, 0)
    wt = p.sum(-1)
    benefit = _safe_div(p, wt[..., None])
    y = ov * jnp.where(cand, rel**alpha, 0)[:, None, None]  # (n, M_j, K, M_i, K)
    quad = jnp.einsum("njkim,nimp,njkip->njki", y, cm, y, precision=_HI)
    # s_im^2a in units of s_max_i^2a, W_i in units of s_max_i^(2+2a): s_max_i^-2 (see ratio2)
    per_task = _safe_div(jnp.clip(quad, 0), wt[:, None, None, :])
    return benefit, per_task


def _module_energies(gr: Grams) -> tuple[jax.Array, jax.Array]:
    """Each task-module's ``||dW||_F^2 = s^2 sum((a^T a) * (b b^T))`` as ``(mantissa, exponent)``
    ``(n, M)`` (float, int32), from the scoring Grams: no pass over the factors of its own."""
    return ((gr.scale**2)[..., None, None] * gr.gii * gr.h).sum((2, 3)), 2 * gr.exp


def score_buckets(
    buckets: Sequence[tuple[jax.Array, jax.Array, jax.Array, jax.Array]],
    *,
    alpha: jax.Array | float,
    rtols: Sequence[jax.Array | float],
    route: str = "cond",
) -> list[BucketStats]:
    """Benefit and interference of every direction of several buckets (pure, traceable).

    Each bucket is ``(a, b, scale, rank)``:

    * ``a (n, M, d_in, r)`` input factors, zero-padded to ``r`` (a task lacking a module is zero);
    * ``b (n, M, r, d_out)`` output factors, zero-padded likewise;
    * ``scale (n, M)`` LoRA scales; ``rank (n, M)`` int, each task's own rank (slots
      ``k >= rank`` are never candidates).

    Factors and scales may hold any finite values (they are normalised by powers of two first,
    see the module docstring); non-finite entries are counted in ``BucketStats.nonfinite`` and
    read as 0, so the rest of the bucket is computed normally. All buckets share two ``eigh``
    calls (see :func:`eigh_batched`); everything else is per bucket. Free of global state: lambda
    and utilities are computed across buckets by the caller, so buckets can be streamed or sharded.

    ``route`` picks how the factors are normalised (see :func:`safe_grams`): the default
    ``"cond"`` is exact for any input; ``"raw"`` is the fastest and exact unless
    ``BucketStats.raw_ok`` is False, in which case the call must be repeated with ``"normalise"``.

    Returns:
      one :class:`BucketStats` per bucket, arrays ``(n, M, r)``.
    """
    return _score_buckets(buckets, (alpha,), rtols, route)[0][0]


def _score_buckets(
    buckets: Sequence[tuple[jax.Array, jax.Array, jax.Array, jax.Array]],
    alphas: Sequence[jax.Array | float],
    rtols: Sequence[jax.Array | float],
    route: str,
    moments: Sequence[tuple[jax.Array, jax.Array]] | None = None,
) -> tuple[list[list[BucketStats]], list[Grams]]:
    """:func:`score_buckets` for each alpha of ``alphas`` from one decomposition: ``(stats,
    grams)``, ``stats[a][b]`` alpha ``a``'s :class:`BucketStats` of bucket ``b``. ``moments``:
    per bucket ``(f (n, M, k, d_in), iso (n, M))`` (:func:`_buckets.stack_moments`) for the
    data-aware score, or None."""
    grs: list[Grams] = []
    for a, b, s, _ in buckets:
        # from leaves, each bucket's Grams after the previous one's: XLA then holds one group
        # of modules' stacked factors at a time (see _grams.leaf_grams)
        grs.append(grams(a, b, s, route, after=grs[-1].h if grs else None))
    if moments is None:
        qs = [None] * len(buckets)
    else:
        qs = [
            (*moment_grams(f, bk[0].stack()[0] if isinstance(bk[0], Leaves) else bk[0], iso), iso)
            for (f, iso), bk in zip(moments, buckets, strict=True)
        ]
    eig_h = eigh_batched([gr.h for gr in grs])
    cores = [_cores(gr, phi, f) for gr, (phi, f) in zip(grs, eig_h, strict=True)]
    eig_c = eigh_batched([c for _, c in cores])
    per_bucket = [
        _finish(gr, rbt, ev, z, bk[3], alphas, rtol, q)
        for gr, (rbt, _), (ev, z), bk, rtol, q in zip(
            grs, cores, eig_c, buckets, rtols, qs, strict=True
        )
    ]
    return [[pb[a] for pb in per_bucket] for a in range(len(alphas))], grs


def lam_auto(benefit: jax.Array, interference: jax.Array, candidate: jax.Array) -> jax.Array:
    """``median(benefit) / median(interference)`` over candidates (paper, Hyperparameters).

    If more than half the candidates have zero interference the median is 0; the ratio then uses
    the median of the positive interferences. With no interference at all (M = 1, or mutually
    orthogonal tasks) lambda is 0: the utility is the benefit whatever lambda is.

    Each median is :func:`jnp.nanmedian`'s of the candidates' values (NaN ones left out), the
    same number, from integer sorts (:func:`_median_runs`; XLA:CPU sorts integers about four
    times faster than floats): both interference medians come from one sort.
    """
    (mb,) = _median_runs(benefit, candidate, positive=False)
    mi, mi_pos = _median_runs(interference, candidate, positive=True)
    denom = jnp.where(mi > 0, mi, mi_pos)
    return jnp.where(jnp.isfinite(denom) & (denom > 0), mb / jnp.where(denom > 0, denom, 1), 0.0)


def _flip(bits: jax.Array) -> jax.Array:
    """A float's bit pattern (as a signed integer) to an integer ordered as the floats are in
    IEEE total order (-NaN < -inf < ... < -0 < +0 < ... < inf < NaN, the order of XLA's float
    sort), and back: negative patterns get every bit but the sign flipped (an involution)."""
    sign = jax.lax.shift_right_arithmetic(
        bits, jnp.full((), 8 * bits.dtype.itemsize - 1, bits.dtype)
    )
    return bits ^ (sign & jnp.full((), np.iinfo(np.dtype(bits.dtype)).max, bits.dtype))


def _median_runs(x: jax.Array, candidate: jax.Array, *, positive: bool) -> tuple[jax.Array, ...]:
    """``jnp.nanmedian(jnp.where(candidate, x, nan))`` and, with ``positive``, the same over
    the candidates with ``x > 0``, from one sort.

    The candidates' values that are not NaN, sorted (as ordered integers, :func:`_flip`; the
    others after them, as nanmedian's NaNs), with the positive ones a run at their end; each
    median is the midpoint ``(low + high) * 0.5`` of the values at ``floor((n - 1) / 2)`` and
    ``ceil((n - 1) / 2)`` of its run of ``n``, as jnp computes it; NaN if ``n`` is 0.
    """
    dtype = x.dtype
    x, candidate = x.ravel(), candidate.ravel()
    if x.size == 0 or dtype.itemsize not in (4, 8):  # (no integer of the width: a float sort)
        out = [jnp.nanmedian(jnp.where(candidate, x, jnp.nan))]
        if positive:
            out.append(jnp.nanmedian(jnp.where(candidate & (x > 0), x, jnp.nan)))
        return tuple(out)
    ity = jnp.int64 if dtype.itemsize == 8 else jnp.int32
    ok = candidate & ~jnp.isnan(x)
    top = jnp.full((), np.iinfo(np.dtype(ity)).max, ity)
    keys = jnp.sort(jnp.where(ok, _flip(jax.lax.bitcast_convert_type(x, ity)), top))
    n = ok.sum(dtype=jnp.int32)

    def median(start, count):
        def value(i):
            k = keys[jnp.clip(start + i, 0, keys.shape[0] - 1)]
            return jax.lax.bitcast_convert_type(_flip(k), dtype)

        mid = (value((count - 1) // 2) + value(count // 2)) * jnp.asarray(0.5, dtype)
        return jnp.where(count > 0, mid, jnp.asarray(jnp.nan, dtype))

    out = [median(0, n)]
    if positive:
        n_pos = (ok & (x > 0)).sum(dtype=jnp.int32)
        out.append(median(n - n_pos, n_pos))
    return tuple(out)


def _score_stats(inputs, alpha, rtols, *, meta, route, energy=False, moments=None):
    """Stage 1 of :func:`_score_impl`: ``(stats, energies)``, ``stats[a]`` each bucket's
    :class:`BucketStats` for ``alpha`` (shape ``()``: one) or each of its values (shape
    ``(A,)``: one decomposition for all), and with ``energy`` each bucket's task-module energies
    (:func:`_module_energies`), else None. ``moments``: per bucket the stacked input moments
    (:func:`_buckets.stack_moments`), or None (the data-free score). Per module, no global
    quantity: a bucket's modules can be split between devices."""
    dtype = meta[0]
    stacked = [
        tuple(x)
        if isinstance(x, _mesh.Stacked)  # stacked on the host, sharded over a mesh
        # the leaves, read module by module (_grams.leaf_grams)
        else (
            _buckets.Leaves(x[0], x[1], d_in, d_out, r_max, dtype),
            None,
            *_buckets.scales_ranks(x[0], x[2], dtype),
        )
        for x, (d_in, d_out, r_max) in zip(inputs, meta[1], strict=True)
    ]
    alphas = [alpha] if jnp.ndim(alpha) == 0 else list(alpha)
    if moments is not None:
        moments = [
            tuple(m)
            if isinstance(m, _buckets.StackedMoments)  # stacked on the host, sharded over a mesh
            else tuple(_buckets.stack_moments(m, d_in=d_in, dtype=dtype))
            for m, (d_in, _, _) in zip(moments, meta[1], strict=True)
        ]
    stats, grs = _score_buckets(stacked, alphas, rtols, route, moments)
    return stats, [_module_energies(gr) for gr in grs] if energy else None


def _score_finish(stats, lam, *, dtype, lam_is_auto, nan_fill):
    """Stage 2 of :func:`_score_impl`, over every bucket: lambda (``"auto"``: the median ratio
    over all candidates), the utilities and the range flags."""
    # Traced calls cannot raise: a module with a NaN/Inf input gets NaN scores, and lam="auto"
    # NaN. (Eager calls raise on such input; their kernels skip this.)
    bad = [(st.nonfinite > 0).any((1, 2)) for st in stats]  # (n,): a module with a NaN/Inf input
    if lam_is_auto:
        lam = lam_auto(
            jnp.concatenate([st.benefit.ravel() for st in stats]),
            jnp.concatenate([st.interference.ravel() for st in stats]),
            jnp.concatenate([st.candidate.ravel() for st in stats]),
        )
        if nan_fill:
            lam = jnp.where(jnp.stack([b.any() for b in bad]).any(), jnp.nan, lam)
    lam = jnp.asarray(lam, dtype)
    fi = jnp.finfo(dtype)
    out = []
    pos_interference = jnp.zeros((), bool)
    for st, b in zip(stats, bad, strict=True):
        cand = st.candidate
        util = jnp.where(cand, st.benefit - lam * st.interference, -jnp.inf)
        fields = (st.sigma, st.benefit, st.interference, util)
        if nan_fill:
            fields = [jnp.where(b[:, None, None], jnp.nan, x) for x in fields]
        # (n, M, 3): a candidate's sigma, interference (too large, or positive and too small) or
        # utility is not a normal number
        ranges = jnp.stack(
            [
                (cand & ~((st.sigma >= fi.tiny) & (st.sigma <= fi.max))).any(-1),
                (cand & ~jnp.isfinite(st.interference)).any(-1) | st.under,
                (cand & ~jnp.isfinite(util)).any(-1),
            ],
            -1,
        )
        pos_interference = pos_interference | (cand & (st.interference > 0)).any()
        # the four fields side by side: one transfer per bucket, each module's (M, r) contiguous
        out.append(_BucketOut(jnp.stack(fields, 1), st.nonfinite, ranges, st.log10_smax))
    lam_bad = jnp.asarray(
        pos_interference & ~((lam >= fi.tiny) & (lam <= fi.max)) if lam_is_auto else False
    )
    raw_ok = jnp.stack([st.raw_ok for st in stats]).all()
    status = jnp.stack(
        [
            raw_ok,
            jnp.stack([(st.nonfinite > 0).any() for st in stats]).any(),
            jnp.stack([o.ranges.any() for o in out]).any() | lam_bad,
            jnp.stack([(st.sigma != 0).any() for st in stats]).any(),
        ]
    )
    return _Finished(tuple(out), lam, lam_bad, raw_ok, status)


class _BucketOut(NamedTuple):
    """One bucket's part of :func:`_score_finish` (``n`` modules, ``M`` tasks)."""

    stats: jax.Array  # (n, 4, M, r_max): the fields of ModuleScores, in its order
    nonfinite: jax.Array  # (n, M, 3) int32: NaN/Inf entries of lora_a, lora_b, scale
    ranges: jax.Array  # (n, M, 3) bool: sigma, interference, utility not a normal number
    log10_smax: jax.Array  # (n, M)


# _Finished.status: what an eager call reads first, in one transfer (the rest only on a problem)
_RAW_OK, _NONFINITE, _BEYOND, _ANY_SIGMA = range(4)


class _Finished(NamedTuple):
    """:func:`_score_finish` for one alpha."""

    outs: tuple[_BucketOut, ...]
    lam: jax.Array  # the lambda used
    lam_bad: jax.Array  # () bool: lam="auto" is not a normal number of the dtype
    raw_ok: jax.Array  # () bool: see safe_grams
    # (4,) bool: raw_ok; a NaN/Inf input; a range flag or lam_bad; a nonzero sigma anywhere.
    # None without live buckets.
    status: jax.Array | None


@kernel(
    static_argnames=("meta", "lam_is_auto", "route", "energy")
)  # (jax.jit, kept on disk by the CLI)
def _score_impl(
    inputs, alpha, lam, rtols, *, meta, lam_is_auto, route="raw", energy=False, moments=None
):
    """The jitted scoring of :func:`score`: ``(finished, raw_ok, energies)``, ``finished`` one
    :func:`_score_finish` per alpha (see :func:`_score_stats`). With ``route="raw"`` the caller
    must redo the call with ``route="normalise"`` when ``raw_ok`` is False (see
    :func:`safe_grams`)."""
    stats, energies = _score_stats(
        inputs, alpha, rtols, meta=meta, route=route, energy=energy, moments=moments
    )
    finished = _finish_all(stats, lam, meta, lam_is_auto, route)
    return finished, finished[0].raw_ok, energies


def _finish_all(stats, lam, meta, lam_is_auto, route):
    kw = {"dtype": meta[0], "lam_is_auto": lam_is_auto, "nan_fill": route == "cond"}
    return tuple(_score_finish(st, lam, **kw) for st in stats)


_score_stats_jit = jax.jit(_score_stats, static_argnames=("meta", "route", "energy"))
_finish_all_jit = jax.jit(_finish_all, static_argnames=("meta", "lam_is_auto", "route"))


def _score_by_device(
    inputs, alpha, lam, rtols, *, meta, lam_is_auto, route, energy, mesh, moments=None
):
    """:func:`_score_impl` with each bucket's modules split between ``mesh``'s devices
    (:func:`_mesh.per_device`: one SPMD program, or on CPU each device's modules of every bucket
    in one call, in turn), then the global stage once."""
    if _mesh.spmd(mesh):  # one program, as _score_impl: the one-device result, bit for bit
        kw = {"meta": meta, "lam_is_auto": lam_is_auto, "route": route, "energy": energy}
        if moments is not None:
            kw["moments"] = _mesh.shard(moments, mesh)
        return _score_impl(_mesh.shard(inputs, mesh), alpha, lam, rtols, **kw)
    if moments is None:
        stats, energies = _mesh.per_device(
            lambda x: _score_stats_jit(x, alpha, rtols, meta=meta, route=route, energy=energy),
            inputs,
            mesh,
        )
    else:
        stats, energies = _mesh.per_device(
            lambda xm: _score_stats_jit(
                xm[0], alpha, rtols, meta=meta, route=route, energy=energy, moments=xm[1]
            ),
            (inputs, moments),
            mesh,
        )
    finished = _finish_all_jit(stats, lam, meta=meta, lam_is_auto=lam_is_auto, route=route)
    return finished, finished[0].raw_ok, energies


def unstack(x: jax.Array) -> list[jax.Array]:
    """Split the leading axis of a bucket-level array into one array per module.

    Done on the host (one transfer, then :func:`put_views` of numpy views): slicing many
    outputs inside a jitted graph costs XLA seconds of compile time per bucket shape. Traced
    inputs are sliced in the graph.
    """
    if isinstance(x, jax.core.Tracer):
        return [x[i] for i in range(x.shape[0])]
    h = jax.device_get(x)
    return put_views([h[i] for i in range(h.shape[0])], x.sharding)


_ALPHA_EXPECTED = (
    "a finite number >= 0 (1.0 Gram geometry, 0.0 row-space heuristic, values in between allowed) "
    "or 'auto'"
)
_LAM_EXPECTED = "a finite number >= 0 (the interference weight) or 'auto'"


def _check_options(fn: str, alpha: Any, lam: Any, rtol: Any, h_threshold: Any) -> None:
    for name, value, expected in (("alpha", alpha, _ALPHA_EXPECTED), ("lam", lam, _LAM_EXPECTED)):
        if isinstance(value, str) and value != "auto":  # messages without the type: tests pin them
            raise InputError(f"{fn}: {name}={brief(value)}; expected {expected}.")
        check_auto(fn, name, value, expected)
    if rtol is not None:
        check_real(fn, "rtol", rtol, "None or a number with 0 <= rtol < 1")
        real_option(fn, "rtol", rtol, "0 <= rtol < 1", lambda v: 0 <= v < 1)
    check_real(fn, "h_threshold", h_threshold, "a finite number")
    v = real_value(h_threshold)  # None under a trace
    if v is not None and not np.isfinite(v):
        raise InputError(f"{fn}: h_threshold={brief(h_threshold)}; expected a finite number.")


def _traced(*trees: Any) -> bool:
    """Is any leaf abstract (the call runs under jit, vmap, grad...)?"""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


def _dead(bk: _tree.Bucket) -> bool:
    """A bucket whose updates are empty (rank 0, or d_in or d_out 0): no candidates."""
    return bk.r_max == 0 or bk.d_in == 0 or bk.d_out == 0


def _score_moments(
    fn: str, buckets: Sequence[_tree.Bucket], rows: Sequence[Any], dtype: Any, mesh: Any
) -> tuple:
    """The live buckets' input moments for :func:`_score_impl`: :func:`moments.resolve`'s rows
    (stacked inside the kernel), or with a mesh stacked on the host and zero-padded like
    :func:`_score_inputs` (:class:`_buckets.StackedMoments`)."""
    live = [r for bk, r in zip(buckets, rows, strict=True) if not _dead(bk)]
    if mesh is None:
        return tuple(live)
    if _traced(live):
        raise InputError(
            f"{fn}: mesh= stacks the input moments on the host, so it needs concrete arrays, "
            "not traced ones: call it outside the transformation, or leave mesh=None."
        )
    live_bk = [bk for bk in buckets if not _dead(bk)]
    return tuple(
        _buckets.stack_moments(
            r, d_in=bk.d_in, dtype=dtype, n_pad=_mesh.padded(len(bk.names), mesh), host=True
        )
        for bk, r in zip(live_bk, live, strict=True)
    )


def _score_inputs(fn: str, live: Sequence[_tree.Bucket], dtype: Any, mesh: Any) -> tuple:
    """The live buckets' inputs of :func:`_score_impl`: their leaves, or with a mesh their
    factors stacked on the host and sharded over it (:mod:`netutility_jax._mesh`)."""
    leaves = tuple(_buckets.bucket_arrays(bk) for bk in live)
    if _mesh.check_mesh(fn, mesh) is None:
        # concrete scales as one (n, M) array per bucket: one argument each, not one per scale
        host = [_buckets.host_scales(s, dtype) for _, _, s in leaves]
        return tuple(
            (a, b, s if h is None else h) for (a, b, s), h in zip(leaves, host, strict=True)
        )
    if _traced(leaves):
        raise InputError(
            f"{fn}: mesh= stacks the factors on the host, so it needs concrete arrays, not "
            "traced ones (a call inside jax.jit or vmap): call it outside the transformation, "
            "or shard the inputs of the jitted function yourself and leave mesh=None."
        )
    return tuple(_mesh.host_stack(bk, dtype, _mesh.padded(len(bk.names), mesh)) for bk in live)


def score(
    adapters: Sequence[Any],
    *,
    alpha: float | str = 1.0,
    lam: float | str = "auto",
    rtol: float | None = None,
    h_threshold: float = 1.0,
    checked: bool = False,
    mesh: Any = None,
    input_moments: Sequence[Mapping[str, moments.InputMoments | None] | None] | None = None,
) -> Scores:
    """Net utility of every singular direction of every module and task (paper Eq. net-utility).

    For task ``j``'s k-th direction of a module, with singular values ``s`` and input-side
    directions ``v`` (``in_dirs``)::

        w_j          = sum_n s_jn^(2+2a)
        benefit      = s_jk^(2+2a) / w_j
        interference = s_jk^2 sum_{i!=j} sum_n s_in^(2a) / w_i (v_jk . v_in)^2
        utility      = benefit - lam * interference

    ``a = 1`` is the Gram geometry ``G_i ~ V_i S_i^2 V_i^T`` (paper Eq. gram-geometry), ``a = 0`` the
    row-space heuristic (App. A.4).

    **Data-aware geometry** (``input_moments``; ours, not the paper's, see
    docs/input_moments.md). The paper weighs task ``i``'s error by ``G_i = E_{x~p_i}[x x^T]``
    and, having no data, replaces it by ``M_i M_i`` with ``M_i = V_i Sigma_i^a V_i^T``: the second
    moment of white inputs read through the adapter. Given an estimate ``S_i`` of task ``i``'s
    input second moment, we use ``G_i = M_i S_i M_i`` (task i's real inputs read through its
    adapter). With ``C_i = V_i^T S_i V_i`` (``r_i x r_i``, from ``S_i``'s factor, never
    ``d_in x d_in``), the paper's derivation (same-task components stay orthogonal under any
    ``G``; each task normalised by its own energy) gives::

        W_j          = sum_n s_jn^(2+2a) C_j[n,n]      (= ||dW_j||^2 under G_j)
        benefit      = s_jk^(2+2a) C_j[k,k] / W_j
        interference = s_jk^2 sum_{i!=j} y^T C_i y / W_i,   y_m = s_im^a (v_jk . v_im)

    ``S_i = I`` gives ``C_i = I`` and the data-free score exactly; any positive scale of ``S_i``
    cancels (as the paper's ``kappa_i``), so activations need not be normalised. The part of
    ``S_i`` outside task i's row space does not count: the geometry keeps the proxy's support.

    All modules of equal shape are scored by one jitted, batched kernel from the Grams of the factors (see the module docstring); no dense update is formed.
    The kernel is scale-safe: factors and scales are normalised by exact powers of two, so any
    finite scale (``lora_alpha`` 1e-30 .. 1e30) gives the float64 result to float32 rounding,
    or an :class:`InputError` where a returned quantity does not fit the compute dtype.

    Checks: on concrete inputs (an ordinary call), every factor and scale must be finite and every
    returned sigma, interference, utility and lambda representable; otherwise
    :class:`InputError` names the module, the task and the array. Under a trace (inside
    ``jax.jit``, ``vmap``...) values are abstract and these checks are skipped: a module with a
    NaN/Inf input gets NaN scores (and ``lam="auto"`` is NaN), an unrepresentable quantity is
    ``inf`` or 0. To have them reported inside ``jit``, pass ``checked=True`` and wrap the
    function in :func:`jax.experimental.checkify.checkify`, which returns the error (``err.get()``
    is the message; ``err.throw()`` raises it). Modules are then named by their position in the
    adapters' module order.

    Args:
      adapters: sequence of M adapter pytrees (one per task) with the same module names. A module
        is ``{"lora_a": (d_in, r), "lora_b": (r, d_out), "scale": ()}`` (scale optional, default
        1, a real number); ranks may differ between tasks and modules (0 too: no candidates).
        ``None`` marks a module a task lacks.
      alpha: geometry exponent, a finite number ``>= 0``; ``"auto"`` applies the paper's
        heterogeneity rule: 0 when ``nu.heterogeneity(adapters) > h_threshold``, else 1.
      lam: interference weight, a finite number ``>= 0``, or ``"auto"``: median benefit / median
        interference over all candidates of all modules (paper, Hyperparameters).
      rtol: relative singular-value cut for candidates, ``0 <= rtol < 1``; default
        ``sqrt(10 * r_max * eps)``.
      h_threshold: finite threshold of the ``alpha="auto"`` rule (between the paper's NLI
        h = 0.63 and vision h = 1.83).
      checked: under a trace, emit :mod:`jax.experimental.checkify` checks for the conditions the
        eager call raises on (the caller must functionalize them with ``checkify.checkify``).
        Ignored on concrete inputs, which are always checked.
      mesh: a one-axis :class:`jax.sharding.Mesh` (:func:`nu.module_mesh`) to shard each
        bucket's modules over its devices (see :mod:`netutility_jax._mesh`); None: one device.
        The scores are those of one device. Concrete inputs only.
      input_moments: None (the data-free score), or one entry per task: None (data-free for
        that task), or ``{module name: InputMoments | None}`` from :func:`nu.input_moments`
        (activations) or :func:`nu.input_moments_dense`, naming every module the task has (None:
        data-free there). Mixing is explicit: a module left out is an error. Each ``factor`` is
        ``(k, d_in)`` with ``S = factor^T factor``; cost ``O(k d_in r)`` per task-module. The
        ``alpha="auto"`` rule and ``lam="auto"`` (the median ratio, over the data-aware
        benefits and interferences) apply unchanged.

    Returns:
      :class:`Scores` with ``modules[name]`` fields ``sigma``, ``benefit``, ``interference``,
      ``utility``, each ``(M, r_max)``. A task whose update is zero in a module (or that lacks it,
      or has rank 0 there) has no candidates there and adds no interference. Non-candidates:
      ``sigma = 0``, ``utility = -inf``. With no candidate anywhere and a numeric ``lam``, every
      utility is ``-inf`` (:func:`nu.allocate` then keeps nothing).

    Raises:
      InputError: (a ``ValueError``) empty list, module names or shapes that differ between tasks,
        factors that do not chain, NaN/Inf in a factor or scale (the message names the module,
        task, array and how many entries), a result beyond the compute dtype's range (tasks
        whose update sizes differ by ~1e19 or more in float32), alpha or lam negative or not
        finite, an unknown string option, rtol outside ``[0, 1)``, ``lam="auto"`` with no
        candidate at all; ``input_moments`` with the wrong number of tasks, a module missing or
        unknown, a factor of the wrong ``d_in``, NaN/Inf or all zero, or a task-module update
        that is zero on all of its inputs.
      InputTypeError: (a ``TypeError``) non-floating factors, a scale that is not a real number
        (e.g. the string ``"2.0"``), an option of the wrong type (alpha/lam/rtol/h_threshold not
        a real number, checked not a bool).

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> ads = [{"q": {"lora_a": rng.normal(size=(32, 4)), "lora_b": rng.normal(size=(4, 16))}}
      ...        for _ in range(3)]
      >>> sc = nu.score(ads)
      >>> sc.modules["q"].utility.shape
      (3, 4)
      >>> bool(np.allclose(sc.modules["q"].benefit.sum(1), 1.0, atol=1e-5))
      True
      >>> big = [{"q": {**ad["q"], "scale": 1e30}} for ad in ads]  # sigma ~1e31: scale-safe
      >>> bool(np.allclose(nu.score(big).modules["q"].utility, sc.modules["q"].utility, atol=1e-5))
      True
    """
    fn = "nu.score"
    checked = check_bool(fn, "checked", checked)
    _check_options(fn, alpha, lam, rtol, h_threshold)
    if isinstance(alpha, str):
        h = heterogeneity(adapters, checked=checked, _fn=f"{fn} (alpha='auto')")
        if isinstance(h, jax.core.Tracer):  # under a trace the rule is data, not a branch
            alpha = jnp.where(h > h_threshold, 0.0, 1.0)
        else:
            alpha = 0.0 if float(h) > float(h_threshold) else 1.0
    run = _score_run(fn, adapters, (alpha,), lam, rtol, checked, mesh, input_moments=input_moments)
    return run.scores[0]


class _Run(NamedTuple):
    """What :func:`_score_run` returns."""

    scores: list[Scores]  # one per alpha
    energies: tuple[np.ndarray, np.ndarray] | None  # per task (k, t): energy t 2^k, or None
    check: list[_Deferred]  # with defer: per alpha, the range check not yet made


class _Deferred(NamedTuple):
    """A range check of :func:`_score_run` not made yet (``defer``): what
    :func:`raise_unrepresentable` reads, the buckets without their factors (:func:`_shell`)."""

    fn: str
    buckets: list[_tree.Bucket]
    outs: list[Any]
    lam: Any
    lam_bad: Any
    dtype: Any
    lam_is_auto: bool
    # whether the kernel flagged a result beyond the dtype (_Finished.status): if not, check()
    # has nothing to find and reads nothing back
    flagged: bool = True

    def check(self) -> None:
        """Raise :class:`InputError` if a result is beyond the compute dtype (as :func:`score`)."""
        if not self.flagged:
            return
        raise_unrepresentable(
            self.fn, self.buckets, self.outs, self.lam, self.lam_bad, dtype=self.dtype,
            lam_is_auto=self.lam_is_auto,
        )  # fmt: skip

    @classmethod
    def join(cls, parts: Sequence[_Deferred]) -> _Deferred:
        """One check over several calls' buckets (streamed chunks of one model with the same
        lam, in the model's bucket order), so the error counts every affected module."""
        p0 = parts[0]
        return p0._replace(
            buckets=[b for p in parts for b in p.buckets],
            outs=[o for p in parts for o in p.outs],
            lam_bad=any(bool(np.asarray(p.lam_bad)) for p in parts),
            flagged=any(p.flagged for p in parts),
        )


def _score_run(
    fn: str,
    adapters: Sequence[Any],
    alphas: Sequence[Any],
    lam: Any,
    rtol: Any,
    checked: bool,
    mesh: Any,
    *,
    energy: bool = False,
    defer: bool = False,
    input_moments: Any = None,
) -> _Run:
    """:func:`score` for each of ``alphas`` (checked numbers) from one decomposition.

    ``energy``: also each task's energy over the modules (concrete inputs), from the scoring
    Grams. ``defer``: results beyond the compute dtype are not raised here (whether they occur
    depends on alpha) but by ``check[a]()``, which holds the modules' names and scales only.
    ``input_moments``: as :func:`score` (checked here).
    """
    names, buckets, m_tasks = _tree.collect(adapters, fn=fn)
    mrows = moments.resolve(fn, input_moments, buckets, m_tasks)
    lam_is_auto = isinstance(lam, str)
    lam_val = 0.0 if lam_is_auto else lam
    dtype = _tree.compute_dtype(buckets)
    live = [bk for bk in buckets if not _dead(bk)]
    n_alpha = len(alphas)
    by_name: list[dict[str, ModuleScores]] = [{} for _ in alphas]
    for bk in buckets:
        if _dead(bk):
            zeros = jnp.zeros((m_tasks, bk.r_max), dtype)
            empty = ModuleScores(
                zeros, zeros, zeros, jnp.full((m_tasks, bk.r_max), -jnp.inf, dtype)
            )
            for d in by_name:
                d.update((nm, empty) for nm in bk.names)
    parts = None  # with energy: each bucket's (mantissa, exponent) of every task-module
    stacked_moments = None
    if live:
        meta = (dtype, tuple((bk.d_in, bk.d_out, bk.r_max) for bk in live))
        rtols = tuple(
            host_constant(default_rtol(bk.r_max, dtype) if rtol is None else rtol, dtype)
            for bk in live
        )
        inputs = _score_inputs(fn, live, dtype, mesh)
        if all(isinstance(a, (bool, int, float, np.generic)) for a in alphas):
            alpha_arg = host_constant(alphas[0] if n_alpha == 1 else np.asarray(alphas), dtype)
        else:
            alpha_arg = jnp.asarray(alphas[0] if n_alpha == 1 else jnp.stack(alphas), dtype)
        kw = {"meta": meta, "lam_is_auto": lam_is_auto, "energy": energy}
        if mrows is not None:
            stacked_moments = _score_moments(fn, buckets, mrows, dtype, mesh)
            kw["moments"] = stacked_moments
        traced = _traced(inputs, alpha_arg, lam_val, stacked_moments)
        # float64 values beyond float32 become inf when cast: counted and reported below
        with np.errstate(over="ignore"):
            args = (inputs, alpha_arg, lam_val, rtols)
            impl = _score_impl if mesh is None else functools.partial(_score_by_device, mesh=mesh)
            finished, _, parts = impl(*args, **kw, route="cond" if traced else "raw")
            if not traced:
                # every alpha's flags in one transfer; the details are read only where one is set
                status = _status(finished)
                # extreme or non-finite factors: the exact route (after the first call is done:
                # one LAPACK-using executable in flight at a time, see eigh_batched)
                if not status[0, _RAW_OK]:
                    finished, _, parts = impl(*args, **kw, route="normalise")
                    status = _status(finished)
    else:
        none = _Finished((), jnp.asarray(lam_val, dtype), jnp.asarray(False), None, None)
        finished = (none,) * n_alpha
        traced = _traced(alphas, lam_val)
        status = np.zeros((n_alpha, 4), bool)
    if mesh is not None and live:  # drop the padding modules of each bucket
        sizes = [len(bk.names) for bk in live]
        # (no eager slice without padding: each would compile a gather)
        cut = functools.partial(_unpad, sizes=sizes)
        finished = tuple(f._replace(outs=cut(f.outs)) for f in finished)
        parts = None if parts is None else cut(parts)
    checks = []
    if traced:
        for f, d in zip(finished, by_name, strict=True):
            if checked:
                checkify_score(fn, names, live, f.outs, f.lam_bad)
            for bk, o in zip(live, f.outs, strict=True):
                fields = [[o.stats[i, k] for k in range(4)] for i in range(len(bk.names))]
                d.update(zip(bk.names, (ModuleScores(*x) for x in fields), strict=True))
    else:
        # (the non-finite counts come from the Grams: the same for every alpha)
        if status[0, _NONFINITE]:
            _tree.raise_nonfinite(fn, live, [o.nonfinite for o in finished[0].outs], dtype=dtype)
        # each bucket's four fields of every alpha, one transfer each
        host = jax.device_get([[o.stats for o in f.outs] for f in finished])
        if stacked_moments is not None:
            isos = [
                _buckets.moment_iso(r)
                for bk, r in zip(buckets, mrows, strict=True)
                if not _dead(bk)
            ]
            raise_blind_moments(fn, live, host[0], isos)
        held = [_shell(bk) for bk in live] if defer else live
        for a, (f, d) in enumerate(zip(finished, by_name, strict=True)):
            check = _Deferred(
                fn, held, list(f.outs), f.lam, f.lam_bad, dtype, lam_is_auto,
                bool(status[a, _BEYOND]),
            )  # fmt: skip
            if defer:
                checks.append(check)
            else:
                check.check()
            d.update(_module_scores(live, f.outs, host[a]))
        if lam_is_auto and not status[0, _ANY_SIGMA]:
            raise InputError(
                f"{fn}: no candidate directions: the update of every task is zero (or below "
                f"rtol, or of rank 0) in all {len(names)} modules, so lam='auto' (a median over "
                "candidates) is undefined. Check that the adapters are trained (lora_b is zero "
                "at initialisation) and loaded correctly; with lam= given explicitly the scores "
                "are defined (every utility -inf) and nu.allocate keeps nothing."
            )
    scores = [
        Scores({k: d[k] for k in names}, f.lam, host_constant(a, dtype))
        for d, f, a in zip(by_name, finished, alphas, strict=True)
    ]
    energies = _sum_energies(parts, m_tasks) if energy else None
    return _Run(scores, energies, checks)


def _status(finished: Sequence[_Finished]) -> np.ndarray:
    """Every alpha's :attr:`_Finished.status` ``(A, 4)`` on the host, in one transfer, once the
    kernel is done (on CPU: one LAPACK-using executable in flight, see _linalg.settle)."""
    settle(finished)
    return np.stack(jax.device_get([f.status for f in finished]))


def _module_scores(
    buckets: Sequence[_tree.Bucket], outs: Sequence[_BucketOut], host: Sequence[np.ndarray]
) -> dict[str, ModuleScores]:
    """Each module's :class:`ModuleScores` from its bucket's fields on the host ``host[b]``
    ``(n, 4, M, r)``: numpy views, placed by :func:`put_views` all at once, on the device (and
    with the sharding) of the kernel's output."""
    out: dict[str, ModuleScores] = {}
    for bk, o, h in zip(buckets, outs, host, strict=True):
        n = len(bk.names)
        arrays = put_views([h[i, k] for i in range(n) for k in range(4)], o.stats.sharding)
        out.update((nm, ModuleScores(*arrays[4 * i : 4 * i + 4])) for i, nm in enumerate(bk.names))
    return out


def _unpad(tree: Any, *, sizes: Sequence[int]) -> Any:
    """Per bucket (``tree[b]``), its first ``sizes[b]`` modules: the mesh's padding dropped."""
    return tuple(
        jax.tree.map(lambda x, n=n: x if x.shape[0] == n else x[:n], o)
        for o, n in zip(tree, sizes, strict=True)
    )


def _shell(bk: _tree.Bucket) -> _tree.Bucket:
    """``bk`` without its factors (names, shapes and scales: what an error message reads)."""
    mods = tuple(
        tuple(None if m is None else _tree.Module(None, None, m.scale) for m in row)
        for row in bk.modules
    )
    return dataclasses.replace(bk, modules=mods)


def _sum_energies(parts: Any, m_tasks: int) -> tuple[np.ndarray, np.ndarray]:
    """Per task ``(k, t)``, the energy summed over modules as ``t 2^k`` (``t`` float64, each
    module's part taken relative to the task's largest power, so nothing overflows), from each
    bucket's ``(mantissa, exponent)`` (:func:`_module_energies`); no module: zeros."""
    if not parts:
        return np.zeros(m_tasks, np.int64), np.zeros(m_tasks)
    e = np.concatenate([np.asarray(m, np.float64) for m, _ in parts])  # (modules, M)
    k = np.concatenate([np.asarray(x, np.int64) for _, x in parts])
    live = e > 0
    kmax = np.where(live, k, np.iinfo(np.int64).min).max(0)
    t = np.where(live, e * np.exp2(np.where(live, k - kmax, 0)), 0.0).sum(0)
    return np.where(live.any(0), kmax, 0), t


@functools.partial(jax.jit, static_argnames=("meta", "route"))
def _log_energy_impl(inputs, *, meta, route="raw"):
    """Per task ``||dW_i||_F^2 = t_i 2^k_i`` summed over modules, scale-safe.

    Returns ``(k (M,) int32, t (M,))``, per bucket the ``(n, M, 3)`` non-finite counts, and
    ``raw_ok`` (see :func:`safe_grams`: False means redo with ``route="normalise"``). Each
    module's energy ``s^2 sum((a^T a) * (b b^T))`` is computed from normalised factors as a
    mantissa and a power of two, and the sum over modules is taken relative to the task's
    largest power, so nothing overflows whatever the scales.
    """
    dtype = meta[0]
    mant, expo, bads, oks = [], [], [], []
    for x, (d_in, d_out, r_max) in zip(inputs, meta[1], strict=True):
        if isinstance(x, _mesh.Stacked):  # stacked on the host (the streamed merge)
            A, B, S, _ = x
        else:
            A, B, S, _ = _buckets.stack_bucket(*x, d_in=d_in, d_out=d_out, r_max=r_max, dtype=dtype)
        gaa, gbb, s2, e, nonfinite, raw_ok = safe_grams(A, B, S, PER_TASK, route)
        oks.append(raw_ok)
        mant.append(((s2**2)[..., None, None] * gaa * gbb).sum((2, 3)))  # (n, M)
        expo.append(2 * e)
        bads.append(nonfinite)
    e = jnp.concatenate(mant, 0)  # (L, M)
    k = jnp.concatenate(expo, 0)
    live = e > 0
    kmax = jnp.max(jnp.where(live, k, jnp.iinfo(jnp.int32).min), 0)
    t = jnp.where(live, mul_pow2(e, jnp.where(live, k - kmax, 0)), 0).sum(0)
    kmax = jnp.where(live.any(0), kmax, 0)
    # a task with a NaN/Inf input has an undefined energy (eager calls raise; traces see NaN)
    bad_task = jnp.concatenate([(b > 0).any(-1) for b in bads], 0).any(0)
    t = jnp.where(bad_task, jnp.nan, t)
    return kmax, t, tuple(bads), jnp.stack(oks).all()


def _log_energies(adapters: Sequence[Any], fn: str, checked: bool, *, stacked: bool = False):
    """``(k, t, buckets)`` of :func:`_log_energy_impl`, with the eager finiteness check.
    ``stacked``: stack each bucket's (concrete) factors on the host first
    (:func:`_mesh.host_stack`): the same values, and a small program whatever the modules."""
    _, buckets, m_tasks = _tree.collect(adapters, fn=fn)
    dtype = _tree.compute_dtype(buckets)
    live = [bk for bk in buckets if not _dead(bk)]
    if not live:
        return jnp.zeros((m_tasks,), jnp.int32), jnp.zeros((m_tasks,), dtype), dtype
    meta = (dtype, tuple((bk.d_in, bk.d_out, bk.r_max) for bk in live))
    inputs = tuple(_buckets.bucket_arrays(bk) for bk in live)
    traced = _traced(inputs)
    if stacked and not traced:
        inputs = tuple(_mesh.host_stack(bk, dtype, len(bk.names)) for bk in live)
    with np.errstate(over="ignore"):  # values beyond the dtype: counted and reported below
        k, t, bads, raw_ok = _log_energy_impl(inputs, meta=meta, route="cond" if traced else "raw")
        # extreme or non-finite factors: the exact route (no LAPACK here, no ordering needed)
        if not traced and not bool(raw_ok):
            k, t, bads, _ = _log_energy_impl(inputs, meta=meta, route="normalise")
    if not isinstance(t, jax.core.Tracer):
        _tree.raise_nonfinite(fn, live, bads, dtype=dtype)
    elif checked:
        from jax.experimental import checkify

        for bad in bads:
            checkify.check(
                ~(bad > 0).any(),
                f"{fn}: a factor or scale has {{count}} non-finite entries (NaN or Inf).",
                count=bad.sum(),
            )
    return k, t, dtype


def task_energies(
    adapters: Sequence[Any], *, checked: bool = False, _fn: str = "nu.task_energies"
) -> jax.Array:
    """``||dW_i||_F^2`` summed over modules, per task, as ``(M,)``; from factor Grams.

    ``||s a b||_F^2 = s^2 sum((a^T a) * (b b^T))``: no dense update. Computed scale-safely (as
    :func:`score`); an energy beyond the compute dtype's range is an :class:`InputError`
    (:func:`heterogeneity` works with log-energies and stays defined).

    Args:
      adapters: sequence of M adapters, as in :func:`score`.
      checked: under a trace, report NaN/Inf inputs through :mod:`jax.experimental.checkify`
        (see :func:`score`).

    Raises:
      InputError: NaN/Inf in a factor or scale; an energy outside the compute dtype's range.
      InputTypeError: as :func:`score`.
    """
    checked = check_bool(_fn, "checked", checked)
    k, t, dtype = _log_energies(adapters, _fn, checked)
    e = mul_pow2(t, k)
    if not isinstance(e, jax.core.Tracer):
        fi = np.finfo(np.dtype(dtype))
        e_np, t_np = np.asarray(e), np.asarray(t)
        out = np.flatnonzero((t_np > 0) & ~((e_np >= fi.tiny) & (e_np <= fi.max)))
        if out.size:
            i = int(out[0])
            l10 = (float(np.asarray(k)[i]) + float(np.log2(t_np[i]))) * np.log10(2.0)
            raise InputError(
                f"{_fn}: task {i}'s energy ||dW||_F^2 is about 1e{l10:+.0f}, outside "
                f"{range_text(dtype)}. Check its LoRA scales (lora_alpha / r), or {X64_HINT}; "
                "nu.heterogeneity works with log-energies and is defined."
            )
    return e


def heterogeneity(
    adapters: Sequence[Any], *, checked: bool = False, _fn: str = "nu.heterogeneity"
) -> jax.Array:
    """Task heterogeneity ``h = Var_i[log ||dW_i||_F^2]`` (paper Eq. h; population variance).

    ``||dW_i||_F^2`` is task i's whole-adapter energy (all modules), from the factors. The paper
    finds h = 1.83 on its vision adapters (where it sets alpha = 0) and 0.63 on NLI (alpha = 1).
    The log-energies are computed from a mantissa and a power of two per task, so ``h`` is
    defined (and exact to rounding) for any finite scales, even where the energies themselves
    overflow.

    Args:
      adapters: sequence of M adapters, as in :func:`score`.
      checked: under a trace, report NaN/Inf inputs through :mod:`jax.experimental.checkify`
        (see :func:`score`).

    Returns:
      scalar ``h`` (0 for M = 1).

    Raises:
      InputError: a task's adapter is zero everywhere (its log-energy is undefined); NaN/Inf in a
        factor or scale.
      InputTypeError: as :func:`score`.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> a, b = rng.normal(size=(16, 2)), rng.normal(size=(2, 8))
      >>> ads = [{"m": {"lora_a": a, "lora_b": b, "scale": c}} for c in (1.0, np.e)]
      >>> round(float(nu.heterogeneity(ads)), 4)  # log-energies differ by 2: variance 1
      1.0
      >>> ads = [{"m": {"lora_a": a, "lora_b": b, "scale": c}} for c in (1e30, np.e * 1e30)]
      >>> round(float(nu.heterogeneity(ads)), 4)  # energies ~1e60 overflow float32; h does not
      1.0
    """
    checked = check_bool(_fn, "checked", checked)
    k, t, dtype = _log_energies(adapters, _fn, checked)
    if not isinstance(t, jax.core.Tracer):
        zero = np.flatnonzero(np.asarray(t) <= 0)
        if zero.size:
            raise InputError(
                f"{_fn}: task {int(zero[0])} has a zero update in every module; its log-energy "
                "is undefined. Drop that adapter"
                f"{' or pass alpha= explicitly' if 'alpha' in _fn else ''}."
            )
    # log e_i = ln 2 (k_i + log2 t_i); the integer part is centred exactly before the float math
    rel = (k - k[0]).astype(dtype) + jnp.log2(t)
    return jnp.var(rel * np.log(2.0).astype(dtype))
