"""One module's input moments (:class:`InputMoments`, a factor ``F`` of ``S = F^T F``) and how
they are made from samples or from a second moment already formed, checked (see
:mod:`netutility_jax.scoring.moments`, the public module)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core import tree as _tree
from .._core.checks import brief, short
from ..errors import InputError, InputTypeError

__all__ = ["InputMoments", "from_dense", "from_samples"]


class InputMoments(NamedTuple):
    """One module's input second moment ``S = factor^T factor`` (``E[x x^T]``, ``d_in x d_in``).

    Build it with :func:`input_moments` (from activations) or :func:`input_moments_dense` (from a
    formed ``S``); both check their input. Only ``S`` matters (any ``factor`` with the same
    ``factor^T factor`` gives the same scores), and only up to a positive factor: the score
    normalises each task by its own energy under its own ``S``.

    Attributes:
      factor: ``(k, d_in)``, ``S = factor^T factor``. From the helpers: ``k = n`` for ``n <=
        2 d_in`` samples, else ``d_in``; the rank of ``S`` from a dense ``S``.
    """

    factor: jax.Array

    @property
    def d_in(self) -> int:
        return int(np.shape(self.factor)[-1])

    def second_moment(self) -> np.ndarray:
        """``S = factor^T factor`` as a float64 numpy array ``(d_in, d_in)`` (for inspection)."""
        f = np.asarray(self.factor, np.float64)
        return f.T @ f


def _floating(fn: str, what: str, x: Any) -> tuple[np.ndarray, Any]:
    """``x`` as a float64 numpy array, and its own dtype."""
    x = _tree.unwrap(x)
    if isinstance(x, jax.core.Tracer):
        raise InputError(
            f"{fn}: {what} is a traced array (a call inside jax.jit or vmap); estimate the "
            "moments outside the transformation, from concrete activations."
        )
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise InputTypeError(f"{fn}: {what} is {brief(x)}; expected an array.")
    if not jax.dtypes.issubdtype(x.dtype, np.floating):
        raise InputTypeError(
            f"{fn}: {what} has dtype {x.dtype}; expected a floating array (float32, bfloat16...)."
        )
    return np.asarray(x, np.float64), x.dtype


def _out_dtype(*dtypes: Any) -> np.dtype:
    return _tree.float_dtype(*dtypes)


def from_samples(fn: str, name: str, x: Any) -> InputMoments:
    parts = list(x) if isinstance(x, (list, tuple)) else [x]
    if not parts:
        raise InputError(f"{fn}: module {short(name)!r} has an empty list of activations.")
    arrs, dtypes = zip(
        *(_floating(fn, f"the activations of module {short(name)!r}", p) for p in parts),
        strict=True,
    )
    d_ins = {a.shape[-1] if a.ndim else None for a in arrs}
    if any(a.ndim < 1 for a in arrs) or len(d_ins) != 1:
        shapes = ", ".join(str(tuple(a.shape)) for a in arrs[:4])
        raise InputError(
            f"{fn}: the activations of module {short(name)!r} have shapes {shapes}; expected "
            "arrays (..., d_in) with one d_in (the module's input width): leading axes (batch, "
            "sequence) are flattened into samples."
        )
    d_in = int(arrs[0].shape[-1])
    rows = np.concatenate([a.reshape(-1, d_in) for a in arrs])
    n = rows.shape[0]
    if n == 0 or d_in == 0:
        raise InputError(
            f"{fn}: the activations of module {short(name)!r} are empty (shape "
            f"{tuple(rows.shape)} after flattening the leading axes); pass at least one input."
        )
    bad = int((~np.isfinite(rows)).sum())
    if bad:
        raise InputError(
            f"{fn}: the activations of module {short(name)!r} ({n} samples x {d_in}) have {bad} "
            "non-finite entries (NaN or Inf); drop those samples (or fix the forward pass)."
        )
    if not rows.any():
        raise InputError(
            f"{fn}: the activations of module {short(name)!r} ({n} samples x {d_in}) are all "
            "zero: S = 0 says the layer sees no input, and every task's energy under it is 0. "
            "Check that these are the module's inputs (not a masked or padded batch)."
        )
    out = _out_dtype(*dtypes)
    rows = rows / np.sqrt(n)
    if n <= 2 * d_in:  # the samples themselves: S = X^T X / n, never formed
        return InputMoments(jnp.asarray(rows.astype(out)))
    # many more samples than d_in: a d_in x d_in factor of the float64 Gram (Cholesky; eigh where
    # S is singular, e.g. a dimension no input uses), the scoring cost then O(d_in^2 r)
    s = rows.T @ rows
    try:
        f = np.linalg.cholesky(s).T
    except np.linalg.LinAlgError:
        w, q = np.linalg.eigh(s)
        f = np.sqrt(np.clip(w, 0, None))[:, None] * q.T
    return InputMoments(jnp.asarray(f.astype(out)))


def from_dense(fn: str, name: str, s: Any) -> InputMoments:
    m, dtype = _floating(fn, f"the second moment of module {short(name)!r}", s)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] == 0:
        raise InputError(
            f"{fn}: the second moment of module {short(name)!r} has shape {tuple(m.shape)}; "
            "expected a square (d_in, d_in) matrix E[x x^T] (for activations (n, d_in) use "
            "nu.input_moments)."
        )
    d_in = m.shape[0]
    bad = int((~np.isfinite(m)).sum())
    if bad:
        raise InputError(
            f"{fn}: the second moment of module {short(name)!r} ({d_in} x {d_in}) has {bad} "
            "non-finite entries (NaN or Inf)."
        )
    scale = float(np.abs(m).max())
    if scale == 0:
        raise InputError(
            f"{fn}: the second moment of module {short(name)!r} ({d_in} x {d_in}) is zero: the "
            "layer would see no input. Pass None for that module to use the data-free geometry."
        )
    eps = float(np.finfo(_out_dtype(dtype)).eps)
    tol = 10 * d_in * eps * scale  # the rounding of a Gram X^T X formed in this dtype
    asym = float(np.abs(m - m.T).max())
    if asym > tol:
        raise InputError(
            f"{fn}: the second moment of module {short(name)!r} ({d_in} x {d_in}) is not "
            f"symmetric (max |S - S^T| = {asym:.3g}, max |S| = {scale:.3g}); expected E[x x^T]."
        )
    w, q = np.linalg.eigh(0.5 * (m + m.T))
    if w[0] < -tol:
        raise InputError(
            f"{fn}: the second moment of module {short(name)!r} ({d_in} x {d_in}) is not "
            f"positive semidefinite (smallest eigenvalue {w[0]:.3g}, largest {w[-1]:.3g}); "
            "expected E[x x^T]. A covariance with the mean subtracted is PSD too, but a "
            "difference of two moments, or a matrix in float16, may not be."
        )
    keep = w > tol
    if not keep.any():
        raise InputError(
            f"{fn}: the second moment of module {short(name)!r} ({d_in} x {d_in}) is zero up to "
            f"rounding (largest eigenvalue {w[-1]:.3g}); pass None for the data-free geometry."
        )
    f = np.sqrt(w[keep])[:, None] * q[:, keep].T  # f^T f = S, rank(S) rows
    return InputMoments(jnp.asarray(f.astype(_out_dtype(dtype))))
