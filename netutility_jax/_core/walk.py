"""Walking adapter trees: nested dicts, flax/nnx states and PEFT-style flat dicts, as nodes with
their key paths (:func:`walk_modules`, :func:`map_modules`), bounded in depth and safe from
cycles; which nodes are LoRA modules or merged updates; the LoRA subtree of a model's parameters
(:func:`extract_lora`); and matching module names across trees (:func:`match_names`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from ..errors import InputError
from .checks import brief as brief
from .checks import check_bool as check_bool
from .checks import check_real as check_real
from .checks import is_real_scalar as is_real_scalar
from .checks import real_value as real_value
from .checks import short as short

__all__ = [
    "MAX_DEPTH",
    "MODULE_KEYS",
    "PLAIN_TYPES",
    "UPDATE_KEYS",
    "KeyPath",
    "extract_lora",
    "has_factor",
    "has_update",
    "is_mapping",
    "map_modules",
    "match_names",
    "name_mismatch",
    "unwrap",
    "walk_modules",
]

MODULE_KEYS = frozenset({"lora_a", "lora_b", "scale"})
UPDATE_KEYS = frozenset({"lora_a", "lora_b", "delta"})  # a merged module, low rank or dense
MAX_DEPTH = 64  # deeper nesting is not an adapter (and recursive code would hit Python's limit)

# types whose instances :func:`unwrap` returns as they are (arrays, numbers): a per-type
# decision, cached so that a walk over thousands of factors makes it once per type
PLAIN_TYPES: set[type] = {float, int, np.ndarray}


def unwrap(x: Any) -> Any:
    """A leaf's array: ``flax.nnx`` Variables (``Param``, ``LoRAParam``) give their value
    (``get_value``, or ``value`` on older flax); anything else is returned as it is."""
    t = type(x)
    if t in PLAIN_TYPES:
        return x
    if isinstance(x, (jax.Array, np.ndarray, np.generic, int, float)):
        if x.__class__ is t:  # decided by the type alone (no __class__ override)
            PLAIN_TYPES.add(t)
        return x
    if hasattr(x, "get_value"):
        return x.get_value()
    if hasattr(x, "value"):
        return x.value
    return x


def is_mapping(x: Any) -> bool:
    """A node the walkers enter: a ``Mapping`` (dict, ``flax.nnx.State``) or anything with
    ``keys`` and ``__getitem__``."""
    return isinstance(x, Mapping) or (hasattr(x, "keys") and hasattr(x, "__getitem__"))


_unwrap = unwrap  # the names merging.py and peft.py use
_is_mapping = is_mapping


def has_factor(node: Any) -> bool:
    """An input LoRA module: a mapping with ``lora_a`` or ``lora_b`` (one missing is an error the
    validator reports, not a reason to look inside)."""
    keys = node.keys()
    return "lora_a" in keys or "lora_b" in keys


def has_update(node: Any) -> bool:
    """A merged module: low rank (``lora_a`` / ``lora_b``) or dense (``delta``)."""
    return bool(UPDATE_KEYS & set(node.keys()))


KeyPath = tuple[str, ...]  # a node's keys as strings; "/".join gives the module name


def _too_deep(path: KeyPath, max_depth: int) -> Exception:
    return InputError(
        f"the tree is nested more than {max_depth} levels deep at {short('/'.join(path))!r}."
    )


def _cycle(path: KeyPath) -> Exception:
    return InputError(
        f"the tree contains itself at {short('/'.join(path))!r} (a cycle of mappings)."
    )


def _nodes(
    tree: Any,
    is_module: Callable[[Any], bool],
    max_depth: int | None,
    too_deep: Callable[[KeyPath], Exception] | None,
    cycle: Callable[[KeyPath], Exception] | None,
) -> Iterator[tuple[tuple[Any, ...], KeyPath, Any, bool]]:
    """Every node, depth first in key order: ``(keys, path, node, stop)``; ``keys`` are the
    mapping keys as they are, ``path`` the same as strings, ``stop`` False for an entered mapping."""
    # an explicit stack: no recursion limit, and the ancestors of each node for cycle detection.
    # The ancestors themselves are kept, not their id()s: a mapping may hand out a new object per
    # lookup (flax.nnx.State does), and a collected one's id can be reused by a later object.
    stack: list[tuple[tuple[Any, ...], KeyPath, Any, tuple[Any, ...]]] = [((), (), tree, ())]
    while stack:
        keys, path, node, ancestors = stack.pop()
        if max_depth is not None and len(path) > max_depth:
            raise too_deep(path) if too_deep else _too_deep(path, max_depth)
        if not is_mapping(node) or is_module(node):
            yield keys, path, node, True
            continue
        yield keys, path, node, False
        if any(a is node for a in ancestors):
            raise cycle(path) if cycle else _cycle(path)
        up = (*ancestors, node)
        stack.extend(
            ((*keys, k), (*path, str(k)), node[k], up) for k in reversed(list(node.keys()))
        )


def walk_modules(
    tree: Any,
    *,
    is_module: Callable[[Any], bool] = has_factor,
    max_depth: int | None = MAX_DEPTH,
    inner: bool = False,
    too_deep: Callable[[KeyPath], Exception] | None = None,
    cycle: Callable[[KeyPath], Exception] | None = None,
) -> Iterator[tuple[KeyPath, Any]]:
    """The modules of a tree of nested mappings: the one walker of adapter pytrees.

    Depth first, in each mapping's key order, yields ``(path, node)`` for every node where the
    walk stops: a mapping for which ``is_module(node)`` holds (a module: not entered), ``None``
    (a task's placeholder for a module it lacks) and any other non-mapping leaf. Every other
    mapping (see :func:`is_mapping`: dicts, ``flax.nnx.State``) is entered. ``path`` is the tuple
    of keys as strings (``"/".join(path)`` is the module name, ``()`` the root); nodes are yielded
    as they are (:func:`unwrap` gives a Variable's array).

    Args:
      tree: the root; itself a module, None or a leaf if so (yielded with path ``()``).
      is_module: called on mappings only; default :func:`has_factor` (input modules);
        :func:`has_update` for merged ones.
      max_depth: refuse paths longer than this (checked before the node is yielded); None: no
        limit.
      inner: also yield each mapping that is entered, before its children, so a caller can check
        every name (a caller tells them apart with ``is_mapping(node) and not is_module(node)``).
      too_deep, cycle: ``path -> exception`` raised for a path longer than ``max_depth`` / for a
        mapping that contains itself (checked after it is yielded with ``inner``, before it is
        entered); default an :class:`InputError` naming the path.
    """
    for _, path, node, stop in _nodes(tree, is_module, max_depth, too_deep, cycle):
        if stop or inner:
            yield path, node


def map_modules(
    tree: Any,
    fn: Callable[[KeyPath, Any], Any],
    *,
    is_module: Callable[[Any], bool] = has_factor,
    max_depth: int | None = MAX_DEPTH,
) -> Any:
    """The tree rebuilt as nested dicts (same keys, same order) with every node where
    :func:`walk_modules` stops (module, None, leaf) replaced by ``fn(path, node)``."""
    root: Any = None
    built: dict[tuple[Any, ...], dict] = {}
    for keys, path, node, stop in _nodes(tree, is_module, max_depth, None, None):
        value = fn(path, node) if stop else {}
        if not stop:
            built[keys] = value
        if keys:
            built[keys[:-1]][keys[-1]] = value
        else:
            root = value
    return root


def _both_factors(node: Any) -> bool:
    keys = node.keys()
    return "lora_a" in keys and "lora_b" in keys


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

    def cycle(path: KeyPath) -> Exception:
        return InputError(
            f"nu.extract_lora: the tree contains itself at {short('/'.join(path))!r} (a cycle of "
            "dicts); pass a tree of parameters."
        )

    out: dict[str, Any] = {}
    for path, node in walk_modules(tree, is_module=_both_factors, max_depth=None, cycle=cycle):
        if is_mapping(node):  # a module; other leaves (kernels, biases) are dropped
            mod = {"lora_a": unwrap(node["lora_a"]), "lora_b": unwrap(node["lora_b"])}
            if "scale" in node.keys():
                mod["scale"] = unwrap(node["scale"])
            out["/".join(path)] = mod
    return out


def _nnx_other(name: str) -> str:
    """The other spelling of an nnx LoRA layer's name: ``X`` <-> ``X/lora`` (an
    ``nnx.LoRALinear`` by layer, and its ``lora`` child's state path), ``lora`` <-> ``""``."""
    if name == "":
        return "lora"
    if name == "lora":
        return ""
    return name[: -len("/lora")] if name.endswith("/lora") else f"{name}/lora"


def match_names(want: Iterable[str], have: Iterable[str]) -> dict[str, str] | None:
    """``{name of want: key of have}`` where each key is the name or its other nnx spelling
    (``X`` / ``X/lora``, see ``nu.nnx``); None unless that pairs every name with exactly one
    key and uses every key once (exact names first)."""
    want, have = list(want), set(have)
    out: dict[str, str] = {}
    for n in want:
        if n in have:
            out[n] = n
        elif _nnx_other(n) in have and _nnx_other(n) not in want:
            out[n] = _nnx_other(n)
        else:
            return None
    return out if len(set(out.values())) == len(out) == len(have) else None


def name_mismatch(
    want: Iterable[str],
    have: Iterable[str],
    *,
    missing: Callable[[list[str]], str],
    extra: Callable[[list[str]], str],
) -> str:
    """How two sets of module names differ, for a message: ``""`` if they agree, else
    ``missing(sorted names of want not in have)`` and ``extra(sorted names of have not in
    want)``, each only if non-empty, joined by ``"; "``."""
    want, have = set(want), set(have)
    parts = [
        describe(names)
        for describe, names in ((missing, sorted(want - have)), (extra, sorted(have - want)))
        if names
    ]
    return "; ".join(parts)
