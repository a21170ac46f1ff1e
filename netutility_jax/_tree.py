"""Adapter pytrees: finding LoRA modules, validating them, and grouping them into buckets.

An adapter is a pytree of nested mappings whose LoRA modules are mappings with the keys
``lora_a`` ``(d_in, r)``, ``lora_b`` ``(r, d_out)`` and an optional ``scale``. A module's name is
its "/"-joined key path. A task that lacks a module says so explicitly with ``None`` at that path.

Everything here is host-side bookkeeping on shapes: no array is read, so it is cheap and runs the
same under an outer ``jit``.
"""

from __future__ import annotations

import dataclasses
import numbers
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .errors import InputError, InputTypeError

MODULE_KEYS = frozenset({"lora_a", "lora_b", "scale"})
MAX_DEPTH = 64  # deeper nesting is not an adapter (and would exhaust Python's recursion limit)


@dataclasses.dataclass(frozen=True)
class Module:
    """One task's LoRA module: factors in kernel layout and the scale (arrays, not copied)."""

    lora_a: Any
    lora_b: Any
    scale: Any

    @property
    def d_in(self) -> int:
        return int(self.lora_a.shape[0])

    @property
    def d_out(self) -> int:
        return int(self.lora_b.shape[1])

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[1])


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Modules of equal ``(d_in, d_out, r_max)``; scored by one batched call.

    Attributes:
      names: module names, in adapter order.
      d_in, d_out, r_max: the common shapes (``r_max`` is the largest rank of any task).
      modules: ``modules[n][i]`` is task ``i``'s :class:`Module` in module ``names[n]``, or None.
    """

    names: tuple[str, ...]
    d_in: int
    d_out: int
    r_max: int
    modules: tuple[tuple[Module | None, ...], ...]


def _unwrap(x: Any) -> Any:
    # flax.nnx Variables (Param, LoRAParam) hold their array; `get_value` is the current accessor.
    if isinstance(x, (jax.Array, np.ndarray, np.generic, int, float)):
        return x
    if hasattr(x, "get_value"):
        return x.get_value()
    if hasattr(x, "value"):
        return x.value
    return x


def _is_mapping(x: Any) -> bool:
    return isinstance(x, Mapping) or (hasattr(x, "keys") and hasattr(x, "__getitem__"))


def flatten_modules(adapter: Any, *, fn: str, task: int) -> dict[str, Module | None]:
    """Map module name -> :class:`Module` (or None where the task lacks the module).

    Raises:
      InputTypeError: if ``adapter`` is not a mapping.
      InputError: on a leaf that is not part of a LoRA module, a module missing a factor, two
        modules of the same name, a cycle, or nesting deeper than :data:`MAX_DEPTH`. Names in
        messages are cut to 80 characters.
    """
    if not _is_mapping(adapter):
        raise InputTypeError(
            f"{fn}: adapter {task} is a {type(adapter).__name__}; expected a mapping (nested dicts) "
            "whose LoRA modules are dicts with 'lora_a' (d_in, r) and 'lora_b' (r, d_out)."
        )
    out: dict[str, Module | None] = {}
    ancestors: list[int] = []  # ids of the mappings on the current path (cycle detection)

    def walk(node: Any, path: tuple[str, ...]) -> None:
        name = "/".join(path)
        if len(path) > MAX_DEPTH:
            raise InputError(
                f"{fn}: adapter {task} is nested more than {MAX_DEPTH} levels deep at "
                f"{short(name)!r}; an adapter is a shallow tree of dicts whose LoRA modules are "
                "{'lora_a', 'lora_b'[, 'scale']} dicts."
            )
        if name in out:
            raise InputError(
                f"{fn}: adapter {task} has two modules named {short(name)!r} (a flat key containing "
                "'/' and a nested path spell the same name); rename one of them."
            )
        if node is None:
            if not path:
                raise InputError(f"{fn}: adapter {task} is None.")
            out[name] = None
            return
        if _is_mapping(node):
            keys = set(node.keys())
            if "lora_a" in keys or "lora_b" in keys:
                missing = {"lora_a", "lora_b"} - keys
                extra = keys - MODULE_KEYS
                if missing:
                    raise InputError(
                        f"{fn}: module {short(name)!r} of task {task} has no "
                        f"{sorted(missing)[0]!r}; a LoRA module needs both 'lora_a' (d_in, r) and "
                        "'lora_b' (r, d_out)."
                    )
                if extra:
                    raise InputError(
                        f"{fn}: module {short(name)!r} of task {task} has keys "
                        f"{brief(sorted(map(str, extra)))} besides "
                        "'lora_a', 'lora_b', 'scale'; pass only the LoRA part of the parameters "
                        "(nu.extract_lora(tree) keeps it)."
                    )
                out[name] = Module(
                    _unwrap(node["lora_a"]),
                    _unwrap(node["lora_b"]),
                    _unwrap(node.get("scale", 1.0)),
                )
                return
            if id(node) in ancestors:
                raise InputError(
                    f"{fn}: adapter {task} contains itself at {short(name)!r} (a cycle of "
                    "dicts); pass a tree of LoRA modules."
                )
            ancestors.append(id(node))
            for k in node.keys():
                walk(node[k], (*path, str(k)))
            ancestors.pop()
            return
        raise InputError(
            f"{fn}: adapter {task} has a leaf at {short(name)!r} ({type(node).__name__}) that is "
            "not part of a LoRA module; pass only LoRA modules (nu.extract_lora(tree) keeps them), "
            "or None for a module the task lacks."
        )

    walk(adapter, ())
    return out


def extract_lora(tree: Any) -> dict[str, Any]:
    """Keep only the LoRA modules of a parameter tree, as a flat dict keyed by module name.

    Useful on a full Flax parameter tree, where LoRA factors sit next to base kernels and biases.
    A mapping holding both ``lora_a`` and ``lora_b`` is a module; its ``scale`` is kept if present.

    Args:
      tree: nested mappings (dicts, ``flax.nnx.State``).

    Returns:
      ``{name: {"lora_a", "lora_b"[, "scale"]}}`` with "/"-joined key paths as names.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> tree = {"q": {"kernel": np.ones((4, 4)), "lora_a": np.ones((4, 2)), "lora_b": np.ones((2, 4))}}
      >>> list(nu.extract_lora(tree))
      ['q']
    """
    out: dict[str, Any] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if _is_mapping(node):
            if "lora_a" in node.keys() and "lora_b" in node.keys():
                mod = {"lora_a": _unwrap(node["lora_a"]), "lora_b": _unwrap(node["lora_b"])}
                if "scale" in node.keys():
                    mod["scale"] = _unwrap(node["scale"])
                out["/".join(path)] = mod
                return
            for k in node.keys():
                walk(node[k], (*path, str(k)))

    walk(tree, ())
    return out


def _is_real_dtype(dt: Any) -> bool:
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
        and _is_real_dtype(x.dtype)
    )


def check_real(fn: str, name: str, x: Any, expected: str) -> None:
    """An option that must be a real number (see :func:`is_real_scalar`): else
    :class:`InputTypeError` naming the option, the value and its type."""
    if not is_real_scalar(x):
        raise InputTypeError(f"{fn}: {name}={brief(x)} ({type(x).__name__}); expected {expected}.")


def real_value(x: Any) -> float | None:
    """The float value of a real scalar option, or None under a trace."""
    return None if isinstance(x, jax.core.Tracer) else float(np.asarray(x, np.float64))


def check_bool(fn: str, name: str, x: Any) -> bool:
    """A real ``bool`` (numpy's too); anything else (``"no"``, 0, None) is an
    :class:`InputTypeError`: options are never taken by truthiness."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    raise InputTypeError(f"{fn}: {name}={brief(x)} ({type(x).__name__}); expected True or False.")


def _check_module(fn: str, name: str, task: int, m: Module) -> None:
    a, b = m.lora_a, m.lora_b
    nm = short(name)
    for label, x in (("lora_a", a), ("lora_b", b)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise InputTypeError(
                f"{fn}: {label} of module {nm!r}, task {task}, is a {type(x).__name__}; "
                "expected an array."
            )
        if len(x.shape) != 2:
            raise InputError(
                f"{fn}: {label} of module {nm!r}, task {task}, has shape {tuple(x.shape)}; "
                f"expected 2-D ({'d_in, r' if label == 'lora_a' else 'r, d_out'})."
            )
        try:
            floating = bool(jnp.issubdtype(x.dtype, jnp.floating))
        except TypeError:
            floating = False
        if not floating:
            raise InputTypeError(
                f"{fn}: {label} of module {nm!r}, task {task}, has dtype {brief(x.dtype)}; "
                "expected a floating dtype (bf16/fp16 are upcast to float32)."
            )
    if a.shape[1] != b.shape[0]:
        raise InputError(
            f"{fn}: factors of module {nm!r}, task {task}, do not chain: lora_a {tuple(a.shape)} "
            f"is (d_in, r={a.shape[1]}) but lora_b {tuple(b.shape)} is (r={b.shape[0]}, d_out). "
            "Factors use the flax kernel layout (dK = lora_a @ lora_b); a PEFT checkpoint stores "
            "lora_A as (r, d_in) and lora_B as (d_out, r): transpose both (nu.peft.load_adapter "
            "does this)."
        )
    s = m.scale
    if hasattr(s, "shape") and hasattr(s, "dtype") and tuple(s.shape) != ():
        raise InputError(
            f"{fn}: scale of module {nm!r}, task {task}, has shape {tuple(s.shape)}; expected a "
            "scalar."
        )
    if not is_real_scalar(s):
        raise InputTypeError(
            f"{fn}: scale of module {nm!r}, task {task}, is {brief(s)} ({type(s).__name__}"
            f"{', dtype ' + str(s.dtype) if hasattr(s, 'dtype') else ''}); expected a real number "
            "(the LoRA scale lora_alpha / r), e.g. 2.0."
        )
    if not isinstance(s, jax.core.Tracer) and not np.isfinite(np.asarray(s, np.float64)):
        raise InputError(
            f"{fn}: scale of module {nm!r}, task {task} (lora_a {tuple(a.shape)}, lora_b "
            f"{tuple(b.shape)}), is {np.asarray(s)}; expected a finite LoRA scale (lora_alpha / r)."
        )


def collect(adapters: Sequence[Any], *, fn: str) -> tuple[list[str], list[Bucket], int]:
    """Validate M adapters and group their modules into buckets of equal shape.

    Returns:
      ``(names, buckets, M)``: module names in the first adapter's order, the buckets (modules in
      each bucket keep that order), and the number of tasks.

    Values are not read, except each scale (a scalar): the factors' finiteness is checked by
    the kernels that read them (see :func:`raise_nonfinite`).

    Raises:
      InputError: empty list, module names that differ between adapters (a few are named, and a
        count), factor shapes that do not chain, a module whose (d_in, d_out) differs across
        tasks, a module that no task has, a scale that is not a finite scalar.
      InputTypeError: non-array or non-floating factors, a scale that is not a real number (a
        string, a bool, a complex number...).
    """
    if isinstance(adapters, Mapping) or not isinstance(adapters, Sequence):
        raise InputTypeError(
            f"{fn}: expected a sequence of adapters (one per task), got {type(adapters).__name__}. "
            "Wrap a single adapter in a list: [adapter]."
        )
    if len(adapters) == 0:
        raise InputError(f"{fn}: the adapter list is empty; pass one adapter per task (M >= 1).")
    flat = [flatten_modules(ad, fn=fn, task=i) for i, ad in enumerate(adapters)]
    names = list(flat[0])
    if not names:
        raise InputError(f"{fn}: adapter 0 has no LoRA modules ('lora_a'/'lora_b' dicts).")
    ref = set(names)
    for i, f in enumerate(flat[1:], start=1):
        if set(f) != ref:
            missing = sorted(ref - set(f))
            extra = sorted(set(f) - ref)
            parts = []
            if missing:
                parts.append(f"task {i} lacks {_few(missing)} that task 0 has")
            if extra:
                parts.append(f"task {i} has {_few(extra)} that task 0 lacks")
            raise InputError(
                f"{fn}: module names differ between adapters: {'; '.join(parts)}. Adapters must "
                "come from the same base model with the same target modules; where a task really "
                "lacks a module, put None at that name."
            )
    m_tasks = len(flat)
    groups: dict[tuple[int, int, int], list[tuple[str, tuple[Module | None, ...]]]] = {}
    for name in names:
        mods = tuple(f[name] for f in flat)
        present = [(i, m) for i, m in enumerate(mods) if m is not None]
        if not present:
            raise InputError(
                f"{fn}: module {short(name)!r} is None in every task; drop it from the adapters."
            )
        for i, m in present:
            _check_module(fn, name, i, m)
        i0, m0 = present[0]
        for i, m in present[1:]:
            if (m.d_in, m.d_out) != (m0.d_in, m0.d_out):
                raise InputError(
                    f"{fn}: module {short(name)!r} has update shape (d_in, d_out) = ({m0.d_in}, "
                    f"{m0.d_out}) in task {i0} (lora_a {tuple(m0.lora_a.shape)}, lora_b "
                    f"{tuple(m0.lora_b.shape)}) but ({m.d_in}, {m.d_out}) in task {i} (lora_a "
                    f"{tuple(m.lora_a.shape)}, lora_b {tuple(m.lora_b.shape)}); the adapters must "
                    "target the same base model."
                )
        r_max = max(m.rank for _, m in present)
        groups.setdefault((m0.d_in, m0.d_out, r_max), []).append((name, mods))
    buckets = [
        Bucket(
            names=tuple(n for n, _ in items),
            d_in=k[0],
            d_out=k[1],
            r_max=k[2],
            modules=tuple(mods for _, mods in items),
        )
        for k, items in groups.items()
    ]
    return names, buckets, m_tasks


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


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


def _few(xs: Sequence[str], n: int = 3) -> str:
    """``module 'a'`` / ``modules 'a', 'b', 'c' and 17 more``: error messages stay short."""
    xs = list(xs)
    shown = ", ".join(repr(short(x)) for x in xs[:n])
    more = f" and {len(xs) - n} more" if len(xs) > n else ""
    return f"module{'s' if len(xs) > 1 else ''} {shown}{more}"


NONFINITE_ARRAYS = ("lora_a", "lora_b", "scale")


def raise_nonfinite(
    fn: str, buckets: Sequence[Bucket], counts: Sequence[Any], *, dtype: Any
) -> None:
    """Raise :class:`InputError` for the first non-finite input, if any.

    Args:
      buckets: the buckets of :func:`collect`.
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
    as64 = np.asarray(raw, np.float64) if _is_real_dtype(raw.dtype) else None
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
        f" In all, {pairs} (module, task) pairs have such entries, in {_few(bad)}."
        if pairs > 1
        else ""
    )
    raise InputError(
        f"{fn}: module {short(bk.names[n])!r}, task {i} (lora_a {tuple(m.lora_a.shape)}, lora_b "
        f"{tuple(m.lora_b.shape)}): {what}{more}"
    )


def float_dtype(*dtypes: Any) -> np.dtype:
    """float64 if any input is float64 and x64 is enabled, else float32 (bf16/fp16 upcast).

    Decided on canonicalized dtypes, so float64 numpy inputs without x64 give float32 without a
    truncation warning, and no implicit promotion happens (safe under strict dtype promotion).
    """
    f64 = any(jax.dtypes.canonicalize_dtype(d) == np.float64 for d in dtypes)
    return np.dtype(np.float64 if f64 else np.float32)


def compute_dtype(buckets: Sequence[Bucket]) -> np.dtype:
    """The compute dtype of a set of buckets (see :func:`float_dtype`)."""
    return float_dtype(
        *(
            d
            for bk in buckets
            for mods in bk.modules
            for m in mods
            if m is not None
            for d in (m.lora_a.dtype, m.lora_b.dtype)
        )
    )


def bucket_arrays(bucket: Bucket) -> tuple[Any, Any, Any]:
    """The raw per-(module, task) leaves of a bucket, as nested tuples for a jitted stack."""
    a = tuple(tuple(None if m is None else m.lora_a for m in mods) for mods in bucket.modules)
    b = tuple(tuple(None if m is None else m.lora_b for m in mods) for mods in bucket.modules)
    s = tuple(tuple(0.0 if m is None else m.scale for m in mods) for mods in bucket.modules)
    return a, b, s


def _padders(d_in: int, d_out: int, r_max: int, dtype: Any):
    """Zero-padding of one ``lora_a`` to ``(d_in, r_max)`` and one ``lora_b`` to ``(r_max, d_out)``
    (None, a task lacking the module, gives zeros)."""

    def pad_a(x):
        if x is None:
            return jnp.zeros((d_in, r_max), dtype)
        return jnp.pad(jnp.asarray(x, dtype), ((0, 0), (0, r_max - x.shape[1])))

    def pad_b(x):
        if x is None:
            return jnp.zeros((r_max, d_out), dtype)
        return jnp.pad(jnp.asarray(x, dtype), ((0, r_max - x.shape[0]), (0, 0)))

    return pad_a, pad_b


def _scales_ranks(a: Any, s: Any, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``scale (n, M)`` and ``rank (n, M)`` int32 (0 where a task lacks the module)."""
    S = jnp.stack([jnp.stack([jnp.asarray(x, dtype) for x in row]) for row in s])
    R = np.array([[0 if x is None else x.shape[1] for x in row] for row in a], np.int32)
    return S, jnp.asarray(R)


def stack_bucket(
    a: Any, b: Any, s: Any, *, d_in: int, d_out: int, r_max: int, dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Stack (and zero-pad to r_max) the leaves of :func:`bucket_arrays` (traceable).

    Returns:
      ``a (n, M, d_in, r_max)``, ``b (n, M, r_max, d_out)``, ``scale (n, M)``, ``rank (n, M)``
      (int32, 0 where a task lacks the module).
    """

    pad_a, pad_b = _padders(d_in, d_out, r_max, dtype)
    A = jnp.stack([jnp.stack([pad_a(x) for x in row]) for row in a])
    B = jnp.stack([jnp.stack([pad_b(x) for x in row]) for row in b])
    S, R = _scales_ranks(a, s, dtype)
    return A, B, S, R


def stack_bucket_cat(
    a: Any, b: Any, s: Any, *, d_in: int, d_out: int, r_max: int, dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`stack_bucket` with the tasks side by side, in the factors' own layouts (traceable).

    Returns:
      ``xa (n, d_in, M r_max)`` = ``[a_1 .. a_M]``, ``yb (n, M r_max, d_out)`` = ``[b_1; ..; b_M]``
      (task ``i`` in columns / rows ``i r_max .. (i + 1) r_max``, zero-padded), ``scale (n, M)`` and
      ``rank (n, M)`` as :func:`stack_bucket`. No transposes: one copy of every factor.
    """

    pad_a, pad_b = _padders(d_in, d_out, r_max, dtype)
    xa = jnp.stack([jnp.concatenate([pad_a(x) for x in row], 1) for row in a])
    # one flat concatenation (a plain copy per factor), then a free reshape
    yb = jnp.concatenate([pad_b(x) for row in b for x in row], 0).reshape(len(b), -1, d_out)
    S, R = _scales_ranks(a, s, dtype)
    return xa, yb, S, R


def split_bucket(bucket: Bucket, max_bytes: int, itemsize: int = 4) -> list[Bucket]:
    """A bucket as consecutive sub-buckets of equal size whose stacked factors fit ``max_bytes``.

    The size divides the bucket's module count (one compiled shape per bucket), so sub-buckets
    hold between 1 and ``n`` modules. Per-bucket kernels are free of global state, so merging a
    bucket piece by piece gives the same result with peak memory bounded by ``max_bytes``.
    """
    n = len(bucket.names)
    m_tasks = len(bucket.modules[0]) if n else 0
    per = max(1, m_tasks * bucket.r_max * (bucket.d_in + bucket.d_out) * itemsize)
    cap = max(1, min(n, max_bytes // per))
    size = max(d for d in range(1, cap + 1) if n % d == 0) if n else 1
    if size >= n:
        return [bucket]
    return [
        dataclasses.replace(
            bucket, names=bucket.names[i : i + size], modules=bucket.modules[i : i + size]
        )
        for i in range(0, n, size)
    ]
