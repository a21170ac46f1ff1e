"""What a method kernel returned, checked: shapes and dtypes while tracing
(:func:`check_low_rank_output`, :func:`check_elementwise_output`), its non-finite entries as a
status word, and whether a merged module is representable in the dtype (:func:`range_status`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._core import checks as _checks
from .._core.linalg import column_norms
from .._core.linalg import t as _t
from ..errors import InputError, InputTypeError

__all__ = [
    "KERNEL_FINITE",
    "KERNEL_INF",
    "KERNEL_NAN",
    "RANGE_KERNEL_NAN",
    "check_elementwise_output",
    "check_low_rank_output",
    "kernel_status",
    "log2_norm",
    "range_status",
    "with_kernel_status",
]

#: :func:`kernel_status` codes: the kernel's output of a module is finite, holds an inf (and no
#: NaN), holds a NaN.
KERNEL_FINITE, KERNEL_INF, KERNEL_NAN = 0, 1, 2


def kernel_status(y):
    """Per module (leading axis) of a kernel's output ``y (n, p, k)``: :data:`KERNEL_FINITE`,
    :data:`KERNEL_INF` or :data:`KERNEL_NAN`, from one reduction (the largest ``|y|``, which a
    NaN anywhere makes NaN and an inf makes inf)."""
    top = jnp.max(jnp.abs(y), axis=(-2, -1), initial=0)
    return jnp.where(
        jnp.isnan(top), KERNEL_NAN, jnp.where(jnp.isinf(top), KERNEL_INF, KERNEL_FINITE)
    ).astype(jnp.int32)


def _kernel_fault(method: str, kind: str, got: str, want: str, *, type_error: bool = False):
    cls = InputTypeError if type_error else InputError
    return cls(
        f"nu.merge: method {method!r}: its {kind} kernel returned {got}; expected {want}. The "
        f"kernel declared for {method!r} (netutility_jax.registry.MethodSpec.kernel) must "
        "return that form (see the registry's module docstring)."
    )


def _dims(*xs) -> str:
    """``(1, 16, K)``: a shape with named dimensions, for messages."""
    return f"({', '.join(map(str, xs))})"


def check_low_rank_output(method: str, ca, cb, out) -> tuple[jax.Array, jax.Array]:
    """A low-rank kernel's output ``out`` for tasks ``ca (..., M, p, r)``, ``cb (..., M, q, r)``:
    a pair ``(a (..., p, K), b (..., q, K))`` of the inputs' dtype, or an error naming the method
    (shapes are static: checked while tracing, at no run-time cost)."""
    lead, p, q = ca.shape[:-3], ca.shape[-2], cb.shape[-2]
    want = f"a {_dims(*lead, p, 'K')} and b {_dims(*lead, q, 'K')} (the same K)"
    tasks = f" for tasks a {tuple(ca.shape)}, b {tuple(cb.shape)}"
    if not (
        isinstance(out, (tuple, list))
        and len(out) == 2
        and all(hasattr(y, "shape") and hasattr(y, "dtype") for y in out)
    ):
        got = (
            f"an array of shape {tuple(out.shape)}" if hasattr(out, "shape") else _checks.given(out)
        )
        raise _kernel_fault(method, "low-rank", got, f"a pair (a, b): {want}{tasks}")
    am, bm = out
    sa, sb = tuple(am.shape), tuple(bm.shape)
    if not (
        len(sa) == len(sb) == len(lead) + 2
        and sa[:-2] == sb[:-2] == tuple(lead)
        and (sa[-2], sb[-2]) == (p, q)
        and sa[-1] == sb[-1]
    ):
        raise _kernel_fault(method, "low-rank", f"a {sa}, b {sb}", want + tasks)
    if am.dtype != ca.dtype or bm.dtype != ca.dtype:
        raise _kernel_fault(
            method, "low-rank", f"dtypes ({am.dtype}, {bm.dtype})",
            f"{ca.dtype} (its inputs' dtype)", type_error=True,
        )  # fmt: skip
    return am, bm


def check_elementwise_output(method: str, x, out) -> jax.Array:
    """An elementwise kernel's output ``out`` for dense tasks ``x (n, M, p, q)``: an array
    ``(n, p, q)`` of ``x``'s dtype, or an error naming the method (checked while tracing)."""
    n, _, p, q = x.shape
    if not (hasattr(out, "shape") and hasattr(out, "dtype")):
        raise _kernel_fault(
            method, "elementwise", _checks.given(out), f"an array ({n}, {p}, {q}) (n, p, q)"
        )
    if tuple(out.shape) != (n, p, q):
        raise _kernel_fault(
            method, "elementwise", f"shape {tuple(out.shape)} for tasks x of shape "
            f"{tuple(x.shape)}", f"{(n, p, q)} (n, p, q)",
        )  # fmt: skip
    if out.dtype != x.dtype:
        raise _kernel_fault(
            method, "elementwise", f"dtype {out.dtype}", f"{x.dtype} (its inputs' dtype)",
            type_error=True,
        )  # fmt: skip
    return out


def with_kernel_status(status, bad, check):
    """A bucket's range ``check`` with its kernel's :func:`kernel_status` folded in, for the
    modules whose inputs are finite (``bad (n, M, 3)`` all zero; the others are reported as bad
    inputs). An inf is an overflow (an extreme ``coef``): range code 1, as an overflow found
    later. A NaN is the kernel's fault: :data:`RANGE_KERNEL_NAN`, which
    :func:`_results.raise_range` reports naming the method and the modules. Without a NaN or an
    inf (the usual case) nothing is done on the device."""
    if status is None:
        return check
    code, log2 = check
    if isinstance(status, jax.core.Tracer) or isinstance(bad, jax.core.Tracer):
        ok = jnp.sum(bad, axis=(1, 2)) == 0
        code = jnp.where(ok & (status == KERNEL_INF), 1, code)
        code = jnp.where(ok & (status == KERNEL_NAN), RANGE_KERNEL_NAN, code).astype(code.dtype)
        return code, log2
    status = np.asarray(status)
    inputs_ok = ~np.asarray(bad).any(axis=(1, 2))
    over = (status == KERNEL_INF) & inputs_ok
    nan = (status == KERNEL_NAN) & inputs_ok
    if not (over.any() or nan.any()):
        return check
    fix = np.where(nan, RANGE_KERNEL_NAN, np.where(over, 1, 0)).astype(np.int32)
    return jnp.where(fix > 0, fix, code).astype(code.dtype), log2


#: :func:`range_status`'s code of a module whose method's kernel returned NaN for finite inputs
#: (folded in by :func:`with_kernel_status` and :func:`module_dense`).
RANGE_KERNEL_NAN = 3


def range_status(w, y, unit, axes):
    """Whether ``y = w 2**unit`` (per module, over ``axes``) is representable: ``(code (n,) int32,
    log2 (n,) float32)``; code 0 fine, 1 not finite, 2 underflow (``w`` is not zero but the
    largest ``|y|`` is below the dtype's smallest normal number: at best a few bits are left);
    ``log2`` is ``log2`` of the largest ``|y|`` that exact arithmetic would give."""
    wmax = jnp.max(jnp.abs(w), axis=axes, initial=0)
    finite = jnp.all(jnp.isfinite(y), axis=axes)
    log2 = jnp.log2(wmax).astype(jnp.float32) + unit.astype(jnp.float32)
    under = (wmax > 0) & (log2 < jnp.finfo(w.dtype).minexp)
    code = jnp.where(finite, jnp.where(under, 2, 0), 1).astype(jnp.int32)
    return code, log2


def log2_norm(x, axis):
    """``log2`` of the largest column norm of ``x (n, p, k)`` over ``axis`` (-2: columns, -1:
    rows), scale-safely; ``-inf`` for an all-zero module. An entry of ``Q x`` (``Q`` with
    orthonormal columns) is at most its column's norm, and at least one is ``norm / sqrt(p)``."""
    cols = column_norms(x if axis == -2 else _t(x))
    return jnp.log2(jnp.max(cols, axis=-1, initial=0)).astype(jnp.float32)
