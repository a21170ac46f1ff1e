"""Budgeted selection of singular directions: global, per-module, and the uniform baseline."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.checks import brief, check_bool, check_budget, check_choice, few, short
from .._core.executables import kernel
from .._core.host import put_views
from .._core.tables import MaskTable, ScoreTable, StackedMasks
from ..errors import InputError, InputTypeError
from ..scoring.utility import Scores

__all__ = ["SCOPES", "allocate", "allocate_stacked", "mask_table", "module_order", "placed_order"]

SCOPES = ("global", "local", "uniform")


def _topk_mask(key: jax.Array, k: int, positive_only: bool) -> jax.Array:
    """Boolean mask of the ``k`` largest entries of the last axis of ``key`` (batched)."""
    k = min(k, key.shape[-1])
    vals, idx = jax.lax.top_k(key, k)
    keep = vals > 0 if positive_only else vals > -jnp.inf
    zeros = jnp.zeros(key.shape, bool)
    if key.ndim == 1:
        return zeros.at[idx].set(keep)
    return jax.vmap(lambda z, i, v: z.at[i].set(v))(zeros, idx, keep)


def _uniform_keys(sigma: jax.Array, cand: jax.Array, budget: int) -> jax.Array:
    """Sort keys for the uniform rule, ``(n, M, r)`` -> ``(n, M*r)``.

    Each of the M' tasks with candidates gets ``floor(R / M')`` of its leading (largest-sigma)
    components (``+inf`` keys); leftovers go by energy share ``s^2 / sum(s^2)``, which decreases
    along each task's spectrum, so every task keeps a prefix.
    """
    n, m_tasks, r = sigma.shape
    n_cand = cand.sum(-1)  # (n, M)
    m_eff = (n_cand > 0).sum(-1, keepdims=True)  # (n, 1)
    base = jnp.minimum(budget // jnp.maximum(m_eff, 1), n_cand)  # (n, M)
    # energy share from s / s_max: sigma**2 itself overflows float32 beyond 1.8e19
    sig = jnp.where(cand, sigma, 0)
    smax = sig.max(-1, keepdims=True)
    rel = sig / jnp.where(smax > 0, smax, 1)
    e = rel**2
    tot = e.sum(-1, keepdims=True)
    share = jnp.where(cand, e / jnp.where(tot > 0, tot, 1), -jnp.inf)
    key = jnp.where(jnp.arange(r) < base[..., None], jnp.inf, share)
    return key.reshape(n, m_tasks * r)


def _bad_count(utils, sigmas) -> jax.Array:
    """How many utilities are NaN or +inf and sigmas NaN, inf or negative, over all modules:
    one reduction per dtype (of the modules concatenated), not one per module (a count per
    module is made on the host only when this is not 0: :func:`_bad_counts`)."""
    total = jnp.zeros((), jnp.int32)
    for xs, bad in (
        (utils, lambda u: jnp.isnan(u) | (u == jnp.inf)),
        (sigmas, lambda s: ~(jnp.isfinite(s) & (s >= 0))),
    ):
        by_dtype: dict[Any, list[jax.Array]] = {}
        for x in xs:
            by_dtype.setdefault(jnp.dtype(x.dtype), []).append(jnp.ravel(x))
        for group in by_dtype.values():
            total = total + jnp.sum(bad(jnp.concatenate(group)), dtype=jnp.int32)
    return total


def _bad_counts(utils, sigmas) -> np.ndarray:
    """Per module, what :func:`_bad_count` counts (numpy, for the message)."""
    out = []
    for u, s in zip(jax.device_get(utils), jax.device_get(sigmas), strict=True):
        u, s = np.asarray(u), np.asarray(s)
        out.append(int(np.sum(np.isnan(u) | (u == np.inf)) + np.sum(~(np.isfinite(s) & (s >= 0)))))
    return np.asarray(out)


@kernel(static_argnames=("budget", "scope", "positive_only"), fast_compile=True)
def _allocate_impl(utils, sigmas, *, budget, scope, positive_only):
    return _select(utils, sigmas, budget=budget, scope=scope, positive_only=positive_only), (
        _bad_count(utils, sigmas)
    )


def _select(utils, sigmas, *, budget, scope, positive_only):
    shapes = [u.shape for u in utils]
    if scope == "global":
        flat = jnp.concatenate([u.ravel() for u in utils])
        if flat.size == 0:
            return jnp.zeros((0,), bool)
        return _topk_mask(flat, budget * len(utils), positive_only)
    # per module: group equal shapes so each group is one batched top_k
    groups: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(shapes):
        groups.setdefault(s, []).append(i)
    out = []
    for (m_tasks, r), idx in groups.items():
        if r == 0:  # rank-0 modules: nothing to select
            out.append(jnp.zeros((len(idx) * m_tasks * r,), bool))
            continue
        u = jnp.stack([utils[i] for i in idx])
        if scope == "local":
            key, pos = u.reshape(len(idx), m_tasks * r), positive_only
        else:
            sg = jnp.stack([sigmas[i] for i in idx])
            key, pos = _uniform_keys(sg, u > -jnp.inf, budget), False
        out.append(_topk_mask(key, budget, pos))
    return jnp.concatenate([o.ravel() for o in out])


@functools.lru_cache(maxsize=8)
def module_order(layout: tuple) -> tuple[np.ndarray, tuple[int, ...], np.ndarray]:
    """For the live buckets' ``layout`` (per bucket its names and ``(M, r)``) in the adapters'
    module order ``layout[0]``: the gather that puts the buckets' flat utilities in module order,
    each live module's size, and the inverse gather (module order back to the buckets' order,
    for a traced allocation); numpy, so a traced call never caches a tracer."""
    names, buckets = layout
    where = {}
    off = 0
    for bnames, (m, r) in buckets:
        for i, nm in enumerate(bnames):
            where[nm] = (off + i * m * r, m * r)
        off += len(bnames) * m * r
    idx = [np.arange(where[nm][0], where[nm][0] + where[nm][1]) for nm in names if nm in where]
    perm = np.concatenate(idx).astype(np.int32) if idx else np.zeros(0, np.int32)
    inverse = np.argsort(perm).astype(np.int32)
    return perm, tuple(where[nm][1] for nm in names if nm in where), inverse


@functools.lru_cache(maxsize=8)
def placed_order(layout: tuple) -> jax.Array:
    """:func:`module_order`'s gather on the device (concrete calls only: placed once)."""
    return jax.device_put(module_order(layout)[0])


@functools.partial(
    jax.jit, static_argnames=("budget", "scope", "positive_only", "n_modules", "packed")
)
def allocate_stacked(stats, perm, *, budget, scope, positive_only, n_modules, packed=False):
    """:func:`_allocate_impl` over each live bucket's stacked fields ``(n, 4, M, r)``: one
    program whatever the module count. Global: the utilities in module order (``perm``), so
    ties go to the lower module, task and slot as before; per module: one batched top-k per
    bucket. Returns ``(masks, bad)``; with ``packed``, for a host that reads them, one bool
    vector instead: every mask raveled in that order, then ``bad > 0`` (one transfer, see
    :func:`_unpack`)."""
    utils = [st[:, 3] for st in stats]
    sigmas = [st[:, 0] for st in stats]
    bad = _bad_count(utils, sigmas)
    if scope == "global":
        flat = jnp.concatenate([u.ravel() for u in utils])[perm]
        masks = _topk_mask(flat, budget * n_modules, positive_only)
    else:
        outs = []
        for u, sg in zip(utils, sigmas, strict=True):
            n, m_tasks, r = u.shape
            if scope == "local":
                key, pos = u.reshape(n, m_tasks * r), positive_only
            else:
                key, pos = _uniform_keys(sg, u > -jnp.inf, budget), False
            outs.append(_topk_mask(key, min(budget, m_tasks * r), pos).reshape(n, m_tasks, r))
        masks = tuple(outs)
    if not packed:
        return masks, bad
    return jnp.concatenate([m.ravel() for m in jax.tree.leaves(masks)] + [(bad > 0)[None]])


def _unpack(vector: np.ndarray, stats, scope: str) -> tuple[Any, bool]:
    """``(masks, bad)`` on the host from :func:`allocate_stacked`'s packed vector: the global
    mask flat, or per bucket ``(n, M, r)``; whether any field was bad."""
    bad = bool(vector[-1])
    if scope == "global":
        return vector[:-1], bad
    outs, at = [], 0
    for st in stats:
        n, _, m_tasks, r = st.shape
        outs.append(vector[at : at + n * m_tasks * r].reshape(n, m_tasks, r))
        at += n * m_tasks * r
    return tuple(outs), bad


def _allocate_table(
    table: ScoreTable, budget: int, scope: str, positive_only: bool
) -> MaskTable | None:
    """:func:`allocate` of :func:`nu.score`'s own scores from their stacked fields, the masks
    held on the host until asked for (:class:`MaskTable`); None where a field is NaN or +inf
    (the per-module path then names the modules)."""
    parts = table.parts()
    names = list(table)
    stats = tuple(st for _, st in parts)
    shapes = tuple((st.shape[2], st.shape[3]) for st in stats)
    if not stats:
        flat, bad = None, 0
    else:
        budget = min(budget, max(1, *(m * r for m, r in shapes)))
        layout = (tuple(names), tuple((bn, sh) for (bn, _), sh in zip(parts, shapes, strict=True)))
        perm, _, inverse = module_order(layout)
        traced = any(isinstance(st, jax.core.Tracer) for st in stats)
        if not traced:
            perm = placed_order(layout)  # (placed once per layout, not every call)
        kw = {"budget": budget, "scope": scope, "positive_only": positive_only}
        kw["n_modules"] = len(names)
        out = None if traced else allocate_stacked(stats, perm, **kw, packed=True)
        if out is None or isinstance(out, jax.core.Tracer):
            # inside a transformation (traced fields, or constants under an outer trace): no
            # values to check, the masks kept per bucket
            flat, _ = allocate_stacked(stats, perm, **kw)
            return _stacked_masks(table, parts, flat, inverse, scope)
        flat, bad = _unpack(np.asarray(jax.device_get(out)), stats, scope)  # one transfer
    if bad:
        return None
    blocks = [(bn, sh) for (bn, _), sh in zip(parts, shapes, strict=True)]
    fixed = {nm: tuple(ms.utility.shape) for nm, ms in table.fixed.items()}
    return mask_table(names, blocks, fixed, flat, scope)


def mask_table(
    names: Sequence[str],
    blocks: Sequence[tuple[Sequence[str], tuple[int, int]]],
    fixed: Mapping[str, tuple[int, ...]],
    flat: Any,
    scope: str,
) -> MaskTable:
    """The :class:`MaskTable` of :func:`allocate_stacked`'s masks read to the host (``flat``:
    the global mask in module order, or per live bucket ``(n, M, r)``; None without a live
    bucket): ``blocks`` per live bucket its names and ``(M, r)``, ``fixed`` the shapes of the
    modules without one (nothing kept)."""
    host: dict[str, np.ndarray] = {}
    if flat is not None and scope == "global":
        shape_of = {nm: sh for bn, sh in blocks for nm in bn}
        off = 0
        for nm in names:
            if nm in shape_of:
                size = math.prod(shape_of[nm])
                host[nm] = flat[off : off + size].reshape(shape_of[nm])
                off += size
    elif flat is not None:
        for (bn, _), masks in zip(blocks, flat, strict=True):
            host.update((nm, masks[i]) for i, nm in enumerate(bn))
    for nm, shape in fixed.items():
        host[nm] = np.zeros(shape, bool)
    return MaskTable({nm: host[nm] for nm in names})


def _stacked_masks(table: ScoreTable, parts, flat, inverse: np.ndarray, scope: str):
    """The traced allocation's masks kept per bucket (:class:`StackedMasks`): the global top-k's
    mask, in module order, gathered back into the buckets' order and cut per bucket (a few
    operations per bucket, none per module); the per-module scopes' masks are per bucket
    already."""
    blocks = []
    if scope == "global":
        flat = flat[inverse]
        off = 0
        for names, st in parts:
            n, _, m, r = st.shape
            blocks.append((names, flat[off : off + n * m * r].reshape(n, m, r)))
            off += n * m * r
    else:
        blocks = [(names, masks) for (names, _), masks in zip(parts, flat, strict=True)]
    fixed = {nm: jnp.zeros(tuple(ms.utility.shape), bool) for nm, ms in table.fixed.items()}
    return StackedMasks(list(table), blocks, fixed)


def _split_masks(flat: jax.Array, shapes: list[tuple[int, int]], scope: str) -> list[jax.Array]:
    """Cut the flat mask of ``_allocate_impl`` back into per-module masks (on the host).

    Many sliced outputs inside the jitted graph cost seconds of XLA compile time; traced inputs
    are sliced in the graph instead.
    """
    if scope == "global":
        order = list(range(len(shapes)))
    else:  # module groups of equal shape, in first-appearance order, as in _allocate_impl
        groups: dict[tuple[int, int], list[int]] = {}
        for i, s in enumerate(shapes):
            groups.setdefault(s, []).append(i)
        order = [i for idx in groups.values() for i in idx]
    traced = isinstance(flat, jax.core.Tracer)
    h = flat if traced else jax.device_get(flat)
    pieces: list = [None] * len(shapes)
    off = 0
    for i in order:
        size = shapes[i][0] * shapes[i][1]
        pieces[i] = h[off : off + size].reshape(shapes[i])
        off += size
    # (on the default device, uncommitted, as jax.device_put(pieces) puts them)
    return pieces if traced else put_views(pieces)


def _check_scores(fn: str, scores: Any) -> list[str]:
    if not isinstance(scores, Scores):
        raise InputTypeError(
            f"{fn}: expected the nu.Scores returned by nu.score, got {type(scores).__name__}."
        )
    if not isinstance(scores.modules, Mapping) or not scores.modules:
        raise InputError(f"{fn}: scores.modules is empty; expected the nu.Scores of nu.score.")
    names = list(scores.modules)
    bad_type, bad_shape = [], []
    shapes = {}
    floating: dict[Any, bool] = {}  # per dtype (a handful), not per module

    def is_floating(x: Any) -> bool:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            return False
        dt = x.dtype
        try:
            return floating[dt]
        except (KeyError, TypeError):  # (TypeError: an unhashable dtype-like, not cached)
            ok = bool(jnp.issubdtype(dt, jnp.floating))
        try:
            floating[dt] = ok
        except TypeError:
            pass
        return ok

    for nm in names:
        ms = scores.modules[nm]
        u = getattr(ms, "utility", None)
        sg = getattr(ms, "sigma", None)
        if not (is_floating(u) and is_floating(sg)):
            bad_type.append(nm)
            continue
        if len(u.shape) != 2 or tuple(sg.shape) != tuple(u.shape):
            bad_shape.append(nm)
            continue
        shapes[nm] = tuple(u.shape)
    if bad_type:
        raise InputTypeError(
            f"{fn}: scores of {few(bad_type)} lack floating 'utility' and 'sigma' arrays; "
            "expected the nu.Scores returned by nu.score."
        )
    if bad_shape:
        nm = bad_shape[0]
        ms = scores.modules[nm]
        raise InputError(
            f"{fn}: scores of {few(bad_shape)}: utility {tuple(ms.utility.shape)} and sigma "
            f"{tuple(ms.sigma.shape)} (first one) must be equal and 2-D (M, r_max); expected the "
            "nu.Scores returned by nu.score."
        )
    tasks = {s[0] for s in shapes.values()}
    if len(tasks) > 1:
        raise InputError(
            f"{fn}: the modules' scores disagree on the number of tasks M ({sorted(tasks)}); "
            "expected the nu.Scores returned by nu.score."
        )
    return names


def allocate(
    scores: Scores,
    budget: int,
    *,
    scope: str = "global",
    positive_only: bool = True,
) -> dict[str, jax.Array]:
    """Select directions under a budget of R per module on average (paper Eq. per-layer-allocation).

    * ``"global"``: the top ``L * R`` utilities over all L modules and all tasks, one
      ``lax.top_k`` on the concatenated utilities; budget moves freely between modules and tasks.
    * ``"local"``: the top R utilities within each module (the paper's scope for TIES and DARE).
    * ``"uniform"``: the paper's baseline. Per module, each of the M' tasks with candidates keeps
      its ``floor(R / M')`` largest-sigma components (or all it has); the leftover slots go one at
      a time to the task whose next component has the largest energy share ``s^2 / sum(s^2)``
      (computed from ``s / s_max``, so any finite sigma works). Every task keeps a spectral
      prefix and exactly ``min(R, candidates)`` are kept.

    With ``positive_only`` (global, local) a direction is admitted only if its utility is > 0: the
    budget need not be spent. Non-candidates (``utility = -inf``) are never selected. Ties are
    broken towards the lower module, task and slot index. A budget at or above the number of
    candidates keeps them all, in every scope, for any integer budget (``2**40`` too). Scores
    without any candidate (every utility ``-inf``) give all-False masks.

    Args:
      scores: output of :func:`nu.score`.
      budget: R, a positive integer (Python or numpy int; not a float or bool): the average number
        of directions per module.
      scope: ``"global"``, ``"local"`` or ``"uniform"``.
      positive_only: admit only positive utilities (ignored by ``"uniform"``); a ``bool``.

    Returns:
      ``{name: bool (M, r_max)}``, True where task j's k-th direction is kept.

    Raises:
      InputError: (a ``ValueError``) budget <= 0, unknown scope string, scores whose arrays do not
        have the shapes of nu.score's, or (on concrete scores) a NaN or +inf utility or a NaN,
        infinite or negative sigma.
      InputTypeError: (a ``TypeError``) scores not a nu.Scores, budget not an integer, scope not
        a string, positive_only not a bool.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> ads = [{f"m{l}": {"lora_a": rng.normal(size=(32, 4)), "lora_b": rng.normal(size=(4, 16))}
      ...         for l in range(2)} for _ in range(3)]
      >>> masks = nu.allocate(nu.score(ads), 4, scope="uniform")
      >>> [int(m.sum()) for m in masks.values()]
      [4, 4]
      >>> [int(m.sum()) for m in nu.allocate(nu.score(ads), 2**40, scope="uniform").values()]
      [12, 12]
    """
    fn = "nu.allocate"
    budget = check_budget(fn, budget)
    if isinstance(scope, str) and scope not in SCOPES:  # tests pin this wording
        raise InputError(f"{fn}: unknown scope {brief(scope)}; expected one of {SCOPES}.")
    check_choice(fn, "scope", scope, SCOPES)
    positive_only = check_bool(fn, "positive_only", positive_only)
    if (
        isinstance(scores, Scores)
        and isinstance(scores.modules, ScoreTable)
        and scores.modules.pristine
    ):
        masks = _allocate_table(scores.modules, budget, scope, positive_only)
        if masks is not None:
            return masks
    names = _check_scores(fn, scores)
    utils = tuple(scores.modules[k].utility for k in names)
    sigmas = tuple(scores.modules[k].sigma for k in names)
    # R at or above a module's slots keeps all of them: cap it (exact, and a small static int)
    budget = min(budget, max(1, *(math.prod(u.shape) for u in utils)))
    flat, bad = _allocate_impl(
        utils, sigmas, budget=budget, scope=scope, positive_only=positive_only
    )
    if not isinstance(bad, jax.core.Tracer):
        flat, bad = jax.device_get((flat, bad))  # both in one round trip
        if bad:
            b = _bad_counts(utils, sigmas)
            hit = [nm for nm, c in zip(names, b, strict=True) if c]
            nm = hit[0]
            raise InputError(
                f"{fn}: scores of {few(hit)} hold NaN or +inf utilities, or NaN, infinite "
                f"or negative sigmas ({int(b[names.index(nm)])} such entries in {short(nm)!r}"
                "); nu.score never returns these on concrete inputs: were the scores computed "
                "under jit from NaN/Inf factors (see nu.score's checked=)?"
            )
    masks = _split_masks(flat, [tuple(u.shape) for u in utils], scope)
    return dict(zip(names, masks, strict=True))
