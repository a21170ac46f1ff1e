"""Thin SVD of LoRA updates from their factors (paper App. A.5), never forming the dense update."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from .._core.checks import check_bool, given, is_real_dtype, is_real_scalar
from .._core.linalg import mul_pow2, pow2_normalise, settle, svd
from .._core.tree import float_dtype
from ..errors import InputError, InputTypeError

__all__ = ["LoraSVD", "lora_svd"]

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
        if hasattr(x, "dtype") and hasattr(x, "shape"):
            dt = x.dtype
        else:
            try:
                dt = np.asarray(x).dtype
            except Exception:  # ragged lists and such: not an array at all
                dt = None
        if dt is None or not _is_floating(dt):
            what = f"has dtype {dt}" if dt is not None else f"is {given(x)}, not an array"
            raise InputTypeError(
                f"nu.lora_svd: {label} {what}; expected a floating dtype (bf16/fp16 are upcast "
                "to float32)."
            )
        dts.append(dt)
    return float_dtype(*dts)


def _is_floating(dt: object) -> bool:
    try:
        return bool(jnp.issubdtype(dt, jnp.floating))
    except TypeError:
        return False


@jax.jit
def _lora_svd(a: jax.Array, b: jax.Array, scale: jax.Array) -> tuple[LoraSVD, jax.Array]:
    # Scale safety: divide each factor and the scale by a power of two (exact) so that the QRs
    # and the r x r core see numbers of order one; the singular values get the power back.
    a, ea, na = pow2_normalise(a, (-2, -1))
    b, eb, nb = pow2_normalise(b, (-2, -1))
    scale, es, ns = pow2_normalise(scale, ())
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
    w, s, zt = svd(core)
    in_dirs = jnp.matmul(qa, w, precision=_HI)
    out_dirs = jnp.matmul(qb, jnp.swapaxes(zt, -1, -2), precision=_HI)
    s_top = s[..., :1] if s.shape[-1] else jnp.zeros((*s.shape[:-1], 1), s.dtype)
    s = mul_pow2(s, (ea + eb + es)[..., None])
    # (..., 4): non-finite entries of lora_a, lora_b, scale; the largest singular value is lost
    # to the dtype's range (it was nonzero in normalised units)
    fi = jnp.finfo(s.dtype)
    big = mul_pow2(s_top, (ea + eb + es)[..., None])[..., 0]
    lost = (s_top[..., 0] > 0) & ~((big >= fi.tiny) & (big <= fi.max))
    # a NaN/Inf input leaves the result undefined: NaN, never a plausible value (eager calls
    # raise instead; this is what a trace without checks returns)
    bad = (na + nb + ns) > 0
    s = jnp.where(bad[..., None], jnp.nan, s)
    in_dirs = jnp.where(bad[..., None, None], jnp.nan, in_dirs)
    out_dirs = jnp.where(bad[..., None, None], jnp.nan, out_dirs)
    return LoraSVD(in_dirs, s, out_dirs), jnp.stack([na, nb, ns, lost.astype(jnp.int32)], -1)


def _raise_bad(issues: np.ndarray, shapes: dict[str, tuple[int, ...]], dtype: np.dtype) -> None:
    """Eager checks of :func:`lora_svd`: non-finite inputs, then an unrepresentable result."""
    if not issues.any():
        return
    idx = np.argwhere(issues > 0)
    kinds = idx[:, -1]
    k = int(kinds.min())
    first = idx[kinds == k][0]
    batch = tuple(int(v) for v in first[:-1])
    where = f" at batch index {batch}" if batch else ""
    n_batch = int((issues[..., k] > 0).sum())
    more = f" ({n_batch} batch elements are affected)" if n_batch > 1 else ""
    if k < 3:
        label = ("lora_a", "lora_b", "scale")[k]
        count = int(issues[(*batch, k)])
        raise InputError(
            f"nu.lora_svd: {label} {shapes[label]} has {count} non-finite "
            f"{'entry' if count == 1 else 'entries'} (NaN or Inf){where}{more}, as seen in "
            f"{dtype.name} (a float64 value beyond float32's range counts: enable x64 to keep "
            "it). Fix the factors."
        )
    fi = np.finfo(dtype)
    raise InputError(
        f"nu.lora_svd: the largest singular value of scale * lora_a @ lora_b{where}{more} is "
        f"outside the range of {dtype.name} (normal numbers {fi.tiny:.1e} to {fi.max:.1e}); "
        "check the scale and the factors, or enable x64 (jax.config.update('jax_enable_x64', "
        "True)) and pass float64 inputs."
    )


def lora_svd(
    lora_a: ArrayLike, lora_b: ArrayLike, scale: ArrayLike = 1.0, *, checked: bool = False
) -> LoraSVD:
    """Thin SVD of ``dK = scale * lora_a @ lora_b`` from QR of both factors (paper App. A.5).

    With ``lora_a = Q_a R_a`` and ``lora_b.T = Q_b R_b`` (thin QR), ``dK = Q_a (scale R_a R_b^T) Q_b^T``;
    the SVD ``W S Z^T`` of the small core gives ``in_dirs = Q_a W``, ``s = S``, ``out_dirs = Q_b Z``.
    Cost ``O(r^2 (d_in + d_out))``; the ``(d_in, d_out)`` update is never formed. Scale-safe: the
    factors and the scale are first divided by exact powers of two, which ``s`` gets back at the
    end, so any finite inputs whose singular values fit the dtype work (entries of 1e20, a scale
    of 1e30).

    On concrete inputs the factors and scale must be finite and the largest singular value
    representable, else :class:`InputError`. Under a trace these checks are skipped: a batch
    element with a NaN/Inf input comes back all NaN, an unrepresentable ``s`` as ``inf`` or 0.
    Pass ``checked=True`` and wrap the caller in :func:`jax.experimental.checkify.checkify` to have
    them reported as checkify errors instead.

    Args:
      lora_a: ``(..., d_in, r)`` input factor (flax ``nnx.LoRA`` layout). Leading axes are batch
        axes, shared with ``lora_b``.
      lora_b: ``(..., r, d_out)`` output factor.
      scale: a real number or ``(...)`` real array of LoRA scales (PEFT's ``lora_alpha / r``).
      checked: under a trace, emit :mod:`jax.experimental.checkify` checks (see above).

    Returns:
      :class:`LoraSVD` with ``in_dirs (..., d_in, k)``, ``s (..., k)`` and ``out_dirs
      (..., d_out, k)``, ``k = min(r, d_in, d_out)``. bf16/fp16 inputs are upcast to float32;
      float64 inputs stay float64 when x64 is enabled.

    Raises:
      InputError: (a ``ValueError``) the factors do not chain or their batch axes differ; the
        scale does not broadcast to the batch axes; NaN/Inf in a factor or the scale; a largest
        singular value beyond the dtype's range.
      InputTypeError: (a ``TypeError``) a factor that is not a floating array; a scale that is not
        real (a string, a complex number, a bool); checked not a bool.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> a, b = rng.normal(size=(3, 64, 4)), rng.normal(size=(3, 4, 32))
      >>> u = nu.lora_svd(a, b, 0.5)
      >>> dk = 0.5 * a @ b
      >>> bool(np.allclose((u.in_dirs * u.s[..., None, :]) @ np.swapaxes(u.out_dirs, -1, -2), dk, atol=1e-4))
      True
      >>> big = nu.lora_svd(a * 1e20, b, 1e10)  # 1e30 times larger: same directions
      >>> bool(np.allclose(big.s / 1e30, u.s / 0.5, rtol=1e-5))
      True

    References:
      Amballa et al., "Not All Ranks Are Equal: Budget-Aware LoRA Merging Across Tasks", App. A.5.
    """
    checked = check_bool("nu.lora_svd", "checked", checked)
    dt = _float_dtype(lora_a=lora_a, lora_b=lora_b)
    with np.errstate(over="ignore"):  # values beyond the dtype become inf: reported below
        a = jnp.asarray(lora_a, dt)
        b = jnp.asarray(lora_b, dt)
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
        raise InputError(
            f"nu.lora_svd: lora_a {a.shape} and lora_b {b.shape} do not chain; expected lora_a "
            "(..., d_in, r) and lora_b (..., r, d_out) with the same leading axes. A PEFT "
            "checkpoint stores lora_A (r, d_in) and lora_B (d_out, r): transpose both."
        )
    if isinstance(scale, (bool, np.bool_, str, bytes, complex)) or not (
        is_real_scalar(scale) or (hasattr(scale, "dtype") and is_real_dtype(scale.dtype))
    ):
        raise InputTypeError(
            f"nu.lora_svd: scale={given(scale)}; expected a real number or a real array "
            "broadcastable to the batch axes (the LoRA scale)."
        )
    try:
        with np.errstate(over="ignore"):
            s = jnp.broadcast_to(jnp.asarray(scale, dt), a.shape[:-2])
    except ValueError:
        raise InputError(
            f"nu.lora_svd: scale of shape {tuple(np.shape(scale))} does not broadcast to the "
            f"batch axes {a.shape[:-2]} of lora_a {a.shape}."
        ) from None
    out, issues = _lora_svd(a, b, s)
    if not isinstance(out.s, jax.core.Tracer):
        # one LAPACK-using executable in flight at a time on CPU (see _linalg.settle)
        settle(out)
        shapes = {"lora_a": tuple(a.shape), "lora_b": tuple(b.shape), "scale": tuple(s.shape)}
        _raise_bad(np.asarray(issues), shapes, np.dtype(dt))
    elif checked:
        from jax.experimental import checkify

        flat = issues.reshape(-1, 4)
        for k, what in enumerate(("lora_a", "lora_b", "scale")):
            checkify.check(
                ~(flat[:, k] > 0).any(),
                f"nu.lora_svd: {what} has {{count}} non-finite entries (NaN or Inf).",
                count=flat[:, k].sum(),
            )
        checkify.check(
            ~(flat[:, 3] > 0).any(),
            "nu.lora_svd: the largest singular value is beyond the range of the dtype.",
        )
    return out
