"""The scoring kernels (paper Eq. net-utility): the per-bucket math and the jitted programs.

Pure functions over stacked buckets (:func:`score_buckets`), lambda's median rule
(:func:`lam_auto`), and the two jitted stages :func:`score_impl` runs (per bucket, then over every
bucket: lambda, utilities and range flags). :mod:`netutility_jax.scoring._run` drives them over an
adapter set, :mod:`netutility_jax.utility` is the public entry; the math is stated in
:mod:`netutility_jax.utility`'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core import buckets as _buckets
from .._core import mesh as _mesh
from .._core.buckets import Leaves
from .._core.executables import kernel
from .._core.host import put_views
from .._core.linalg import eigh_batched, mul_pow2
from ._grams import Grams, grams, moment_grams
from ._median import lam_auto  # (re-exported)

__all__ = [
    "ANY_SIGMA",
    "BEYOND",
    "INTERFERENCES",
    "NONFINITE",
    "RAW_OK",
    "BucketOut",
    "BucketStats",
    "Finished",
    "ModuleScores",
    "Scores",
    "default_rtol",
    "lam_auto",
    "score_buckets",
    "score_by_device",
    "score_impl",
    "unstack",
]

_HI = jax.lax.Precision.HIGHEST

#: The interference terms :func:`score_buckets` computes: ``"overlap"`` the paper's (input-side
#: overlaps, sign-blind), ``"signed"`` this project's sign-aware one (only conflicting parts of
#: the directions' Frobenius inner products count; docs/math.md, section "Sign-aware
#: interference"), and ``"signed_weaker"`` its asymmetric form (a conflicting pair charges only
#: the direction holding the smaller share of its own task's energy, both on a tie).
#: The interference terms ``nu.score`` takes (``nu.INTERFERENCES``): the paper's input-side
#: overlap, and this project's sign-aware term and its asymmetric form (docs/math.md).
INTERFERENCES = ("overlap", "signed", "signed_weaker")
#: The interference terms that need the directions' output sides (one more Gram).
SIGNED = ("signed", "signed_weaker")


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
    interference: str = "overlap",
) -> list[BucketStats]:
    """Stage 3: singular values, input directions ``a_i T_i``, overlaps, then for each alpha of
    ``alphas`` the benefit and interference (the overlaps, the costly part, are shared).

    Everything is in each task's normalised units (``s = s' 2^E``) until the end: benefits and
    overlaps do not depend on ``E``; sigma and the cross-task ratios get it back exactly.

    ``moments``: ``(q (n, M, r, r), tr (n, M), iso (n, M))``, each task-module's ``a^T S a`` and
    ``tr(S)`` (:func:`moment_grams`) and whether it has no data (the data-free geometry, ``S =
    I``): the data-aware score (:func:`score`, ``input_moments``). None: the data-free score.

    ``interference="signed"`` (this project's, docs/math.md): each input overlap ``v_jk . v_im``
    is replaced by ``(v_jk . v_im) |u_jk . u_im|`` where the rank-1 cosine ``(u_jk . u_im)(v_jk
    . v_im)`` is negative (a conflict) and by 0 elsewhere, with the output directions ``u = W^T
    v / s`` from ``gr.hb``; with ``alpha = 1`` and no moments, task i's part of the
    interference is then ``sum_m min(0, <c_jk, c_im>_F)^2 / w_i``. ``"signed_weaker"``: the
    same, counting task i's component ``m`` only where the benefit (energy share) of ``(j, k)``
    is at most that of ``(i, m)``: of a conflicting pair, the direction that matters less to its
    own task is charged (both where the shares are equal).
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
    if interference in SIGNED:
        # u_i = W'_i^T v_i / s'_i = b'_i^T p_i with p_i = scale'_i (a'_i^T a'_i) t_i / s'_i
        pv = gr.scale[..., None, None] * jnp.matmul(gr.gii, t_in, precision=_HI) * inv[..., None, :]
        hp = jnp.einsum("njaib,nibm->njaim", gr.hb, pv, precision=_HI)
        ou = jnp.einsum("njak,njaim->njkim", pv, hp, precision=_HI)  # u_jk . u_im
        # only conflicting pairs (rank-1 cosine (u_jk . u_im)(v_jk . v_im) < 0), the input
        # overlap weighted by the output one: squared, min(0, cosine)^2; signed as v_jk . v_im,
        # so flipping a component's (u, v) flips its entry and its row of C_i together (the
        # data-aware quadratic form is invariant, as the update is)
        ov = jnp.where(ov * ou < 0, ov * jnp.abs(ou), 0)
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
            per_task = jnp.einsum("njkim,nim->njki", _weaker(ov, benefit, interference) ** 2, c)
        else:
            p, wt = _data_aware_weights(cm, rel, cand, alpha)
            benefit = _safe_div(p, wt[..., None])
            per_task = _data_aware(cm, _weaker(ov, benefit, interference), rel, cand, alpha, wt)
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


def _weaker(ov: jax.Array, benefit: jax.Array, interference: str) -> jax.Array:
    """``ov (n, M_j, K, M_i, K)`` as the interference of :func:`_finish` reads it: for
    ``"signed_weaker"`` only the pairs where ``(j, k)``'s benefit ``(n, M, K)`` is at most
    ``(i, m)``'s (a mask that depends on no sign: the data-aware form stays invariant to the
    SVD's sign choices); unchanged for the other terms."""
    if interference != "signed_weaker":
        return ov
    weaker = benefit[:, :, :, None, None] <= benefit[:, None, None, :, :]
    return jnp.where(weaker, ov, 0)


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


def _data_aware_weights(
    cm: jax.Array, rel: jax.Array, cand: jax.Array, alpha: jax.Array | float
) -> tuple[jax.Array, jax.Array]:
    """``(p, W)``: ``p_jk = s_jk^(2+2a) C_j[k,k]`` and ``W_j = sum_n p_jn`` of the data-aware
    geometry, in the units of :func:`_finish`."""
    dg = jnp.clip(jnp.einsum("nikk->nik", cm), 0)
    p = jnp.where(cand, rel ** (2 + 2 * alpha) * dg, 0)
    return p, p.sum(-1)


def _data_aware(
    cm: jax.Array,
    ov: jax.Array,
    rel: jax.Array,
    cand: jax.Array,
    alpha: jax.Array | float,
    wt: jax.Array,
) -> jax.Array:
    """Per-task interference of the data-aware geometry ``G_i = M_i S_i M_i``, ``M_i = V_i
    Sigma_i^a V_i^T`` (docs/input_moments.md), in the units of :func:`_finish`.

    ``benefit_jk = s_jk^(2+2a) C_j[k,k] / W_j``, ``W_j = sum_n s_jn^(2+2a) C_j[n,n]`` (``wt``,
    from :func:`_data_aware_weights`); task i's part of the interference of ``(j, k)``: ``s_jk^2
    y^T C_i y / W_i`` with ``y_m = s_im^a (v_jk . v_im)``. Scale-free in each ``C_i`` (it cancels
    against ``W_i``); with ``C_i = I`` it is the data-free formula term for term.
    """
    y = ov * jnp.where(cand, rel**alpha, 0)[:, None, None]  # (n, M_j, K, M_i, K)
    quad = jnp.einsum("njkim,nimp,njkip->njki", y, cm, y, precision=_HI)
    # s_im^2a in units of s_max_i^2a, W_i in units of s_max_i^(2+2a): s_max_i^-2 (see ratio2)
    return _safe_div(jnp.clip(quad, 0), wt[:, None, None, :])


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
    interference: str = "overlap",
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

    ``interference`` (:data:`INTERFERENCES`): ``"overlap"``, the paper's term, or ``"signed"``,
    this project's sign-aware one (one more Gram, every task pair's ``b_i b_j^T``), or
    ``"signed_weaker"``, its asymmetric form.

    Returns:
      one :class:`BucketStats` per bucket, arrays ``(n, M, r)``.
    """
    return _score_buckets(buckets, (alpha,), rtols, route, interference=interference)[0][0]


def _score_buckets(
    buckets: Sequence[tuple[jax.Array, jax.Array, jax.Array, jax.Array]],
    alphas: Sequence[jax.Array | float],
    rtols: Sequence[jax.Array | float],
    route: str,
    moments: Sequence[tuple[jax.Array, jax.Array]] | None = None,
    interference: str = "overlap",
) -> tuple[list[list[BucketStats]], list[Grams]]:
    """:func:`score_buckets` for each alpha of ``alphas`` from one decomposition: ``(stats,
    grams)``, ``stats[a][b]`` alpha ``a``'s :class:`BucketStats` of bucket ``b``. ``moments``:
    per bucket ``(f (n, M, k, d_in), iso (n, M))`` (:func:`_buckets.stack_moments`) for the
    data-aware score, or None."""
    grs: list[Grams] = []
    cross_b = interference in SIGNED
    for a, b, s, _ in buckets:
        # from leaves, each bucket's Grams after the previous one's: XLA then holds one group
        # of modules' stacked factors at a time (see _grams.leaf_grams)
        grs.append(grams(a, b, s, route, after=grs[-1].h if grs else None, cross_b=cross_b))
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
        _finish(gr, rbt, ev, z, bk[3], alphas, rtol, q, interference)
        for gr, (rbt, _), (ev, z), bk, rtol, q in zip(
            grs, cores, eig_c, buckets, rtols, qs, strict=True
        )
    ]
    return [[pb[a] for pb in per_bucket] for a in range(len(alphas))], grs


def _score_stats(
    inputs, alpha, rtols, *, meta, route, energy=False, moments=None, interference="overlap"
):
    """Stage 1 of :func:`score_impl`: ``(stats, energies)``, ``stats[a]`` each bucket's
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
    stats, grs = _score_buckets(stacked, alphas, rtols, route, moments, interference)
    return stats, [_module_energies(gr) for gr in grs] if energy else None


def _score_finish(stats, lam, *, dtype, lam_is_auto, nan_fill):
    """Stage 2 of :func:`score_impl`, over every bucket: lambda (``"auto"``: the median ratio
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
        out.append(BucketOut(jnp.stack(fields, 1), st.nonfinite, ranges, st.log10_smax))
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
    return Finished(tuple(out), lam, lam_bad, raw_ok, status)


class BucketOut(NamedTuple):
    """One bucket's part of :func:`_score_finish` (``n`` modules, ``M`` tasks)."""

    stats: jax.Array  # (n, 4, M, r_max): the fields of ModuleScores, in its order
    nonfinite: jax.Array  # (n, M, 3) int32: NaN/Inf entries of lora_a, lora_b, scale
    ranges: jax.Array  # (n, M, 3) bool: sigma, interference, utility not a normal number
    log10_smax: jax.Array  # (n, M)


# Finished.status: what an eager call reads first, in one transfer (the rest only on a problem)
RAW_OK, NONFINITE, BEYOND, ANY_SIGMA = range(4)


class Finished(NamedTuple):
    """:func:`_score_finish` for one alpha."""

    outs: tuple[BucketOut, ...]
    lam: jax.Array  # the lambda used
    lam_bad: jax.Array  # () bool: lam="auto" is not a normal number of the dtype
    raw_ok: jax.Array  # () bool: see safe_grams
    # (4,) bool: raw_ok; a NaN/Inf input; a range flag or lam_bad; a nonzero sigma anywhere.
    # None without live buckets.
    status: jax.Array | None


@kernel(
    static_argnames=("meta", "lam_is_auto", "route", "energy", "interference"),
    fast_compile=True,  # (its time is the Grams' dots and the eigh: _core.executables)
)
def score_impl(
    inputs,
    alpha,
    lam,
    rtols,
    *,
    meta,
    lam_is_auto,
    route="raw",
    energy=False,
    moments=None,
    interference="overlap",
):
    """The jitted scoring of :func:`score`: ``(finished, raw_ok, energies)``, ``finished`` one
    :func:`_score_finish` per alpha (see :func:`_score_stats`). With ``route="raw"`` the caller
    must redo the call with ``route="normalise"`` when ``raw_ok`` is False (see
    :func:`safe_grams`)."""
    stats, energies = _score_stats(
        inputs, alpha, rtols, meta=meta, route=route, energy=energy, moments=moments,
        interference=interference,
    )  # fmt: skip
    finished = _finish_all(stats, lam, meta, lam_is_auto, route)
    return finished, finished[0].raw_ok, energies


def _finish_all(stats, lam, meta, lam_is_auto, route):
    kw = {"dtype": meta[0], "lam_is_auto": lam_is_auto, "nan_fill": route == "cond"}
    return tuple(_score_finish(st, lam, **kw) for st in stats)


_score_stats_jit = jax.jit(
    _score_stats, static_argnames=("meta", "route", "energy", "interference")
)
_finish_all_jit = jax.jit(_finish_all, static_argnames=("meta", "lam_is_auto", "route"))


def score_by_device(
    inputs,
    alpha,
    lam,
    rtols,
    *,
    meta,
    lam_is_auto,
    route,
    energy,
    mesh,
    moments=None,
    interference="overlap",
):
    """:func:`score_impl` with each bucket's modules split between ``mesh``'s devices
    (:func:`_mesh.per_device`: one SPMD program, or on CPU each device's modules of every bucket
    in one call, in turn), then the global stage once."""
    if _mesh.spmd(mesh):  # one program, as score_impl: the one-device result, bit for bit
        kw = {"meta": meta, "lam_is_auto": lam_is_auto, "route": route, "energy": energy}
        kw["interference"] = interference
        if moments is not None:
            kw["moments"] = _mesh.shard(moments, mesh)
        return score_impl(_mesh.shard(inputs, mesh), alpha, lam, rtols, **kw)
    if moments is None:
        stats, energies = _mesh.per_device(
            lambda x: _score_stats_jit(
                x, alpha, rtols, meta=meta, route=route, energy=energy, interference=interference
            ),
            inputs,
            mesh,
        )
    else:
        stats, energies = _mesh.per_device(
            lambda xm: _score_stats_jit(
                xm[0],
                alpha,
                rtols,
                meta=meta,
                route=route,
                energy=energy,
                moments=xm[1],
                interference=interference,
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
