"""Adapter pytrees: walking them, finding LoRA modules, validating them, grouping them into
buckets, and the compute dtype.

An adapter is a pytree of nested mappings whose LoRA modules are mappings with the keys
``lora_a`` ``(d_in, r)``, ``lora_b`` ``(r, d_out)`` and an optional ``scale``. A module's name is
its "/"-joined key path. A task that lacks a module says so explicitly with ``None`` at that path.

Every walk over such a tree goes through :func:`walk_modules` (or :func:`map_modules` to rebuild
one); :func:`float_dtype` is the one rule for the dtype computations run in.

Everything here is host-side bookkeeping on shapes: no array is read, so it is cheap and runs the
same under an outer ``jit``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InputError, InputTypeError
from .checks import NONFINITE_ARRAYS as NONFINITE_ARRAYS
from .checks import brief as brief
from .checks import check_bool as check_bool
from .checks import check_real as check_real
from .checks import few as _few
from .checks import is_real_scalar as is_real_scalar
from .checks import raise_nonfinite as raise_nonfinite
from .checks import real_value as real_value
from .checks import short as short
from .walk import (
    MAX_DEPTH as MAX_DEPTH,
)
from .walk import (
    MODULE_KEYS as MODULE_KEYS,
)
from .walk import (  # (re-exported: the walk of the trees)
    PLAIN_TYPES,
)
from .walk import (
    UPDATE_KEYS as UPDATE_KEYS,
)
from .walk import (
    KeyPath as KeyPath,
)
from .walk import (
    extract_lora as extract_lora,
)
from .walk import (
    has_factor as has_factor,
)
from .walk import (
    has_update as has_update,
)
from .walk import (
    is_mapping as is_mapping,
)
from .walk import (
    map_modules as map_modules,
)
from .walk import (
    match_names as match_names,
)
from .walk import (
    name_mismatch as name_mismatch,
)
from .walk import (
    unwrap as unwrap,
)
from .walk import (
    walk_modules as walk_modules,
)

__all__ = [
    "MAX_DEPTH",
    "MODULE_KEYS",
    "NONFINITE_ARRAYS",
    "UPDATE_KEYS",
    "Bucket",
    "KeyPath",
    "Module",
    "collect",
    "compute_dtype",
    "extract_lora",
    "flatten_modules",
    "float_dtype",
    "has_factor",
    "has_update",
    "is_mapping",
    "map_modules",
    "name_mismatch",
    "raise_nonfinite",
    "unwrap",
    "walk_modules",
]
# Also importable, for older call sites: brief, short, _few, check_bool, check_real, real_value,
# is_real_scalar, _is_real_dtype (from ._checks), and _unwrap / _is_mapping (aliases).


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
    # the factors stacked once (``nu.stack_adapters``: a ``_mesh.Stacked`` on the device), in
    # which case ``modules`` hold their shapes, dtypes and scales only; None: the leaves
    stacked: Any = None

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()``, a fact of this bucket's modules (which never change), computed once per
        bucket: a ``nu.stack_adapters`` set keeps its buckets, so its calls do not walk every
        (module, task) again. Not a field: equality and ``dataclasses.replace`` ignore it."""
        memo = self.__dict__.setdefault("_memo", {})  # (frozen: the dict, not an attribute)
        if key not in memo:
            memo[key] = make()
        return memo[key]


def _as_module(fn: str, task: int, name: str, node: Any) -> Module:
    """An input module's mapping as a :class:`Module` (factors and scale unwrapped)."""
    keys = set(node.keys())
    missing = {"lora_a", "lora_b"} - keys
    extra = keys - MODULE_KEYS
    if missing:
        raise InputError(
            f"{fn}: module {short(name)!r} of task {task} has no {sorted(missing)[0]!r}; a LoRA "
            "module needs both 'lora_a' (d_in, r) and 'lora_b' (r, d_out)."
        )
    if extra:
        raise InputError(
            f"{fn}: module {short(name)!r} of task {task} has keys "
            f"{brief(sorted(map(str, extra)))} besides 'lora_a', 'lora_b', 'scale'; pass only the "
            "LoRA part of the parameters (nu.extract_lora(tree) keeps it)."
        )
    return Module(unwrap(node["lora_a"]), unwrap(node["lora_b"]), unwrap(node.get("scale", 1.0)))


def _new_module(
    lora_a: Any, lora_b: Any, scale: Any, _new=object.__new__, _set=object.__setattr__
) -> Module:
    """``Module(lora_a, lora_b, scale)``: what the frozen dataclass's ``__init__`` does (three
    ``object.__setattr__``), without its call; made once per module and task."""
    m = _new(Module)
    _set(m, "lora_a", lora_a)
    _set(m, "lora_b", lora_b)
    _set(m, "scale", scale)
    return m


def _flatten_dicts(adapter: Any) -> dict[str, Module | None] | None:
    """:func:`flatten_modules` of a tree of plain dicts with nothing to report, or None.

    The common case in one recursive pass over the dicts: inner nodes and modules are ``dict``s
    (not subclasses, not other mappings), every module has exactly ``lora_a``, ``lora_b`` and
    optionally ``scale``, and no other leaf than None. None (not an error) as soon as anything
    else is met: another mapping type, a leaf, a module with missing or extra keys, a repeated
    name, a dict that contains an ancestor, nesting beyond :data:`MAX_DEPTH`, a root that is a
    module, or any exception; :func:`flatten_modules` then walks the tree in full and gives the
    result or the error, in the order it always has.
    """
    if type(adapter) is not dict or "lora_a" in adapter or "lora_b" in adapter:
        return None
    out: dict[str, Module | None] = {}
    plain = PLAIN_TYPES

    def walk(node: dict, prefix: str, depth: int, ancestors: tuple[dict, ...]) -> bool:
        if depth >= MAX_DEPTH and node:  # its children's paths would be too long
            return False
        for k, v in node.items():
            name = prefix + str(k)
            if name in out:
                return False
            if v is None:
                out[name] = None
            elif type(v) is not dict:
                return False
            elif "lora_a" in v or "lora_b" in v:
                has_scale = "scale" in v
                if len(v) != 2 + has_scale or "lora_a" not in v or "lora_b" not in v:
                    return False
                a, b = v["lora_a"], v["lora_b"]
                s = v["scale"] if has_scale else 1.0
                out[name] = _new_module(
                    a if type(a) in plain else unwrap(a),
                    b if type(b) in plain else unwrap(b),
                    s if type(s) in plain else unwrap(s),
                )
            elif any(u is v for u in ancestors) or not walk(
                v, name + "/", depth + 1, (*ancestors, v)
            ):
                return False
        return True

    try:
        return out if walk(adapter, "", 0, (adapter,)) else None
    except Exception:  # the full walk meets it again and reports it where it always has
        return None


def flatten_modules(adapter: Any, *, fn: str, task: int) -> dict[str, Module | None]:
    """Map module name -> :class:`Module` (or None where the task lacks the module).

    Raises:
      InputTypeError: if ``adapter`` is not a mapping.
      InputError: on a leaf that is not part of a LoRA module, a module missing a factor, two
        modules of the same name, a cycle, or nesting deeper than :data:`MAX_DEPTH`. Names in
        messages are cut to 80 characters.
    """
    if not is_mapping(adapter):
        raise InputTypeError(
            f"{fn}: adapter {task} is a {type(adapter).__name__}; expected a mapping (nested dicts) "
            "whose LoRA modules are dicts with 'lora_a' (d_in, r) and 'lora_b' (r, d_out)."
        )

    def too_deep(path: KeyPath) -> Exception:
        return InputError(
            f"{fn}: adapter {task} is nested more than {MAX_DEPTH} levels deep at "
            f"{short('/'.join(path))!r}; an adapter is a shallow tree of dicts whose LoRA modules "
            "are {'lora_a', 'lora_b'[, 'scale']} dicts."
        )

    def cycle(path: KeyPath) -> Exception:
        return InputError(
            f"{fn}: adapter {task} contains itself at {short('/'.join(path))!r} (a cycle of "
            "dicts); pass a tree of LoRA modules."
        )

    fast = _flatten_dicts(adapter)
    if fast is not None:
        return fast
    out: dict[str, Module | None] = {}
    for path, node in walk_modules(adapter, inner=True, too_deep=too_deep, cycle=cycle):
        name = "/".join(path)
        if name in out:
            raise InputError(
                f"{fn}: adapter {task} has two modules named {short(name)!r} (a flat key containing "
                "'/' and a nested path spell the same name); rename one of them."
            )
        if node is None:
            out[name] = None
        elif is_mapping(node):
            if has_factor(node):
                out[name] = _as_module(fn, task, name, node)
        else:
            raise InputError(
                f"{fn}: adapter {task} has a leaf at {short(name)!r} ({type(node).__name__}) that "
                "is not part of a LoRA module; pass only LoRA modules (nu.extract_lora(tree) keeps "
                "them), or None for a module the task lacks."
            )
    return out


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


# floating dtypes met so far (np.dtype instances): the factors' dtype check, decided once per dtype
_FLOATING_DTYPES: set[Any] = set()


def _is_floating(dt: Any) -> bool:
    """:func:`_check_module`'s dtype rule (``jnp.issubdtype(dt, jnp.floating)``, False where that
    raises ``TypeError``), remembered for ``np.dtype`` instances found floating."""
    if dt in _FLOATING_DTYPES:
        return True
    try:
        floating = bool(jnp.issubdtype(dt, jnp.floating))
    except TypeError:
        return False
    if floating and isinstance(dt, np.dtype):
        _FLOATING_DTYPES.add(dt)
    return floating


def _scale_ok(s: Any) -> bool:
    """True where :func:`_check_module` accepts ``s`` as a module's scale (a finite real scalar,
    or a traced one), False where it raises its error; an exception where its own steps raise one
    (``np.asarray`` of an int beyond float64), which :func:`_check_module` raises too."""
    t = type(s)
    if t is float:
        return s - s == 0.0  # finite (inf - inf and nan - nan are nan)
    if hasattr(s, "shape") and hasattr(s, "dtype") and tuple(s.shape) != ():
        return False
    if not is_real_scalar(s):
        return False
    return isinstance(s, jax.core.Tracer) or bool(np.isfinite(np.asarray(s, np.float64)))


_Groups = dict[tuple[int, int, int], list[tuple[str, tuple[Module | None, ...]]]]


def _group_fast(names: list[str], flat: list[dict[str, Module | None]]) -> _Groups | None:
    """:func:`_group_checked`'s groups where every module passes its checks, else None.

    One pass over the (module, task) pairs that reads each factor's shape and dtype once and
    decides the dtype rule once per dtype (:func:`_is_floating`); ``None`` (not an error) on
    anything :func:`_check_module` or the shape checks across tasks would refuse, or might
    (a shape that is not a tuple, any exception): :func:`_group_checked` then runs the checks
    one by one, in their order, and raises the first error.
    """
    groups: _Groups = {}
    floating = _FLOATING_DTYPES
    try:
        rows = zip(*([f[n] for n in names] for f in flat), strict=True)
        for name, mods in zip(names, rows, strict=True):
            d_in0 = d_out0 = None
            r_max = 0
            for m in mods:
                if m is None:
                    continue
                a, b = m.lora_a, m.lora_b
                sa, sb = a.shape, b.shape
                if type(sa) is not tuple or type(sb) is not tuple:
                    return None
                d_in, r = sa  # a ValueError if not 2-D
                r_b, d_out = sb
                if (
                    r != r_b
                    or type(d_in) is not int
                    or type(r) is not int
                    or type(d_out) is not int
                ):
                    return None
                da, db = a.dtype, b.dtype
                if not (
                    (da in floating or _is_floating(da)) and (db in floating or _is_floating(db))
                ):
                    return None
                sc = m.scale
                if not (sc - sc == 0.0 if type(sc) is float else _scale_ok(sc)):
                    return None
                if d_in0 is None:
                    d_in0, d_out0 = d_in, d_out
                elif d_in != d_in0 or d_out != d_out0:
                    return None
                if r > r_max:
                    r_max = r
            if d_in0 is None:  # None in every task
                return None
            groups.setdefault((d_in0, d_out0, r_max), []).append((name, mods))
    except Exception:  # the checks one by one meet it again and report it in their order
        return None
    return groups


def _group_checked(fn: str, names: list[str], flat: list[dict[str, Module | None]]) -> _Groups:
    """Check every module of every task, one by one in module then task order, and group the
    modules by ``(d_in, d_out, r_max)``: the reference for :func:`_group_fast`."""
    groups: _Groups = {}
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
    return groups


def _not_a_list(adapters: Any) -> str:
    """What :func:`collect`'s refusal says it got: a mapping whose values are adapters with
    the same modules (a dict of tasks) is told to pass its values."""
    if not isinstance(adapters, Mapping):
        return f"{type(adapters).__name__}. Wrap a single adapter in a list: [adapter]."
    kind = type(adapters).__name__
    try:
        keys = list(adapters.keys())
        mods = [
            frozenset(extract_lora(v)) if is_mapping(v) and not has_factor(v) else frozenset()
            for v in (adapters[k] for k in keys)
        ]
    except Exception:  # a value that cannot be walked is no adapter: the general advice
        keys, mods = [], []
    if len(mods) >= 2 and mods[0] and all(m == mods[0] for m in mods):
        shown = ", ".join(repr(short(str(k))) for k in keys[:3])
        more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
        return (
            f"a {kind} of {len(keys)} adapters ({shown}{more}) with the same modules: pass "
            "list(d.values()) for one task per value (or [d] if the dict is one adapter)."
        )
    return (
        f"a {kind}: wrap a single adapter in a list, [adapter]; for a dict of tasks "
        "({'sql': adapter, ...}) pass list(d.values())."
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
    stacked = getattr(type(adapters), "_netutility_collect", None)
    if stacked is not None:  # nu.stack_adapters' set: checked and grouped when it was made
        return stacked(adapters)
    if isinstance(adapters, Mapping) or not isinstance(adapters, Sequence):
        raise InputTypeError(
            f"{fn}: expected a sequence of adapters (one per task), got {_not_a_list(adapters)}"
        )
    if len(adapters) == 0:
        raise InputError(f"{fn}: the adapter list is empty; pass one adapter per task (M >= 1).")
    flat = [flatten_modules(ad, fn=fn, task=i) for i, ad in enumerate(adapters)]
    names = list(flat[0])
    if not names:
        raise InputError(f"{fn}: adapter 0 has no LoRA modules ('lora_a'/'lora_b' dicts).")
    ref = set(names)
    for i, f in enumerate(flat[1:], start=1):
        if f.keys() == ref:
            continue
        diff = name_mismatch(
            ref,
            f,
            missing=lambda x, i=i: f"task {i} lacks {_few(x)} that task 0 has",
            extra=lambda x, i=i: f"task {i} has {_few(x)} that task 0 lacks",
        )
        if diff:
            raise InputError(
                f"{fn}: module names differ between adapters: {diff}. Adapters must "
                "come from the same base model with the same target modules; where a task really "
                "lacks a module, put None at that name."
            )
    m_tasks = len(flat)
    groups = _group_fast(names, flat)
    if groups is None:
        groups = _group_checked(fn, names, flat)
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


def float_dtype(*dtypes: Any) -> np.dtype:
    """The package's one dtype rule: the dtype computations on inputs of these dtypes run in.

    float64 if any of ``dtypes`` is float64 and x64 is enabled; else float32. So bf16 and fp16
    are upcast to float32, float32 stays float32, and float64 without x64 is float32 (what JAX
    would make of it anyway). Integer dtypes never ask for float64.

    Decided on canonicalized dtypes, so float64 numpy inputs without x64 give float32 without a
    truncation warning, and no implicit promotion happens (safe under strict dtype promotion).

    Args:
      *dtypes: dtypes (``x.dtype``, not arrays); none gives float32.

    Example:
      >>> import numpy as np, jax.numpy as jnp
      >>> from netutility_jax._core.tree import float_dtype
      >>> float_dtype(jnp.bfloat16, np.float16).name
      'float32'
    """
    f64 = any(jax.dtypes.canonicalize_dtype(d) == np.float64 for d in dtypes)
    return np.dtype(np.float64 if f64 else np.float32)


def compute_dtype(buckets: Sequence[Bucket]) -> np.dtype:
    """The compute dtype of a set of buckets (see :func:`float_dtype`)."""
    return float_dtype(*(d for bk in buckets for d in bk.memo("dtypes", lambda bk=bk: _dtypes(bk))))


def _dtypes(bk: Bucket) -> tuple:
    """The distinct dtypes of a bucket's factors."""
    mods = [m for mods in bk.modules for m in mods if m is not None]
    try:  # each distinct dtype once: a handful, not two per module and task
        return tuple({m.lora_a.dtype for m in mods} | {m.lora_b.dtype for m in mods})
    except TypeError:  # an unhashable dtype: every one
        return tuple(d for m in mods for d in (m.lora_a.dtype, m.lora_b.dtype))
