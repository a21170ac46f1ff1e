"""Shared linear-algebra helpers, written so that no two LAPACK calls can run at once.

jaxlib 0.10's CPU LAPACK kernels (``eigh``, ``qr``, ``svd``) fan their batch out into the intra-op
thread pool they run on and block on it, so two of them running at once deadlock a 2-thread pool.
XLA's thunk executor runs independent custom calls concurrently and drops optimization barriers.
So every helper here issues ONE call per stage for all of its inputs (the A and B sides of a
factored matrix, the buckets of a model), and each stage depends on the data of the previous one.
Code that calls LAPACK several times must chain the calls through data (see :func:`after`), and
eager wrappers block on their results before returning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

HI = jax.lax.Precision.HIGHEST


def mm(x: jax.Array, y: jax.Array) -> jax.Array:
    """``x @ y`` at full float32 precision (no bf16 passes on accelerators)."""
    return jnp.matmul(x, y, precision=HI)


def t(x: jax.Array) -> jax.Array:
    """Swap the last two axes."""
    return jnp.swapaxes(x, -1, -2)


def after(x: jax.Array, *deps: jax.Array) -> jax.Array:
    """``x`` made data-dependent on ``deps`` (adds ``0 * dep[0...]``), to order LAPACK calls."""
    for d in deps:
        x = x + jnp.zeros((), x.dtype) * d.reshape(-1)[0].astype(x.dtype)
    return x


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


def svd_many(mats: Sequence[jax.Array]) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """Thin SVDs of several batches of equally shaped ``(..., m, k)`` matrices as ONE call."""
    tail = {m.shape[-2:] for m in mats}
    if len(tail) != 1:
        raise ValueError(f"svd_many: matrices must share their last two dims; got {sorted(tail)}.")
    flat, shapes = _flat_concat(mats)
    u, s, vt = jnp.linalg.svd(flat, full_matrices=False)
    return list(
        zip(_split_flat(u, shapes), _split_flat(s, shapes), _split_flat(vt, shapes), strict=True)
    )


def _orth_pass_many(xs: Sequence[jax.Array], rtol2: float) -> list[tuple[jax.Array, jax.Array]]:
    """One CholeskyQR pass (``eigh`` for Cholesky) of each ``x``: ``(m, r)`` with ``Q = x m``
    and ``x = Q r``; one ``eigh`` call for all inputs."""
    grams = []
    for x in xs:
        g = mm(t(x), x)
        grams.append(0.5 * (g + t(g)))
    out = []
    for lam, e in eigh_batched(grams):
        keep = lam > rtol2 * jnp.max(lam, -1, keepdims=True)
        root = jnp.sqrt(jnp.where(keep, lam, 0))
        inv = jnp.where(keep, 1 / jnp.where(keep, root, 1), 0)
        out.append((e * inv[..., None, :], t(e * root[..., None, :])))
    return out


class LazyQR(NamedTuple):
    """``x = Q r`` with ``Q = q1 @ m`` kept factored: ``Q @ c`` costs one ``d``-sized matmul.

    Attributes:
      q1: ``(..., d, K)`` first-pass orthonormalised columns.
      m: ``(..., K, K)`` second-pass correction.
      r: ``(..., K, K)`` with ``x = Q r``.
    """

    q1: jax.Array
    m: jax.Array
    r: jax.Array

    def q_times(self, c: jax.Array) -> jax.Array:
        """``Q @ c`` for a small ``c (..., K, k)``: the small product first."""
        return mm(self.q1, mm(self.m, c))

    @property
    def q(self) -> jax.Array:
        return mm(self.q1, self.m)


def orth_qr_lazy_many(xs: Sequence[jax.Array], *, rtol: float = 0.0) -> list[LazyQR]:
    """``x = Q R`` for each tall ``x (..., d, K)`` (same ``K``), two ``eigh`` calls for all of them.

    CholeskyQR2 with ``eigh`` in place of Cholesky: ``Q = x E Lambda^-1/2`` where
    ``x^T x = E Lambda E^T``, twice (the second pass restores orthogonality to working precision).
    Directions with ``lambda <= max(rtol^2, 10 K eps) lambda_max`` are dropped (zero columns of
    ``Q``), never inverted. All ``d``-sized work is matmuls (three per input: two Grams and the
    first pass); the eigenproblems are ``K x K``. ``Q`` stays factored (:class:`LazyQR`) so that
    callers fold their small rotations into the last ``d``-sized product. ``R`` is not
    triangular (it is ``Q^T x``); callers only need ``x = Q R`` with ``Q^T Q`` a projector.
    """
    ks = {x.shape[-1] for x in xs}
    if len(ks) != 1:
        raise ValueError(f"orth_qr_many: inputs must share their column count; got {sorted(ks)}.")
    k = ks.pop()
    eps = float(jnp.finfo(xs[0].dtype).eps)
    first = _orth_pass_many(xs, max(rtol**2, 10 * k * eps))
    q1s = [mm(x, m1) for x, (m1, _) in zip(xs, first, strict=True)]
    second = _orth_pass_many(q1s, 10 * k * eps)
    return [
        LazyQR(q1, m2, mm(r2, r1)) for q1, (_, r1), (m2, r2) in zip(q1s, first, second, strict=True)
    ]


def orth_qr_many(
    xs: Sequence[jax.Array], *, rtol: float = 0.0
) -> list[tuple[jax.Array, jax.Array]]:
    """:func:`orth_qr_lazy_many` with ``Q`` formed: ``[(Q, R)]``."""
    return [(f.q, f.r) for f in orth_qr_lazy_many(xs, rtol=rtol)]


def orth_qr(x: jax.Array, *, rtol: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """:func:`orth_qr_many` of one matrix."""
    return orth_qr_many([x], rtol=rtol)[0]


def block(tree):
    """``block_until_ready`` on every array leaf (eager wrappers: one executable in flight)."""
    return jax.block_until_ready(tree)
