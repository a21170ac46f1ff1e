"""Merges inside ``jax.jit``, ``jax.grad`` and ``jax.vmap``: one traceable program over stacked
buckets.

A merge outside a transformation returns each module at the rank its kept directions need, which
depends on the values (the masks). Inside one, shapes must be static, so :func:`merge_traced`
returns every module at the padded rank ``M r_max`` (task ``i``'s slots in columns
``i r_max .. (i + 1) r_max``, the directions it does not keep as zero columns): the same update,
in factors of a static shape. Everything is batched over the modules of a bucket and the tasks:
only matmuls and ``r x r`` symmetric eigenproblems (batched small kernels, which accelerators run
as one call), no Householder QR and no host round trip.

The kept part of task ``i``'s update in one module (``dK = s a b``, ``a (d_in, r)``,
``b (r, d_out)``) is the projection of ``dK`` onto its kept input directions. With ``G = a^T a``,
``H = b b^T`` and the eigendecomposition ``G^(1/2) H G^(1/2) = U diag(sigma^2 / s^2) U^T`` (sigma
descending), task ``i``'s k-th input direction is ``a G^(-1/2) U[:, k]``, so the projection is
``s a C b`` with the ``r x r`` matrix ``C = G^(-1/2) U_kept U_kept^T G^(1/2)`` (pseudo-inverse
square roots on ``G``'s range). ``C`` is invariant to any positive scaling of ``a``, ``b`` or
``s``, so it is computed from factors divided by their largest entries: the merged factors are
``a C * (s coef w)`` and ``b``, exact wherever the result is representable. With every direction
kept, ``C`` is the projector onto ``G``'s range and ``a C = a``.

Supported under a trace: method ``"ta"`` in every space (TA is the same in full, core and KnOTS
space). The others' output ranks or selections depend on the values through host-side steps of
the in-memory engine; they are refused by :func:`refuse_untraceable` with the way out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _buckets, _tree
from .._plan import check_masks
from ..errors import InputError, InputTypeError

__all__ = [
    "TRACEABLE_METHODS",
    "any_traced",
    "kept_factors",
    "merge_traced",
    "refuse_untraceable",
]

#: the methods a merge runs under ``jax.jit`` / ``grad`` / ``vmap`` (any space)
TRACEABLE_METHODS = ("ta",)

_HI = jax.lax.Precision.HIGHEST


def any_traced(*trees: Any) -> bool:
    """Whether any leaf of ``trees`` is a tracer (the call runs inside a JAX transformation).

    flax ``nnx`` Variables are unwrapped first, so their values are what is looked at."""
    for tree in trees:
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "get_value"))
        if any(isinstance(_tree.unwrap(x), jax.core.Tracer) for x in leaves):
            return True
    return False


def refuse_untraceable(fn: str, method: str, options: Mapping[str, Any]) -> None:
    """:class:`InputTypeError` for a merge that cannot run under a transformation."""
    if method not in TRACEABLE_METHODS:
        raise InputTypeError(
            f"{fn}: method={method!r} cannot run inside jax.jit, jax.grad or jax.vmap (its "
            "selection or output ranks are computed from the values on the host). Under a "
            f"transformation {fn} supports method='ta' (in any space, with any masks); call "
            f"{fn} with method={method!r} outside the transformation, or see docs/python.md, "
            "'Composing with jit, vmap and grad'."
        )
    if options.get("isotropize"):
        raise InputTypeError(
            f"{fn}: isotropize=True cannot run inside jax.jit, jax.grad or jax.vmap (the "
            "flattened spectrum needs the merge's rank, a value); call it outside the "
            "transformation."
        )


def _sqrt_pinv(g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(G^(1/2), G^(-1/2))`` of symmetric PSD ``g (..., r, r)``, the inverse on the range
    (eigenvalues above ``r eps`` of the largest; the rest are the zero or padded columns)."""
    w, e = jnp.linalg.eigh(g)
    tol = g.shape[-1] * jnp.finfo(g.dtype).eps * jnp.max(w, -1, keepdims=True)
    live = w > tol
    root = jnp.where(live, jnp.sqrt(jnp.where(live, w, 1)), 0)
    inv = jnp.where(live, 1 / jnp.where(live, root, 1), 0)
    half = jnp.einsum("...ik,...k,...jk->...ij", e, root, e, precision=_HI)
    ihalf = jnp.einsum("...ik,...k,...jk->...ij", e, inv, e, precision=_HI)
    return half, ihalf


def _normalised(x: jax.Array) -> jax.Array:
    """``x`` over its largest absolute entry per matrix (zeros stay zeros)."""
    m = jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True)
    return x / jnp.where(m > 0, m, 1)


def kept_factors(a: jax.Array, b: jax.Array, mask: jax.Array | None) -> jax.Array:
    """``C (..., r, r)`` with ``s a C b`` the part of ``dK = s a b`` on its kept directions.

    Args:
      a: ``(..., d_in, r)`` input factors.
      b: ``(..., r, d_out)`` output factors.
      mask: ``(..., r)`` bool, slot ``k`` the k-th largest singular direction (the layout of
        :func:`nu.allocate`'s masks), or None (every direction).

    Returns:
      ``(..., r, r)``; scale-free (any positive scaling of ``a`` or ``b`` gives the same ``C``).
    """
    an, bn = _normalised(a), _normalised(b)
    g = jnp.einsum("...dk,...dl->...kl", an, an, precision=_HI)
    half, ihalf = _sqrt_pinv(g)
    if mask is None:
        return ihalf @ half
    h = jnp.einsum("...ko,...lo->...kl", bn, bn, precision=_HI)
    k = jnp.einsum("...ij,...jk,...kl->...il", half, h, half, precision=_HI)
    k = (k + jnp.swapaxes(k, -1, -2)) / 2
    _, u = jnp.linalg.eigh(k)
    u = u[..., ::-1]  # descending singular values: slot k is the k-th largest
    uk = u * mask[..., None, :].astype(u.dtype)
    return jnp.einsum("...ij,...kj,...kl->...il", ihalf @ uk, uk, half, precision=_HI)


def _stacked_masks(fn: str, masks: Mapping[str, Any], bk: _tree.Bucket, m_tasks: int):
    rows = []
    for name in bk.names:
        m = masks[name]
        shape = tuple(getattr(m, "shape", np.shape(m)))
        if shape != (m_tasks, bk.r_max):
            raise InputError(
                f"{fn}: mask of module {name!r} has shape {shape}; expected (M, r_max) = "
                f"({m_tasks}, {bk.r_max}) (tasks x the module's largest rank)."
            )
        rows.append(jnp.asarray(m, bool))
    return jnp.stack(rows)


def merge_traced(
    fn: str,
    adapters: Sequence[Any],
    masks: Mapping[str, Any] | None,
    *,
    coef: Any,
    weights: Any = None,
) -> dict[str, dict[str, jax.Array]]:
    """TA of the kept components, traceable: ``{name: {"lora_a", "lora_b", "scale"}}``.

    Each module comes back at rank ``M r_max`` (see the module docstring); ``coef`` and
    ``weights`` (``(M,)`` or None) may be traced, and gradients flow to them and to the factors.
    """
    names, buckets, m_tasks = _tree.collect(adapters, fn=fn)
    if masks is not None:
        masks = check_masks(fn, masks, names, buckets, m_tasks)
    dtype = _tree.compute_dtype(buckets)
    w = None if weights is None else jnp.asarray(weights, dtype)
    out: dict[str, dict[str, jax.Array]] = {}
    for bk in buckets:
        a, b, s, _ = _buckets.stack_bucket(
            *_buckets.bucket_arrays(bk), d_in=bk.d_in, d_out=bk.d_out, r_max=bk.r_max, dtype=dtype
        )  # a (n, M, d_in, r), b (n, M, r, d_out), s (n, M)
        mask = None if masks is None else _stacked_masks(fn, masks, bk, m_tasks)
        c = kept_factors(a, b, mask)  # (n, M, r, r)
        factor = s * jnp.asarray(coef, dtype)
        if w is not None:
            factor = factor * w
        la = jnp.einsum("nmdk,nmkl->nmdl", a, c, precision=_HI) * factor[..., None, None]
        n = len(bk.names)
        la = jnp.moveaxis(la, 1, 2).reshape(n, bk.d_in, m_tasks * bk.r_max)
        lb = b.reshape(n, m_tasks * bk.r_max, bk.d_out)
        one = jnp.ones((), dtype)
        for i, name in enumerate(bk.names):
            out[name] = {"lora_a": la[i], "lora_b": lb[i], "scale": one}
    return {nm: out[nm] for nm in names}


def traced_report_fields(masks: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A traced report's counts: ``kept`` per module ``(M,)``, ``kept_per_task``,
    ``budget_spent`` and ``non_prefix_fraction`` (as :mod:`netutility_jax.analysis`, in jnp)."""
    kept = {nm: jnp.sum(jnp.asarray(masks[nm]), 1) for nm in names}
    per_task = sum(kept.values())
    spent = sum(jnp.sum(k) for k in kept.values()) / len(names)
    sets = nonprefix = jnp.zeros((), jnp.int32)
    for nm in names:
        m = jnp.asarray(masks[nm])
        n = m.sum(1)
        prefix = jnp.arange(m.shape[1])[None, :] < n[:, None]
        live = n > 0
        sets = sets + live.sum()
        nonprefix = nonprefix + (live & jnp.any(m != prefix, 1)).sum()
    frac = jnp.where(sets > 0, nonprefix / jnp.maximum(sets, 1), 0.0)
    return {
        "kept": kept,
        "kept_per_task": per_task,
        "budget_spent": spent,
        "non_prefix_fraction": frac,
    }


def padded_ranks(adapters: Sequence[Any], fn: str) -> dict[str, int]:
    """Each module's rank in :func:`merge_traced`'s output, ``M r_max`` (static)."""
    names, buckets, m_tasks = _tree.collect(adapters, fn=fn)
    ranks = {nm: m_tasks * bk.r_max for bk in buckets for nm in bk.names}
    return {nm: ranks[nm] for nm in names}


def check_traced_weights(fn: str, weights: Any, m_tasks: int) -> jax.Array | None:
    """Traced (or concrete) ``weights`` as an ``(M,)`` array; their values cannot be checked."""
    if weights is None:
        return None
    if isinstance(weights, (str, bytes, Mapping)) or not hasattr(weights, "__len__"):
        raise InputTypeError(
            f"{fn}: weights={type(weights).__name__}; expected a sequence of {m_tasks} numbers, "
            "one per task."
        )
    w = (
        jnp.stack([jnp.asarray(x) for x in weights])
        if isinstance(weights, Sequence)
        else (jnp.asarray(weights))
    )
    if w.shape != (m_tasks,):
        raise InputError(
            f"{fn}: weights of shape {w.shape} for {m_tasks} tasks; pass one weight per task."
        )
    if not jnp.issubdtype(w.dtype, jnp.floating) and not jnp.issubdtype(w.dtype, jnp.integer):
        raise InputTypeError(f"{fn}: weights of dtype {w.dtype}; expected real numbers.")
    return w
