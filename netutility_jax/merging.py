"""Merging M LoRA adapters: kept components -> space -> method -> back (paper, Algorithm 1).

:func:`merge` runs a bucketed pipeline: modules of equal ``(d_in, d_out, r_max)`` are stacked and
merged by one jitted kernel per bucket (no global state, so buckets can be streamed or sharded).
Results stay low rank wherever the math allows: TA, TSV, Iso-C and Iso-CTS in every space and every
method in Core and KnOTS space return ``{"lora_a" (d_in, K), "lora_b" (K, d_out), "scale": 1.0}``
with ``K`` the module's own result rank. Only TIES, DARE and DARE-TIES in full space need entry
access to ``dK``; they return ``{"delta": (d_in, d_out)}`` and are run module by module, so at most
one module's ``M`` dense task updates are alive at a time (:func:`to_lora` truncates them back).

Each bucket is merged a piece at a time (at most ``_PIECE_BYTES`` of stacked factors) in the
reduced coordinates of its stacked factors (:class:`spaces.Reduced`): the ``d``-sized work of a
low-rank merge is two Grams and two products per side, everything else is ``(M r)``-sized, and
only the live columns are mapped back. Factors and scales are normalised by powers of two first
and each module is merged in a unit of its own (:mod:`netutility_jax.spaces`, "Scale safety"), so
extreme scales neither overflow a Gram nor flush a weak task to zero.

Checks are eager, at the public boundary: options (types and ranges), masks, the inputs'
finiteness (counted by the first stage) and the range of every merged module (reported by the
last); the jitted stages themselves check nothing.

:func:`merge_adapters` is the one-call pipeline: score, allocate, merge, report.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _tree
from . import methods as _m
from . import spaces as _s
from ._linalg import mm as _mm
from ._linalg import mul_pow2
from ._linalg import t as _t
from .allocate import allocate
from .analysis import budget_spent, kept_per_task, non_prefix_fraction
from .decompose import lora_svd
from .errors import InputError, InputTypeError
from .utility import default_rtol, heterogeneity, score

METHODS = ("ta", "ties", "dare", "dare_ties", "tsv", "iso_c", "iso_cts")
LOW_RANK_METHODS = ("ta", "tsv", "iso_c", "iso_cts")
ELEMENTWISE_METHODS = ("ties", "dare", "dare_ties")
# options each method takes, with defaults (None: required)
METHOD_OPTIONS: dict[str, dict[str, Any]] = {
    "ta": {"isotropize": False},
    "tsv": {"isotropize": False},
    "iso_c": {},
    "iso_cts": {"common_fraction": 0.8},
    "ties": {"density": 0.2, "scope": "module"},
    "dare": {"p": None},
    "dare_ties": {"p": None},
}
SPACE_OPTIONS: dict[str, dict[str, Any]] = {
    "full": {},
    "core": {},
    "knots": {"variant": "core_space"},
}
ALLOCATIONS = ("net_utility", "uniform", "all")
_PIECE_BYTES = 32 << 20  # stacked factors per piece of a bucket merged at once
_FN = "nu.merge"


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _given(x: Any) -> str:
    """What the user passed, for a message: a short repr and its type."""
    return f"{_tree.brief(x)} ({type(x).__name__})"


def _check_choice(fn: str, name: str, value: Any, choices: Sequence[str], why: str = "") -> str:
    """A string option from a fixed set."""
    if not isinstance(value, str):
        raise InputTypeError(
            f"{fn}: {name}={_given(value)}; expected one of {tuple(choices)}{why}."
        )
    if value not in choices:
        raise InputError(f"{fn}: {name}={_given(value)}; expected one of {tuple(choices)}{why}.")
    return value


def _check_bool(fn: str, name: str, value: Any) -> bool:
    """A real ``bool`` (numpy's too): a string or number is not taken by its truthiness."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise InputTypeError(f"{fn}: {name}={_given(value)}; expected True or False.")


def _check_real(
    fn: str, name: str, value: Any, expected: str, ok=None, *, traced: bool = True
) -> Any:
    """A finite real scalar (Python/numpy int or float, or a 0-d real array; not bool, complex or
    str) for which ``ok(float)`` holds; returned as a float (a tracer as it is, if ``traced``)."""
    if not _tree.is_real_scalar(value):
        raise InputTypeError(f"{fn}: {name}={_given(value)}; expected {expected}.")
    if isinstance(value, jax.core.Tracer):
        if traced:
            return value
        raise InputTypeError(
            f"{fn}: {name} is traced (inside jax.jit); it must be a concrete number, since it "
            f"sets a count on the host: pass {expected} as a static Python value."
        )
    v = float(np.asarray(value, np.float64))
    if not np.isfinite(v) or (ok is not None and not ok(v)):
        raise InputError(f"{fn}: {name}={_given(value)}; expected {expected}.")
    return v


def _check_auto(fn: str, name: str, value: Any, expected: str) -> Any:
    """``"auto"`` or a finite real number >= 0 (``alpha``, ``lam``)."""
    if isinstance(value, str):
        if value != "auto":
            raise InputError(f"{fn}: {name}={_given(value)}; expected {expected}.")
        return value
    return _check_real(fn, name, value, expected, lambda v: v >= 0)


_EXPECT = {
    "density": "a number in [0, 1] (the fraction of entries each task keeps, e.g. 0.2)",
    "p": "a number in [0, 1) (the drop rate, e.g. 0.5)",
    "common_fraction": "a number in [0, 1] (the common share of the TA sum's rank, e.g. 0.8)",
}
_IN_RANGE = {
    "density": lambda v: 0 <= v <= 1,
    "p": lambda v: 0 <= v < 1,
    "common_fraction": lambda v: 0 <= v <= 1,
}


def _resolve_options(fn: str, method: Any, space: Any, options: Mapping[str, Any]) -> dict:
    """Every option checked for type and range, with the defaults filled in."""
    _check_choice(fn, "method", method, METHODS)
    _check_choice(fn, "space", space, _s.SPACES)
    takes = {**METHOD_OPTIONS[method], **SPACE_OPTIONS[space]}
    extra = sorted(set(options) - set(takes), key=str)
    if extra:
        which = ", ".join(repr(k) for k in takes) or "no options"
        raise InputError(
            f"{fn}: method={method!r} in space={space!r} does not take "
            f"{', '.join(_tree.brief(k) for k in extra[:4])}{' ...' if len(extra) > 4 else ''}; "
            f"it takes {which}."
        )
    opts = {**takes, **options}
    for name in ("density", "p", "common_fraction"):
        if name not in takes:
            continue
        if opts[name] is None:
            raise InputError(f"{fn}: method={method!r} needs {name}= ({_EXPECT[name]}).")
        # density sets a count on the host (methods.topk_count): it must be concrete
        opts[name] = _check_real(
            fn, name, opts[name], _EXPECT[name], _IN_RANGE[name], traced=name != "density"
        )
    if "scope" in takes:
        _check_choice(
            fn,
            "scope",
            opts["scope"],
            ("module", "model"),
            " ('module': per-module top-k, default; 'model': top-k over the whole model, as the "
            "original KnOTS)",
        )
    if "variant" in takes:
        _check_choice(
            fn,
            "variant",
            opts["variant"],
            _s.KNOTS_VARIANTS,
            " ('core_space': unscaled blocks V_i, default; 'original': scaled blocks S V_i)",
        )
    if "isotropize" in takes:
        opts["isotropize"] = _check_bool(fn, "isotropize", opts["isotropize"])
    return opts


def _check_coef(fn: str, coef: Any) -> None:
    _check_real(fn, "coef", coef, "a finite real number (the merged update's coefficient)")


def _is_key(key: Any) -> bool:
    """A ``jax.random`` key: a typed key (``jax.random.key(0)``, shape ``()``) or a legacy raw
    threefry key (``jax.random.PRNGKey(0)``: ``uint32 (2,)``)."""
    dt, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    if dt is None or shape is None:
        return False
    try:
        if jax.dtypes.issubdtype(dt, jax.dtypes.prng_key):
            return tuple(shape) == ()
        return np.dtype(dt) == np.uint32 and tuple(shape) == (2,)
    except TypeError:
        return False


def _check_key(fn: str, key: Any, method: str) -> None:
    hint = (
        f"method={method!r} draws its drop mask from key=, a jax.random key: pass "
        "jax.random.key(0) (any seed), not a plain integer"
    )
    if key is None:
        raise InputError(f"{fn}: {hint}.")
    if _is_key(key):
        return
    dt = getattr(key, "dtype", None)
    what = (
        _given(key)
        if dt is None
        else f"{type(key).__name__} of dtype {str(dt)[:40]} and shape "
        f"{_tree.brief(getattr(key, 'shape', None))}"
    )
    raise InputTypeError(f"{fn}: key={what}; {hint}.")


def _check_masks(fn: str, masks: Any, names: list[str], buckets, m_tasks: int) -> dict:
    if not isinstance(masks, Mapping):
        raise InputTypeError(
            f"{fn}: masks is a {type(masks).__name__}; expected the {{name: bool (M, r_max)}} dict "
            "returned by nu.allocate, or None to keep every component."
        )
    have, want = set(masks), set(names)
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        parts = []
        if missing:
            parts.append(f"no mask for {_tree._few(missing)}")
        if extra:
            parts.append(f"masks for {_tree._few(extra)} that the adapters lack")
        raise InputError(
            f"{fn}: mask names do not match the adapters' modules: {'; '.join(parts)}. Pass the "
            "masks nu.allocate returns for these same adapters."
        )
    out = {}
    for bk in buckets:
        for name in bk.names:
            m = masks[name]
            shape = tuple(getattr(m, "shape", np.shape(m)))
            if shape != (m_tasks, bk.r_max):
                raise InputError(
                    f"{fn}: mask of module {name!r} has shape {shape}; expected (M, r_max) = "
                    f"({m_tasks}, {bk.r_max}) (tasks x the module's largest rank)."
                )
            dt = np.dtype(getattr(m, "dtype", np.asarray(m).dtype))
            if dt != np.bool_:
                raise InputTypeError(
                    f"{fn}: mask of module {name!r} has dtype {dt}; expected bool."
                )
            out[name] = m
    return out


# ---------------------------------------------------------------------------------------------
# Per-bucket kernels (pure; batched over the bucket's modules)
# ---------------------------------------------------------------------------------------------


# traced: new values do not recompile. TIES's density is static: it only sets the kept counts,
# which are made on the host (methods.topk_count) and passed as data, so it reaches no compiled
# function and a new density does not recompile either.
NUMERIC_OPTIONS = ("p", "common_fraction")


def _split(opts: dict, dtype) -> tuple[tuple, dict]:
    static = tuple(sorted((k, v) for k, v in opts.items() if k not in NUMERIC_OPTIONS))
    nums = {k: jnp.asarray(v, dtype) for k, v in opts.items() if k in NUMERIC_OPTIONS}
    return static, nums


def _elementwise(x, keys, *, method, coef, opts, k_top=None):
    """An elementwise method on a batch of modules: ``x (n, M, p, q)``, ``keys (n,)``, ``k_top
    (n,)``. Batched natively (not vmapped), so TIES can skip its tie-breaking pass at run time."""
    if method == "ties":
        return _m.ties(x, coef=coef, k=k_top)
    fn = _m.dare if method == "dare" else _m.dare_ties  # one key per module
    return jax.vmap(lambda xx, kk: fn(xx, kk, coef=coef, p=opts["p"]))(x, keys)


def _coords(k, a, b, ts, *, space, opts, rtol):
    if space == "full":
        return _s.full_coords(k)
    if space == "core":
        return _s.core_coords(k, a, b, rtol=rtol, a_exp=ts.a_exp, b_exp=ts.b_exp)
    return _s.knots_coords(k, rtol=rtol, variant=opts["variant"], block_exp=_s.HEADROOM)


def _low_rank(c, *, method, coef, opts, rtol, is_svd):
    if method == "ta":
        if opts["isotropize"]:
            return _m.iso_c(c.a, c.b, coef=coef, rtol=rtol)
        return _m.ta(c.a, c.b, coef=coef)
    if method == "iso_c":
        return _m.iso_c(c.a, c.b, coef=coef, rtol=rtol)
    if method == "tsv":
        return _m.tsv(c.a, c.b, coef=coef, rtol=rtol, is_svd=is_svd, isotropize=opts["isotropize"])
    return _m.iso_cts(c.a, c.b, coef=coef, rtol=rtol, common_fraction=opts["common_fraction"])


# The bucket pipeline is a few jitted stages (reduce, space transform, method, decode, map back) so
# that compiled stages are shared between methods and spaces; each is pure and batched over modules.
#
# Scale safety: the stacked factors and scales are split into powers of two and normalised numbers
# per task (spaces.normalise_tasks) before any Gram, and each module is merged in units of 2**unit
# (spaces.module_unit), multiplied back by the last stage. Every method is positively homogeneous
# of degree one and a power of two rounds nothing, so results are those of the unscaled
# computation wherever that one does not over- or underflow. The last stage also reports, per
# module, whether the result is representable (a range check): merge raises instead of returning
# an infinite or flushed-to-zero module.


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_stack(leaves, *, cfg):
    """Zero-padded stacked factors of a bucket (see ``_tree.stack_bucket``), as given."""
    d_in, d_out, r_max, dtype = cfg
    a, b, s = leaves
    return _tree.stack_bucket(a, b, s, d_in=d_in, d_out=d_out, r_max=r_max, dtype=dtype)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_keep(a, b, s, r, *, cfg):
    """Every candidate of a stacked bucket ``(n, M, r_max)`` (``allocation="all"``)."""
    (r_max,) = cfg
    a, b, ts, _ = _s.normalise_tasks(a, b, s, a_axes=(2, 3), b_axes=(2, 3))
    mask = jnp.ones((*ts.mant.shape, r_max), bool)
    k = _s.kept_components(a, b, ts.mant, r, mask, cand_rtol=default_rtol(r_max, a.dtype))
    return k.keep


@jax.jit
def _stage_scales(a, b, s):
    """Per module the unit (:func:`spaces.module_unit`), per task the :class:`spaces.TaskScales`
    and the non-finite counts ``(n, M, 3)`` of stacked factors ``a (n, M, d_in, r)``, ``b``."""
    _, _, ts, bad = _s.normalise_tasks(a, b, s, a_axes=(2, 3), b_axes=(2, 3))
    return ts, _s.module_unit(ts), bad


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_reduce(leaves, *, cfg):
    """A bucket's factors, normalised per task by powers of two, in the bases of their own spans
    (:class:`spaces.Reduced`); their :class:`spaces.TaskScales`, ranks, non-finite counts
    ``(n, M, 3)`` and units ``(n,)``. The only ``d``-sized work before the map back (two Grams,
    one product per side, and one read of the factors for their sizes)."""
    d_in, d_out, r_max, dtype, m_tasks = cfg
    a, b, s = leaves
    ts, bad = _s.leaf_scales(a, b, s, dtype)
    mant = tuple(tuple(ts.mant[j, i] for i in range(m_tasks)) for j in range(len(a)))

    def reduce(a, b):
        xa, yb, _, R = _tree.stack_bucket_cat(
            a, b, mant, d_in=d_in, d_out=d_out, r_max=r_max, dtype=dtype
        )
        return _s.reduce_factors(xa, yb, m_tasks), R

    def plain():  # factors of moderate size: their Grams are safe, normalise the small R's
        red, R = reduce(a, b)
        ra = mul_pow2(red.a, -ts.a_exp[..., None, None])
        rb = mul_pow2(red.b, -ts.b_exp[..., None, None])
        return red._replace(a=ra, b=rb), R

    def scaled():  # extreme (or non-finite) factors: normalise them before any Gram
        return reduce(*_s.scale_leaves(a, b, ts, dtype))

    # 2**+-24 of the largest entry: no Gram of such factors can leave float32's range
    moderate = (jnp.abs(ts.a_exp) <= 24) & (jnp.abs(ts.b_exp) <= 24)
    red, R = jax.lax.cond(jnp.all(moderate) & ~jnp.any(bad), plain, scaled)
    return red, ts, R, bad, _s.module_unit(ts)


def _expand_in(qa, x):
    """Reduced input-side columns ``x (n, [M,] K, k)`` to ``d_in``: ``Q_a x``."""
    q1, m = (qa.q1, qa.m) if x.ndim == 3 else (qa.q1[:, None], qa.m[:, None])
    return _mm(q1, _mm(m, x))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_coords(red, ts, R, mask, unit, *, cfg):
    """Kept components of a bucket in a space's coordinates (:class:`spaces.Coords`), in units
    of ``2**unit`` (``unit (n,)``: each task's singular values get ``2**(exp_i - unit)``).

    Computed in the reduced coordinates of :class:`spaces.Reduced`; with ``ambient_in`` (KnOTS
    with an elementwise method, whose input side is entry-wise in ``d_in``) the input side is
    mapped back to ``d_in``.
    """
    space, variant, rtol, ambient_in = cfg
    k = _s.kept_components(
        red.a,
        red.b,
        ts.mant,
        R,
        mask,
        cand_rtol=default_rtol(red.a.shape[-1], red.a.dtype),
        scale_exp=ts.exp - unit[:, None],
    )
    c = _coords(k, red.a, red.b, ts, space=space, opts={"variant": variant}, rtol=rtol)
    if ambient_in:
        c = c._replace(a=_expand_in(red.qa, c.a))
    return c


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_low_rank(ca, cb, coef, nums, *, cfg):
    """A spectral method (TA, TSV, Iso-C, Iso-CTS) on factored coordinates."""
    method, opts, rtol, is_svd = cfg
    c = _s.Coords(ca, cb, None, None, None)
    return _low_rank(
        c, method=method, coef=coef, opts={**dict(opts), **nums}, rtol=rtol, is_svd=is_svd
    )


def _range_status(w, y, unit, axes):
    """Whether ``y = w 2**unit`` (per module, over ``axes``) is representable: ``(code (n,) int32,
    log2 (n,) float32)``; code 0 fine, 1 not finite, 2 underflow (``w`` is not zero but the
    largest ``|y|`` is below the dtype's smallest normal number: at best a few bits are left);
    ``log2`` is ``log2`` of the largest ``|y|`` that exact arithmetic would give."""
    wmax = jnp.max(jnp.abs(w), axis=axes, initial=0)
    finite = jnp.all(jnp.isfinite(y), axis=axes)
    log2 = jnp.log2(wmax).astype(jnp.float32) + unit.astype(jnp.float32)
    under = (wmax > 0) & (log2 < jnp.finfo(w.dtype).minexp)
    code = jnp.where(finite, jnp.where(under, 2, 0), 1).astype(jnp.int32)
    return code, log2


def _log2_norm(x, axis):
    """``log2`` of the largest column norm of ``x (n, p, k)`` over ``axis`` (-2: columns, -1:
    rows), scale-safely; ``-inf`` for an all-zero module. An entry of ``Q x`` (``Q`` with
    orthonormal columns) is at most its column's norm, and at least one is ``norm / sqrt(p)``."""
    cols = _m._column_norms(x if axis == -2 else _t(x))
    return jnp.log2(jnp.max(cols, axis=-1, initial=0)).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_map_back(la, lb, qa, qb, unit, *, cfg):
    """Reduced results in units of ``2**unit`` to ``(lora_a (n, d_in, width), lora_b (n, width,
    d_out))`` of their true size, and per module ``(code, log2)``: code 0 representable, 1 not
    finite, 2 underflow (the largest ``lora_a`` entry below the smallest normal number)."""
    width, expand_in = cfg
    la, lb = la[..., :width], lb[..., :width, :]
    fi = jnp.finfo(la.dtype)
    # Bounds of the mapped-back entries from the small sides (no d-sized pass): the module's unit
    # goes to the input side; where that side alone could overflow (the product need not: KnOTS
    # blocks carry S on the output side) it is split between both sides.
    hi_a = _log2_norm(la, -2) if expand_in else jnp.log2(jnp.max(jnp.abs(la), (1, 2), initial=0))
    hi_b = _log2_norm(lb, -1)
    hi_a, hi_b = hi_a.astype(jnp.float32), hi_b.astype(jnp.float32)
    u = unit.astype(jnp.float32)
    split = hi_a + u >= fi.maxexp - 1
    d = u + hi_a - hi_b
    half = jnp.where(split & jnp.isfinite(d), jnp.floor(d / 2), 0).astype(jnp.int32)
    sa, sb = unit - half, half
    la = mul_pow2(la, sa[:, None, None])
    lb = mul_pow2(lb, sb[:, None, None])
    if expand_in:
        la = _expand_in(qa, la)
    lb = qb.times_qt(lb)
    hi_a, hi_b = hi_a + sa.astype(jnp.float32), hi_b + sb.astype(jnp.float32)
    lo_a = hi_a - 0.5 * float(np.log2(la.shape[-2]))  # some entry is at least this large
    surely_fine = (
        (hi_a < fi.maxexp - 1) & (hi_b < fi.maxexp - 1) & ((lo_a >= fi.minexp) | (hi_a == -jnp.inf))
    )

    def exact(la, lb):  # one pass over the outputs, only where the bounds cannot decide
        ma = jnp.max(jnp.abs(la), axis=(1, 2), initial=0)
        mb = jnp.max(jnp.abs(lb), axis=(1, 2), initial=0)
        finite = jnp.isfinite(ma) & jnp.isfinite(mb)
        under = (hi_a > -jnp.inf) & (ma < fi.tiny)
        code = jnp.where(finite, jnp.where(under, 2, 0), 1).astype(jnp.int32)
        return code, (jnp.log2(ma) + jnp.log2(mb)).astype(jnp.float32)

    def bounded(la, lb):
        return jnp.zeros(unit.shape, jnp.int32), hi_a + hi_b

    check = jax.lax.cond(jnp.all(surely_fine), bounded, exact, la, lb)
    return la, lb, check


def _map_back(la, lb, live, qa, qb, expand_in, unit):
    """Reduced results ``la (n, K|d_in, k)``, ``lb (n, k, K)`` (live columns first) in units of
    ``2**unit`` to ``d_in`` / ``d_out``: only the bucket's largest live count of columns, rounded
    up to a multiple of 16 (few compiled widths), are mapped back and returned, with the
    :func:`_range_status` of each module."""
    if isinstance(live, jax.core.Tracer):
        width = live.shape[-1]
    else:
        most = int(np.asarray(live.sum(-1)).max(initial=0))
        width = min(live.shape[-1], -(-most // 16) * 16)
    la, lb, check = _stage_map_back(la, lb, qa, qb, unit, cfg=(width, expand_in))
    return la, lb, live[..., :width], check


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_decode(coords, am, bm, *, cfg):
    rtol, compact = cfg
    return _s.decode_factored(coords, am, bm, rtol=rtol, compact=compact)


def _entry_counts(c):
    """Per module the live rows and columns of its dense coordinates ``(p, q)``: columns of
    ``left`` (``p`` itself without ``left``) and of ``right`` that its bases span."""
    live_q = (jnp.abs(c.right).sum(-2) > 0).sum(-1, dtype=jnp.int32)
    if c.left is None:
        return jnp.full_like(live_q, c.a.shape[-2]), live_q
    return (jnp.abs(c.left).sum(-2) > 0).sum(-1, dtype=jnp.int32), live_q


def _real_entries(c):
    """TIES's ``n`` in core / KnOTS: entries of each module's dense coordinates that its bases
    span (the bases may be smaller than ``D``); int64 on the host."""
    rows, cols = _entry_counts(c)
    return np.asarray(rows, np.int64) * np.asarray(cols, np.int64)


@functools.lru_cache(maxsize=32)
def _count_table_np(density: float, p: int, q: int, has_left: bool) -> np.ndarray:
    rows = np.arange(p + 1, dtype=np.int64) if has_left else np.array([p], np.int64)
    n = rows[:, None] * np.arange(q + 1, dtype=np.int64)[None, :]
    return _m.topk_count(density, n).astype(np.int32)


def _count_table(density: float, c) -> jax.Array:
    """TIES's kept count for every ``n`` a bucket's coordinates can have, made on the host by
    :func:`methods.topk_count` (PEFT's rule, exact): ``table[rows, cols] = int(density * rows *
    cols)`` over the live rows (``0..p``; one row, ``p``, without a ``left`` basis) and columns
    (``0..q``) of :func:`_entry_counts`. A traced stage looks its counts up: no count is ever
    computed in a traced (float32) dtype."""
    p, q = c.a.shape[-2], c.b.shape[-2]
    return jnp.asarray(_count_table_np(float(density), p, q, c.left is not None))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_split(coords, keys, table, *, cfg):
    """A bucket's coordinates cut into chunks of whole modules for :func:`_stage_elementwise`:
    ``[(a, b, keys, k_top)]`` per chunk. TIES keeps ``k_top = int(density * n)`` of the ``n``
    real entries of a module's coordinates, looked up in the host-made ``table``
    (:func:`_count_table`); ``table=None`` (DARE) gives zeros."""
    (chunk,) = cfg
    c = coords
    n = c.a.shape[0]
    if table is None:
        k_top = jnp.zeros((n,), jnp.int32)
    else:
        rows, cols = _entry_counts(c)
        k_top = table[rows if c.left is not None else 0, cols]
    return [tuple(x[j0 : j0 + chunk] for x in (c.a, c.b, keys, k_top)) for j0 in range(0, n, chunk)]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_elementwise(a, b, keys, k_top, coef, nums, *, cfg):
    """TIES / DARE on a chunk of modules' dense core or KnOTS coordinates ``a b^T``."""
    (method,) = cfg
    return _elementwise(_mm(a, _t(b)), keys, method=method, coef=coef, opts=dict(nums), k_top=k_top)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_decode_chunks(coords, xms, *, cfg):
    """The merged chunks back to LoRA form: KnOTS blocks ``(d_in, k)`` are kept as the input
    factor, core matrices are re-factored by SVD."""
    (rtol,) = cfg
    xm = jnp.concatenate(xms) if len(xms) > 1 else xms[0]
    return _s.decode_dense(coords, xm, rtol=rtol, compact=coords.left is not None)


def _elementwise_bucket(coords, coef, keys, nums, table, *, cfg):
    """TIES / DARE on a bucket, a chunk of whole modules per call (at most one chunk's dense
    tasks alive), then decoded. A Python loop rather than ``lax.map``: XLA:CPU writes a mapped
    output through an in-place update that it emits as scalar code, ~4 ms per KnOTS module."""
    method, rtol, chunk = cfg
    xms = [
        _stage_elementwise(a, b, kk, kt, coef, nums, cfg=(method,))
        for a, b, kk, kt in _stage_split(coords, keys, table, cfg=(chunk,))
    ]
    return _stage_decode_chunks(coords, xms, cfg=(rtol,))


def _bucket_merge(leaves, mask, coef, keys, nums, *, cfg):
    """One bucket, every method except elementwise-in-full: ``(lora_a, lora_b, live, check,
    bad)``, the factors padded, ``check`` the :func:`_range_status` of each module and ``bad``
    the inputs' non-finite counts ``(n, M, 3)``.

    Composes the jitted stages (traceable as a whole, e.g. by ``jax.make_jaxpr``).
    """
    method, space, opts, d_in, d_out, r_max, dtype, chunk = cfg
    opts = dict(opts)
    m_tasks = len(leaves[0][0])
    red, ts, R, bad, unit = _stage_reduce(leaves, cfg=(d_in, d_out, r_max, dtype, m_tasks))
    rtol = _m.rank_rtol((d_in, d_out, m_tasks * r_max), dtype)
    elementwise = method in ELEMENTWISE_METHODS
    ambient_in = elementwise and space == "knots"
    # Spectral methods are invariant to the orthonormal bases they run in, as long as the bases
    # span the kept components; the reduced coordinates are such bases (Core Space's reference
    # bases up to a rotation), so Core Space's bases and core matrices would change nothing:
    # core-space TA / TSV / Iso-C / Iso-CTS run in the reduced coordinates directly.
    cspace = "full" if space == "core" and not elementwise else space
    c = _stage_coords(red, ts, R, mask, unit, cfg=(cspace, opts.get("variant"), rtol, ambient_in))
    if elementwise:
        table = _count_table(opts["density"], c) if method == "ties" else None
        la, lb, live = _elementwise_bucket(c, coef, keys, nums, table, cfg=(method, rtol, chunk))
        return (*_map_back(la, lb, live, red.qa, red.qb, not ambient_in, unit), bad)
    mopts = tuple((k, v) for k, v in sorted(opts.items()) if k != "variant")
    am, bm = _stage_low_rank(c.a, c.b, coef, nums, cfg=(method, mopts, rtol, cspace == "full"))
    # the result's factors are exact as they come (live columns = the nonzero ones)
    la, lb, live = _stage_decode(c, am, bm, cfg=(rtol, False))
    return (*_map_back(la, lb, live, red.qa, red.qb, True, unit), bad)


def _dense_kept(a, b, s, r, mask, unit, *, r_max):
    """One module's kept dense task updates ``(1, M, d_in, d_out)`` in units of ``2**unit`` (the
    module's own unit if None) and that unit; ``a (M, d_in, r)``, ``b (M, r, d_out)``, ``s (M,)``
    as stacked (normalised here)."""
    a, b, ts, _ = _s.normalise_tasks(a[None], b[None], s[None], a_axes=(2, 3), b_axes=(2, 3))
    if unit is None:
        unit = _s.module_unit(ts)[0]
    k = _s.kept_components(
        a,
        b,
        ts.mant,
        r[None],
        mask[None],
        cand_rtol=default_rtol(r_max, a.dtype),
        scale_exp=ts.exp - unit,
    )
    return _s.dense_tasks(_s.full_coords(k)), unit


def _scale_dense(x, unit):
    """A dense merged update ``x (d_in, d_out)`` in units of ``2**unit`` back to its size, and
    its :func:`_range_status` (one module)."""
    y = mul_pow2(x, unit)
    code, log2 = _range_status(x[None], y[None], unit[None], (1, 2))
    return y, (code, log2)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _module_dense(a, b, s, r, mask, coef, key, nums, k_top, *, cfg):
    """One module, elementwise method in full space: dense ``(d_in, d_out)`` merged update and
    its :func:`_range_status`."""
    method, r_max = cfg
    x, unit = _dense_kept(a, b, s, r, mask, None, r_max=r_max)
    xm = _elementwise(x, key[None], method=method, coef=coef, opts=dict(nums), k_top=k_top[None])
    return _scale_dense(xm[0], unit)


# TIES with scope="model": each task keeps its int(density * N) largest entries over the whole
# model (N = entries of all modules in the space's coordinates), as the original TIES and KnOTS.
# The per-task threshold is found by radix selection over the magnitudes' bit patterns, 16 bits
# per pass, each pass streaming the modules (full space) or chunks of modules (core, KnOTS) with
# only the counts kept: memory stays at one unit's dense tasks, like scope="module". Magnitudes
# are compared across modules, so every module is merged in one common unit (the largest).


@functools.partial(jax.jit, static_argnames=("cfg",))
def _module_tasks(a, b, s, r, mask, unit, *, cfg):
    """One module's kept dense task updates, full space, in units of ``2**unit``:
    ``(1, M, d_in, d_out)``."""
    (r_max,) = cfg
    return _dense_kept(a, b, s, r, mask, unit, r_max=r_max)[0]


_stage_scale_dense = jax.jit(_scale_dense)


@jax.jit
def _coords_tasks(ca, cb):
    return _mm(ca, _t(cb))


@functools.partial(jax.jit, static_argnames=("shift", "width"))
def _digit_hist(x, hi, *, shift, width):
    return _m.digit_histogram(x, hi, shift=shift, width=width)


@functools.partial(jax.jit, static_argnames=("flat_ties",))
def _ties_apply(x, t, room, coef, *, flat_ties):
    """Trim at the thresholds ``t`` and take the disjoint mean. Without ``flat_ties`` every entry
    at a task's threshold is known to fit (``room`` = their count), so the running count that
    breaks ties in flat order (a slow scan on CPU) is skipped."""
    if flat_ties:
        trimmed, used = _m.trim_at(x, t, room)
    else:
        xt = jnp.moveaxis(x, -3, 0)
        bits = jax.lax.bitcast_convert_type(jnp.abs(xt), t.dtype)
        keep = bits >= t.reshape(-1, *([1] * (bits.ndim - 1)))
        trimmed, used = jnp.moveaxis(jnp.where(keep, xt, 0), 0, -3), room
    return coef * _m.disjoint_mean(trimmed), used


def _radix_threshold(units, m_tasks: int, k: int, dtype) -> tuple[np.ndarray, ...]:
    """Per task the bit pattern ``t`` of its k-th largest magnitude, how many ties at ``t`` to
    keep (so that exactly ``k`` entries are kept) and how many entries are at ``t``; ``units``
    yield dense tasks ``(u, M, p, q)``."""
    ut = np.dtype(_m._uint_of(dtype))
    nbits, width = ut.itemsize * 8, 16
    if k <= 0:  # keep nothing: no magnitude exceeds the largest bit pattern
        zero = np.zeros(m_tasks, np.int64)
        return np.full(m_tasks, np.iinfo(ut).max, ut), zero, zero
    hi = np.zeros(m_tasks, np.uint64)
    above = np.zeros(m_tasks, np.int64)
    at = np.zeros(m_tasks, np.int64)
    for shift in range(nbits - width, -1, -width):
        counts = np.zeros((m_tasks, 2**width), np.int64)
        prefix = jnp.asarray(hi.astype(ut))
        for produce, _ in units:
            counts += np.asarray(_digit_hist(produce(), prefix, shift=shift, width=width))
        for i in range(m_tasks):
            c = counts[i, ::-1]
            j = int(np.searchsorted(above[i] + np.cumsum(c), k))
            above[i] += int(c[:j].sum())
            at[i] = c[j]
            hi[i] |= np.uint64(2**width - 1 - j) << np.uint64(shift)
    return hi.astype(ut), k - above, at


def _ties_model(fn, buckets, mks, *, space, variant, density, coef, dtype, m_tasks, checks) -> dict:
    """TIES over the whole model (see the comment above); returns ``{name: module}`` and appends
    each module's :func:`_range_status` to ``checks``."""
    # first the inputs (checked) and the common unit: the largest over the live modules
    staged = []
    units = []
    for bk in buckets:
        leaves = _tree.bucket_arrays(bk)
        if space == "full":
            st = _stage_stack(leaves, cfg=(bk.d_in, bk.d_out, bk.r_max, dtype))
            ts, unit, bad = _stage_scales(*st[:3])
        else:
            st = _stage_reduce(leaves, cfg=(bk.d_in, bk.d_out, bk.r_max, dtype, m_tasks))
            ts, bad, unit = st[1], st[3], st[4]
        _raise_nonfinite(fn, [bk], [bad], dtype)
        live = np.asarray(ts.mant).any(-1)
        units.extend(np.asarray(unit)[live].tolist())
        staged.append(st)
    unit = jnp.asarray(max(units, default=0), jnp.int32)
    work = []  # (produce dense tasks, finish with the merged dense coordinates)
    n_total = 0
    results: dict[str, Any] = {}
    for bk, mk, st in zip(buckets, mks, staged, strict=True):
        if space == "full":
            for j, nm in enumerate(bk.names):
                n_total += bk.d_in * bk.d_out

                def produce(j=j, st=st, mk=mk, r_max=bk.r_max):
                    a, b, s, r = st
                    return _module_tasks(a[j], b[j], s[j], r[j], mk[j], unit, cfg=(r_max,))

                def finish(xm, nm=nm):
                    delta, check = _stage_scale_dense(xm[0], unit)
                    results[nm] = {"delta": jax.block_until_ready(delta)}
                    checks.append(((nm,), check))

                work.append((produce, finish))
            continue
        red, ts, R = st[0], st[1], st[2]
        rtol = _m.rank_rtol((bk.d_in, bk.d_out, m_tasks * bk.r_max), dtype)
        ambient_in = space == "knots"
        units_b = jnp.full((len(bk.names),), unit)
        c = jax.block_until_ready(
            _stage_coords(red, ts, R, mk, units_b, cfg=(space, variant, rtol, ambient_in))
        )
        qa, qb = red.qa, red.qb
        del red
        n_total += int(_real_entries(c).sum())
        p, q = c.a.shape[-2], c.b.shape[-2]
        chunk = _chunk(m_tasks, p, q, jnp.dtype(dtype).itemsize, len(bk.names))
        for j0 in range(0, len(bk.names), chunk):
            sl, sqa, sqb, su = jax.tree.map(
                lambda x, j0=j0, n=chunk: x[j0 : j0 + n], (c, qa, qb, units_b)
            )

            def produce(sl=sl):
                return _coords_tasks(sl.a, sl.b)

            def finish(
                xm, sl=sl, sqa=sqa, sqb=sqb, su=su, j0=j0, bk=bk, rtol=rtol, ex=not ambient_in
            ):
                la, lb, live, check = _map_back(
                    *_stage_decode_chunks(sl, [xm], cfg=(rtol,)), sqa, sqb, ex, su
                )
                names = bk.names[j0 : j0 + len(live)]
                checks.append((names, check))
                ranks = np.asarray(live.sum(-1))
                for jj, rk in enumerate(ranks):
                    rk = int(rk)
                    results[names[jj]] = {
                        "lora_a": la[jj, :, :rk],
                        "lora_b": lb[jj, :rk, :],
                        "scale": 1.0,
                    }

            work.append((produce, finish))
    k = _m.topk_count(density, n_total)
    t, room, at = _radix_threshold(work, m_tasks, k, dtype)
    flat_ties = bool(np.any(at > room))  # otherwise every entry at a threshold is kept
    t = jnp.asarray(t)
    for produce, finish in work:
        xm, used = _ties_apply(
            produce(),
            t,
            jnp.asarray(np.minimum(room, 2**31 - 1), jnp.int32),
            coef,
            flat_ties=flat_ties,
        )
        room = room - np.asarray(used, np.int64)
        finish(xm)
    return results


# ---------------------------------------------------------------------------------------------
# Range and finiteness checks (eager, at the public boundary)
# ---------------------------------------------------------------------------------------------


_X64 = (
    "enable x64 (jax.config.update('jax_enable_x64', True)) and pass float64 factors, or rescale "
    "the adapters"
)


def _check_scale_range(fn: str, buckets: Sequence[_tree.Bucket], dtype) -> None:
    """Scales beyond the compute dtype's range (``lora_alpha = 1e40`` with float32 factors)
    would become ``inf`` when cast: refused here, before anything is computed."""
    fi = np.finfo(dtype)
    for bk in buckets:
        for name, mods in zip(bk.names, bk.modules, strict=True):
            for i, m in enumerate(mods):
                if m is None or isinstance(m.scale, jax.core.Tracer):
                    continue
                v = abs(float(np.asarray(m.scale, np.float64)))
                if v > float(fi.max) or 0 < v < float(fi.tiny):
                    raise InputError(
                        f"{fn}: scale of module {_tree.short(name)!r}, task {i}, is {v:.3g}, "
                        f"outside the range of {np.dtype(dtype).name} (normal numbers "
                        f"{fi.tiny:.3g} to {fi.max:.3g}); {_X64}."
                    )


def _raise_nonfinite(fn: str, buckets, bads, dtype) -> None:
    """The inputs' non-finite counts (from the stages) as :class:`InputError` (eager only)."""
    if any(isinstance(b, jax.core.Tracer) for b in bads):
        return
    _tree.raise_nonfinite(fn, buckets, [np.asarray(b) for b in bads], dtype=dtype)


def _raise_range(fn: str, checks, dtype) -> None:
    """Merged modules that over- or underflow the compute dtype (:func:`_range_status`)."""
    over: list[tuple[str, float]] = []
    under: list[tuple[str, float]] = []
    for names, (code, log2) in checks:
        if isinstance(code, jax.core.Tracer):
            return
        for nm, c, lg in zip(names, np.asarray(code), np.asarray(log2), strict=True):
            if c:
                (over if c == 1 else under).append((nm, float(lg)))
    name = np.dtype(dtype).name
    fi = np.finfo(dtype)
    for bad, what, limit in (
        (over, "overflows", f"at most {fi.max:.3g}"),
        (under, "underflows", f"normal numbers from {fi.tiny:.3g}"),
    ):
        if not bad:
            continue
        sizes = [lg for _, lg in bad if np.isfinite(lg)]
        if sizes:  # the inputs are finite (checked), so a result is beyond the range, not NaN
            top = max(sizes, key=abs)
            size = f"its entries reach about 2**{top:.0f} (1e{np.log10(2) * top:+.0f})"
        else:  # beyond the range on the way: only an extreme coef can do that
            size = "its values leave the range on the way (check coef)"
        raise InputError(
            f"{fn}: the merged update of {_tree._few([n for n, _ in bad])} {what} {name}: "
            f"{size} where {name} holds {limit}. The tasks' scales (lora_alpha / r) or factors "
            f"are too extreme for {name}: {_X64}."
        )


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def _chunk(
    n_tasks: int, p: int, q: int, itemsize: int, n: int | None = None, budget_bytes: int = 64 << 20
) -> int:
    """Modules per chunk of dense work: within ``budget_bytes``, and dividing ``n`` if given."""
    per = max(1, 8 * n_tasks * p * q * itemsize)  # dense tasks plus a few temporaries
    c = int(max(1, budget_bytes // per))
    if n is not None:
        c = max(d for d in range(1, min(c, n) + 1) if n % d == 0)
    return c


def _rebuild(adapter: Any, results: Mapping[str, Any]) -> Any:
    """The first adapter's tree with each module (or None placeholder) replaced by its result."""

    def walk(node, path):
        name = "/".join(path)
        if node is None or (
            _tree._is_mapping(node) and ("lora_a" in node.keys() or "lora_b" in node.keys())
        ):
            return results[name or "lora"]
        return {k: walk(node[k], (*path, str(k))) for k in node.keys()}

    return walk(adapter, ())


def _bucket_mask(masks, bk, m_tasks: int) -> jax.Array:
    if masks is None:
        return jnp.ones((len(bk.names), m_tasks, bk.r_max), bool)
    return jnp.stack([jnp.asarray(masks[nm], bool) for nm in bk.names])


def _keys_for(key: jax.Array, idx: Sequence[int]) -> jax.Array:
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(np.asarray(idx, np.int32)))


def merge(
    adapters: Sequence[Any],
    masks: Mapping[str, Any] | None = None,
    *,
    method: str = "ta",
    space: str = "full",
    coef: float = 1.0,
    key: jax.Array | None = None,
    **options: Any,
) -> Any:
    """Merge the kept components of M adapters in a space with a method (paper, Algorithm 1).

    Each task's update is decomposed (:func:`nu.lora_svd`); slot ``k`` of ``masks[name][j]`` keeps
    task j's k-th largest singular direction. The kept updates ``dK_i`` are represented in ``space``
    (see :mod:`netutility_jax.spaces`), merged by ``method``, and mapped back:

    * ``"ta"``: ``coef * sum_i dK_i`` (``isotropize=True``: Iso-C).
    * ``"tsv"``: ``coef * polar([U_i]) diag([s_i]) polar([V_i])^T`` (``isotropize=True``: the kept
      ``s`` flattened to their mean, the paper's "Iso-C + TSV").
    * ``"iso_c"``: the TA sum with its nonzero singular values replaced by their mean.
    * ``"iso_cts"``: Iso-CTS (``common_fraction=0.8`` of the TA sum's rank is common).
    * ``"ties"``: per task keep exactly ``int(density * n)`` largest-magnitude entries (``density``,
      default 0.2; ``scope="module"``), elect signs (sign of the sum, 0 -> +), disjoint mean,
      times ``coef``. ``n`` is the exact number of entries (full space ``d_in d_out``; core and
      KnOTS the entries their bases span; ``scope="model"`` the sum over modules) and the count
      is PEFT's ``int(density * n)`` in binary64, made on the host (:func:`methods.topk_count`):
      0.3 of 96 x 25 entries keeps 720. Entries of equal magnitude are taken in flat row-major
      order (modules in order for ``scope="model"``), lower index first.
    * ``"dare"``: drop entries with probability ``p``, rescale by ``1/(1-p)``, sum, times ``coef``;
      a fresh mask per call from ``key`` (folded with the module index). ``"dare_ties"``: the
      same drop, then TIES sign election and disjoint mean.

    Spaces: ``"full"``, ``"core"`` (Core Space) and ``"knots"`` (``variant="core_space"`` unscaled
    blocks, default, or ``"original"`` scaled blocks). TA is identical in all three; TSV, Iso-C and
    Iso-CTS are identical in full, core and original-KnOTS space (the transforms are isometries on
    the spans of the kept directions). Elementwise methods depend on the space. In KnOTS's default
    variant the task blocks are unscaled (``V_i``) and the merged block maps back through ``S U^T``,
    so Iso-C and ``isotropize=True`` flatten the spectrum of the merge in those coordinates, not of
    the returned update (there, Iso-C + TSV equals TSV); use ``variant="original"`` for the
    isotropic result.

    Low-rank results are returned as they come out of the method, not re-factored: ``lora_a``'s
    columns are the merge's (nonzero) directions, so a module's rank is its number of live
    columns (TA: the kept components; TSV in full and core space: orthonormal ``lora_b`` rows).
    KnOTS elementwise merges keep the merged ``(d_in, k)`` block as ``lora_a`` (rank ``k`` but for
    zero columns), up to a power of two moved between the factors. Use :func:`to_lora` for a
    truncated SVD of any module.

    Numerics: each task's factors and scale are split into powers of two and normalised numbers
    and each module is merged in a unit of its own (:mod:`netutility_jax.spaces`), so an extreme
    but finite scale (``lora_alpha = 1e30`` in one task, float32) gives the merge of the same
    inputs in float64, rounded to the dtype. A merge that cannot be held in the dtype is refused
    (``InputError`` naming the modules), never returned as ``inf``, NaN or zeros: a dense result
    beyond its range, factors that overflow even when balanced, or a result whose largest entry is
    below its smallest normal number. Low-rank results are factors: finite factors whose product
    would overflow the dtype are returned (:func:`fold` and :func:`module_update` check the
    product). Elementwise selections are exact on the numbers computed: an entry within rounding
    of a task's threshold (or of a zero sum in the sign election) can be selected differently in
    float32 and float64, and Iso-CTS and TSV give every kept direction unit weight in their polar
    factors, so there tasks of very different sizes make the result depend on each precision's
    rank cut.

    Args:
      adapters: M adapters (one per task) with the same module names, as for :func:`nu.score`.
      masks: ``{name: bool (M, r_max)}`` from :func:`nu.allocate`, or None to keep every candidate.
      method: one of ``"ta"``, ``"tsv"``, ``"iso_c"``, ``"iso_cts"``, ``"ties"``, ``"dare"``,
        ``"dare_ties"``.
      space: ``"full"``, ``"core"`` or ``"knots"``.
      coef: finite real scaling coefficient of the merged update (may be traced).
      key: ``jax.random`` key (``jax.random.key(0)``, or a raw ``PRNGKey``), required by
        ``"dare"`` and ``"dare_ties"``.
      **options: method options (``density`` in ``[0, 1]``, a concrete number; ``scope``
        ``"module"`` or ``"model"``; ``p`` in ``[0, 1)``; ``isotropize`` a bool;
        ``common_fraction`` in ``[0, 1]``) and space options (``variant`` for KnOTS:
        ``"core_space"`` or ``"original"``). Booleans must be bools and numbers real numbers
        (numpy scalars are fine); nothing is taken by its truthiness.

    Returns:
      An adapter with the first adapter's tree and module names; each module is
      ``{"lora_a": (d_in, K), "lora_b": (K, d_out), "scale": 1.0}`` (``K`` the module's result rank,
      0 if nothing is kept) or, for TIES/DARE in full space, ``{"delta": (d_in, d_out)}``.

    Raises:
      InputError: (a ``ValueError``) unknown method, space or option value; density, p or
        common_fraction out of range; DARE without a key; non-finite coef; masks whose names or
        shapes do not match the adapters; bad adapters (NaN or inf factors, a scale outside the
        dtype's normal range); a merged module beyond the dtype's range.
      InputTypeError: (a ``TypeError``) an option of the wrong type (a string for a bool, a
        complex coef, an int key); masks not a dict of bool arrays.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> ads = [{"q": {"lora_a": rng.normal(size=(32, 4)), "lora_b": rng.normal(size=(4, 16))}}
      ...        for _ in range(3)]
      >>> out = nu.merge(ads, method="ta", space="core")
      >>> dk = out["q"]["lora_a"] @ out["q"]["lora_b"]
      >>> bool(np.allclose(dk, sum(a["q"]["lora_a"] @ a["q"]["lora_b"] for a in ads), atol=1e-3))
      True

    References:
      Amballa et al., "Not All Ranks Are Equal", Algorithm 1; Panariello et al. 2025 (Core Space);
      Stoica et al. 2024 (KnOTS); Ilharco et al. 2023; Yadav et al. 2023; Yu et al. 2024;
      Gargiulo et al. 2025; Marczak et al. 2025.
    """
    fn = _FN
    opts = _resolve_options(fn, method, space, options)
    _check_coef(fn, coef)
    if method in ("dare", "dare_ties"):
        _check_key(fn, key, method)
    names, buckets, m_tasks = _tree.collect(adapters, fn=fn)
    if masks is not None:
        masks = _check_masks(fn, masks, names, buckets, m_tasks)
    dtype = _tree.compute_dtype(buckets)
    _check_scale_range(fn, buckets, dtype)
    if method in ELEMENTWISE_METHODS:
        _check_entry_count(fn, space, buckets, m_tasks)
    coef_arr = jnp.asarray(coef, dtype)
    index = {n: i for i, n in enumerate(names)}
    if method == "ta" and opts["isotropize"]:  # the same operator: share one compiled kernel
        method, opts = "iso_c", {k: v for k, v in opts.items() if k != "isotropize"}
    static_opts, nums = _split(opts, dtype)
    results: dict[str, Any] = {}
    checks: list = []  # (module names, _range_status), checked once every bucket is dispatched
    # buckets are merged a piece at a time: peak memory stays near one piece's stacked factors
    itemsize = jnp.dtype(dtype).itemsize
    buckets = [sub for bk in buckets for sub in _tree.split_bucket(bk, _PIECE_BYTES, itemsize)]
    if method == "ties" and opts["scope"] == "model":
        mks = [_bucket_mask(masks, bk, m_tasks) for bk in buckets]
        results = _ties_model(
            fn,
            buckets,
            mks,
            space=space,
            variant=opts.get("variant"),
            density=opts["density"],
            coef=coef_arr,
            dtype=dtype,
            m_tasks=m_tasks,
            checks=checks,
        )
        _raise_range(fn, checks, dtype)
        return _rebuild(adapters[0], results)
    bads: list = []
    for bk in buckets:
        n = len(bk.names)
        mk = _bucket_mask(masks, bk, m_tasks)
        idx = [index[nm] for nm in bk.names]
        keys = _keys_for(key, idx) if key is not None else jnp.zeros((n,), jnp.uint32)
        leaves = _tree.bucket_arrays(bk)
        if space == "full" and method in ELEMENTWISE_METHODS:
            # module by module: at most one module's M dense task updates are alive
            A, B, S, R = _stage_stack(leaves, cfg=(bk.d_in, bk.d_out, bk.r_max, dtype))
            _raise_nonfinite(fn, [bk], [_stage_scales(A, B, S)[2]], dtype)
            k_top = jnp.asarray(
                _m.topk_count(opts.get("density", 0.0), bk.d_in * bk.d_out), jnp.int32
            )
            for j, nm in enumerate(bk.names):
                delta, check = _module_dense(
                    A[j],
                    B[j],
                    S[j],
                    R[j],
                    mk[j],
                    coef_arr,
                    keys[j],
                    nums,
                    k_top,
                    cfg=(method, bk.r_max),
                )
                # one module's executable at a time: bounded memory, and no two LAPACK calls in
                # flight together (see netutility_jax._linalg)
                results[nm] = {"delta": jax.block_until_ready(delta)}
                checks.append(((nm,), check))
            del A, B, S, R
            continue
        if space == "knots":
            p, q = bk.d_in, m_tasks * bk.r_max
        else:
            p = q = m_tasks * bk.r_max
        chunk = _chunk(m_tasks, p, q, jnp.dtype(dtype).itemsize, len(bk.names))
        cfg = (method, space, static_opts, bk.d_in, bk.d_out, bk.r_max, dtype, chunk)
        la, lb, live, check, bad = _bucket_merge(leaves, mk, coef_arr, keys, nums, cfg=cfg)
        bads.append((bk, bad))
        checks.append((bk.names, check))
        ranks = np.asarray(live.sum(-1))
        for j, nm in enumerate(bk.names):
            rk = int(ranks[j])
            results[nm] = {"lora_a": la[j, :, :rk], "lora_b": lb[j, :rk, :], "scale": 1.0}
    if bads:
        _raise_nonfinite(fn, [bk for bk, _ in bads], [bad for _, bad in bads], dtype)
    _raise_range(fn, checks, dtype)
    return _rebuild(adapters[0], results)


def _check_entry_count(fn: str, space: str, buckets, m_tasks: int) -> None:
    """Elementwise methods index a task's dense coordinates with int32: at most 2**31 - 1
    entries per task and module (a full-space 65536 x 32768 module would need 8 GiB per task)."""
    big = []
    for bk in buckets:
        p, q = {
            "full": (bk.d_in, bk.d_out),
            "core": (m_tasks * bk.r_max,) * 2,
            "knots": (bk.d_in, m_tasks * bk.r_max),
        }[space]
        if p * q > 2**31 - 1:
            big.extend((nm, p, q) for nm in bk.names)
    if big:
        _, p, q = big[0]
        raise InputError(
            f"{fn}: TIES / DARE in space={space!r} work on each task's dense ({p}, {q}) "
            f"coordinates of {_tree._few([b[0] for b in big])}: {p * q} entries, more than "
            "2**31 - 1. Use space='core' (its coordinates are (M r, M r)) or a low-rank method."
        )


def _nonfinite_count(x: Any) -> int:
    """Non-finite entries of a concrete array (0 under a trace: checks are eager only)."""
    if isinstance(x, jax.core.Tracer):
        return 0
    if isinstance(x, jax.Array):
        return int(jnp.sum(~jnp.isfinite(x)))
    return int(np.sum(~np.isfinite(np.asarray(x))))


def _module_array(fn: str, where: str, label: str, x: Any) -> Any:
    """A module's 2-D real array (``delta``, ``lora_a``, ``lora_b``), checked eagerly: finite."""
    x = _tree._unwrap(x)
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        try:
            x = np.asarray(x)
        except Exception:  # ragged lists and such: not an array at all
            x = None
    try:
        real = x is not None and bool(
            jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)
        )
    except TypeError:
        real = False
    if not real:
        what = f"has dtype {x.dtype}" if x is not None else "is not an array"
        raise InputTypeError(f"{fn}: {where}{label} {what}; expected a real (floating) array.")
    if len(x.shape) != 2:
        want = {"lora_a": "d_in, r", "lora_b": "r, d_out"}.get(label, "d_in, d_out")
        raise InputError(f"{fn}: {where}{label} has shape {tuple(x.shape)}; expected 2-D ({want}).")
    n = _nonfinite_count(x)
    if n:
        raise InputError(
            f"{fn}: {where}{label} {tuple(x.shape)} has {n} non-finite "
            f"{'entry' if n == 1 else 'entries'} (NaN or inf) of {int(np.prod(x.shape))}; "
            "expected finite values."
        )
    return x


def _module_arrays(fn: str, module: Any, name: str | None, *, bare_ok: bool) -> tuple:
    """A merged (or input) module checked eagerly (shapes, dtypes, finite values):
    ``("delta", x)`` or ``("lora", a, b, scale)``."""
    where = f"module {_tree.short(name)!r}: " if name is not None else ""
    if _tree._is_mapping(module):
        keys = set(module.keys())
        if keys & {"lora_a", "lora_b"}:
            missing = sorted({"lora_a", "lora_b"} - keys)
            if missing:
                raise InputError(
                    f"{fn}: {where}the module has no {missing[0]!r}; a LoRA module needs both "
                    "'lora_a' (d_in, r) and 'lora_b' (r, d_out)."
                )
            a = _module_array(fn, where, "lora_a", module["lora_a"])
            b = _module_array(fn, where, "lora_b", module["lora_b"])
            if a.shape[1] != b.shape[0]:
                raise InputError(
                    f"{fn}: {where}lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} do not "
                    "chain; expected (d_in, r) and (r, d_out) (dK = lora_a @ lora_b)."
                )
            scale = _tree._unwrap(module["scale"]) if "scale" in keys else 1.0
            _check_real(fn, f"{where}scale", scale, "a finite real number (the LoRA scale)")
            return "lora", a, b, scale
        if "delta" not in keys:
            raise InputError(
                f"{fn}: {where}expected {{'delta': (d_in, d_out)}} or a LoRA module {{'lora_a', "
                f"'lora_b'[, 'scale']}}; got keys {_tree.brief(sorted(map(str, keys)))}."
            )
        return "delta", _module_array(fn, where, "delta", module["delta"])
    if bare_ok:
        return "delta", _module_array(fn, where, "delta", module)
    raise InputTypeError(
        f"{fn}: {where}module is {_given(module)}; expected {{'delta': (d_in, d_out)}} or a LoRA "
        "module {'lora_a', 'lora_b'[, 'scale']}."
    )


@jax.jit
def _lora_product(a, b, mant, exp):
    """``mant 2**exp a b`` without over- or underflow on the way: the factors are normalised by
    powers of two (exact) and the power comes back once, at the end."""
    a, ea, _, _ = _s.split_pow2(a, (0, 1))
    b, eb, _, _ = _s.split_pow2(b, (0, 1))
    return mul_pow2(mant * jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST), ea + eb + exp)


def _split_scale(scale: Any, dtype) -> tuple[jax.Array, jax.Array]:
    """``scale = mant 2**exp`` with ``|mant|`` in ``[0.5, 1)``; on the host in float64 for a
    concrete scale (so a scale beyond ``dtype``'s range still works), else traced."""
    if isinstance(scale, jax.core.Tracer):
        m, e = jnp.frexp(jnp.asarray(scale, dtype))
        return m, e.astype(jnp.int32)
    m, e = np.frexp(np.float64(np.asarray(scale, np.float64)))
    return jnp.asarray(m, dtype), jnp.asarray(e, jnp.int32)


def _update(kind: str, *arrs: Any) -> jax.Array:
    """The dense update of a checked module (:func:`_module_arrays`)."""
    if kind == "delta":
        return jnp.asarray(arrs[0])
    a, b, scale = arrs
    dt = _float_at_least32(a.dtype, b.dtype)
    m, e = _split_scale(scale, dt)
    return _lora_product(jnp.asarray(a, dt), jnp.asarray(b, dt), m, e)


def to_lora(module: Mapping[str, Any] | Any, rank: int) -> dict[str, Any]:
    """Best rank-``rank`` LoRA module of a merged module (truncated SVD, Eckart-Young).

    Args:
      module: ``{"delta": (d_in, d_out)}``, a dense ``(d_in, d_out)`` array, or a LoRA module
        ``{"lora_a", "lora_b"[, "scale"]}`` (truncated from its factors, never densified).
      rank: number of singular directions to keep (>= 0; capped at the module's rank).

    Returns:
      ``{"lora_a": (d_in, k), "lora_b": (k, d_out), "scale": 1.0}`` with ``lora_a = U_k S_k``.

    Raises:
      InputError: rank negative; arrays that are not 2-D or do not chain; a NaN or inf in any
        array or the scale (checked eagerly); a result beyond the dtype's range.
      InputTypeError: rank not an integer; an array of a non-real dtype.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> d = np.outer(np.arange(1.0, 5.0), np.ones(3))
      >>> m = nu.to_lora({"delta": d}, 2)
      >>> bool(np.allclose(m["lora_a"] @ m["lora_b"], d, atol=1e-4)), m["lora_a"].shape
      (True, (4, 2))
    """
    fn = "nu.to_lora"
    if isinstance(rank, (bool, np.bool_)) or not isinstance(rank, numbers.Integral):
        raise InputTypeError(f"{fn}: rank={_given(rank)}; expected an integer >= 0.")
    if rank < 0:
        raise InputError(f"{fn}: rank={_given(rank)}; expected an integer >= 0.")
    kind, *arrs = _module_arrays(fn, module, None, bare_ok=True)
    if kind == "lora":
        a, b, scale = arrs
        u = lora_svd(a, b, scale)  # scale-safe, and raises if s leaves the dtype's range
        k = min(int(rank), u.s.shape[-1])
        return {"lora_a": u.in_dirs[:, :k] * u.s[:k], "lora_b": u.out_dirs[:, :k].T, "scale": 1.0}
    (x,) = arrs
    x = jnp.asarray(x, _float_at_least32(x.dtype))
    k = min(int(rank), min(x.shape))
    la, lb, code = _truncated_svd(x, k)
    if not isinstance(code, jax.core.Tracer) and int(code):
        raise InputError(
            f"{fn}: U_k S_k of the {tuple(x.shape)} update is beyond the range of "
            f"{x.dtype.name} (its largest singular value exceeds {np.finfo(x.dtype).max:.3g}); "
            f"{_X64}."
        )
    return {"lora_a": la, "lora_b": lb, "scale": 1.0}


@functools.partial(jax.jit, static_argnums=(1,))
def _truncated_svd(x, k):
    """``(U_k S_k, V_k^T, not finite)`` of ``x``, computed on ``x`` normalised by a power of
    two (exact) so that no singular value overflows on the way."""
    y, e, _, _ = _s.split_pow2(x, (0, 1))
    u, s, vt = jnp.linalg.svd(y, full_matrices=False)
    la = mul_pow2(u[:, :k] * s[:k], e)
    return la, vt[:k], ~jnp.all(jnp.isfinite(la))


def _float_at_least32(*dts) -> np.dtype:
    """float64 if any input is float64 and x64 is on, else float32 (bf16/fp16 upcast)."""
    if any(np.dtype(d) == np.float64 for d in dts):
        return np.dtype(jax.dtypes.canonicalize_dtype(np.float64))
    return np.dtype(np.float32)


def module_update(module: Mapping[str, Any]) -> jax.Array:
    """Dense ``(d_in, d_out)`` update of a merged (or input) module: ``delta`` or ``scale a b``.

    ``scale a b`` is formed on factors normalised by powers of two (exact), so an extreme but
    finite scale or factor gives the right product wherever the product itself is representable.

    Raises:
      InputError: arrays that are not 2-D or do not chain, or hold a NaN or inf (eager check).
      InputTypeError: not a module, or an array of a non-real dtype.
    """
    return _update(*_module_arrays("nu.module_update", module, None, bare_ok=False))


def fold(params: Any, merged: Any, *, kernel: str = "kernel", coef: float = 1.0) -> Any:
    """Add a merged adapter to a pytree of base kernels, for evaluation: ``W + coef * dK``.

    ``params`` mirrors the adapter's module paths: at each module's path it holds either a mapping
    with a ``kernel`` entry ``(d_in, d_out)`` (flax layout) or the kernel array itself; a flat dict
    keyed by module name works too. Modules may be low rank (``lora_a``/``lora_b``/``scale``) or
    dense (``delta``). Returns a new pytree; other leaves are shared, nothing is mutated. The
    result keeps each kernel's dtype.

    Raises:
      InputError: a module path missing from ``params``, a kernel whose shape differs from the
        module's ``(d_in, d_out)``, a NaN or inf in a module, its scale or its base kernel, a
        non-finite ``coef``, or a folded kernel beyond its dtype's range (all checked eagerly).
      InputTypeError: ``coef`` not a real number, ``kernel`` not a string, arrays of a non-real
        dtype.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> params = {"q": {"kernel": np.zeros((4, 3)), "bias": np.zeros(3)}}
      >>> merged = {"q": {"lora_a": np.ones((4, 1)), "lora_b": np.ones((1, 3)), "scale": 2.0}}
      >>> float(nu.fold(params, merged)["q"]["kernel"].sum())
      24.0
    """
    fn = "nu.fold"
    if not isinstance(kernel, str):
        raise InputTypeError(
            f"{fn}: kernel={_given(kernel)}; expected a string (the key of the base kernel in "
            "each module's params, e.g. 'kernel')."
        )
    coef = _check_real(fn, "coef", coef, "a finite real number (the merged update's coefficient)")
    mods: dict[str, Mapping[str, Any]] = {}

    def walk(node, path):
        if node is None:
            return
        if _tree._is_mapping(node) and ({"lora_a", "lora_b", "delta"} & set(node.keys())):
            mods["/".join(path)] = node
            return
        if _tree._is_mapping(node):
            for k in node.keys():
                walk(node[k], (*path, str(k)))

    walk(merged, ())
    if not mods:
        raise InputError(f"{fn}: merged adapter has no modules ('lora_a'/'lora_b' or 'delta').")

    def add(target, name, mod):
        d = _update(*_module_arrays(fn, mod, name, bare_ok=False))
        w = _module_array(fn, f"module {_tree.short(name)!r}: ", "base kernel", target)
        if tuple(w.shape) != tuple(d.shape):
            raise InputError(
                f"{fn}: module {_tree.short(name)!r}: base kernel has shape {tuple(w.shape)} but "
                f"the update is (d_in, d_out) = {tuple(d.shape)}; kernels use the flax layout "
                "(d_in, d_out)."
            )
        w = jnp.asarray(w)
        out = w + (coef * d).astype(w.dtype)
        if _nonfinite_count(out):
            big = float(jnp.max(jnp.abs(d), initial=0)) * abs(float(coef))
            raise InputError(
                f"{fn}: module {_tree.short(name)!r}: W + coef * dK is not finite in "
                f"{w.dtype.name} (|coef * dK| reaches {big:.3g}; {w.dtype.name} holds at most "
                f"{float(jnp.finfo(w.dtype).max):.3g}); use a smaller coef or a wider kernel "
                "dtype."
            )
        return out

    def put(node, path, name, mod):
        if not path:
            if _tree._is_mapping(node):
                if kernel not in node.keys():
                    raise InputError(
                        f"{fn}: params at {_tree.short(name)!r} has no {_tree.brief(kernel)} entry."
                    )
                out = dict(node)
                out[kernel] = add(node[kernel], name, mod)
                return out
            return add(node, name, mod)
        if not _tree._is_mapping(node) or path[0] not in node.keys():
            raise InputError(
                f"{fn}: module {_tree.short(name)!r} has no counterpart in params (missing key "
                f"{_tree.brief(path[0])}); params must mirror the adapter's module paths."
            )
        out = dict(node)
        out[path[0]] = put(node[path[0]], path[1:], name, mod)
        return out

    out = params
    for name, mod in mods.items():
        if _tree._is_mapping(out) and name in out.keys():
            out = dict(out)
            out[name] = put(out[name], (), name, mod)
        else:
            out = put(out, tuple(name.split("/")), name, mod)
    return out


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`merge_adapters` did.

    Attributes:
      lam: interference weight used (None for ``allocation="all"``, which does not score).
      alpha: geometry exponent used (None for ``"all"``).
      budget: the budget R asked for (average directions per module).
      budget_spent: average directions kept per module.
      kept: ``{name: (M,) int}`` directions kept per module and task.
      kept_per_task: ``(M,)`` directions kept per task over all modules.
      non_prefix_fraction: fraction of per-(module, task) kept sets that are not a spectral prefix.
      heterogeneity: ``h = Var_i[log ||dW_i||_F^2]`` (paper Eq. h); NaN if a task is all zero.
      ranks: ``{name: int}`` rank of each merged module (None for dense modules).
      method, space, allocation, scope: the settings used.
      masks: ``{name: bool (M, r_max)}`` the kept components (for plots and analyses).
      scores: the :class:`nu.Scores` the allocation used (None for ``allocation="all"``).
    """

    lam: float | None
    alpha: float | None
    budget: int
    budget_spent: float
    kept: dict[str, np.ndarray]
    kept_per_task: np.ndarray
    non_prefix_fraction: float
    heterogeneity: float
    ranks: dict[str, int | None]
    method: str
    space: str
    allocation: str
    scope: str | None
    masks: dict[str, Any] | None = None
    scores: Any = None


def merge_adapters(
    adapters: Sequence[Any],
    *,
    budget: int,
    method: str = "ta",
    space: str = "full",
    allocation: str = "net_utility",
    scope: str | None = None,
    alpha: float | str = 1.0,
    lam: float | str = "auto",
    positive_only: bool = True,
    coef: float = 1.0,
    key: jax.Array | None = None,
    **options: Any,
) -> tuple[Any, Report]:
    """Score, allocate a budget, merge and report, in one call (paper, Algorithm 1).

    ``allocation="net_utility"`` keeps the top utilities (:func:`nu.score`, :func:`nu.allocate`)
    with ``scope`` defaulting to the paper's choice: ``"global"`` for TA, TSV, Iso-C and Iso-CTS,
    ``"local"`` (per module) for TIES, DARE and DARE-TIES. ``"uniform"`` is the paper's baseline
    (equal share per task, spectral prefixes); ``"all"`` keeps every candidate (no scoring).

    Args:
      adapters: M adapters, as for :func:`merge`.
      budget: R, average directions per module (a positive Python or numpy int).
      method, space, coef, key, **options: as for :func:`merge`.
      allocation: ``"net_utility"``, ``"uniform"`` or ``"all"``.
      scope: ``"global"`` or ``"local"`` for net utility; None picks the paper's default.
      alpha, lam, positive_only: as for :func:`nu.score` / :func:`nu.allocate`.

    Returns:
      ``(merged_adapter, Report)``.

    Raises:
      InputError: unknown allocation or scope, budget <= 0, ``lam`` or ``alpha`` negative or not
        finite (they are ``"auto"`` or a finite number >= 0), plus everything :func:`merge` and
        :func:`nu.score` raise.
      InputTypeError: an option of the wrong type (``positive_only`` not a bool, ``budget`` not
        an int, a complex ``lam``, an int ``key``).

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> ads = [{f"m{l}": {"lora_a": rng.normal(size=(32, 4)), "lora_b": rng.normal(size=(4, 16))}
      ...         for l in range(2)} for _ in range(3)]
      >>> out, rep = nu.merge_adapters(ads, budget=4, allocation="uniform")
      >>> rep.budget_spent, sum(rep.ranks.values())
      (4.0, 8)
    """
    fn = "nu.merge_adapters"
    _resolve_options(fn, method, space, options)
    _check_choice(fn, "allocation", allocation, ALLOCATIONS)
    if scope is not None:
        _check_choice(
            fn, "scope", scope, ("global", "local"), " or None (the paper's choice per method)"
        )
    if scope is None:
        scope = "local" if method in ELEMENTWISE_METHODS else "global"
    if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, numbers.Integral):
        raise InputTypeError(
            f"{fn}: budget={_given(budget)}; expected a positive integer R (directions per "
            "module on average)."
        )
    if budget <= 0:
        raise InputError(
            f"{fn}: budget={_given(budget)}; expected a positive integer R (directions per "
            "module on average)."
        )
    _check_auto(
        fn, "alpha", alpha, "a finite number >= 0 (1.0 Gram geometry, 0.0 row space) or 'auto'"
    )
    _check_auto(fn, "lam", lam, "a finite number >= 0 (the interference weight) or 'auto'")
    positive_only = _check_bool(fn, "positive_only", positive_only)
    _check_coef(fn, coef)
    if method in ("dare", "dare_ties"):
        _check_key(fn, key, method)
    names, buckets, _m_tasks = _tree.collect(adapters, fn=fn)
    lam_used = alpha_used = None
    sc = None
    if allocation == "all":
        masks = None
        kept_masks = {}
        dtype = _tree.compute_dtype(buckets)
        _check_scale_range(fn, buckets, dtype)
        for bk in buckets:
            stacked = _stage_stack(
                _tree.bucket_arrays(bk), cfg=(bk.d_in, bk.d_out, bk.r_max, dtype)
            )
            # one LAPACK-using computation at a time
            keep = jax.block_until_ready(_stage_keep(*stacked, cfg=(bk.r_max,)))
            for j, nm in enumerate(bk.names):
                kept_masks[nm] = keep[j]
        kept_masks = {nm: kept_masks[nm] for nm in names}
    else:
        sc = score(adapters, alpha=alpha, lam=lam)
        lam_used, alpha_used = float(sc.lam), float(sc.alpha)
        masks = allocate(
            sc,
            budget,
            scope="uniform" if allocation == "uniform" else scope,
            positive_only=positive_only,
        )
        kept_masks = masks
    merged = merge(adapters, masks, method=method, space=space, coef=coef, key=key, **options)
    try:
        h = float(heterogeneity(adapters))
    except ValueError:
        h = float("nan")
    ranks: dict[str, int | None] = {}

    def walk(node, path):
        if _tree._is_mapping(node) and ("lora_a" in node.keys() or "delta" in node.keys()):
            ranks["/".join(path) or "lora"] = (
                int(node["lora_a"].shape[1]) if "lora_a" in node.keys() else None
            )
            return
        for k2 in node.keys():
            walk(node[k2], (*path, str(k2)))

    walk(merged, ())
    kept = {nm: np.asarray(v, bool).sum(1) for nm, v in kept_masks.items()}
    report = Report(
        lam=lam_used,
        alpha=alpha_used,
        budget=int(budget),
        budget_spent=budget_spent(kept_masks),
        kept=kept,
        kept_per_task=np.asarray(kept_per_task(kept_masks)),
        non_prefix_fraction=non_prefix_fraction(kept_masks),
        heterogeneity=h,
        ranks={nm: ranks[nm] for nm in names},
        method=method,
        space=space,
        allocation=allocation,
        scope=scope if allocation == "net_utility" else None,
        masks=dict(kept_masks),
        scores=sc,
    )
    return merged, report
