"""Input second moments per task and module: the data for :func:`nu.score`'s data-aware geometry.

The paper's preservation objective weighs every task's error by ``G_i = E_{x ~ p_i}[x x^T]``, the
second moment of the layer's inputs under task ``i``'s data (paper Eq. preservation-surrogate), and
then replaces it by a data-free proxy built from the adapter itself (Eq. gram-geometry, App. A.4).
This module holds an estimate ``S_i`` of ``E[x x^T]`` from a few hundred unlabelled inputs, in
factor form ``S = F^T F`` with ``F (k, d_in)``: ``k`` is the number of samples up to ``2 d_in``,
``d_in`` beyond, so ``S`` (``d_in x d_in``) is never formed for a few hundred samples. How the score uses it, and
the derivation, are in :func:`nu.score` and docs/input_moments.md.

* :func:`input_moments` from activations ``{module: (..., d_in)}`` (the usual way);
* :func:`input_moments_dense` from second moments ``{module: (d_in, d_in)}`` already formed
  (checked symmetric and positive semidefinite);
* :class:`InputMoments` is one module's estimate; ``None`` in its place means "no data: the
  data-free geometry" (isotropic inputs, ``S = I``), and must be written out (see :func:`resolve`).

References:
  Amballa et al., "Not All Ranks Are Equal: Budget-Aware LoRA Merging Across Tasks": Eq.
  preservation-surrogate (``G_i``), Eq. gram-geometry and App. A.4 (the data-free proxies).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .._core import tree as _tree
from .._core.checks import brief, few, short
from ..errors import InputError, InputTypeError
from ._moment_core import InputMoments, from_dense, from_samples
from ._moment_files import (
    MOMENTS_FORMAT,
    NPZ_MAX_RATIO,
    NPZ_MIN_BYTES,
    load_input_moments,
    save_input_moments,
)

# (defined apart, public here: repr, docs and pickles name this module)
InputMoments.__module__ = __name__

__all__ = [
    "MOMENTS_FORMAT",
    "NPZ_MAX_RATIO",
    "NPZ_MIN_BYTES",
    "InputMoments",
    "input_moments",
    "input_moments_dense",
    "load_input_moments",
    "resolve",
    "save_input_moments",
]


def _named(fn: str, tree: Any, what: str, sown: str | None = None) -> dict[str, Any]:
    """``{"/"-joined path: leaf}`` of a mapping (nested mappings are joined like adapters';
    a list or tuple of arrays is one leaf: several batches of one module). With ``sown``, a
    mapping holding the key ``sown`` is a leaf: its value (what ``Module.sow(..., sown, x)``
    stored), named by the path to it."""
    if not isinstance(tree, Mapping):
        raise InputTypeError(
            f"{fn}: expected a mapping {{module name: {what}}}, got {type(tree).__name__}."
        )
    out: dict[str, Any] = {}

    def walk(node: Any, path: tuple[str, ...], depth: int) -> None:
        if depth > _tree.MAX_DEPTH:
            raise InputError(f"{fn}: the mapping nests deeper than {_tree.MAX_DEPTH} levels.")
        if sown is not None and sown in node:
            if not path:
                raise InputError(
                    f"{fn}: sown={sown!r} is a key of the mapping itself; expected it under each "
                    "module's path ({module path: {sown: activations}})."
                )
            out["/".join(path)] = _tree.unwrap(node[sown])
            return
        for k, v in node.items():
            p = (*path, str(k))
            v = v if isinstance(v, Mapping) else _tree.unwrap(v)
            if isinstance(v, Mapping):
                walk(v, p, depth + 1)
            else:
                out["/".join(p)] = v

    walk(tree, (), 0)
    if not out:
        raise InputError(
            f"{fn}: the mapping is empty"
            f"{f' (or holds no key {sown!r})' if sown is not None else ''}; expected "
            f"{{module name: {what}}}."
        )
    return out


def input_moments(
    activations: Mapping[str, Any] | Sequence[Mapping[str, Any]], *, sown: str | None = None
) -> dict[str, InputMoments | None]:
    """Input second moments ``S = E[x x^T]`` of each module, from sampled inputs (activations).

    ``S = X^T X / n`` from the ``n`` rows of ``X``, kept in factor form: ``X / sqrt(n)`` when
    ``n <= 2 d_in`` (``S`` is never formed), else a ``d_in x d_in`` factor of ``S`` (Cholesky of
    the float64 Gram), so the score's cost per task-module is ``O(min(n, 2 d_in) d_in r)``.
    No mean is subtracted: the objective weighs ``||dW x||^2`` over the inputs ``x`` themselves
    (paper Eq. preservation-surrogate). Computed in float64 on the host, returned in the
    activations' float dtype (float32 for bf16/fp16, float64 only with x64 enabled).

    Args:
      activations: ``{module name: array (..., d_in)}``, the inputs of each adapted layer on one
        task's data (leading axes, such as batch and sequence, are flattened into samples; a list
        or tuple of arrays is concatenated, as ``nnx.sow`` collects calls), or a list of such
        mappings (batches, concatenated per module). Names are those of the adapter (nested
        mappings, ``nnx.State`` included, are "/"-joined). Drop padding tokens first. ``None``
        at a name is passed through: the data-free geometry for that module.
      sown: the name passed to ``Module.sow`` (e.g. ``"inputs"``): each module's ``{sown: (x,
        ...)}`` node of an ``nnx.capture`` state is its activations, named by the module's path
        (docs/input_moments.md has the recipe).

    Returns:
      ``{name: InputMoments | None}``, to pass as one task's entry of ``nu.score(...,
      input_moments=[...])``.

    Raises:
      InputError: NaN/Inf in an activation, an empty or all-zero activation set, arrays of one
        module with different ``d_in``, batches naming different modules.
      InputTypeError: not a mapping (or a list of them), a non-floating array.

    Example:
      >>> import numpy as np
      >>> from netutility_jax.moments import input_moments
      >>> x = np.random.default_rng(0).normal(size=(4, 10, 8)).astype(np.float32)  # 40 tokens
      >>> m = input_moments({"q": x})["q"]
      >>> m.factor.shape  # 40 samples > 2 d_in = 16: one 8 x 8 factor
      (8, 8)
      >>> bool(np.allclose(m.second_moment(), x.reshape(-1, 8).T @ x.reshape(-1, 8) / 40,
      ...                  atol=1e-5))
      True
    """
    fn = "nu.input_moments"
    what = "activations (..., d_in)"
    if isinstance(activations, Sequence) and not isinstance(activations, str):
        if not activations:
            raise InputError(f"{fn}: the list of batches is empty.")
        batches = [_named(fn, b, what, sown) for b in activations]
        for k, b in enumerate(batches[1:], start=1):
            if set(b) != set(batches[0]):
                diff = sorted(set(b) ^ set(batches[0]))
                raise InputError(
                    f"{fn}: batch {k} names different modules than batch 0 ({few(diff)} in one "
                    "only); every batch must hold the same modules."
                )
        named = {}
        for name in batches[0]:
            parts = [b[name] for b in batches]
            if any(p is None for p in parts):
                named[name] = None
                continue
            named[name] = [x for p in parts for x in (p if isinstance(p, (list, tuple)) else [p])]
    else:
        named = _named(fn, activations, what, sown)
    return {k: None if v is None else from_samples(fn, k, v) for k, v in named.items()}


def input_moments_dense(second_moments: Mapping[str, Any]) -> dict[str, InputMoments | None]:
    """:func:`input_moments` from formed second moments ``{module: S (d_in, d_in)}``.

    Each ``S`` is checked finite, symmetric and positive semidefinite (to a tolerance of
    ``10 d_in eps`` of its largest entry, the rounding of a Gram formed in its dtype) and
    factored by ``eigh`` (``S = F^T F``, ``F`` of ``rank(S)`` rows).

    Raises:
      InputError: not square, NaN/Inf, not symmetric, not PSD (the smallest eigenvalue is
        named), zero.
      InputTypeError: not a mapping, a non-floating array.
    """
    fn = "nu.input_moments_dense"
    return {
        k: None if v is None else from_dense(fn, k, v)
        for k, v in _named(fn, second_moments, "second moment (d_in, d_in)").items()
    }


# ------------------------------------------------------------------------------------------------
# Checking nu.score's input_moments against the adapters
# ------------------------------------------------------------------------------------------------

_HOW = (
    "Build each task's entry with nu.input_moments({module name: activations (n, d_in)}); "
    "put None for a module (or for a whole task) to use the data-free geometry there."
)


def check_entries(fn: str, input_moments: Any, m_tasks: int, *, how: str = "") -> None:
    """``input_moments`` is a list of one entry per task (``how``: advice appended to the
    messages)."""
    if isinstance(input_moments, (Mapping, str)) or not isinstance(input_moments, Sequence):
        raise InputTypeError(
            f"{fn}: input_moments is a {type(input_moments).__name__}; expected a list with one "
            f"entry per task (M = {m_tasks}), in the adapters' order.{how}"
        )
    if len(input_moments) != m_tasks:
        raise InputError(
            f"{fn}: input_moments has {len(input_moments)} entries for M = {m_tasks} adapters; "
            f"expected one per task, in the adapters' order.{how}"
        )


def resolve(
    fn: str, input_moments: Any, buckets: Sequence[_tree.Bucket], m_tasks: int
) -> list[tuple[tuple[Any, ...], ...]] | None:
    """``input_moments`` checked against the adapters' buckets.

    Returns None when every entry is None (the data-free score, unchanged), else per bucket
    ``rows[n][i]``: task ``i``'s factor ``(k, d_in)`` in module ``n``, or None (no data there,
    or the task lacks the module: the data-free geometry).

    Rules: one entry per task (None: data-free in every module), each a mapping that names
    every module the task has (None: data-free there) and no other; factors ``(k, d_in)`` of
    that module's ``d_in``, floating, finite (checked on concrete arrays), not all zero.
    """
    if input_moments is None:
        return None
    check_entries(fn, input_moments, m_tasks, how=f" {_HOW}")
    all_names = {nm for bk in buckets for nm in bk.names}
    where = {nm: (b, n) for b, bk in enumerate(buckets) for n, nm in enumerate(bk.names)}
    rows = [[[None] * m_tasks for _ in bk.names] for bk in buckets]
    any_data = False
    for i, entry in enumerate(input_moments):
        if entry is None:
            continue
        _check_entry_names(fn, i, entry, buckets, all_names)
        for nm, v in entry.items():
            b, n = where[str(nm)]
            bk = buckets[b]
            if v is None or bk.modules[n][i] is None:
                continue
            rows[b][n][i] = _checked_factor(fn, i, nm, v, bk, n)
            any_data = True
    if not any_data:
        return None
    return [tuple(tuple(r) for r in bucket_rows) for bucket_rows in rows]


def _check_entry_names(fn: str, i: int, entry: Any, buckets, all_names: set[str]) -> None:
    """Task ``i``'s entry is a mapping naming every module the task has and no other."""
    if not isinstance(entry, Mapping):
        raise InputTypeError(
            f"{fn}: input_moments[{i}] is a {type(entry).__name__}; expected None or a "
            f"mapping {{module name: InputMoments | None}}. {_HOW}"
        )
    extra = sorted(set(map(str, entry)) - all_names)
    if extra:
        raise InputError(
            f"{fn}: input_moments[{i}] names {few(extra)} that the adapters lack; the "
            "names must be the adapters' module names."
        )
    missing = [
        nm
        for bk in buckets
        for nm, mods in zip(bk.names, bk.modules, strict=True)
        if mods[i] is not None and nm not in entry
    ]
    if missing:
        raise InputError(
            f"{fn}: input_moments[{i}] lacks {few(missing)} that task {i} has. Mixing data "
            "and the data-free geometry must be explicit: put None at those names (data-free "
            "there), or collect their inputs."
        )


def _checked_factor(fn: str, i: int, nm: Any, v: Any, bk: _tree.Bucket, n: int) -> Any:
    """Task ``i``'s moments of module ``nm`` (row ``n`` of ``bk``): their factor ``(k, d_in)``,
    floating, and on concrete arrays finite and not all zero."""
    if not isinstance(v, InputMoments):
        raise InputTypeError(
            f"{fn}: input_moments[{i}][{short(nm)!r}] is {brief(v)}; expected an "
            "InputMoments or None (a raw array is ambiguous: samples (n, d_in) or "
            f"E[x x^T] (d_in, d_in)?). {_HOW} (or nu.input_moments_dense for E[x x^T])."
        )
    f = _tree.unwrap(v.factor)
    shape = tuple(np.shape(f))
    if len(shape) != 2 or shape[1] != bk.d_in or shape[0] == 0:
        raise InputError(
            f"{fn}: input_moments[{i}][{short(nm)!r}] has a factor of shape {shape} "
            f"(S = factor^T factor), but module {short(nm)!r} of task {i} has d_in = "
            f"{bk.d_in} (lora_a {tuple(bk.modules[n][i].lora_a.shape)}); expected "
            f"(k, {bk.d_in}): inputs of this module, not of another layer."
        )
    if not jax.dtypes.issubdtype(f.dtype, np.floating):
        raise InputTypeError(
            f"{fn}: input_moments[{i}][{short(nm)!r}] has a factor of dtype {f.dtype}; "
            "expected a floating array."
        )
    if isinstance(f, jax.core.Tracer):
        return f
    h = np.asarray(f)
    if h.dtype not in (np.float32, np.float64):  # bf16/fp16: no BLAS kernel
        h = h.astype(np.float32)
    # one BLAS pass: finite and positive says finite and not all zero; otherwise (an error, or
    # entries beyond sqrt of the dtype's range) count exactly
    ss = np.vdot(h.ravel(), h.ravel()) if h.size else 0.0
    ok = bool(np.isfinite(ss) and ss > 0)
    bad = 0 if ok else int((~np.isfinite(h)).sum())
    if bad:
        raise InputError(
            f"{fn}: input_moments[{i}][{short(nm)!r}] (factor {shape}) has {bad} "
            "non-finite entries (NaN or Inf)."
        )
    if not ok and not h.any():
        raise InputError(
            f"{fn}: input_moments[{i}][{short(nm)!r}] (factor {shape}) is zero: "
            f"task {i}'s update would have no energy on its own inputs. Pass None "
            "for the data-free geometry."
        )
    return f
