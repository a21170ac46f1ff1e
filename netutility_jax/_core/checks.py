"""Checks of user-given values, and the short renderings error messages use.

One helper per kind of value (a choice among strings, a real bool, a finite real number in a
range, ``"auto"`` or a number), shared by every public function and by the method registry
(:mod:`netutility_jax.registry`), so that the same mistake gets the same message everywhere:
``fn: name=<value> (<type>); expected <what>.`` Options are never taken by their truthiness: a
string is not a bool and a bool is not a number.

Messages quote user values through :func:`brief` (a ``repr`` cut to a few dozen characters) and
module names through :func:`short` / :func:`few`, since both can come from user files.
"""

from __future__ import annotations

import numbers
import operator
import os
import reprlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InputError, InputTypeError
from .tables import MaskTable

__all__ = [
    "NONFINITE_ARRAYS",
    "as_integer",
    "brief",
    "check_auto",
    "check_bool",
    "check_budget",
    "check_choice",
    "check_masks",
    "check_real",
    "check_weights_sequence",
    "few",
    "given",
    "is_real_dtype",
    "is_real_scalar",
    "raise_nonfinite",
    "real_option",
    "real_value",
    "short",
    "size_text",
]

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def caller_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` for the first frame outside the library, from the
    function that calls this one (so a warning names the user's line however many of the
    library's frames, e.g. a wrapper, lie between)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def brief(x: Any) -> str:
    """``repr(x)`` cut to a few dozen characters (user values can be huge, hostile, or both)."""
    try:
        shape = getattr(x, "shape", None)
        if shape is not None and hasattr(x, "dtype") and len(shape) > 0:
            return f"<{type(x).__name__} of shape {tuple(shape)}, dtype {x.dtype}>"
        return _REPR.repr(x)
    except Exception:  # a repr that fails is still reported, by its type
        return f"<{type(x).__name__}>"


def short(name: str, n: int = 80) -> str:
    """A module name cut to ``n`` characters (keys come from user files)."""
    name = str(name)
    return name if len(name) <= n else f"{name[: n // 2]}...{name[-(n // 2 - 3) :]}"


def few(xs: Sequence[str], n: int = 3) -> str:
    """``module 'a'`` / ``modules 'a', 'b', 'c' and 17 more``: error messages stay short."""
    xs = list(xs)
    shown = ", ".join(repr(short(x)) for x in xs[:n])
    more = f" and {len(xs) - n} more" if len(xs) > n else ""
    return f"module{'s' if len(xs) > 1 else ''} {shown}{more}"


def given(x: Any) -> str:
    """What the user passed, for a message: a short repr and its type."""
    return f"{brief(x)} ({type(x).__name__})"


def is_real_dtype(dt: Any) -> bool:
    """Integer or floating (not bool, complex, string or object)."""
    try:
        dt = np.dtype(dt)
    except TypeError:
        return False
    return bool(jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer))


def is_real_scalar(x: Any) -> bool:
    """A real number: a Python/numpy int or float (not bool, complex or str), or a 0-d array of
    integer or floating dtype (a tracer too)."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, numbers.Real) and not isinstance(x, np.ndarray):
        return True
    return (
        hasattr(x, "shape")
        and hasattr(x, "dtype")
        and tuple(x.shape) == ()
        and is_real_dtype(x.dtype)
    )


def check_real(fn: str, name: str, x: Any, expected: str) -> None:
    """An option that must be a real number (see :func:`is_real_scalar`): else
    :class:`InputTypeError` naming the option, the value and its type."""
    if not is_real_scalar(x):
        raise InputTypeError(f"{fn}: {name}={given(x)}; expected {expected}.")


def real_value(x: Any) -> float | None:
    """The float value of a real scalar option, or None under a trace."""
    return None if isinstance(x, jax.core.Tracer) else float(np.asarray(x, np.float64))


def check_bool(fn: str, name: str, x: Any) -> bool:
    """A real ``bool`` (numpy's too); anything else (``"no"``, 0, None) is an
    :class:`InputTypeError`: options are never taken by truthiness."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    raise InputTypeError(f"{fn}: {name}={given(x)}; expected True or False.")


def check_choice(fn: str, name: str, value: Any, choices: Sequence[str], why: str = "") -> str:
    """A string option from a fixed set (``why`` is appended to the list of choices)."""
    if not isinstance(value, str):
        raise InputTypeError(f"{fn}: {name}={given(value)}; expected one of {tuple(choices)}{why}.")
    if value not in choices:
        raise InputError(f"{fn}: {name}={given(value)}; expected one of {tuple(choices)}{why}.")
    return value


def real_option(
    fn: str,
    name: str,
    value: Any,
    expected: str,
    ok: Callable[[float], bool] | None = None,
    *,
    traced: bool = True,
) -> Any:
    """A finite real scalar (see :func:`is_real_scalar`) for which ``ok(float)`` holds, returned
    as a float; a tracer is returned as it is if ``traced`` (it may reach a compiled kernel as
    data), else refused (the value sets something on the host, such as a count)."""
    check_real(fn, name, value, expected)
    if isinstance(value, jax.core.Tracer):
        if traced:
            return value
        raise InputTypeError(
            f"{fn}: {name} is traced (inside jax.jit); it must be a concrete number, since it "
            f"sets a count on the host: pass {expected} as a static Python value."
        )
    v = float(np.asarray(value, np.float64))
    if not np.isfinite(v) or (ok is not None and not ok(v)):
        raise InputError(f"{fn}: {name}={given(value)}; expected {expected}.")
    return v


def check_auto(fn: str, name: str, value: Any, expected: str) -> Any:
    """``"auto"`` or a finite real number >= 0 (``alpha``, ``lam``); a tracer passes as it is."""
    if isinstance(value, str):
        if value != "auto":
            raise InputError(f"{fn}: {name}={given(value)}; expected {expected}.")
        return value
    return real_option(fn, name, value, expected, lambda v: v >= 0)


def as_integer(x: Any) -> int | None:
    """``x`` as a Python int if it is an integer (a Python or numpy int, not a bool), else None.

    Example:
      >>> as_integer(np.int64(3)), as_integer(True), as_integer(2.0)
      (3, None, None)
    """
    if isinstance(x, (bool, np.bool_)):
        return None
    try:
        return int(operator.index(x))
    except TypeError:
        return None


def check_budget(fn: str, budget: Any) -> int:
    """``budget`` (R, directions per module on average) as a positive Python int.

    Raises:
      InputTypeError: not an integer (a bool, a float, a string...).
      InputError: an integer <= 0.
    """
    value = as_integer(budget)
    if value is None:
        raise InputTypeError(
            f"{fn}: budget={given(budget)}; expected a positive "
            "integer R (a Python or numpy int), the average number of directions kept per module."
        )
    if value <= 0:
        raise InputError(
            f"{fn}: budget={value}; expected a positive integer (directions per module)."
        )
    return value


def check_masks(fn: str, masks: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
    """The ``{name: bool (M, r_max)}`` masks of :func:`nu.allocate` as numpy bool arrays,
    validated (``fn`` names the caller in messages)."""
    if not isinstance(masks, Mapping):
        raise InputTypeError(
            f"{fn}: masks is a {type(masks).__name__}; expected the {{name: bool (M, r_max)}} "
            "masks returned by nu.allocate."
        )
    if not masks:
        raise InputError(
            f"{fn}: masks is empty; expected the {{name: bool (M, r_max)}} masks returned by "
            "nu.allocate (one entry per module)."
        )
    if (
        isinstance(masks, MaskTable) and masks.pristine
    ):  # nu.allocate's own masks, on the host already
        return masks.host_dict()
    out: dict[str, np.ndarray] = {}
    bad_type: list = []
    bad_shape: list = []
    for k, v in masks.items():
        if isinstance(v, jax.core.Tracer) or not (hasattr(v, "dtype") and hasattr(v, "shape")):
            bad_type.append(k)
            continue
        try:
            is_bool = np.dtype(v.dtype) == np.bool_
        except TypeError:
            is_bool = False
        if not is_bool:
            bad_type.append(k)
        elif len(v.shape) != 2:
            bad_shape.append(k)
        else:
            out[k] = np.asarray(v)
    if bad_type:
        first = masks[bad_type[0]]
        what = getattr(first, "dtype", type(first).__name__)
        raise InputTypeError(
            f"{fn}: the masks of {few(bad_type)} are not concrete bool arrays (the first "
            f"is {what}); expected the {{name: bool (M, r_max)}} masks returned by nu.allocate "
            "(cast 0/1 arrays with .astype(bool))."
        )
    if bad_shape:
        raise InputError(
            f"{fn}: the masks of {few(bad_shape)} are not 2-D (the first has shape "
            f"{tuple(masks[bad_shape[0]].shape)}); expected (M, r_max) per module."
        )
    return out


def size_text(n: float) -> str:
    """A byte count for people: ``"512 bytes"``, ``"3.41 MB"`` (powers of 1000, up to TB)."""
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def check_weights_sequence(fn: str, weights: Any, m_tasks: int) -> None:
    """:class:`InputTypeError` unless ``weights`` is a sequence (or array): what
    :func:`check_weights` and the traced merge (whose values cannot be read) both check."""
    if isinstance(weights, (str, bytes, Mapping)) or not hasattr(weights, "__len__"):
        raise InputTypeError(
            f"{fn}: weights={given(weights)}; expected a sequence of {m_tasks} numbers, "
            "one per task."
        )


NONFINITE_ARRAYS = ("lora_a", "lora_b", "scale")


def raise_nonfinite(fn: str, buckets: Sequence[Any], counts: Sequence[Any], *, dtype: Any) -> None:
    """Raise :class:`InputError` for the first non-finite input, if any.

    Args:
      buckets: the buckets of :func:`..tree.collect` (their names and modules).
      counts: per bucket, ``(n, M, 3)`` ints: non-finite entries of ``lora_a``, ``lora_b`` and
        ``scale`` of each module and task, as seen in the compute ``dtype`` (a float64 value
        beyond float32's range counts: the message says so).
    """
    hits = [
        (bk, np.asarray(c)) for bk, c in zip(buckets, counts, strict=True) if np.asarray(c).any()
    ]
    if not hits:
        return
    bk, c = hits[0]
    n, i, k = (int(v) for v in np.argwhere(c > 0)[0])
    m = bk.modules[n][i]
    label = NONFINITE_ARRAYS[k]
    raw = np.asarray(getattr(m, label))
    size = raw.size
    count = int(c[n, i, k])
    as64 = np.asarray(raw, np.float64) if is_real_dtype(raw.dtype) else None
    if as64 is not None and np.isfinite(as64).all():
        big = float(np.max(np.abs(as64)))
        where = (
            f"scale = {float(as64):.3g} is"
            if label == "scale"
            else f"{label} has {count} {'entry' if count == 1 else 'entries'} (largest |{label}| "
            f"= {big:.3g})"
        )
        what = (
            f"{where} beyond the range of {np.dtype(dtype).name}. Enable x64 "
            "(jax.config.update('jax_enable_x64', True)) and pass float64 factors, or rescale "
            "them (move a power of two between lora_a, lora_b and scale)."
        )
    else:
        what = (
            f"{label} has {count} non-finite {'entry' if count == 1 else 'entries'} (NaN or Inf)"
            f"{f' of {size}' if size > 1 else ''}. Fix or retrain that adapter."
        )
    bad = [nm for bk2, c2 in hits for nm, row in zip(bk2.names, c2, strict=True) if row.any()]
    pairs = sum(int((c2.sum(-1) > 0).sum()) for _, c2 in hits)
    more = (
        f" In all, {pairs} (module, task) pairs have such entries, in {few(bad)}."
        if pairs > 1
        else ""
    )
    raise InputError(
        f"{fn}: module {short(bk.names[n])!r}, task {i} (lora_a {tuple(m.lora_a.shape)}, lora_b "
        f"{tuple(m.lora_b.shape)}): {what}{more}"
    )
