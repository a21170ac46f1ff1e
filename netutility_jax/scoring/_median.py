"""``lam="auto"``: the median benefit over the median interference of every candidate direction
(:func:`lam_auto`), each median from an integer sort of the values' bit patterns."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["lam_auto"]


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
