"""Adapter pytrees: finding LoRA modules, validating them, and grouping them into buckets.

An adapter is a pytree of nested mappings whose LoRA modules are mappings with the keys
``lora_a`` ``(d_in, r)``, ``lora_b`` ``(r, d_out)`` and an optional ``scale``. A module's name is
its "/"-joined key path. A task that lacks a module says so explicitly with ``None`` at that path.

Everything here is host-side bookkeeping on shapes: no array is read, so it is cheap and runs the
same under an outer ``jit``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .errors import InputError, InputTypeError

MODULE_KEYS = frozenset({"lora_a", "lora_b", "scale"})


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
      TypeError: if ``adapter`` is not a mapping.
      ValueError: on a leaf that is not part of a LoRA module, or a module missing a factor.
    """
    if not _is_mapping(adapter):
        raise InputTypeError(
            f"{fn}: adapter {task} is a {type(adapter).__name__}; expected a mapping (nested dicts) "
            "whose LoRA modules are dicts with 'lora_a' (d_in, r) and 'lora_b' (r, d_out)."
        )
    out: dict[str, Module | None] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        name = "/".join(path)
        if name in out:
            raise InputError(
                f"{fn}: adapter {task} has two modules named {name!r} (a flat key containing '/' "
                "and a nested path spell the same name); rename one of them."
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
                        f"{fn}: module {name!r} of task {task} has no {sorted(missing)[0]!r}; a LoRA "
                        "module needs both 'lora_a' (d_in, r) and 'lora_b' (r, d_out)."
                    )
                if extra:
                    raise InputError(
                        f"{fn}: module {name!r} of task {task} has keys {sorted(extra)} besides "
                        "'lora_a', 'lora_b', 'scale'; pass only the LoRA part of the parameters "
                        "(nu.extract_lora(tree) keeps it)."
                    )
                out[name] = Module(
                    _unwrap(node["lora_a"]),
                    _unwrap(node["lora_b"]),
                    _unwrap(node.get("scale", 1.0)),
                )
                return
            for k in node.keys():
                walk(node[k], (*path, str(k)))
            return
        raise InputError(
            f"{fn}: adapter {task} has a leaf at {name!r} ({type(node).__name__}) that is not part "
            "of a LoRA module; pass only LoRA modules (nu.extract_lora(tree) keeps them), or None "
            "for a module the task lacks."
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


def _check_module(fn: str, name: str, task: int, m: Module) -> None:
    a, b = m.lora_a, m.lora_b
    for label, x in (("lora_a", a), ("lora_b", b)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise InputTypeError(
                f"{fn}: {label} of module {name!r}, task {task}, is a {type(x).__name__}; "
                "expected an array."
            )
        if len(x.shape) != 2:
            raise InputError(
                f"{fn}: {label} of module {name!r}, task {task}, has shape {tuple(x.shape)}; "
                f"expected 2-D ({'d_in, r' if label == 'lora_a' else 'r, d_out'})."
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise InputTypeError(
                f"{fn}: {label} of module {name!r}, task {task}, has dtype {x.dtype}; expected a "
                "floating dtype (bf16/fp16 are upcast to float32)."
            )
    if a.shape[1] != b.shape[0]:
        raise InputError(
            f"{fn}: factors of module {name!r}, task {task}, do not chain: lora_a {tuple(a.shape)} "
            f"is (d_in, r={a.shape[1]}) but lora_b {tuple(b.shape)} is (r={b.shape[0]}, d_out). "
            "Factors use the flax kernel layout (dK = lora_a @ lora_b); a PEFT checkpoint stores "
            "lora_A as (r, d_in) and lora_B as (d_out, r): transpose both (nu.peft.load_adapter "
            "does this)."
        )
    s = m.scale
    if not isinstance(s, jax.core.Tracer):
        s_arr = np.asarray(s)
        if s_arr.shape != ():
            raise InputError(
                f"{fn}: scale of module {name!r}, task {task}, has shape {s_arr.shape}; expected a "
                "scalar."
            )
        if not np.isfinite(s_arr):
            raise InputError(
                f"{fn}: scale of module {name!r}, task {task} (lora_a {tuple(a.shape)}, lora_b "
                f"{tuple(b.shape)}), is {s_arr}; expected a finite LoRA scale (lora_alpha / r)."
            )


def collect(adapters: Sequence[Any], *, fn: str) -> tuple[list[str], list[Bucket], int]:
    """Validate M adapters and group their modules into buckets of equal shape.

    Returns:
      ``(names, buckets, M)``: module names in the first adapter's order, the buckets (modules in
      each bucket keep that order), and the number of tasks.

    Raises:
      ValueError: empty list, module names that differ between adapters, factor shapes that do not
        chain, a module whose (d_in, d_out) differs across tasks, a module that no task has.
      TypeError: non-array or non-floating factors.
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
                f"{fn}: module {name!r} is None in every task; drop it from the adapters."
            )
        for i, m in present:
            _check_module(fn, name, i, m)
        i0, m0 = present[0]
        for i, m in present[1:]:
            if (m.d_in, m.d_out) != (m0.d_in, m0.d_out):
                raise InputError(
                    f"{fn}: module {name!r} has update shape (d_in, d_out) = ({m0.d_in}, "
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


def _few(xs: list[str], n: int = 3) -> str:
    shown = ", ".join(repr(x) for x in xs[:n])
    more = f" and {len(xs) - n} more" if len(xs) > n else ""
    return f"module{'s' if len(xs) > 1 else ''} {shown}{more}"


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
