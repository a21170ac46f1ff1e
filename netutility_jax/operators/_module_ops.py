"""Operations on single merged (or input) modules: densify, truncate, fold into base kernels.

A module is ``{"lora_a" (d_in, r), "lora_b" (r, d_out)[, "scale"]}`` (low rank) or
``{"delta": (d_in, d_out)}`` (dense), as :func:`nu.merge` returns them. Every function here
checks its module eagerly (2-D real arrays that chain, finite values) and computes on factors
normalised by powers of two, so extreme but finite scales give the right result wherever the
result itself is representable.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import checks as _checks
from .._core import tree as _tree
from .._core.linalg import mul_pow2
from ..errors import InputError, InputTypeError
from ..scoring.decompose import lora_svd
from . import spaces as _s
from ._plan import X64_HINT as _X64

__all__ = ["fold", "module_update", "to_lora"]


def _nonfinite_count(x: Any) -> int:
    """Non-finite entries of a concrete array (0 under a trace: checks are eager only)."""
    if isinstance(x, jax.core.Tracer):
        return 0
    if isinstance(x, jax.Array):
        return int(jnp.sum(~jnp.isfinite(x)))
    return int(np.sum(~np.isfinite(np.asarray(x))))


def _module_array(fn: str, where: str, label: str, x: Any) -> Any:
    """A module's 2-D real array (``delta``, ``lora_a``, ``lora_b``), checked eagerly: finite."""
    x = _tree.unwrap(x)
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        try:
            x = np.asarray(x)
        except Exception:  # ragged lists and such: not an array at all
            x = None
    try:
        real = x is not None and bool(
            jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)
        )
    except TypeError:
        real = False
    if not real:
        what = f"has dtype {x.dtype}" if x is not None else "is not an array"
        raise InputTypeError(f"{fn}: {where}{label} {what}; expected a real (floating) array.")
    if len(x.shape) != 2:
        want = {"lora_a": "d_in, r", "lora_b": "r, d_out"}.get(label, "d_in, d_out")
        raise InputError(f"{fn}: {where}{label} has shape {tuple(x.shape)}; expected 2-D ({want}).")
    n = _nonfinite_count(x)
    if n:
        raise InputError(
            f"{fn}: {where}{label} {tuple(x.shape)} has {n} non-finite "
            f"{'entry' if n == 1 else 'entries'} (NaN or inf) of {int(np.prod(x.shape))}; "
            "expected finite values."
        )
    return x


def _module_arrays(fn: str, module: Any, name: str | None, *, bare_ok: bool) -> tuple:
    """A merged (or input) module checked eagerly (shapes, dtypes, finite values):
    ``("delta", x)`` or ``("lora", a, b, scale)``."""
    where = f"module {_checks.short(name)!r}: " if name is not None else ""
    if _tree.is_mapping(module):
        keys = set(module.keys())
        if keys & {"lora_a", "lora_b"}:
            missing = sorted({"lora_a", "lora_b"} - keys)
            if missing:
                raise InputError(
                    f"{fn}: {where}the module has no {missing[0]!r}; a LoRA module needs both "
                    "'lora_a' (d_in, r) and 'lora_b' (r, d_out)."
                )
            a = _module_array(fn, where, "lora_a", module["lora_a"])
            b = _module_array(fn, where, "lora_b", module["lora_b"])
            if a.shape[1] != b.shape[0]:
                raise InputError(
                    f"{fn}: {where}lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} do not "
                    "chain; expected (d_in, r) and (r, d_out) (dK = lora_a @ lora_b)."
                )
            scale = _tree.unwrap(module["scale"]) if "scale" in keys else 1.0
            _checks.real_option(fn, f"{where}scale", scale, "a finite real number (the LoRA scale)")
            return "lora", a, b, scale
        if "delta" not in keys:
            raise InputError(
                f"{fn}: {where}expected {{'delta': (d_in, d_out)}} or a LoRA module {{'lora_a', "
                f"'lora_b'[, 'scale']}}; got keys {_checks.brief(sorted(map(str, keys)))}."
            )
        return "delta", _module_array(fn, where, "delta", module["delta"])
    if bare_ok:
        return "delta", _module_array(fn, where, "delta", module)
    raise InputTypeError(
        f"{fn}: {where}module is {_checks.given(module)}; expected {{'delta': (d_in, d_out)}} or a LoRA "
        "module {'lora_a', 'lora_b'[, 'scale']}."
    )


@jax.jit
def _lora_product(a, b, mant, exp):
    """``mant 2**exp a b`` without over- or underflow on the way: the factors are normalised by
    powers of two (exact) and the power comes back once, at the end."""
    a, ea, _, _ = _s.split_pow2(a, (0, 1))
    b, eb, _, _ = _s.split_pow2(b, (0, 1))
    return mul_pow2(mant * jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST), ea + eb + exp)


def _split_scale(scale: Any, dtype) -> tuple[jax.Array, jax.Array]:
    """``scale = mant 2**exp`` with ``|mant|`` in ``[0.5, 1)``; on the host in float64 for a
    concrete scale (so a scale beyond ``dtype``'s range still works), else traced."""
    if isinstance(scale, jax.core.Tracer):
        m, e = jnp.frexp(jnp.asarray(scale, dtype))
        return m, e.astype(jnp.int32)
    m, e = np.frexp(np.float64(np.asarray(scale, np.float64)))
    return jnp.asarray(m, dtype), jnp.asarray(e, jnp.int32)


def _update(kind: str, *arrs: Any) -> jax.Array:
    """The dense update of a checked module (:func:`_module_arrays`)."""
    if kind == "delta":
        return jnp.asarray(arrs[0])
    a, b, scale = arrs
    dt = _tree.float_dtype(a.dtype, b.dtype)
    m, e = _split_scale(scale, dt)
    return _lora_product(jnp.asarray(a, dt), jnp.asarray(b, dt), m, e)


def to_lora(module: Mapping[str, Any] | Any, rank: int) -> dict[str, Any]:
    """Best rank-``rank`` LoRA module of a merged module (truncated SVD, Eckart-Young).

    Args:
      module: ``{"delta": (d_in, d_out)}``, a dense ``(d_in, d_out)`` array, or a LoRA module
        ``{"lora_a", "lora_b"[, "scale"]}`` (truncated from its factors, never densified).
      rank: number of singular directions to keep (>= 0; capped at the module's rank).

    Returns:
      ``{"lora_a": (d_in, k), "lora_b": (k, d_out), "scale": 1.0}`` with ``lora_a = U_k S_k``.

    Raises:
      InputError: rank negative; arrays that are not 2-D or do not chain; a NaN or inf in any
        array or the scale (checked eagerly); a result beyond the dtype's range.
      InputTypeError: rank not an integer; an array of a non-real dtype.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> d = np.outer(np.arange(1.0, 5.0), np.ones(3))
      >>> m = nu.to_lora({"delta": d}, 2)
      >>> bool(np.allclose(m["lora_a"] @ m["lora_b"], d, atol=1e-4)), m["lora_a"].shape
      (True, (4, 2))
    """
    fn = "nu.to_lora"
    if isinstance(rank, (bool, np.bool_)) or not isinstance(rank, numbers.Integral):
        raise InputTypeError(f"{fn}: rank={_checks.given(rank)}; expected an integer >= 0.")
    if rank < 0:
        raise InputError(f"{fn}: rank={_checks.given(rank)}; expected an integer >= 0.")
    kind, *arrs = _module_arrays(fn, module, None, bare_ok=True)
    if kind == "lora":
        a, b, scale = arrs
        u = lora_svd(a, b, scale)  # scale-safe, and raises if s leaves the dtype's range
        k = min(int(rank), u.s.shape[-1])
        return {"lora_a": u.in_dirs[:, :k] * u.s[:k], "lora_b": u.out_dirs[:, :k].T, "scale": 1.0}
    (x,) = arrs
    x = jnp.asarray(x, _tree.float_dtype(x.dtype))
    k = min(int(rank), min(x.shape))
    la, lb, code = _truncated_svd(x, k)
    if not isinstance(code, jax.core.Tracer) and int(code):
        raise InputError(
            f"{fn}: U_k S_k of the {tuple(x.shape)} update is beyond the range of "
            f"{x.dtype.name} (its largest singular value exceeds {np.finfo(x.dtype).max:.3g}); "
            f"{_X64}."
        )
    return {"lora_a": la, "lora_b": lb, "scale": 1.0}


@functools.partial(jax.jit, static_argnums=(1,))
def _truncated_svd(x, k):
    """``(U_k S_k, V_k^T, not finite)`` of ``x``, computed on ``x`` normalised by a power of
    two (exact) so that no singular value overflows on the way."""
    y, e, _, _ = _s.split_pow2(x, (0, 1))
    u, s, vt = jnp.linalg.svd(y, full_matrices=False)
    la = mul_pow2(u[:, :k] * s[:k], e)
    return la, vt[:k], ~jnp.all(jnp.isfinite(la))


def module_update(module: Mapping[str, Any]) -> jax.Array:
    """Dense ``(d_in, d_out)`` update of a merged (or input) module: ``delta`` or ``scale a b``.

    ``scale a b`` is formed on factors normalised by powers of two (exact), so an extreme but
    finite scale or factor gives the right product wherever the product itself is representable.

    Raises:
      InputError: arrays that are not 2-D or do not chain, or hold a NaN or inf (eager check).
      InputTypeError: not a module, or an array of a non-real dtype.
    """
    return _update(*_module_arrays("nu.module_update", module, None, bare_ok=False))


_NNX_FOLD = "nu.nnx.apply_adapter(model, merged, mode='fold')"


def _nested_key(node: Any, key: str, depth: int = 3) -> tuple[str, ...] | None:
    """The path of the first ``key`` entry nested in ``node`` (this level's keys first, then
    each child's, at most ``depth`` levels down), for :func:`fold`'s message; None if none."""
    if depth == 0 or not _tree.is_mapping(node):
        return None
    keys = list(node.keys())
    if key in keys:
        return (str(key),)
    for k in keys:
        sub = _nested_key(node[k], key, depth - 1)
        if sub is not None:
            return (str(k), *sub)
    return None


def _no_kernel(fn: str, name: str, node: Any, kernel: str) -> str:
    """:func:`fold`'s message for params without a ``kernel`` entry at a module's path: where a
    kernel is (an ``nnx.LoRA``'s ``base_module/kernel``, an ``nnx.LoRALinear``'s parent), and the
    nnx route."""
    nm, k = _checks.short(name), _checks.brief(kernel)
    keys = _checks.brief(sorted(map(str, node.keys())))
    head = f"{fn}: params at {nm!r} has no {k} entry (its keys: {keys})"
    needs = (
        f"nu.fold needs each module's base kernel (d_in, d_out) at the module's path, as the "
        f"array or {{{k}: array}}"
    )
    try:
        nested = _nested_key(node, kernel)
    except Exception:  # a mapping that fails when read: the message still comes, without it
        nested = None
    if nested is not None:
        where = _checks.short("/".join((name, *nested)))
        return (
            f"{head}; its base kernel is nested at {where!r} (an nnx.LoRA's base_module). For "
            f"an nnx model use {_NNX_FOLD}, which folds into that kernel; {needs}."
        )
    if name == "lora" or name.endswith("/lora"):
        parent = name[: -len("lora")].rstrip("/")
        at = repr(_checks.short(f"{parent}/{kernel}")) if parent else f"{k} at the root"
        return (
            f"{head}; {nm!r} is an nnx.LoRALinear's lora child (a LoRA state merged directly "
            f"names it so) and its base kernel is its parent's, {at}. Merge "
            "nu.nnx.extract_adapter(state) of each task (modules named by layer), or for an nnx "
            f"model use {_NNX_FOLD}."
        )
    return f"{head}; {needs}. For an nnx model use {_NNX_FOLD}."


def fold(params: Any, merged: Any, *, kernel: str = "kernel", coef: float = 1.0) -> Any:
    """Add a merged adapter to a pytree of base kernels, for evaluation: ``W + coef * dK``.

    ``params`` mirrors the adapter's module paths: at each module's path it holds either a mapping
    with a ``kernel`` entry ``(d_in, d_out)`` (flax layout) or the kernel array itself; a flat dict
    keyed by module name works too. Modules may be low rank (``lora_a``/``lora_b``/``scale``) or
    dense (``delta``). Returns a new pytree; other leaves are shared, nothing is mutated. The
    result keeps each kernel's dtype.

    Raises:
      InputError: a module path missing from ``params``, a kernel whose shape differs from the
        module's ``(d_in, d_out)``, a NaN or inf in a module, its scale or its base kernel, a
        non-finite ``coef``, or a folded kernel beyond its dtype's range (all checked eagerly).
      InputTypeError: ``coef`` not a real number, ``kernel`` not a string, arrays of a non-real
        dtype.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> params = {"q": {"kernel": np.zeros((4, 3)), "bias": np.zeros(3)}}
      >>> merged = {"q": {"lora_a": np.ones((4, 1)), "lora_b": np.ones((1, 3)), "scale": 2.0}}
      >>> float(nu.fold(params, merged)["q"]["kernel"].sum())
      24.0
    """
    fn = "nu.fold"
    if not isinstance(kernel, str):
        raise InputTypeError(
            f"{fn}: kernel={_checks.given(kernel)}; expected a string (the key of the base kernel in "
            "each module's params, e.g. 'kernel')."
        )
    coef = _checks.real_option(
        fn, "coef", coef, "a finite real number (the merged update's coefficient)"
    )
    mods: dict[str, Mapping[str, Any]] = {
        "/".join(path): node
        for path, node in _tree.walk_modules(merged, is_module=_tree.has_update, max_depth=None)
        if node is not None and _tree.is_mapping(node) and _tree.has_update(node)
    }
    if not mods:
        raise InputError(f"{fn}: merged adapter has no modules ('lora_a'/'lora_b' or 'delta').")

    def add(target, name, mod):
        d = _update(*_module_arrays(fn, mod, name, bare_ok=False))
        w = _module_array(fn, f"module {_checks.short(name)!r}: ", "base kernel", target)
        if tuple(w.shape) != tuple(d.shape):
            raise InputError(
                f"{fn}: module {_checks.short(name)!r}: base kernel has shape {tuple(w.shape)} but "
                f"the update is (d_in, d_out) = {tuple(d.shape)}; kernels use the flax layout "
                "(d_in, d_out)."
            )
        w = jnp.asarray(w)
        out = w + (coef * d).astype(w.dtype)
        if _nonfinite_count(out):
            big = float(jnp.max(jnp.abs(d), initial=0)) * abs(float(coef))
            raise InputError(
                f"{fn}: module {_checks.short(name)!r}: W + coef * dK is not finite in "
                f"{w.dtype.name} (|coef * dK| reaches {big:.3g}; {w.dtype.name} holds at most "
                f"{float(jnp.finfo(w.dtype).max):.3g}); use a smaller coef or a wider kernel "
                "dtype."
            )
        return out

    def put(node, path, name, mod):
        if not path:
            if _tree.is_mapping(node):
                if kernel not in node.keys():
                    raise InputError(_no_kernel(fn, name, node, kernel))
                out = dict(node)
                out[kernel] = add(node[kernel], name, mod)
                return out
            return add(node, name, mod)
        if not _tree.is_mapping(node) or path[0] not in node.keys():
            raise InputError(
                f"{fn}: module {_checks.short(name)!r} has no counterpart in params (missing key "
                f"{_checks.brief(path[0])}); params must mirror the adapter's module paths."
            )
        out = dict(node)
        out[path[0]] = put(node[path[0]], path[1:], name, mod)
        return out

    out = params
    for name, mod in mods.items():
        if _tree.is_mapping(out) and name in out.keys():
            out = dict(out)
            out[name] = put(out[name], (), name, mod)
        else:
            out = put(out, tuple(name.split("/")), name, mod)
    return out
