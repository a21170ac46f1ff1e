"""Budgeted selection of singular directions: global, per-module, and the uniform baseline."""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from .errors import InputError, InputTypeError
from .utility import Scores

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
    e = jnp.where(cand, sigma**2, 0)
    tot = e.sum(-1, keepdims=True)
    share = jnp.where(cand, e / jnp.where(tot > 0, tot, 1), -jnp.inf)
    key = jnp.where(jnp.arange(r) < base[..., None], jnp.inf, share)
    return key.reshape(n, m_tasks * r)


@functools.partial(jax.jit, static_argnames=("budget", "scope", "positive_only"))
def _allocate_impl(utils, sigmas, *, budget, scope, positive_only):
    shapes = [u.shape for u in utils]
    if scope == "global":
        flat = jnp.concatenate([u.ravel() for u in utils])
        return _topk_mask(flat, budget * len(utils), positive_only)
    # per module: group equal shapes so each group is one batched top_k
    groups: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(shapes):
        groups.setdefault(s, []).append(i)
    out = []
    for (m_tasks, r), idx in groups.items():
        u = jnp.stack([utils[i] for i in idx])
        if scope == "local":
            key, pos = u.reshape(len(idx), m_tasks * r), positive_only
        else:
            sg = jnp.stack([sigmas[i] for i in idx])
            key, pos = _uniform_keys(sg, u > -jnp.inf, budget), False
        out.append(_topk_mask(key, budget, pos))
    return jnp.concatenate([o.ravel() for o in out])


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
    h = flat if traced else np.asarray(flat)
    pieces: list = [None] * len(shapes)
    off = 0
    for i in order:
        size = shapes[i][0] * shapes[i][1]
        pieces[i] = h[off : off + size].reshape(shapes[i])
        off += size
    return pieces if traced else jax.device_put(pieces)


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
      a time to the task whose next component has the largest energy share ``s^2 / sum(s^2)``.
      Every task keeps a spectral prefix and exactly ``min(R, candidates)`` are kept.

    With ``positive_only`` (global, local) a direction is admitted only if its utility is > 0: the
    budget need not be spent. Non-candidates (``utility = -inf``) are never selected. Ties are
    broken towards the lower module, task and slot index.

    Args:
      scores: output of :func:`nu.score`.
      budget: R, a positive integer: the average number of directions per module.
      scope: ``"global"``, ``"local"`` or ``"uniform"``.
      positive_only: admit only positive utilities (ignored by ``"uniform"``).

    Returns:
      ``{name: bool (M, r_max)}``, True where task j's k-th direction is kept.

    Raises:
      ValueError: budget not a positive integer, unknown scope.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> ads = [{f"m{l}": {"lora_a": rng.normal(size=(32, 4)), "lora_b": rng.normal(size=(4, 16))}
      ...         for l in range(2)} for _ in range(3)]
      >>> masks = nu.allocate(nu.score(ads), 4, scope="uniform")
      >>> [int(m.sum()) for m in masks.values()]
      [4, 4]
    """
    fn = "nu.allocate"
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
        raise InputError(
            f"{fn}: budget={budget!r} ({type(budget).__name__}); expected a positive integer R, the "
            "average number of directions kept per module."
        )
    if budget <= 0:
        raise InputError(
            f"{fn}: budget={budget}; expected a positive integer (directions per module)."
        )
    if scope not in SCOPES:
        raise InputError(f"{fn}: unknown scope {scope!r}; expected one of {SCOPES}.")
    if not isinstance(scores, Scores) or not scores.modules:
        raise InputTypeError(
            f"{fn}: expected the nu.Scores returned by nu.score, got {type(scores).__name__}."
        )
    names = list(scores.modules)
    utils = tuple(scores.modules[k].utility for k in names)
    sigmas = tuple(scores.modules[k].sigma for k in names)
    flat = _allocate_impl(
        utils, sigmas, budget=int(budget), scope=scope, positive_only=bool(positive_only)
    )
    masks = _split_masks(flat, [tuple(u.shape) for u in utils], scope)
    return dict(zip(names, masks, strict=True))
