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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core import tree as _tree
from .._core.checks import brief, few, short
from ..errors import InputError, InputTypeError

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


def _from_samples(fn: str, name: str, x: Any) -> InputMoments:
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


def _from_dense(fn: str, name: str, s: Any) -> InputMoments:
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
    return {k: None if v is None else _from_samples(fn, k, v) for k, v in named.items()}


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
        k: None if v is None else _from_dense(fn, k, v)
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
        for nm, v in entry.items():
            b, n = where[str(nm)]
            bk = buckets[b]
            if v is None or bk.modules[n][i] is None:
                continue
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
            if not isinstance(f, jax.core.Tracer):
                h = np.asarray(f)
                if h.dtype not in (np.float32, np.float64):  # bf16/fp16: no BLAS kernel
                    h = h.astype(np.float32)
                # one BLAS pass: finite and positive says finite and not all zero; otherwise
                # (an error, or entries beyond sqrt of the dtype's range) count exactly
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
            rows[b][n][i] = f
            any_data = True
    if not any_data:
        return None
    return [tuple(tuple(r) for r in bucket_rows) for bucket_rows in rows]


# ------------------------------------------------------------------------------------------------
# Files: one task's moments, for `netutility merge --input-moments`
# ------------------------------------------------------------------------------------------------

MOMENTS_FORMAT = "netutility-input-moments"
"""The ``format`` a moments file written by :func:`save_input_moments` declares."""
_NPZ_HEADER = "__netutility__"  # an .npz's header: a 0-d string array holding JSON
NPZ_MAX_RATIO = 64
"""By default an ``.npz`` moments file's arrays may take this many times the file's size once
decompressed (:func:`load_input_moments`; ``np.savez`` stores them uncompressed, ratio 1, and
float data deflates little), or :data:`NPZ_MIN_BYTES`, whichever is more."""
NPZ_MIN_BYTES = 32 * 2**20
"""The least an ``.npz`` moments file's arrays may take once decompressed, by default."""
_NPZ_CHUNK = 2**20  # bytes decompressed at a time
_FORMS = ("second_moment", "factor")


def _suffix(fn: str, path: Any) -> str:
    import os

    name = os.fspath(path)
    suffix = name.rsplit(".", 1)[-1].lower() if "." in os.path.basename(name) else ""
    if suffix not in ("safetensors", "npz"):
        raise InputError(
            f"{fn}: {name} is neither a .safetensors nor an .npz file; a moments file is one of "
            "the two (docs/input_moments.md)."
        )
    return suffix


def save_input_moments(
    moments: Mapping[str, InputMoments | None], path: str | Any, *, form: str = "factor"
) -> None:
    """Write one task's input moments to ``path`` (``.safetensors`` or ``.npz``), the file
    ``netutility merge --input-moments`` reads (one per task, in the adapters' order).

    One array per module, keyed by its name: ``form="factor"`` (default) writes each
    ``InputMoments.factor`` ``(k, d_in)`` as it is, so the merge reads back exactly the moments
    given (bit for bit: the same scores as ``nu.merge_adapters(..., input_moments=[moments,
    ...])``); ``form="second_moment"`` writes ``S = factor^T factor`` ``(d_in, d_in)`` in float64
    (any program can write that form: the file needs no header, see below). Modules whose
    value is None (the data-free geometry) are listed in the header. float32 and float64
    factors are kept as they are; bf16/fp16 ones are written as float32 (exactly).

    The header (safetensors ``__metadata__``, or the ``.npz`` key ``__netutility__`` holding a
    JSON string) is ``{"format": "netutility-input-moments", "version": "1", "form": ...,
    "data_free": [names]}``. A file without one holds second moments ``(d_in, d_in)``.

    Args:
      moments: ``{module name: InputMoments | None}``, as :func:`input_moments` returns.
      path: the file to write (replaced atomically if it exists); its suffix picks the format.
      form: ``"factor"`` or ``"second_moment"``.

    Raises:
      InputError: a suffix other than ``.safetensors``/``.npz``, an unknown ``form``, an empty
        mapping, a reserved name (``__netutility__``), a factor that is not ``(k, d_in)``.
      InputTypeError: a value that is neither an InputMoments nor None.

    Example:
      >>> import numpy as np, tempfile, os
      >>> from netutility_jax.moments import input_moments, save_input_moments, load_input_moments
      >>> x = np.random.default_rng(0).normal(size=(12, 8)).astype(np.float32)
      >>> m = input_moments({"q": x, "v": None})
      >>> path = os.path.join(tempfile.mkdtemp(), "task0.safetensors")
      >>> save_input_moments(m, path)
      >>> back = load_input_moments(path)
      >>> bool(np.array_equal(back["q"].factor, m["q"].factor)), back["v"]
      (True, None)
    """
    import json

    from .._core import io as _io

    fn = "nu.moments.save_input_moments"
    suffix = _suffix(fn, path)
    if form not in _FORMS:
        raise InputError(f"{fn}: form={form!r}; expected 'factor' or 'second_moment'.")
    if not isinstance(moments, Mapping) or not moments:
        raise InputTypeError(
            f"{fn}: expected a non-empty mapping {{module name: InputMoments | None}}, got "
            f"{brief(moments)}."
        )
    arrays: dict[str, np.ndarray] = {}
    data_free = []
    for name, v in moments.items():
        name = str(name)
        if name == _NPZ_HEADER:
            raise InputError(f"{fn}: the module name {name!r} is reserved for the file's header.")
        if v is None:
            data_free.append(name)
            continue
        if not isinstance(v, InputMoments):
            raise InputTypeError(
                f"{fn}: module {short(name)!r} is {brief(v)}; expected an InputMoments (from "
                "nu.input_moments or nu.input_moments_dense) or None."
            )
        f = np.asarray(_tree.unwrap(v.factor))
        if f.ndim != 2 or 0 in f.shape:
            raise InputError(
                f"{fn}: module {short(name)!r} has a factor of shape {f.shape}; expected (k, d_in)."
            )
        if f.dtype not in (np.float32, np.float64):
            f = f.astype(np.float32)
        if form == "second_moment":
            f64 = f.astype(np.float64)
            f = f64.T @ f64
        arrays[name] = np.ascontiguousarray(f)
    header = {"format": MOMENTS_FORMAT, "version": "1", "form": form, "data_free": data_free}
    with _io.atomic_file(path, "wb") as fh:
        if suffix == "safetensors":
            from safetensors.numpy import save

            meta = {**header, "data_free": json.dumps(data_free)}
            fh.write(save(arrays, metadata=meta))
        else:
            np.savez(fh, **arrays, **{_NPZ_HEADER: np.asarray(json.dumps(header))})


def _safetensors_header(fn: str, data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's bytes (``{}`` if none)."""
    import json

    if len(data) < 8:
        raise InputError(f"{fn}: not a safetensors file (only {len(data)} bytes).")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise InputError(f"{fn}: not a safetensors file (its header runs past the end).")
    try:
        head = json.loads(data[8 : 8 + n])
    except (ValueError, UnicodeDecodeError):
        raise InputError(f"{fn}: not a safetensors file (its header is not JSON).") from None
    meta = head.get("__metadata__") if isinstance(head, dict) else None
    return dict(meta) if isinstance(meta, dict) else {}


def _default_max_bytes(size: int) -> int:
    """What the arrays of an ``.npz`` of ``size`` bytes may take once decompressed, by default:
    :data:`NPZ_MAX_RATIO` times the file, at least :data:`NPZ_MIN_BYTES`."""
    return max(NPZ_MIN_BYTES, NPZ_MAX_RATIO * size)


def _read_npz(fn: str, data: bytes, max_bytes: int | None, hint: str) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` archive's bytes, read without pickles and within ``max_bytes``
    decompressed bytes (default :func:`_default_max_bytes`).

    Every member's uncompressed size as the zip's central directory declares it is checked
    (each, and their sum) before anything is decompressed, so a zip bomb is refused at once; the
    members are then decompressed a chunk at a time into a buffer of the declared size, from a
    stream that yields no more than that (a header that under-declares its member cannot make
    it read more: the zip's CRC refuses it), and each ``.npy`` header's shape and dtype must
    account for exactly the bytes read (no array is allocated from a header alone)."""
    import io
    import zipfile
    import zlib

    limit = _default_max_bytes(len(data)) if max_bytes is None else max_bytes
    # (a damaged zip: BadZipFile; a damaged compressed member: zlib.error; an encrypted one:
    # RuntimeError; an unknown compression: NotImplementedError; a cut member: EOFError)
    broken = (
        ValueError, OSError, zipfile.BadZipFile, EOFError, zlib.error, KeyError, RuntimeError,
        NotImplementedError, TypeError, OverflowError, MemoryError,
    )  # fmt: skip
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except broken as e:
        raise InputError(
            f"{fn}: cannot be read as .npz without pickles ({_one(e)}); a moments file holds "
            "plain float arrays."
        ) from None
    with zf:
        infos = zf.infolist()
        seen: set[str] = set()
        total = 0
        for info in infos:
            name = info.filename
            if name in seen:
                raise InputError(f"{fn}: the archive holds member {name!r} twice.")
            seen.add(name)
            total += info.file_size
            if info.file_size > limit or total > limit:
                what = (
                    f"member {name!r} declares {info.file_size:,} bytes once decompressed "
                    f"(from {info.compress_size:,} compressed)"
                    if info.file_size > limit
                    else f"its members declare {total:,} bytes once decompressed (up to member "
                    f"{name!r})"
                )
                raise InputError(
                    f"{fn}: {what}, more than the {limit:,} bytes allowed for this "
                    f"{len(data):,}-byte file (a zip bomb?); moments files are written "
                    f"uncompressed (np.savez, nu.moments.save_input_moments){hint}."
                )
        arrays: dict[str, np.ndarray] = {}
        for info in infos:
            name = info.filename
            key = name[:-4] if name.endswith(".npy") else name
            try:
                arrays[key] = _npz_member(fn, zf, info)
            except InputError:
                raise
            except broken as e:
                raise InputError(
                    f"{fn}: member {name!r} cannot be read ({_one(e)}); the archive is damaged "
                    "(a moments file holds plain float arrays: np.savez, or "
                    "nu.moments.save_input_moments)."
                ) from None
    return arrays


def _npz_member(fn: str, zf: Any, info: Any) -> np.ndarray:
    """One ``.npz`` member as an array: at most its declared size read (then the zip's CRC), its
    ``.npy`` header parsed first and checked against the bytes there are."""
    import io

    name, size = info.filename, info.file_size
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    with zf.open(info) as fh:
        while got < size:
            n = fh.readinto(view[got : min(size, got + _NPZ_CHUNK)])
            if not n:
                break
            got += n
        extra = fh.read(1)  # (the stream itself stops at the declared size; this says so)
    view.release()
    if got != size or extra:
        raise InputError(
            f"{fn}: member {name!r} holds {'more' if extra else f'only {got:,}'} bytes "
            f"{'than' if extra else 'of'} the {size:,} its header declares; the archive is "
            "damaged."
        )
    fp = io.BytesIO(buf)
    fmt = np.lib.format
    if not buf.startswith(fmt.MAGIC_PREFIX):
        raise InputError(
            f"{fn}: member {name!r} is not a .npy array; a moments file holds one plain float "
            "array per module (np.savez, or nu.moments.save_input_moments)."
        )
    version = fmt.read_magic(fp)
    if version == (1, 0):
        shape, fortran, dtype = fmt.read_array_header_1_0(fp)
    elif version == (2, 0):
        shape, fortran, dtype = fmt.read_array_header_2_0(fp)
    else:
        raise InputError(
            f"{fn}: member {name!r} is a .npy array of format version {version}; expected 1.0 or "
            "2.0 (np.savez of a plain float array)."
        )
    if dtype.hasobject:
        raise InputError(
            f"{fn}: cannot be read as .npz without pickles (member {name!r} holds Python "
            f"objects, dtype {dtype}); a moments file holds plain float arrays."
        )
    count = 1
    for d in shape:
        count *= int(d)
    start = fp.tell()
    if count * dtype.itemsize != size - start:
        raise InputError(
            f"{fn}: member {name!r} declares a {dtype} array of shape {tuple(shape)} "
            f"({count * dtype.itemsize:,} bytes) but holds {size - start:,} bytes of data; the "
            "archive is damaged."
        )
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=start)
    if fortran:
        return arr.reshape(tuple(shape)[::-1]).transpose()
    return arr.reshape(tuple(shape))


def _read_file(
    fn: str, suffix: str, data: bytes, max_bytes: int | None = None, hint: str = ""
) -> tuple[dict[str, np.ndarray], dict]:
    """``(arrays by name, header)`` of a moments file's bytes."""
    import json

    if suffix == "safetensors":
        try:
            from safetensors.numpy import load
        except ImportError:
            raise InputError(
                f"{fn}: reading .safetensors needs safetensors (pip install safetensors); or "
                "write the moments as .npz."
            ) from None
        meta = _safetensors_header(fn, data)
        try:
            arrays = load(data)
        except Exception as e:  # (safetensors raises its own SafetensorError, or TypeError)
            raise InputError(f"{fn}: cannot be read as safetensors ({_one(e)}).") from None
        header = dict(meta)
        if "data_free" in header:
            try:
                header["data_free"] = json.loads(header["data_free"])
            except ValueError:
                raise InputError(f"{fn}: its header's data_free is not a JSON list.") from None
    else:
        if not data.startswith((b"PK\x03\x04", b"PK\x05\x06")):  # (np.load would take a .npy)
            what = "a single .npy array" if data.startswith(b"\x93NUMPY") else "no zip archive"
            raise InputError(
                f"{fn}: not an .npz archive ({what}); a moments file holds one plain float "
                "array per module (np.savez, or nu.moments.save_input_moments)."
            )
        arrays = _read_npz(fn, data, max_bytes, hint)
        header = {}
        raw = arrays.pop(_NPZ_HEADER, None)
        if raw is not None:
            try:
                header = json.loads(str(raw[()]))
            except (ValueError, TypeError, IndexError):
                raise InputError(f"{fn}: its {_NPZ_HEADER} entry is not a JSON header.") from None
            if not isinstance(header, dict):
                raise InputError(f"{fn}: its {_NPZ_HEADER} entry is not a JSON mapping.")
    return arrays, header


def _one(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def load_input_moments(
    path: str | Any,
    *,
    data: bytes | None = None,
    what: str | None = None,
    max_bytes: int | None = None,
) -> dict[str, InputMoments | None]:
    """One task's input moments from a file written by :func:`save_input_moments` (or by any
    program: arrays ``(d_in, d_in)`` ``E[x x^T]`` keyed by module name, in ``.safetensors`` or
    ``.npz``; the latter read with ``allow_pickle=False``).

    Second moments are checked as :func:`input_moments_dense` checks them (square, finite,
    symmetric, positive semidefinite, nonzero) and factored; factors (``form: factor`` in the
    header) are checked 2-D, floating, finite and nonzero, and kept as they are. Names in the
    header's ``data_free`` list come back as None (the data-free geometry there).

    Args:
      path: the ``.safetensors`` or ``.npz`` file.
      data: its bytes, if already read (``netutility merge`` reads each file once, for its
        digest too).
      what: how messages name the file (default ``nu.moments.load_input_moments(<path>)``).
      max_bytes: the most bytes an ``.npz``'s arrays may take once decompressed, checked against
        the sizes the archive declares before anything is decompressed (a zip bomb is refused
        at once, in little memory) and enforced while reading. Default: :data:`NPZ_MAX_RATIO`
        (64) times the file's size, at least :data:`NPZ_MIN_BYTES` (32 MiB); files written by
        :func:`save_input_moments` or ``np.savez`` (uncompressed) always fit.

    Returns:
      ``{module name: InputMoments | None}``: one task's entry of ``input_moments=``.

    Raises:
      InputError: another suffix; a file that cannot be read as its format (an ``.npz`` whose
        members declare more than ``max_bytes`` decompressed, or hold other than they declare,
        named by file and member); an unknown header
        ``format`` or ``form``; an array that is not 2-D floating, or (second moments) not
        square, finite, symmetric, PSD; a name both in the file and its data_free list; no
        module at all.
      MissingFileError, FileAccessError: no file at ``path``, or it cannot be read.
    """
    import os

    from ..errors import FileAccessError, MissingFileError

    fn = what or f"nu.moments.load_input_moments({os.fspath(path)!r})"
    suffix = _suffix(fn, path)
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)):
            raise InputTypeError(
                f"nu.moments.load_input_moments: max_bytes is {brief(max_bytes)}; expected a "
                "number of bytes (an int) or None for the default."
            )
        if max_bytes < 0:
            raise InputError(
                f"nu.moments.load_input_moments: max_bytes={int(max_bytes)}; expected >= 0."
            )
    if data is None:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise MissingFileError(f"{fn}: no such file.") from None
        except PermissionError:
            raise FileAccessError(f"{fn}: cannot be read (permission denied).") from None
        except OSError as e:
            raise FileAccessError(f"{fn}: cannot be read ({e.strerror or e}).") from None
    hint = "" if what is not None else ", or pass a larger max_bytes="
    arrays, header = _read_file(
        fn, suffix, data, None if max_bytes is None else int(max_bytes), hint
    )
    fmt = header.get("format", MOMENTS_FORMAT)
    if fmt != MOMENTS_FORMAT:
        raise InputError(f"{fn}: its header says format {fmt!r}; expected {MOMENTS_FORMAT!r}.")
    form = header.get("form", "second_moment")
    if form not in _FORMS:
        raise InputError(f"{fn}: its header says form {form!r}; expected one of {_FORMS}.")
    data_free = header.get("data_free", [])
    if not isinstance(data_free, list) or not all(isinstance(n, str) for n in data_free):
        raise InputError(f"{fn}: its header's data_free is not a list of module names.")
    both = sorted(set(data_free) & set(arrays))
    if both:
        raise InputError(
            f"{fn}: module {short(both[0])!r} is both in the file and in its data_free list."
        )
    if not arrays and not data_free:
        raise InputError(f"{fn}: holds no module; expected {{module name: array}}.")
    out: dict[str, InputMoments | None] = {}
    for name, arr in arrays.items():
        if not np.issubdtype(arr.dtype, np.floating):
            raise InputTypeError(
                f"{fn}: module {short(name)!r} has dtype {arr.dtype}; expected floating arrays."
            )
        if form == "second_moment":
            # (a signalling NaN in the file would warn as it is cast; the check refuses it)
            with np.errstate(invalid="ignore"):
                out[name] = _from_dense(fn, name, arr)
            continue
        if arr.ndim != 2 or 0 in arr.shape:
            raise InputError(
                f"{fn}: module {short(name)!r} has a factor of shape {tuple(arr.shape)}; "
                "expected (k, d_in) with S = factor^T factor."
            )
        bad = int((~np.isfinite(arr)).sum())
        if bad:
            raise InputError(
                f"{fn}: module {short(name)!r} (factor {tuple(arr.shape)}) has {bad} non-finite "
                "entries (NaN or Inf)."
            )
        if not arr.any():
            raise InputError(
                f"{fn}: module {short(name)!r} (factor {tuple(arr.shape)}) is zero; list the "
                "module as data-free instead (None when saving)."
            )
        out[name] = InputMoments(jnp.asarray(arr))
    for name in data_free:
        out[name] = None
    return out
