"""Shared linear-algebra helpers, written so that no two LAPACK calls can run at once on CPU.

jaxlib 0.10's CPU LAPACK kernels (``eigh``, ``qr``, ``svd``) fan their batch out into the intra-op
thread pool they run on and block on it, so two of them running at once deadlock a 2-thread pool.
XLA's thunk executor runs independent custom calls concurrently and drops optimization barriers.
So every helper here issues ONE call per stage for all of its inputs (the A and B sides of a
factored matrix, the buckets of a model), and each stage depends on the data of the previous one.

The workaround is CPU-only, behind two helpers that do nothing on other backends (GPU and TPU
solvers do not share a blocking thread pool, and there asynchronous dispatch is worth keeping):

* :func:`after` chains one value to others through data, inside a traced function;
* :func:`settle` blocks on an eager result, so one LAPACK-using executable is in flight.

Both decide by :func:`lapack_serial`, the default backend at the time of the call (at trace time
for :func:`after`): code jitted for a CPU device on a GPU host keeps the chains only if the CPU is
the default backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InputError

__all__ = [
    "HI",
    "LazyQR",
    "after",
    "eigh_batched",
    "exponent",
    "lapack_serial",
    "mm",
    "mul_pow2",
    "orth_qr_lazy_many",
    "pow2",
    "pow2_normalise",
    "settle",
    "svd",
    "svd_many",
    "t",
]

HI = jax.lax.Precision.HIGHEST


def mm(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x @ y`` at full float32 precision (no bf16 passes on accelerators)."""
    return jnp.matmul(x, y, precision=HI)


def t(x: jax.Array) -> jax.Array:
    """Swap the last two axes."""
    return jnp.swapaxes(x, -1, -2)


def lapack_serial() -> bool:
    """Whether LAPACK calls must run one at a time: on the CPU backend (see the module doc)."""
    return jax.default_backend() == "cpu"


def after(x: jax.Array, *deps: jax.Array) -> jax.Array:
    """``x`` made data-dependent on ``deps`` (adds ``0 * dep[0...]``, a non-finite entry read as
    0 so that it cannot make ``x`` NaN), to order LAPACK calls on CPU; ``x`` itself on other
    backends."""
    if not lapack_serial():
        return x
    for d in deps:
        v = d.reshape(-1)[0].astype(x.dtype)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            v = jnp.where(jnp.isfinite(v), v, 0)
        x = x + jnp.zeros((), x.dtype) * v
    return x


def _bits(dtype) -> tuple[np.dtype, int, int]:
    """(integer type of the same width, mantissa bits, exponent bias) of a float dtype."""
    fi = jnp.finfo(dtype)
    return (
        np.dtype(np.int64 if jnp.dtype(dtype).itemsize == 8 else np.int32),
        fi.nmant,
        fi.maxexp - 1,
    )


def pow2(k: jax.Array, dtype) -> jax.Array:
    """Exact ``2.0 ** k`` for integer ``k``, clipped to the normal exponent range (bitcast)."""
    ity, nmant, bias = _bits(dtype)
    k = jnp.minimum(jnp.maximum(k.astype(ity), 1 - bias), bias)
    return jax.lax.bitcast_convert_type((k + bias) << nmant, dtype)


def exponent(x: jax.Array) -> jax.Array:
    """``e`` (int32) with ``|x| = m 2^e``, ``m`` in ``[0.5, 1)``, for normal ``x``; 0 for 0 (and
    subnormals, which XLA:CPU reads as 0). Like ``jnp.frexp(x)[1]``, from the exponent bits."""
    ity, nmant, bias = _bits(x.dtype)
    field = (jax.lax.bitcast_convert_type(x, ity) >> nmant) & (2 * bias + 1)
    return jnp.where(field > 0, field - (bias - 1), 0).astype(jnp.int32)


def mul_pow2(x: jax.Array, k: jax.Array) -> jax.Array:
    """``x * 2**k`` for integer ``k`` (broadcast), exact unless the result under/overflows.

    Two exact power-of-two factors, each in the normal range, so ``k`` may reach twice the
    exponent range (``2**k`` itself need not be representable: ``1e-30 * 2**200`` is fine).
    Multiplying by a power of two rounds nothing; a result beyond the range becomes ``inf`` (or
    0), as the true value would in this dtype, for ``|x|`` between ``2^-(emax-1)`` and ``2^emax``
    (beyond twice the range, ``k`` is clipped). Both factors are ``<= 1`` or both ``>= 1``, so
    the intermediate product over/underflows only if the result does.
    """
    k = jnp.asarray(k, jnp.int32)
    k1 = jax.lax.shift_right_arithmetic(k, jnp.ones((), jnp.int32))  # floor(k / 2), cheaply
    dt = x.dtype
    return x * pow2(k1, dt) * pow2(k - k1, dt)


def pow2_normalise(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Scale ``x`` by a power of two per slice so its largest ``|entry|`` over ``axes`` is in
    ``[0.5, 1)``: ``x = mul_pow2(y, e)`` exactly (entries more than ``2**-126`` below the slice's
    largest may flush to zero: they are below its rounding).

    Non-finite entries are set to 0 in ``y`` and counted, so what follows stays finite.

    Returns:
      ``(y, e, n_bad)``: ``y`` like ``x``; ``e`` int32 and ``n_bad`` int32 with ``axes`` reduced
      (``e = 0`` for an all-zero slice).
    """
    ok = jnp.isfinite(x)
    y = jnp.where(ok, x, jnp.zeros((), x.dtype))
    amax = jnp.max(jnp.abs(y), axis=axes, keepdims=True, initial=0.0)
    e = exponent(amax)
    y = mul_pow2(y, -e)
    n_bad = jnp.sum(~ok, axis=axes, dtype=jnp.int32)
    return y, jnp.squeeze(e, axis=axes), n_bad


def _flat_concat(mats: Sequence[jax.Array]) -> tuple[jax.Array, list[tuple]]:
    shapes = [m.shape[:-2] for m in mats]
    flat = [m.reshape(-1, *m.shape[-2:]) for m in mats]
    return (jnp.concatenate(flat) if len(flat) > 1 else flat[0]), shapes


def _split_flat(x: jax.Array, shapes: list[tuple]) -> list[jax.Array]:
    out, off = [], 0
    for shape in shapes:
        n = int(np.prod(shape, dtype=np.int64))
        out.append(x[off : off + n].reshape(*shape, *x.shape[1:]))
        off += n
    return out


def eigh_batched(mats: Sequence[jax.Array]) -> list[tuple[jax.Array, jax.Array]]:
    """Symmetric eigendecompositions of several batches as ONE ``eigh`` call (ascending order).

    Each entry is ``(..., k, k)`` with ``k <= K = max k``; smaller ones are zero-padded to ``K``
    (that adds zero eigenvalues, whose vectors live on the padding). Returns ``(w (..., K),
    v (..., K, K))`` per entry.
    """
    k_max = max(m.shape[-1] for m in mats)
    padded = []
    for m in mats:
        pad = k_max - m.shape[-1]
        padded.append(jnp.pad(m, [(0, 0)] * (m.ndim - 2) + [(0, pad), (0, pad)]))
    flat, shapes = _flat_concat(padded)
    w, v = jnp.linalg.eigh(flat)
    return list(zip(_split_flat(w, shapes), _split_flat(v, shapes), strict=True))


# jaxlib's CUDA SVD (cuSOLVER gesvdj) runs one matrix after another when a side exceeds 32 (its
# batched Jacobi kernel stops there), while its eigh decomposes a whole batch in one call
# (syevBatched since CUDA 12.6.2; batched Jacobi up to 32 x 32). Read in jaxlib/gpu/
# solver_kernels_ffi.cc (jax 0.10-0.11); benchmarks/gpu_lowering.py counts the calls.
_GPU_BATCHED_SVD = 32
# Tests only: take the GPU route on any backend (set it, then clear JAX's caches).
FORCE_EIGH_SVD = False


def svd(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Thin SVD ``(u, s, vt)`` of ``x (..., m, k)``, ``s`` descending.

    LAPACK's (``jnp.linalg.svd``) on a CPU, and XLA's own on a TPU. On CUDA and ROCm a batch of
    matrices with a side above 32 is decomposed by :func:`_svd_by_eigh`, one batched ``eigh``,
    where the solver's SVD would run once per matrix. The route is chosen when the program is
    lowered (:func:`jax.lax.platform_dependent`), so a program exported for a GPU takes it too.
    Both are backward stable (``s`` to ``eps ||x||``); where the GPU route cannot pair a
    singular value's vectors (``s`` at rounding level) it gives zero columns and ``s = 0``.
    Every caller keeps only ``s > rtol s_max`` (:func:`operators.methods.above_rtol`), with
    ``rtol`` at least ``max(m, k) eps``.
    """

    def lapack(y):
        return tuple(jnp.linalg.svd(y, full_matrices=False))

    if FORCE_EIGH_SVD:
        return _svd_by_eigh(x)
    m, k = x.shape[-2:]
    if x.ndim == 2 or max(m, k) <= _GPU_BATCHED_SVD:
        return lapack(x)
    return jax.lax.platform_dependent(x, cuda=_svd_by_eigh, rocm=_svd_by_eigh, default=lapack)


def _svd_by_eigh(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Thin SVD from the symmetric eigendecomposition of ``H = [[0, x], [x^T, 0]]`` (order
    ``m + k``): its eigenvalues are ``+-s_i`` and ``|m - k|`` zeros, the eigenvector of ``+s_i``
    is ``(u_i, v_i) / sqrt(2)``. Unlike ``eigh`` of ``x^T x`` it does not square the condition
    number: ``s`` is accurate to ``eps ||x||`` as LAPACK's SVD is. The ``min(m, k)`` largest
    eigenpairs give ``(u, s, v)``; each half is renormalised (then one Newton-Schulz step makes
    the columns orthonormal to working precision), and a pair whose half vanishes (``s`` at
    rounding level, where ``+-s`` and the zeros mix) gives zero columns and ``s = 0``.
    """
    m, k = x.shape[-2:]
    c = min(m, k)
    lead = x.shape[:-2]
    top = jnp.concatenate([jnp.zeros((*lead, m, m), x.dtype), x], -1)
    bottom = jnp.concatenate([t(x), jnp.zeros((*lead, k, k), x.dtype)], -1)
    w, v = jnp.linalg.eigh(jnp.concatenate([top, bottom], -2))  # ascending
    w, v = w[..., ::-1][..., :c], v[..., ::-1][..., :c]
    halves = []
    for h in (v[..., :m, :], v[..., m:, :]):
        norm = jnp.sqrt(jnp.sum(h * h, axis=-2, keepdims=True))  # 1 / sqrt(2) for s > 0
        halves.append((h, norm))
    live = (halves[0][1] > 0.25) & (halves[1][1] > 0.25) & (w[..., None, :] > 0)  # (..., 1, c)
    u, vv = (jnp.where(live, h / jnp.where(live, n, 1), 0) for h, n in halves)
    # the halves of close pairs (small s) are orthonormal only to eps / gap: one Newton-Schulz
    # step, ``Y (3 I - Y^T Y) / 2``, squares that error (zero columns stay zero)
    eye = jnp.eye(c, dtype=x.dtype)
    u, vv = (mm(y, 1.5 * eye - 0.5 * mm(t(y), y)) for y in (u, vv))
    s = jnp.where(live[..., 0, :], w, 0)
    # a zeroed pair among live ones at rounding level: move it last, keeping s descending
    order = jnp.argsort(-s, axis=-1, stable=True)
    s = jnp.take_along_axis(s, order, -1)
    u, vv = (jnp.take_along_axis(h, order[..., None, :], -1) for h in (u, vv))
    return u, s, t(vv)


def svd_many(mats: Sequence[jax.Array]) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """Thin SVDs of several batches of ``(..., m, k)`` matrices as ONE call.

    Matrices of different shapes are zero-padded to the largest ``(m, k)`` (padding adds zero
    singular values only, ordered last) and the thin factors are sliced back.
    """
    pm = max(m.shape[-2] for m in mats)
    pk = max(m.shape[-1] for m in mats)
    padded = [
        jnp.pad(m, [(0, 0)] * (m.ndim - 2) + [(0, pm - m.shape[-2]), (0, pk - m.shape[-1])])
        for m in mats
    ]
    flat, shapes = _flat_concat(padded)
    u, s, vt = svd(flat)
    out = []
    for m, uu, ss, vv in zip(
        mats, _split_flat(u, shapes), _split_flat(s, shapes), _split_flat(vt, shapes), strict=True
    ):
        p, k = m.shape[-2:]
        c = min(p, k)
        out.append((uu[..., :p, :c], ss[..., :c], vv[..., :c, :k]))
    return out


def _gram(x: jax.Array, rows: bool) -> jax.Array:
    """``x^T x`` of columns ``x (..., d, K)``, or ``x x^T`` of rows ``x (..., K, d)``; symmetric."""
    g = mm(x, t(x)) if rows else mm(t(x), x)
    return 0.5 * (g + t(g))


def _orth_pass_many(grams: Sequence[jax.Array], rtol2: float) -> list[tuple[jax.Array, jax.Array]]:
    """One CholeskyQR pass (``eigh`` for Cholesky, rank-revealing) from each Gram of ``x``:
    ``(m, r)`` with ``Q = x m`` and ``x = Q r``; one ``eigh`` call for all inputs.

    The Gram is equilibrated first (``D G D`` with ``D = diag(1 / ||x_j||)``, zero columns kept
    at zero): a Gram's rounding error is relative to the column norms, so columns of very different
    norms (tasks of different energy, a spectrum decaying over the rank) lose nothing, and ``rtol2``
    cuts the spectrum of ``x D`` (near-dependent columns), not of ``x``.
    """
    eq, scales = [], []
    for g in grams:
        norm = jnp.sqrt(jnp.maximum(jnp.diagonal(g, axis1=-2, axis2=-1), 0))
        dinv = jnp.where(norm > 0, 1 / jnp.where(norm > 0, norm, 1), 0)
        eq.append(g * dinv[..., :, None] * dinv[..., None, :])
        scales.append((norm, dinv))
    out = []
    for (lam, e), (norm, dinv) in zip(eigh_batched(eq), scales, strict=True):
        keep = lam > rtol2 * jnp.max(lam, -1, keepdims=True)
        root = jnp.sqrt(jnp.where(keep, lam, 0))
        inv = jnp.where(keep, 1 / jnp.where(keep, root, 1), 0)
        # x D = Q Lambda^1/2 E^T  =>  Q = x (D E Lambda^-1/2),  x = Q (Lambda^1/2 E^T D^-1)
        m = dinv[..., :, None] * e * inv[..., None, :]
        r = t(e * root[..., None, :]) * norm[..., None, :]
        out.append((m, r))
    return out


def _chol_pass_many(grams: Sequence[jax.Array]) -> list[tuple[jax.Array, jax.Array]]:
    """Second CholeskyQR pass from the Grams of nearly orthonormal ``x`` (same ``K``): ``(m, r)``
    with ``Q = x m``, ``x = Q r``; one Cholesky and one triangular solve for all inputs.

    Zero columns of ``x`` (directions the first pass dropped) stay zero: their rows and columns
    of the Gram are replaced by the identity's. If the factorisation fails (not finite) the pass
    is the identity, leaving the first pass's ``Q``.
    """
    k = grams[0].shape[-1]
    eye = jnp.eye(k, dtype=grams[0].dtype)
    regs = []
    for g in grams:
        dead = jnp.diagonal(g, axis1=-2, axis2=-1) < 0.25  # live columns have norm ~1
        cross = dead[..., :, None] | dead[..., None, :]
        regs.append(jnp.where(cross, eye, g))
    flat, shapes = _flat_concat(regs)
    low = jnp.linalg.cholesky(flat)
    eyes = jnp.broadcast_to(eye, flat.shape)
    linv = jax.lax.linalg.triangular_solve(low, eyes, left_side=True, lower=True)
    ok = jnp.isfinite(linv).all((-2, -1), keepdims=True)
    m = jnp.where(ok, t(linv), eyes)  # L^-T
    r = jnp.where(ok, t(low), eyes)  # L^T (waits for the solve too: see the module docstring)
    return list(zip(_split_flat(m, shapes), _split_flat(r, shapes), strict=True))


class LazyQR(NamedTuple):
    """``x = Q r`` with ``Q = q1 @ m`` kept factored: ``Q @ c`` costs one ``d``-sized matmul.

    Attributes:
      q1: ``(..., d, K)`` first-pass orthonormalised columns (``(..., K, d)`` rows for a QR of
        ``x^T`` given as rows, see :func:`orth_qr_lazy_many`).
      m: ``(..., K, K)`` second-pass correction.
      r: ``(..., K, K)`` with ``x = Q r``.
    """

    q1: jax.Array
    m: jax.Array
    r: jax.Array

    def q_times(self, c: jax.Array) -> jax.Array:
        """``Q @ c`` for a small ``c (..., K, k)``: the small product first."""
        return mm(self.q1, mm(self.m, c))

    def times_qt(self, y: jax.Array) -> jax.Array:
        """``y @ Q^T`` for a small ``y (..., k, K)`` of a QR built from rows: ``(..., k, d)``."""
        return mm(mm(y, t(self.m)), self.q1)

    @property
    def q(self) -> jax.Array:
        return mm(self.q1, self.m)


_SMALL = 512  # at most this many rows: Householder QR directly (exact, and cheap at this size)


def _householder_many(xs: Sequence[jax.Array], rows: Sequence[bool], k: int) -> list[LazyQR]:
    """Householder QR of each input (LAPACK ``geqrf``/``orgqr``), one input after another.

    Backward stable whatever the conditioning (nothing is dropped: dependent columns give a small
    ``R``). ``Q`` is zero-padded to ``K`` columns when an input has fewer rows than columns.
    """
    out: list[LazyQR] = []
    prev = None
    for j, (x, rw) in enumerate(zip(xs, rows, strict=True)):
        xc = t(x) if rw else x
        # chain the LAPACK calls through data, one in flight at a time; the first waits for every
        # input, so it cannot overlap a call that produces one of the others
        xc = after(xc, *xs[1:]) if j == 0 else after(xc, prev)
        q, r = jnp.linalg.qr(xc, mode="reduced")  # q (..., d, c), r (..., c, K), c = min(d, K)
        c = q.shape[-1]
        if c < k:
            q = jnp.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, k - c)])
            r = jnp.pad(r, [(0, 0)] * (r.ndim - 2) + [(0, k - c), (0, 0)])
        # q (orgqr) comes after r (geqrf): whatever uses r or q must wait for both
        r = after(r, q)
        prev = r
        eye = jnp.broadcast_to(jnp.eye(k, dtype=r.dtype), r.shape)
        out.append(LazyQR(t(q) if rw else q, eye, r))
    return out


def orth_qr_lazy_many(
    xs: Sequence[jax.Array],
    *,
    rtol: float = 0.0,
    rows: Sequence[bool] | None = None,
    exact: bool = False,
) -> list[LazyQR]:
    """``x = Q R`` for each tall ``x (..., d, K)`` (same ``K``), one ``eigh``, one Cholesky.

    CholeskyQR2: a first pass with ``eigh`` in place of Cholesky (rank-revealing, on the
    equilibrated Gram): ``Q1 = x D E Lambda^-1/2`` where ``D x^T x D = E Lambda E^T``; then a
    Cholesky pass on ``Q1^T Q1`` restores orthogonality to working precision. Directions with
    ``lambda <= max(rtol^2, 10 K eps) lambda_max`` are dropped (zero columns of ``Q``), never
    inverted. All ``d``-sized work is matmuls (two Grams and the first-pass product); the
    factorisations are ``K x K``. ``Q`` stays factored (:class:`LazyQR`) so that callers fold their
    small rotations into the last ``d``-sized product. ``R`` is not triangular (it is ``Q^T x``);
    callers only need ``x = Q R`` with ``Q^T Q`` a projector.

    A Gram in float32 resolves the directions of ``x D`` down to about ``1e-2`` of the largest;
    weaker ones (a LoRA ``B`` whose spectrum decays by ``1e3``, tasks sharing their ``A``
    initialisation) are what the first pass drops. With ``exact``, an input whose first pass
    drops a direction of a nonzero column is factored by Householder QR instead (the whole call
    switches, at run time, by ``lax.cond``), so ``x = Q R`` holds to working precision for any
    conditioning. Inputs with at most ``_SMALL`` rows always use Householder QR.

    ``rows[i]`` says ``xs[i]`` is given transposed, as rows ``(..., K, d)`` (a LoRA ``B``): the QR
    is of its transpose, and ``q1`` is kept as rows (use :meth:`LazyQR.times_qt`). No transposed
    copy of a ``d``-sized array is made on the Cholesky route.
    """
    rows = [False] * len(xs) if rows is None else list(rows)
    ks = {x.shape[-2] if rw else x.shape[-1] for x, rw in zip(xs, rows, strict=True)}
    if len(ks) != 1:
        raise InputError(f"orth_qr_many: inputs must share their column count; got {sorted(ks)}.")
    k = ks.pop()
    if max(x.shape[-1] if rw else x.shape[-2] for x, rw in zip(xs, rows, strict=True)) <= _SMALL:
        return _householder_many(xs, rows, k)
    eps = float(jnp.finfo(xs[0].dtype).eps)
    grams = [_gram(x, rw) for x, rw in zip(xs, rows, strict=True)]
    first = _orth_pass_many(grams, max(rtol**2, 10 * k * eps))

    def cholesky_route():
        q1s = [
            mm(t(m1), x) if rw else mm(x, m1)
            for x, rw, (m1, _) in zip(xs, rows, first, strict=True)
        ]
        second = _chol_pass_many([_gram(q1, rw) for q1, rw in zip(q1s, rows, strict=True)])
        return [
            LazyQR(q1, m2, mm(r2, r1))
            for q1, (_, r1), (m2, r2) in zip(q1s, first, second, strict=True)
        ]

    if not exact:
        return cholesky_route()
    # a direction of a nonzero column dropped: rank(x D) below its nonzero columns
    lost = jnp.zeros((), bool)
    for g, (m1, _) in zip(grams, first, strict=True):
        nonzero = (jnp.diagonal(g, axis1=-2, axis2=-1) > 0).sum(-1)
        kept = (jnp.abs(m1).sum(-2) > 0).sum(-1)
        lost = lost | jnp.any(kept < nonzero)
    return jax.lax.cond(lost, lambda: _householder_many(xs, rows, k), cholesky_route)


def settle(tree: Any) -> Any:
    """``tree`` after its arrays are computed, on CPU (``jax.block_until_ready``: one LAPACK-using
    executable in flight, and bounded memory in loops over modules); ``tree`` as it is, still
    being computed, on other backends."""
    return jax.block_until_ready(tree) if lapack_serial() else tree


def concat_tasks(x: jax.Array) -> jax.Array:
    """``(..., M, p, r)`` -> ``(..., p, M r)``: the tasks' columns side by side."""
    *lead, m, p, r = x.shape
    return jnp.moveaxis(x, -3, -2).reshape(*lead, p, m * r)


def column_norms(a: jax.Array) -> jax.Array:
    """Euclidean norms of the columns of ``a (..., p, k)`` without under- or overflow in the
    squares: each column is divided by its largest ``|entry|`` first (a column of tiny but
    nonzero entries has a tiny nonzero norm, not 0)."""
    m = jnp.max(jnp.abs(a), axis=-2, keepdims=True, initial=0)
    safe = jnp.where(m > 0, m, 1)
    return (m * jnp.linalg.norm(a / safe, axis=-2, keepdims=True))[..., 0, :]
