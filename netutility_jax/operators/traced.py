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
descending), task ``i``'s k-th input direction is ``v_k = a G^(-1/2) U[:, k]`` (pseudo-inverse square root on ``G``'s range) and its output side
``dK^T v_k = s b^T G G^(-1/2) U[:, k]``, so the kept part is ``sum_kept v_k (dK^T v_k)^T``:
:func:`kept_directions` returns those columns and rows, the unkept ones zero. The directions do
not depend on positive scalings of ``a`` and ``b``, so they are computed from factors divided by
their largest entries, exact wherever the result is representable.

Under a trace TA runs here (every space: TA is the same in full, core and KnOTS space); the
other methods run the bucket pipeline's stages traced as one program
(:func:`netutility_jax.operators.program.merge_traced`), each module at that program's static width.
What needs the values on the host is refused by :func:`refuse_untraceable` with the way out:
model-wide TIES, elementwise methods in full space, ``isotropize``, modules merged in blocks of
rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import buckets as _buckets
from .._core import tree as _tree
from .._core.checks import check_weights_sequence
from .._core.linalg import after, eigh_batched
from .._core.tables import MaskTable, MergedTable, StackedMasks, StackedRows
from ..errors import InputError, InputTypeError
from ._plan import check_masks

__all__ = [
    "any_traced",
    "kept_directions",
    "kept_directions_many",
    "merge_traced",
    "refuse_untraceable",
    "stacked_masks",
    "traced_refusal",
]

_HI = jax.lax.Precision.HIGHEST


def any_traced(*trees: Any) -> bool:
    """Whether any leaf of ``trees`` is a tracer (the call runs inside a JAX transformation).

    flax ``nnx`` Variables are unwrapped first, so their values are what is looked at. A
    pristine :class:`MaskTable` holds host arrays, never tracers: it is not flattened (which
    would place every module's mask on the device)."""
    for tree in trees:
        if isinstance(tree, MaskTable) and tree.pristine:
            continue
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "get_value"))
        if any(isinstance(_tree.unwrap(x), jax.core.Tracer) for x in leaves):
            return True
    return False


def traced_refusal(res: Any) -> str | None:
    """Why a resolved method (:func:`registry.resolve_options`) cannot run under a
    transformation, or None."""
    if res.model_wide:
        return "trim_scope='model' (a threshold over every entry of the model, found on the host)"
    if res.spec.kind == "elementwise" and res.space == "full":
        return f"method={res.spec.name!r} in full space (dense updates merged module by module)"
    return None


def refuse_untraceable(fn: str, res: Any, options: Mapping[str, Any]) -> None:
    """:class:`InputTypeError` for a merge that cannot run under a transformation (``res``: the
    resolved method, :func:`registry.resolve_options`)."""
    why = traced_refusal(res)
    if why is not None:
        raise InputTypeError(
            f"{fn}: {why} cannot run inside jax.jit, jax.grad or jax.vmap (its selection or "
            f"output is computed on the host); call {fn} outside the transformation, or see "
            "docs/python.md, 'Composing with jit, vmap and grad'."
        )
    if options.get("isotropize"):
        raise InputTypeError(
            f"{fn}: isotropize=True cannot run inside jax.jit, jax.grad or jax.vmap (the "
            "flattened spectrum needs the merge's rank, a value); call it outside the "
            "transformation."
        )


def _sqrt_pinv(w: jax.Array, e: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(G^(1/2), G^(-1/2))`` from ``G = e diag(w) e^T`` (symmetric PSD), the inverse on the
    range (eigenvalues above ``K eps`` of the largest; the rest are zero or padded columns)."""
    tol = w.shape[-1] * jnp.finfo(w.dtype).eps * jnp.max(w, -1, keepdims=True)
    live = w > tol
    root = jnp.where(live, jnp.sqrt(jnp.where(live, w, 1)), 0)
    inv = jnp.where(live, 1 / jnp.where(live, root, 1), 0)
    half = jnp.einsum("...ik,...k,...jk->...ij", e, root, e, precision=_HI)
    ihalf = jnp.einsum("...ik,...k,...jk->...ij", e, inv, e, precision=_HI)
    return half, ihalf


def kept_directions(
    a: jax.Array, b: jax.Array, s: jax.Array, mask: jax.Array | None, *, with_sigma: bool = False
) -> tuple[jax.Array, ...]:
    """Task updates ``dK = s a b`` as their singular directions, the unkept ones zeroed.

    With ``G = a^T a``, ``H = b b^T`` and ``G^(1/2) H G^(1/2) = U diag(sigma^2 / s^2) U^T``
    (descending), ``T = G^(-1/2) U``: the k-th input direction is ``v_k = a T[:, k]`` (unit
    norm) and ``dK^T v_k = s b^T G T[:, k]``, so ``dK = sum_k v_k (dK^T v_k)^T`` and the kept
    part is the same sum over the kept ``k``. Computed from ``a`` and ``b`` divided by their
    largest entries (the directions do not depend on positive scalings); only ``r x r``
    eigenproblems and matmuls.

    Args:
      a: ``(..., d_in, r)`` input factors.
      b: ``(..., r, d_out)`` output factors.
      s: ``(...)`` scales (with any coefficient or weight multiplied in).
      mask: ``(..., r)`` bool, slot ``k`` the k-th largest singular direction (the layout of
        :func:`nu.allocate`'s masks), or None (every direction: ``(a, s b)`` as they are, unless
        ``with_sigma``).
      with_sigma: also return each slot's singular value relative to the task-module's largest
        ``(..., r)`` (0 for an all-zero update).

    Returns:
      ``la (..., d_in, r)`` (unit columns, zero where not kept) and ``lb (..., r, d_out)`` with
      ``la @ lb`` the kept part of ``dK`` (and with ``with_sigma`` the relative values).
    """
    if mask is None and not with_sigma:
        return a, b * s[..., None, None]
    (out,) = kept_directions_many([(a, b, s, mask)])
    return out if with_sigma else out[:2]


def kept_directions_many(items: Sequence[tuple]) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """:func:`kept_directions` (``with_sigma``) of several buckets ``(a, b, s, mask)``, their
    ``r x r`` eigenproblems as two batched calls in all (:func:`_linalg.eigh_batched`): one
    kernel each on an accelerator, and on CPU no two LAPACK calls in flight at once."""
    empty = [a.shape[-1] == 0 for a, *_ in items]  # rank 0 (every task): nothing to decompose
    if any(empty):
        live = kept_directions_many([it for it, e in zip(items, empty, strict=True) if not e])
        it = iter(live)
        return [
            (a, b, jnp.zeros((*a.shape[:-2], 0), a.dtype)) if e else next(it)
            for (a, b, *_), e in zip(items, empty, strict=True)
        ]
    if not items:
        return []
    prep = []
    for a, b, s, mask in items:
        am = jnp.max(jnp.abs(a), axis=(-2, -1))
        bm = jnp.max(jnp.abs(b), axis=(-2, -1))
        an = a / jnp.where(am > 0, am, 1)[..., None, None]
        bn = b / jnp.where(bm > 0, bm, 1)[..., None, None]
        g = jnp.einsum("...dk,...dl->...kl", an, an, precision=_HI)
        if mask is not None:  # on CPU: after the LAPACK calls that made the masks (scoring)
            g = after(g, mask)
        h = jnp.einsum("...ko,...lo->...kl", bn, bn, precision=_HI)
        prep.append((an, bn, g, h, s * am * bm, mask))
    roots = []
    for (w, e), (_, _, g, *_) in zip(eigh_batched([p[2] for p in prep]), prep, strict=True):
        r = g.shape[-1]
        half, ihalf = _sqrt_pinv(w, e)
        roots.append((half[..., :r, :r], ihalf[..., :r, :r]))
    ks = []
    for (half, _), (_, _, _, h, _, _) in zip(roots, prep, strict=True):
        k = jnp.einsum("...ij,...jk,...kl->...il", half, h, half, precision=_HI)
        ks.append((k + jnp.swapaxes(k, -1, -2)) / 2)
    out = []
    for (lam, u), (_, ihalf), (an, bn, g, _, size, mask) in zip(
        eigh_batched(ks), roots, prep, strict=True
    ):
        r = g.shape[-1]
        lam = jnp.maximum(lam[..., ::-1][..., :r], 0)  # descending: slot k is the k-th largest
        t = ihalf @ u[..., :r, ::-1][..., :r]
        if mask is not None:
            t = t * mask[..., None, :].astype(t.dtype)
        la = jnp.einsum("...dk,...kl->...dl", an, t, precision=_HI)
        lb = jnp.einsum("...kj,...kl,...lo->...jo", t, g, bn, precision=_HI)
        top = lam[..., :1]
        rel = jnp.sqrt(lam / jnp.where(top > 0, top, 1))
        out.append((la, lb * size[..., None, None], rel))
    return out


def stacked_masks(fn: str, masks: Mapping[str, Any], bk: _tree.Bucket, m_tasks: int):
    """The bucket's masks ``(n, M, r_max)``: a traced allocation's block as it is (checked by
    :func:`check_masks`), or the modules' masks stacked."""
    if isinstance(masks, StackedMasks) and masks.pristine:
        block = masks.blocks().get(tuple(bk.names))
        if block is not None:
            return block
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
) -> MergedTable:
    """TA of the kept components, traceable: ``{name: {"lora_a", "lora_b", "scale"}}`` as a
    :class:`MergedTable` (the factors stacked per bucket, a module sliced when it is read).

    Each module comes back at rank ``M r_max`` (see the module docstring); ``coef`` and
    ``weights`` (``(M,)`` or None) may be traced, and gradients flow to them and to the factors.
    """
    names, buckets, m_tasks = _tree.collect(adapters, fn=fn)
    if masks is not None:
        masks = check_masks(fn, masks, names, buckets, m_tasks)
    dtype = _tree.compute_dtype(buckets)
    w = None if weights is None else jnp.asarray(weights, dtype)
    items = []
    for bk in buckets:
        if bk.stacked is not None:  # (nu.stack_adapters)
            a, b, s = (x.astype(dtype) for x in bk.stacked[:3])
        else:  # a (n, M, d_in, r), b (n, M, r, d_out), s (n, M)
            a, b, s, _ = _buckets.stack_bucket(
                *_buckets.bucket_arrays(bk), d_in=bk.d_in, d_out=bk.d_out, r_max=bk.r_max,
                dtype=dtype,
            )  # fmt: skip
        factor = s * jnp.asarray(coef, dtype)
        if w is not None:
            factor = factor * w
        mask = None if masks is None else stacked_masks(fn, masks, bk, m_tasks)
        items.append((a, b, factor, mask))
    if masks is None:
        done = [kept_directions(*it) for it in items]
    else:
        done = [x[:2] for x in kept_directions_many(items)]
    blocks = []
    for bk, (la, lb) in zip(buckets, done, strict=True):
        n = len(bk.names)
        la = jnp.moveaxis(la, 1, 2).reshape(n, bk.d_in, m_tasks * bk.r_max)
        lb = lb.reshape(n, m_tasks * bk.r_max, bk.d_out)
        blocks.append((bk.names, la, lb))
    return MergedTable(names, blocks)


def _report_blocks(masks: Mapping[str, Any], names: Sequence[str]) -> list[tuple[tuple, Any]]:
    """The masks as ``(names, (n, M, r) block)`` groups: a traced allocation's blocks (and its
    all-False modules), else the modules stacked by shape."""
    if isinstance(masks, StackedMasks) and masks.pristine:
        out = list(masks.blocks().items())
        fixed = masks.fixed
    else:
        out, fixed = [], {nm: masks[nm] for nm in names}
    groups: dict[tuple, list[str]] = {}
    for nm, m in fixed.items():
        groups.setdefault(tuple(jnp.shape(m)), []).append(nm)
    out += [(tuple(g), jnp.stack([jnp.asarray(fixed[nm]) for nm in g])) for g in groups.values()]
    return out


def traced_report_fields(masks: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A traced report's counts: ``kept`` per module ``(M,)``, ``kept_per_task``,
    ``budget_spent`` and ``non_prefix_fraction`` (as :mod:`netutility_jax.analysis`, in jnp),
    computed per block of modules (a few operations per bucket; ``kept`` stays stacked, a module's
    counts sliced when read: :class:`StackedRows`)."""
    blocks = _report_blocks(masks, names)
    kept_blocks = []
    per_task = spent = sets = nonprefix = 0
    for bnames, m in blocks:
        m = jnp.asarray(m, bool)
        n = m.sum(2)  # (n, M)
        kept_blocks.append((bnames, n))
        per_task = per_task + n.sum(0)
        spent = spent + n.sum()
        prefix = jnp.arange(m.shape[2])[None, None, :] < n[..., None]
        live = n > 0
        sets = sets + live.sum()
        nonprefix = nonprefix + (live & jnp.any(m != prefix, 2)).sum()
    frac = jnp.where(sets > 0, nonprefix / jnp.maximum(sets, 1), 0.0)
    return {
        "kept": StackedRows(names, kept_blocks, {}),
        "kept_per_task": per_task,
        "budget_spent": spent / len(names),
        "non_prefix_fraction": frac,
    }


def padded_ranks(names: Sequence[str], buckets: Sequence[_tree.Bucket], m_tasks: int):
    """Each module's rank in :func:`merge_traced`'s output, ``M r_max`` (static)."""
    ranks = {nm: m_tasks * bk.r_max for bk in buckets for nm in bk.names}
    return {nm: ranks[nm] for nm in names}


def check_traced_weights(fn: str, weights: Any, m_tasks: int) -> jax.Array | None:
    """Traced (or concrete) ``weights`` as an ``(M,)`` array; their values cannot be checked."""
    if weights is None:
        return None
    check_weights_sequence(fn, weights, m_tasks)
    if isinstance(weights, Sequence):
        w = jnp.stack([jnp.asarray(x) for x in weights])
    else:
        w = jnp.asarray(weights)
    if w.shape != (m_tasks,):
        raise InputError(
            f"{fn}: weights of shape {w.shape} for {m_tasks} tasks; pass one weight per task."
        )
    if not jnp.issubdtype(w.dtype, jnp.floating) and not jnp.issubdtype(w.dtype, jnp.integer):
        raise InputTypeError(f"{fn}: weights of dtype {w.dtype}; expected real numbers.")
    return w
