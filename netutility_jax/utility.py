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

References:
  Amballa et al., "Not All Ranks Are Equal: Budget-Aware LoRA Merging Across Tasks": Eq.
  net-utility (alpha = 1), App. A.4 (alpha = 0), Hyperparameters (lambda, h).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _tree
from ._linalg import eigh_batched as eigh_batched
from .errors import InputError

_HI = jax.lax.Precision.HIGHEST


class ModuleScores(NamedTuple):
    """Scores of one module, each ``(M, r_max)``; slot ``k`` of task ``j`` is its k-th direction.

    Attributes:
      sigma: singular values, descending per task; 0 on non-candidates.
      benefit: ``s^(2+2a) / w_j``, ``w_j = sum_n s_jn^(2+2a)`` (the task's energy share).
      interference: ``s_jk^2 sum_{i!=j} sum_n s_in^(2a) / w_i (v_jk . v_in)^2`` (before lambda).
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
    finite: jax.Array  # bool (n, M): Grams finite (no NaN/Inf/overflow in the factors)


def default_rtol(r_max: int, dtype: Any) -> float:
    """Relative singular-value cut of the Gram route: ``sqrt(10 * r_max * eps(dtype))``."""
    return float(np.sqrt(10.0 * r_max * np.finfo(np.dtype(dtype)).eps))


def _safe_div(x: jax.Array, y: jax.Array) -> jax.Array:
    ok = y > 0
    return jnp.where(ok, x / jnp.where(ok, y, 1), 0)


class _Grams(NamedTuple):
    g: jax.Array  # (n, M, r, M, r) = a_i^T a_j blocks
    gii: jax.Array  # (n, M, r, r)
    h: jax.Array  # (n, M, r, r) = b_i b_i^T
    scale: jax.Array  # (n, M)
    finite: jax.Array  # (n, M)


def _grams(a: jax.Array, b: jax.Array, scale: jax.Array) -> _Grams:
    """Stage 1: the only d-sized work, two Grams per module."""
    g = jnp.einsum("nidk,njdl->nikjl", a, a, precision=_HI)
    h = jnp.einsum("nikd,nild->nikl", b, b, precision=_HI)
    gii = jnp.einsum("nikil->nikl", g)
    finite = (
        jnp.isfinite(jnp.diagonal(gii, axis1=-2, axis2=-1)).all(-1)
        & jnp.isfinite(jnp.diagonal(h, axis1=-2, axis2=-1)).all(-1)
        & jnp.isfinite(scale)
    )
    # Non-finite modules are reported by the caller; zeroing keeps the rest of the batch clean.
    fix = lambda x: jnp.where(jnp.isfinite(x), x, 0)
    return _Grams(fix(g), fix(gii), fix(h), fix(scale), finite)


def _cores(gr: _Grams, phi: jax.Array, f: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Stage 2: ``R_b^T = F Phi^(1/2)`` (r, K) from ``eigh(H)``, and the (K, K) cores."""
    r = gr.h.shape[-1]
    rbt = f[..., :r, :] * jnp.sqrt(jnp.clip(phi, 0))[..., None, :]
    core = (gr.scale**2)[..., None, None] * jnp.einsum(
        "nika,nikl,nilb->niab", rbt, gr.gii, rbt, precision=_HI
    )
    return rbt, 0.5 * (core + jnp.swapaxes(core, -1, -2))


def _finish(
    gr: _Grams,
    rbt: jax.Array,
    ev: jax.Array,
    z: jax.Array,
    rank: jax.Array,
    alpha: jax.Array | float,
    rtol: jax.Array | float,
) -> BucketStats:
    """Stage 3: singular values, input directions ``a_i T_i``, overlaps, benefit, interference."""
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
    p = jnp.where(cand, rel ** (2 + 2 * alpha), 0)
    wt = p.sum(-1)
    benefit = _safe_div(p, wt[..., None])
    # c_in = s_in^(2a) / w_i, in units of s_max_i^-2 (put back through ratio2 below)
    c = _safe_div(jnp.where(cand, rel ** (2 * alpha), 0), wt[..., None])
    per_task = jnp.einsum("njkim,nim->njki", ov**2, c)  # (n, M_j, K, M_i)
    ratio2 = _safe_div(sig[..., None], smax[:, None, None, :]) ** 2  # (s_jk / s_max_i)^2
    off = 1 - jnp.eye(m_tasks, dtype=sig.dtype)
    interference = jnp.where(cand, (ratio2 * per_task * off[None, :, None, :]).sum(-1), 0)
    # at most r nonzero singular values per task: the slots past r are never candidates
    return BucketStats(
        sig[..., :r], benefit[..., :r], interference[..., :r], cand[..., :r], gr.finite
    )


def score_buckets(
    buckets: Sequence[tuple[jax.Array, jax.Array, jax.Array, jax.Array]],
    *,
    alpha: jax.Array | float,
    rtols: Sequence[jax.Array | float],
) -> list[BucketStats]:
    """Benefit and interference of every direction of several buckets (pure, traceable).

    Each bucket is ``(a, b, scale, rank)``:

    * ``a (n, M, d_in, r)`` input factors, zero-padded to ``r`` (a task lacking a module is zero);
    * ``b (n, M, r, d_out)`` output factors, zero-padded likewise;
    * ``scale (n, M)`` LoRA scales; ``rank (n, M)`` int, each task's own rank (slots
      ``k >= rank`` are never candidates).

    All buckets share two ``eigh`` calls (see :func:`eigh_batched`); everything else is per
    bucket. Free of global state: lambda and utilities are computed across buckets by the caller,
    so buckets can be streamed or sharded.

    Returns:
      one :class:`BucketStats` per bucket, arrays ``(n, M, r)``.
    """
    grams = [_grams(a, b, s) for a, b, s, _ in buckets]
    eig_h = eigh_batched([gr.h for gr in grams])
    cores = [_cores(gr, phi, f) for gr, (phi, f) in zip(grams, eig_h, strict=True)]
    eig_c = eigh_batched([c for _, c in cores])
    return [
        _finish(gr, rbt, ev, z, bk[3], alpha, rtol)
        for gr, (rbt, _), (ev, z), bk, rtol in zip(grams, cores, eig_c, buckets, rtols, strict=True)
    ]


def lam_auto(benefit: jax.Array, interference: jax.Array, candidate: jax.Array) -> jax.Array:
    """``median(benefit) / median(interference)`` over candidates (paper, Hyperparameters).

    If more than half the candidates have zero interference the median is 0; the ratio then uses
    the median of the positive interferences. With no interference at all (M = 1, or mutually
    orthogonal tasks) lambda is 0: the utility is the benefit whatever lambda is.
    """
    nan = jnp.nan
    mb = jnp.nanmedian(jnp.where(candidate, benefit, nan))
    mi = jnp.nanmedian(jnp.where(candidate, interference, nan))
    mi_pos = jnp.nanmedian(jnp.where(candidate & (interference > 0), interference, nan))
    denom = jnp.where(mi > 0, mi, mi_pos)
    return jnp.where(jnp.isfinite(denom) & (denom > 0), mb / jnp.where(denom > 0, denom, 1), 0.0)


@functools.partial(jax.jit, static_argnames=("meta", "lam_is_auto"))
def _score_impl(inputs, alpha, lam, rtols, *, meta, lam_is_auto):
    dtype = meta[0]
    stacked = [
        _tree.stack_bucket(a, b, s, d_in=d_in, d_out=d_out, r_max=r_max, dtype=dtype)
        for (a, b, s), (d_in, d_out, r_max) in zip(inputs, meta[1], strict=True)
    ]
    stats = score_buckets(stacked, alpha=alpha, rtols=rtols)
    if lam_is_auto:
        lam = lam_auto(
            jnp.concatenate([st.benefit.ravel() for st in stats]),
            jnp.concatenate([st.interference.ravel() for st in stats]),
            jnp.concatenate([st.candidate.ravel() for st in stats]),
        )
    lam = jnp.asarray(lam, dtype)
    out = []
    for st in stats:
        util = jnp.where(st.candidate, st.benefit - lam * st.interference, -jnp.inf)
        out.append((ModuleScores(st.sigma, st.benefit, st.interference, util), st.finite))
    return tuple(out), lam


def unstack(x: jax.Array) -> list[jax.Array]:
    """Split the leading axis of a bucket-level array into one array per module.

    Done on the host (one device_put of numpy views): slicing many outputs inside a jitted graph
    costs XLA seconds of compile time per bucket shape. Traced inputs are sliced in the graph.
    """
    if isinstance(x, jax.core.Tracer):
        return [x[i] for i in range(x.shape[0])]
    h = np.asarray(x)
    return jax.device_put([h[i] for i in range(h.shape[0])], x.sharding)


def _raise_nonfinite(fn: str, bucket: _tree.Bucket, finite: np.ndarray) -> None:
    n, i = (int(x) for x in np.argwhere(~finite)[0])
    m = bucket.modules[n][i]
    what = "lora_a"
    for label, x in (("lora_a", m.lora_a), ("lora_b", m.lora_b), ("scale", m.scale)):
        if not np.isfinite(np.asarray(x, np.float64)).all():
            what = f"{label} has NaN or Inf"
            break
    else:
        what = "lora_a or lora_b overflows in the Gram (entries too large for float32)"
    raise InputError(
        f"{fn}: module {bucket.names[n]!r}, task {i} (lora_a {tuple(m.lora_a.shape)}, lora_b "
        f"{tuple(m.lora_b.shape)}): {what}. Fix or retrain that adapter, or enable x64 and pass "
        "float64 factors if they are merely large."
    )


def _check_alpha(fn: str, alpha: Any) -> None:
    if isinstance(alpha, jax.core.Tracer):
        return
    a = np.asarray(alpha)
    if a.shape != () or not np.isfinite(a) or a < 0:
        raise InputError(
            f"{fn}: alpha={alpha!r}; expected a finite scalar >= 0 (1.0 Gram geometry, 0.0 "
            "row-space heuristic; 'auto' picks by heterogeneity)."
        )


def score(
    adapters: Sequence[Any],
    *,
    alpha: float | str = 1.0,
    lam: float | str = "auto",
    rtol: float | None = None,
    h_threshold: float = 1.0,
) -> Scores:
    """Net utility of every singular direction of every module and task (paper Eq. net-utility).

    For task ``j``'s k-th direction of a module, with singular values ``s`` and input-side
    directions ``v`` (``in_dirs``)::

        w_j          = sum_n s_jn^(2+2a)
        benefit      = s_jk^(2+2a) / w_j
        interference = s_jk^2 sum_{i!=j} sum_n s_in^(2a) / w_i (v_jk . v_in)^2
        utility      = benefit - lam * interference

    ``a = 1`` is the Gram geometry ``G_i ~ V_i S_i^2 V_i^T`` (paper Eq. gram-geometry), ``a = 0`` the
    row-space heuristic (App. A.4). All modules of equal shape are scored by one jitted, batched
    kernel from the Grams of the factors (see the module docstring); no dense update is formed.

    Args:
      adapters: sequence of M adapter pytrees (one per task) with the same module names. A module
        is ``{"lora_a": (d_in, r), "lora_b": (r, d_out), "scale": ()}`` (scale optional, default
        1); ranks may differ between tasks and modules. ``None`` marks a module a task lacks.
      alpha: geometry exponent ``>= 0``; ``"auto"`` applies the paper's heterogeneity rule: 0 when
        ``nu.heterogeneity(adapters) > h_threshold``, else 1.
      lam: interference weight, or ``"auto"``: median benefit / median interference over all
        candidates of all modules (paper, Hyperparameters).
      rtol: relative singular-value cut for candidates; default ``sqrt(10 * r_max * eps)``.
      h_threshold: threshold of the ``alpha="auto"`` rule (between the paper's NLI h = 0.63 and
        vision h = 1.83).

    Returns:
      :class:`Scores` with ``modules[name]`` fields ``sigma``, ``benefit``, ``interference``,
      ``utility``, each ``(M, r_max)``. A task whose update is zero in a module (or that lacks it)
      has no candidates there and adds no interference. Non-candidates: ``sigma = 0``,
      ``utility = -inf``.

    Raises:
      ValueError: empty list, module names or shapes that differ between tasks, factors that do
        not chain, NaN/Inf in a factor, negative alpha, unknown lam.
      TypeError: non-floating factors.

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
    """
    fn = "nu.score"
    names, buckets, _m_tasks = _tree.collect(adapters, fn=fn)
    if isinstance(alpha, str):
        if alpha != "auto":
            raise InputError(f"{fn}: alpha={alpha!r}; expected a float >= 0 or 'auto'.")
        alpha = 0.0 if float(heterogeneity(adapters)) > h_threshold else 1.0
    _check_alpha(fn, alpha)
    if isinstance(lam, str):
        if lam != "auto":
            raise InputError(f"{fn}: lam={lam!r}; expected 'auto' or a float.")
        lam_is_auto, lam_val = True, 0.0
    else:
        if not isinstance(lam, jax.core.Tracer) and not np.isfinite(np.asarray(lam)):
            raise InputError(f"{fn}: lam={lam!r}; expected a finite float or 'auto'.")
        lam_is_auto, lam_val = False, lam
    if rtol is not None and not (0 <= float(rtol) < 1):
        raise InputError(f"{fn}: rtol={rtol!r}; expected 0 <= rtol < 1.")
    dtype = _tree.compute_dtype(buckets)
    meta = (dtype, tuple((bk.d_in, bk.d_out, bk.r_max) for bk in buckets))
    rtols = tuple(
        jnp.asarray(default_rtol(bk.r_max, dtype) if rtol is None else rtol, dtype)
        for bk in buckets
    )
    inputs = tuple(_tree.bucket_arrays(bk) for bk in buckets)
    outs, lam_used = _score_impl(
        inputs, jnp.asarray(alpha, dtype), lam_val, rtols, meta=meta, lam_is_auto=lam_is_auto
    )
    if not isinstance(lam_used, jax.core.Tracer):
        # Finish before returning: two LAPACK-using executables in flight at once can deadlock
        # jaxlib's CPU thread pool (see eigh_batched).
        jax.block_until_ready((outs, lam_used))
    by_name: dict[str, ModuleScores] = {}
    for bk, (mods, finite) in zip(buckets, outs, strict=True):
        if not isinstance(finite, jax.core.Tracer):
            fin = np.asarray(finite)
            if not fin.all():
                _raise_nonfinite(fn, bk, fin)
        per_module = zip(*(unstack(f) for f in mods), strict=True)
        by_name.update(zip(bk.names, (ModuleScores(*f) for f in per_module), strict=True))
    if not isinstance(lam_used, jax.core.Tracer) and not any(
        np.asarray(ms.sigma).any() for ms in by_name.values()
    ):
        raise InputError(
            f"{fn}: no candidate directions: the update of every task is zero (or below rtol) in "
            f"all {len(names)} modules; check that the adapters are trained (lora_b is zero at "
            "initialisation) and loaded correctly."
        )
    return Scores({k: by_name[k] for k in names}, lam_used, jnp.asarray(alpha, dtype))


@functools.partial(jax.jit, static_argnames=("meta",))
def _energy_impl(inputs, *, meta):
    dtype = meta[0]
    total = 0
    for (a, b, s), (d_in, d_out, r_max) in zip(inputs, meta[1], strict=True):
        A, B, S, _ = _tree.stack_bucket(a, b, s, d_in=d_in, d_out=d_out, r_max=r_max, dtype=dtype)
        gaa = jnp.einsum("nidk,nidl->nikl", A, A, precision=_HI)
        gbb = jnp.einsum("nikd,nild->nikl", B, B, precision=_HI)
        total = total + ((S**2)[..., None, None] * gaa * gbb).sum((0, 2, 3))
    return total


def task_energies(adapters: Sequence[Any], *, _fn: str = "nu.task_energies") -> jax.Array:
    """``||dW_i||_F^2`` summed over modules, per task, as ``(M,)``; from factor Grams.

    ``||s a b||_F^2 = s^2 sum((a^T a) * (b b^T))``: no dense update.
    """
    _, buckets, _ = _tree.collect(adapters, fn=_fn)
    dtype = _tree.compute_dtype(buckets)
    meta = (dtype, tuple((bk.d_in, bk.d_out, bk.r_max) for bk in buckets))
    return _energy_impl(tuple(_tree.bucket_arrays(bk) for bk in buckets), meta=meta)


def heterogeneity(adapters: Sequence[Any]) -> jax.Array:
    """Task heterogeneity ``h = Var_i[log ||dW_i||_F^2]`` (paper Eq. h; population variance).

    ``||dW_i||_F^2`` is task i's whole-adapter energy (all modules), from the factors. The paper
    finds h = 1.83 on its vision adapters (where it sets alpha = 0) and 0.63 on NLI (alpha = 1).

    Args:
      adapters: sequence of M adapters, as in :func:`score`.

    Returns:
      scalar ``h`` (0 for M = 1).

    Raises:
      ValueError: if a task's adapter is zero everywhere (its log-energy is undefined).

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> a, b = rng.normal(size=(16, 2)), rng.normal(size=(2, 8))
      >>> ads = [{"m": {"lora_a": a, "lora_b": b, "scale": c}} for c in (1.0, np.e)]
      >>> round(float(nu.heterogeneity(ads)), 4)  # log-energies differ by 2: variance 1
      1.0
    """
    e = task_energies(adapters, _fn="nu.heterogeneity")
    if not isinstance(e, jax.core.Tracer):
        zero = np.flatnonzero(np.asarray(e) <= 0)
        if zero.size:
            raise InputError(
                f"nu.heterogeneity: task {int(zero[0])} has a zero update in every module; its "
                "log-energy is undefined. Drop that adapter."
            )
    return jnp.var(jnp.log(e))
