"""Thin SVD of LoRA updates from their factors (paper App. A.5), never forming the dense update."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from ._tree import float_dtype
from .errors import InputError, InputTypeError

_HI = jax.lax.Precision.HIGHEST


class LoraSVD(NamedTuple):
    """Thin SVD ``dK = in_dirs @ diag(s) @ out_dirs.T`` of a LoRA update in kernel layout.

    Attributes:
      in_dirs: ``(..., d_in, k)`` orthonormal columns; the paper's input-side ``V``.
      s: ``(..., k)`` singular values, descending.
      out_dirs: ``(..., d_out, k)`` orthonormal columns; the paper's output-side ``U``.
    """

    in_dirs: jax.Array
    s: jax.Array
    out_dirs: jax.Array


def _float_dtype(**xs: ArrayLike) -> np.dtype:
    dts = []
    for label, x in xs.items():
        dt = np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype
        if not jnp.issubdtype(dt, jnp.floating):
            raise InputTypeError(
                f"nu.lora_svd: {label} has dtype {dt}; expected a floating dtype (bf16/fp16 are "
                "upcast to float32)."
            )
        dts.append(dt)
    return float_dtype(*dts)


@jax.jit
def _lora_svd(a: jax.Array, b: jax.Array, scale: jax.Array) -> LoraSVD:
    # Both QRs as ONE call on the zero-padded pair (padding rows add nothing to R): jaxlib 0.10's
    # CPU LAPACK kernels block on the thread pool they run on, and two running at once deadlock
    # a 2-thread pool (see utility.eigh_batched).
    d_in, d_out = a.shape[-2], b.shape[-1]
    d = max(d_in, d_out)
    if min(d_in, d_out) < a.shape[-1]:  # wide factor: thin QRs of different widths, call twice
        qa, ra = jnp.linalg.qr(a)
        qb, rb = jnp.linalg.qr(jnp.swapaxes(b, -1, -2) + 0 * jnp.sum(ra))
    else:
        pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, d - x.shape[-2]), (0, 0)])
        q, rr = jnp.linalg.qr(jnp.stack([pad(a), pad(jnp.swapaxes(b, -1, -2))]))
        qa, ra, qb, rb = q[0, ..., :d_in, :], rr[0], q[1, ..., :d_out, :], rr[1]
    core = scale[..., None, None] * jnp.matmul(ra, jnp.swapaxes(rb, -1, -2), precision=_HI)
    w, s, zt = jnp.linalg.svd(core, full_matrices=False)
    in_dirs = jnp.matmul(qa, w, precision=_HI)
    out_dirs = jnp.matmul(qb, jnp.swapaxes(zt, -1, -2), precision=_HI)
    return LoraSVD(in_dirs, s, out_dirs)


def lora_svd(lora_a: ArrayLike, lora_b: ArrayLike, scale: ArrayLike = 1.0) -> LoraSVD:
    """Thin SVD of ``dK = scale * lora_a @ lora_b`` from QR of both factors (paper App. A.5).

    With ``lora_a = Q_a R_a`` and ``lora_b.T = Q_b R_b`` (thin QR), ``dK = Q_a (scale R_a R_b^T) Q_b^T``;
    the SVD ``W S Z^T`` of the small core gives ``in_dirs = Q_a W``, ``s = S``, ``out_dirs = Q_b Z``.
    Cost ``O(r^2 (d_in + d_out))``; the ``(d_in, d_out)`` update is never formed.

    Args:
      lora_a: ``(..., d_in, r)`` input factor (flax ``nnx.LoRA`` layout). Leading axes are batch
        axes, shared with ``lora_b``.
      lora_b: ``(..., r, d_out)`` output factor.
      scale: scalar or ``(...)`` LoRA scale (PEFT's ``lora_alpha / r``).

    Returns:
      :class:`LoraSVD` with ``in_dirs (..., d_in, k)``, ``s (..., k)`` and ``out_dirs
      (..., d_out, k)``, ``k = min(r, d_in, d_out)``. bf16/fp16 inputs are upcast to float32;
      float64 inputs stay float64 when x64 is enabled.

    Raises:
      ValueError: if the factors do not chain or their batch axes differ.
      TypeError: if a factor is not floating point.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> a, b = rng.normal(size=(3, 64, 4)), rng.normal(size=(3, 4, 32))
      >>> u = nu.lora_svd(a, b, 0.5)
      >>> dk = 0.5 * a @ b
      >>> bool(np.allclose((u.in_dirs * u.s[..., None, :]) @ np.swapaxes(u.out_dirs, -1, -2), dk, atol=1e-4))
      True

    References:
      Amballa et al., "Not All Ranks Are Equal: Budget-Aware LoRA Merging Across Tasks", App. A.5.
    """
    dt = _float_dtype(lora_a=lora_a, lora_b=lora_b)
    a = jnp.asarray(lora_a, dt)
    b = jnp.asarray(lora_b, dt)
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
        raise InputError(
            f"nu.lora_svd: lora_a {a.shape} and lora_b {b.shape} do not chain; expected lora_a "
            "(..., d_in, r) and lora_b (..., r, d_out) with the same leading axes. A PEFT "
            "checkpoint stores lora_A (r, d_in) and lora_B (d_out, r): transpose both."
        )
    s = jnp.broadcast_to(jnp.asarray(scale, dt), a.shape[:-2])
    out = _lora_svd(a, b, s)
    if not isinstance(out.s, jax.core.Tracer):
        # one LAPACK-using executable in flight at a time (see utility.eigh_batched)
        jax.block_until_ready(out)
    return out
