"""Grams of a bucket's factors, scale-safely: the only ``d``-sized work of scoring.

:func:`grams` gives, per module, the Gram of the task-stacked input factors ``a' ^T a'`` (all task
pairs, or each task alone) and each task's ``b' b'^T``, on factors divided by powers of two so that
neither overflows nor flushes to zero, with the exponents and the scale kept apart exactly
(docs/math.md §8, §10). Three routes (:data:`ROUTES`) trade speed for range; see
:func:`safe_grams`.

From the per-(module, task) leaves (:class:`_buckets.Leaves`, what :func:`nu.score` passes its
kernel), the raw route never stacks the whole bucket: :func:`leaf_grams` takes a few modules at a
time, each group's ``X = [a_1 .. a_M]`` made right before its Gram and chained to the previous
group through data, so XLA keeps one group's copy alive instead of every module's (on XLA:CPU a
bucket-sized temporary is fresh memory every call: its page faults cost as much as the Gram).
The Gram of stacked factors (:data:`CROSS`) is the same product, ``X^T X`` batched over modules,
so both give the same bits (tests/test_utility.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._core.buckets import Leaves
from .._core.linalg import exponent, pow2, pow2_normalise

__all__ = [
    "CROSS",
    "PER_TASK",
    "ROUTES",
    "GramKind",
    "Grams",
    "RawGrams",
    "grams",
    "leaf_grams",
    "moment_grams",
    "safe_grams",
]

_HI = jax.lax.Precision.HIGHEST


# Largest |log2| of a task-module's largest factor entry for which the Grams of the raw factors
# are exact up to rounding: entries at most 2^40 square to at most d 2^80 (no overflow), and a
# product that underflows (< 2^-126) is below 2^-46 of the largest entry squared (>= 2^-80).
_RAW_GRAM_RANGE = 40


class Grams(NamedTuple):
    """Grams of the factors divided by powers of two (largest entry in ``[0.5, 1)``), and the
    scale likewise: the update is ``2^exp * scale a' b'`` (see :func:`grams`)."""

    g: jax.Array  # (n, M, r, M, r) = a'_i^T a'_j blocks
    gii: jax.Array  # (n, M, r, r)
    h: jax.Array  # (n, M, r, r) = b'_i b'_i^T
    scale: jax.Array  # (n, M), |scale'| in [0.5, 1) (or 0)
    exp: jax.Array  # (n, M) int32
    nonfinite: jax.Array  # (n, M, 3) int32: NaN/Inf entries of lora_a, lora_b, scale (read as 0)
    raw_ok: jax.Array  # () bool: see safe_grams
    # (n, M, r, M, r) = b'_i b'_j^T blocks, all task pairs: only for the sign-aware score
    # (``interference="signed"``, the output sides of the directions), else None
    hb: jax.Array | None = None


class GramKind(NamedTuple):
    """How a kernel forms the Gram of the input factors ``a (n, M, d_in, r)``."""

    gram: Any  # a -> Gram
    diag: Any  # Gram -> (n, M, r) squared column norms
    rescale: Any  # (Gram, ea (n, M)) -> Gram of a * 2^-ea, for |ea| <= _RAW_GRAM_RANGE + 1


# Modules per group of leaf_grams: at most this many groups per bucket (compile time grows with
# them), and groups of at least _GROUP_BYTES of factors (smaller ones gain nothing).
_MAX_GROUPS = 64
_GROUP_BYTES = 2 << 20


def _columns_gram(x: jax.Array, m_tasks: int) -> jax.Array:
    """``X^T X`` of ``x (n, d_in, M r)`` (tasks side by side) as ``(n, M, r, M, r)`` blocks."""
    n, _, mr = x.shape
    g = jnp.einsum("ndk,ndl->nkl", x, x, precision=_HI)
    return g.reshape(n, m_tasks, mr // m_tasks, m_tasks, mr // m_tasks)


def _cross_gram(a: jax.Array) -> jax.Array:
    """All task pairs' ``a_i^T a_j`` of stacked ``a (n, M, d_in, r)``: one ``X^T X`` per module
    with ``X = [a_1 .. a_M]``, as :func:`leaf_grams` computes it (the same bits)."""
    n, m_tasks, d_in, r = a.shape
    x = jnp.swapaxes(a, 1, 2).reshape(n, d_in, m_tasks * r)
    return _columns_gram(x, m_tasks)


# rescale: exponents are within +-(_RAW_GRAM_RANGE + 1) there, so one power of two is exact
CROSS = GramKind(  # all task pairs: (n, M, r, M, r)
    _cross_gram,
    lambda g: jnp.einsum("nikik->nik", g),
    lambda g, e: g * pow2(-(e[:, :, None, None, None] + e[:, None, None, :, None]), g.dtype),
)
PER_TASK = GramKind(  # each task alone: (n, M, r, r)
    lambda a: jnp.einsum("nidk,nidl->nikl", a, a, precision=_HI),
    lambda g: jnp.einsum("nikk->nik", g),
    lambda g, e: g * pow2(-2 * e[..., None, None], g.dtype),
)


def _b_gram(b: jax.Array) -> jax.Array:
    return jnp.einsum("nikd,nild->nikl", b, b, precision=_HI)


def _b_cross_gram(b: jax.Array) -> jax.Array:
    """All task pairs' ``b_i b_j^T`` of stacked ``b (n, M, r, d_out)``: ``(n, M, r, M, r)``."""
    return jnp.einsum("nikd,njld->nikjl", b, b, precision=_HI)


def _b_cross_rescale(hb: jax.Array, eb: jax.Array) -> jax.Array:
    """The cross Gram of ``b * 2^-eb`` from the raw one (``|eb| <= _RAW_GRAM_RANGE + 1``)."""
    return hb * pow2(-(eb[:, :, None, None, None] + eb[:, None, None, :, None]), hb.dtype)


ROUTES = ("raw", "normalise", "cond")


class RawGrams(NamedTuple):
    """The Grams of the raw factors and each task-module's largest entries (the raw route)."""

    ga: jax.Array  # the kind's Gram of a
    h: jax.Array  # (n, M, r, r) = b_i b_i^T
    amax: jax.Array  # (n, M): max |a|
    bmax: jax.Array  # (n, M): max |b|
    hb: jax.Array | None = None  # (n, M, r, M, r) = b_i b_j^T (``cross_b``), else None


def _raw_grams(a: jax.Array, b: jax.Array, kind: GramKind, cross_b: bool = False) -> RawGrams:
    return RawGrams(
        kind.gram(a),
        _b_gram(b),
        jnp.max(jnp.abs(a), axis=(-2, -1), initial=0.0),
        jnp.max(jnp.abs(b), axis=(-2, -1), initial=0.0),
        _b_cross_gram(b) if cross_b else None,
    )


def _after(x: jax.Array, dep: Any) -> jax.Array:
    """``x`` plus an exact zero computed from ``dep``: a data dependency that orders XLA's work
    (never NaN, whatever ``dep`` holds; ``x`` unchanged but for the sign of a zero)."""
    if dep is None:
        return x
    z = jnp.isnan(dep.reshape(-1)[0]).astype(x.dtype) * jnp.zeros((), x.dtype)
    return x + z


def leaf_grams(leaves: Leaves, after: Any = None, cross_b: bool = False) -> RawGrams:
    """:class:`RawGrams` of the :data:`CROSS` kind from a bucket's leaves, a group of modules at
    a time (see the module docstring), each group's stacking after ``after`` (an array: the
    previous bucket's last output, or None) and the previous group's Grams; with ``cross_b``
    also every task pair's ``b_i b_j^T``."""
    pad_a, pad_b = leaves.padders()
    n = len(leaves.a)
    m_tasks = len(leaves.a[0])
    itemsize = jnp.dtype(leaves.dtype).itemsize
    per = max(1, m_tasks * leaves.r_max * (leaves.d_in + leaves.d_out) * itemsize)
    size = max(-(-n // _MAX_GROUPS), min(n, max(1, _GROUP_BYTES // per)))
    parts = []
    for s in range(0, n, size):
        rows_a = [[pad_a(x) for x in row] for row in leaves.a[s : s + size]]
        rows_b = [[pad_b(x) for x in row] for row in leaves.b[s : s + size]]
        rows_a[0][0] = _after(rows_a[0][0], after)
        rows_b[0][0] = _after(rows_b[0][0], after)
        x = jnp.stack([jnp.concatenate(row, 1) for row in rows_a])  # (c, d_in, M r)
        b = jnp.stack([jnp.stack(row) for row in rows_b])  # (c, M, r, d_out)
        ga, h = _columns_gram(x, m_tasks), _b_gram(b)
        # max |a| per task: over d_in first (the minor axis stays whole), then over r
        amax = jnp.max(jnp.max(jnp.abs(x), axis=1).reshape(-1, m_tasks, leaves.r_max), axis=-1)
        bmax = jnp.max(jnp.abs(b), axis=(-2, -1))
        parts.append(RawGrams(ga, h, amax, bmax, _b_cross_gram(b) if cross_b else None))
        after = h
    fields = zip(*parts, strict=True)
    return RawGrams(
        *(None if f[0] is None else jnp.concatenate(f) if len(parts) > 1 else f[0] for f in fields)
    )


def safe_grams(
    a: jax.Array, b: jax.Array, scale: jax.Array, kind: GramKind, route: str
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Grams of ``a`` and ``b`` divided by powers of two, and the scale likewise (scale-safe).

    Each task-module's ``lora_a``, ``lora_b`` and ``scale`` are divided by the power of two that
    brings their largest entry into ``[0.5, 1)``. ``route`` says how, for the factors:

    * ``"raw"``: on the Grams of the raw factors (exact, ``(M r)``-sized, one max-reduction over
      the factors as the only extra work). Exact only when every largest entry is finite and
      within ``2^+-40``, which the returned ``raw_ok`` says; otherwise the result is to be
      discarded and the call repeated with ``"normalise"`` (eager callers do this).
    * ``"normalise"``: on the factors themselves, before the Grams (one more pass over the
      factors); non-finite entries are zeroed and counted. Exact for any input.
    * ``"cond"``: ``"raw"`` when ``raw_ok``, else ``"normalise"``, chosen at run time by
      ``lax.cond`` (for traced calls, where the eager retry is impossible).

    Returns:
      ``(ga, h, scale', exp, nonfinite, raw_ok)``: ``h = b' b'^T (n, M, r, r)``, ``scale' (n, M)``,
      ``exp (n, M)`` int32 with ``scale a b = 2^exp scale' a' b'``, ``nonfinite (n, M, 3)`` int32
      (NaN/Inf entries of lora_a, lora_b, scale, read as 0; 0 on the raw route, whose inputs are
      finite when ``raw_ok``), and the scalar bool ``raw_ok``.
    """
    return _safe(lambda: _raw_grams(a, b, kind), lambda: (a, b), scale, kind, route)[:6]


def _safe(
    raw: Callable[[], RawGrams],
    stacked: Callable[[], tuple[jax.Array, jax.Array]],
    scale: jax.Array,
    kind: GramKind,
    route: str,
    cross_b: bool = False,
) -> tuple:
    """:func:`safe_grams` from ``raw()`` (called unless the route is ``"normalise"``) and
    ``stacked()``, the factors ``(a, b)`` stacked (called only where ``"normalise"`` runs),
    with a seventh entry: with ``cross_b`` every task pair's ``b'_i b'_j^T`` (``raw()`` then
    gives :attr:`RawGrams.hb`), else None."""
    s, es, ns = pow2_normalise(scale, ())

    def normalised():
        a, b = stacked()
        a2, ea, na = pow2_normalise(a, (-2, -1))
        b2, eb, nb = pow2_normalise(b, (-2, -1))
        hb = _b_cross_gram(b2) if cross_b else None
        return kind.gram(a2), _b_gram(b2), ea + eb, jnp.stack([na, nb], -1), hb

    if route == "normalise":
        gs, hs, e_ab, bad, hbs = normalised()
        raw_ok = jnp.ones((), bool)
    else:
        ga, h, amax, bmax, hb = raw()
        lo, hi = 2.0**-_RAW_GRAM_RANGE, 2.0**_RAW_GRAM_RANGE

        def in_range(x):
            return (x == 0) | ((x >= lo) & (x <= hi))

        # a max-reduction may skip NaN; the Gram diagonals (sums of squares) never do
        raw_ok = (
            jnp.isfinite(kind.diag(ga)).all(-1)
            & jnp.isfinite(jnp.einsum("nikk->nik", h)).all(-1)
            & in_range(amax)
            & in_range(bmax)
        ).all()

        def from_raw():
            ea, eb = exponent(amax), exponent(bmax)
            hs = h * pow2(-2 * eb[..., None, None], h.dtype)
            hbs = _b_cross_rescale(hb, eb) if cross_b else None
            return kind.rescale(ga, ea), hs, ea + eb, jnp.zeros((*ea.shape, 2), jnp.int32), hbs

        if route == "raw":
            gs, hs, e_ab, bad, hbs = from_raw()
        else:
            gs, hs, e_ab, bad, hbs = jax.lax.cond(raw_ok, from_raw, normalised)
    return gs, hs, s, e_ab + es, jnp.concatenate([bad, ns[..., None]], -1), raw_ok, hbs


def grams(
    a: jax.Array | Leaves,
    b: jax.Array | None,
    scale: jax.Array,
    route: str,
    after: Any = None,
    cross_b: bool = False,
) -> Grams:
    """Stage 1: the only d-sized work, two Grams per module, scale-safe (see
    :func:`safe_grams`), from the stacked factors ``a``, ``b``, or from a bucket's
    :class:`_buckets.Leaves` ``a`` (``b`` None; :func:`leaf_grams`, after ``after``). With
    ``cross_b`` (the sign-aware score) also every task pair's ``b'_i b'_j^T``
    (:attr:`Grams.hb`): a third ``d_out``-sized product, ``M`` times the per-task one."""
    if isinstance(a, Leaves):
        leaves = a
        g, h, s, e, nonfinite, raw_ok, hb = _safe(
            lambda: leaf_grams(leaves, after, cross_b), leaves.stack, scale, CROSS, route, cross_b
        )
    else:
        g, h, s, e, nonfinite, raw_ok, hb = _safe(
            lambda: _raw_grams(a, b, CROSS, cross_b), lambda: (a, b), scale, CROSS, route, cross_b
        )
    return Grams(g, jnp.einsum("nikil->nikl", g), h, s, e, nonfinite, raw_ok, hb)


def moment_grams(f: jax.Array, a: jax.Array, iso: Any = None) -> tuple[jax.Array, jax.Array]:
    """``a^T S a = (F a)^T (F a)`` per task-module, ``(n, M, r, r)``, up to a positive factor,
    and ``tr(S)`` ``(n, M)`` in the same units (``||F||_F^2``).

    ``f (n, M, k, d_in)`` is each task-module's input-moment factor (``S = F^T F``), ``a (n, M,
    d_in, r)`` its input factor. ``F`` and ``a`` are each divided by a power of two (largest entry
    in ``[0.5, 1)``, for ``F``: of the order of ``||F||_F``, applied to the product ``F a'`` when
    ``||F||_F^2`` is within ``2^+-100``, which saves a pass over ``F``), so nothing overflows
    whatever their size; the result is therefore
    ``a^T S a`` times a positive number per task-module, which the data-aware score cancels (it
    normalises each task by its own energy under its own ``S``). The second ``d``-sized product
    of scoring, ``O(k d_in r)`` per task-module; a NaN/Inf in ``f`` makes that task-module's
    result NaN (traced calls; eager calls refuse such input before).

    ``iso (n, M)`` bool marks task-modules without a factor (their result is not used).

    ``a`` is divided by the same power of two as in :func:`safe_grams` (its largest entry's), so
    with the scoring's unit input directions ``v = a' T``, ``T^T q T = V^T S' V`` and
    ``v^T S' v / tr`` is the share of the inputs' energy along ``v`` (the score's noise floor).
    """
    a2, _, _ = pow2_normalise(a, (-2, -1))
    # ||F||_F^2 is one fast pass (a max-reduction over F is several times slower on XLA:CPU);
    # within 2^+-100 it sets the power of two, applied to the small product F a' afterwards
    ss = jnp.sum(f * f, axis=(-2, -1))
    lo, hi = 2.0**-100, 2.0**100
    # (a zero sum is a factor too small to square, unless the task-module has none: ``iso``)
    skip = jnp.zeros(ss.shape, bool) if iso is None else jnp.asarray(iso)
    raw_ok = (skip | ((ss >= lo) & (ss <= hi))).all()

    def from_raw():
        # |F| <= 2^50 and |a'| < 1: F a' cannot overflow, nor can its square once scaled
        e = (exponent(ss) + 1) // 2  # 2^-e ||F||_F <= 1
        y = jnp.einsum("nikd,nidr->nikr", f, a2, precision=_HI)
        y = y * pow2(-e, y.dtype)[..., None, None]
        return y, ss * pow2(-2 * e, ss.dtype), jnp.zeros(ss.shape, jnp.int32)

    def normalised():  # any finite F (NaN/Inf zeroed and counted)
        f2, _, bad = pow2_normalise(f, (-2, -1))
        y = jnp.einsum("nikd,nidr->nikr", f2, a2, precision=_HI)
        return y, jnp.sum(f2 * f2, axis=(-2, -1)), bad

    y, tr, bad = jax.lax.cond(raw_ok, from_raw, normalised)
    q = jnp.einsum("nikr,niks->nirs", y, y, precision=_HI)
    return jnp.where((bad > 0)[..., None, None], jnp.asarray(jnp.nan, q.dtype), q), tr
