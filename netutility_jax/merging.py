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
only the live columns are mapped back.

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


def _resolve_options(fn: str, method: str, space: str, options: Mapping[str, Any]) -> dict:
    if method not in METHODS:
        raise InputError(f"{fn}: unknown method {method!r}; expected one of {METHODS}.")
    if space not in _s.SPACES:
        raise InputError(f"{fn}: unknown space {space!r}; expected one of {_s.SPACES}.")
    takes = {**METHOD_OPTIONS[method], **SPACE_OPTIONS[space]}
    extra = sorted(set(options) - set(takes))
    if extra:
        which = ", ".join(repr(k) for k in takes) or "no options"
        raise InputError(
            f"{fn}: method={method!r} in space={space!r} does not take {', '.join(map(repr, extra))}; "
            f"it takes {which}."
        )
    opts = {**takes, **options}
    for name in ("density", "p"):
        if name not in takes:
            continue
        v = opts[name]
        if v is None:
            raise InputError(
                f"{fn}: method={method!r} needs {name}= (the drop rate in [0, 1), e.g. p=0.5)."
            )
        hi_ok = name == "density"
        if (
            isinstance(v, bool)
            or not isinstance(v, numbers.Real)
            or not np.isfinite(v)
            or not (0 <= v < 1 or (hi_ok and v == 1))
        ):
            rng = "[0, 1]" if hi_ok else "[0, 1)"
            raise InputError(f"{fn}: {name}={v!r}; expected a number in {rng}.")
        opts[name] = float(v)
    if method == "ties" and opts["scope"] not in ("module", "model"):
        raise InputError(
            f"{fn}: TIES scope={opts['scope']!r}; expected 'module' (per-module top-k, default) "
            "or 'model' (top-k over the whole model, as the original KnOTS)."
        )
    if method == "iso_cts":
        cf = opts["common_fraction"]
        if isinstance(cf, bool) or not isinstance(cf, numbers.Real) or not 0 <= cf <= 1:
            raise InputError(f"{fn}: common_fraction={cf!r}; expected a number in [0, 1].")
        opts["common_fraction"] = float(cf)
    if space == "knots" and opts["variant"] not in _s.KNOTS_VARIANTS:
        raise InputError(
            f"{fn}: KnOTS variant={opts['variant']!r}; expected one of {_s.KNOTS_VARIANTS} "
            "('core_space': unscaled blocks V_i, default; 'original': scaled blocks S V_i)."
        )
    for name in ("isotropize",):
        if name in opts:
            opts[name] = bool(opts[name])
    return opts


def _check_coef(fn: str, coef: Any) -> None:
    if isinstance(coef, jax.core.Tracer):
        return
    c = np.asarray(coef)
    if c.shape != () or not np.issubdtype(c.dtype, np.number) or not np.isfinite(c):
        raise InputError(f"{fn}: coef={coef!r}; expected a finite scalar.")


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
                raise InputTypeError(f"{fn}: mask of module {name!r} has dtype {dt}; expected bool.")
            out[name] = m
    return out


# ---------------------------------------------------------------------------------------------
# Per-bucket kernels (pure; batched over the bucket's modules)
# ---------------------------------------------------------------------------------------------


NUMERIC_OPTIONS = ("density", "p", "common_fraction")  # traced: new values do not recompile


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


def _coords(k, a, b, *, space, opts, rtol):
    if space == "full":
        return _s.full_coords(k)
    if space == "core":
        return _s.core_coords(k, a, b, rtol=rtol)
    return _s.knots_coords(k, rtol=rtol, variant=opts["variant"])


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


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_stack(leaves, *, cfg):
    """Zero-padded stacked factors of a bucket (see ``_tree.stack_bucket``)."""
    d_in, d_out, r_max, dtype = cfg
    a, b, s = leaves
    return _tree.stack_bucket(a, b, s, d_in=d_in, d_out=d_out, r_max=r_max, dtype=dtype)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_reduce(leaves, *, cfg):
    """A bucket's factors in the bases of their own spans (:class:`spaces.Reduced`), its scales
    and ranks: the only ``d``-sized work before the map back (two Grams, one product per side)."""
    d_in, d_out, r_max, dtype, m_tasks = cfg
    a, b, s = leaves
    xa, yb, S, R = _tree.stack_bucket_cat(a, b, s, d_in=d_in, d_out=d_out, r_max=r_max, dtype=dtype)
    return _s.reduce_factors(xa, yb, m_tasks), S, R


def _expand_in(qa, x):
    """Reduced input-side columns ``x (n, [M,] K, k)`` to ``d_in``: ``Q_a x``."""
    q1, m = (qa.q1, qa.m) if x.ndim == 3 else (qa.q1[:, None], qa.m[:, None])
    return _mm(q1, _mm(m, x))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_coords(red, S, R, mask, *, cfg):
    """Kept components of a bucket in a space's coordinates (:class:`spaces.Coords`).

    Computed in the reduced coordinates of :class:`spaces.Reduced`; with ``ambient_in`` (KnOTS
    with an elementwise method, whose input side is entry-wise in ``d_in``) the input side is
    mapped back to ``d_in``.
    """
    space, variant, rtol, ambient_in = cfg
    k = _s.kept_components(
        red.a, red.b, S, R, mask, cand_rtol=default_rtol(red.a.shape[-1], red.a.dtype)
    )
    c = _coords(k, red.a, red.b, space=space, opts={"variant": variant}, rtol=rtol)
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


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_map_back(la, lb, qa, qb, *, cfg):
    width, expand_in = cfg
    la, lb = la[..., :width], lb[..., :width, :]
    if expand_in:
        la = _expand_in(qa, la)
    return la, qb.times_qt(lb)


def _map_back(la, lb, live, qa, qb, expand_in):
    """Reduced results ``la (n, K|d_in, k)``, ``lb (n, k, K)`` (live columns first) to ``d_in`` /
    ``d_out``: only the bucket's largest live count of columns, rounded up to a multiple of 16
    (few compiled widths), are mapped back and returned."""
    if isinstance(live, jax.core.Tracer):
        width = live.shape[-1]
    else:
        most = int(np.asarray(live.sum(-1)).max(initial=0))
        width = min(live.shape[-1], -(-most // 16) * 16)
    la, lb = _stage_map_back(la, lb, qa, qb, cfg=(width, expand_in))
    return la, lb, live[..., :width]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_decode(coords, am, bm, *, cfg):
    rtol, compact = cfg
    return _s.decode_factored(coords, am, bm, rtol=rtol, compact=compact)


def _real_entries(c):
    """Entries of each module's dense coordinates ``(p, q)`` that its bases span (live columns of
    ``left`` times those of ``right``; ``p`` without ``left``): TIES's ``n`` in core / KnOTS."""
    live_q = (jnp.abs(c.right).sum(-2) > 0).sum(-1, dtype=jnp.int32)
    if c.left is None:
        return c.a.shape[-2] * live_q
    return (jnp.abs(c.left).sum(-2) > 0).sum(-1, dtype=jnp.int32) * live_q


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_split(coords, keys, density, *, cfg):
    """A bucket's coordinates cut into chunks of whole modules for :func:`_stage_elementwise`:
    ``[(a, b, keys, k_top)]`` per chunk. TIES keeps ``k_top = int(density * n)`` of the ``n``
    real entries of a module's coordinates (the bases may be smaller than ``D``)."""
    (chunk,) = cfg
    c = coords
    n = c.a.shape[0]
    k_top = jnp.broadcast_to(_m.topk_count(density, _real_entries(c)), (n,))
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


def _elementwise_bucket(coords, coef, keys, nums, *, cfg):
    """TIES / DARE on a bucket, a chunk of whole modules per call (at most one chunk's dense
    tasks alive), then decoded. A Python loop rather than ``lax.map``: XLA:CPU writes a mapped
    output through an in-place update that it emits as scalar code, ~4 ms per KnOTS module."""
    method, rtol, chunk = cfg
    density = nums.get("density", jnp.zeros((), coef.dtype))
    xms = [
        _stage_elementwise(a, b, kk, kt, coef, nums, cfg=(method,))
        for a, b, kk, kt in _stage_split(coords, keys, density, cfg=(chunk,))
    ]
    return _stage_decode_chunks(coords, xms, cfg=(rtol,))


def _bucket_merge(leaves, mask, coef, keys, nums, *, cfg):
    """One bucket, every method except elementwise-in-full: ``(lora_a, lora_b, live)`` padded.

    Composes the jitted stages (traceable as a whole, e.g. by ``jax.make_jaxpr``).
    """
    method, space, opts, d_in, d_out, r_max, dtype, chunk = cfg
    opts = dict(opts)
    m_tasks = len(leaves[0][0])
    red, S, R = _stage_reduce(leaves, cfg=(d_in, d_out, r_max, dtype, m_tasks))
    rtol = _m.rank_rtol((d_in, d_out, m_tasks * r_max), dtype)
    elementwise = method in ELEMENTWISE_METHODS
    ambient_in = elementwise and space == "knots"
    # Spectral methods are invariant to the orthonormal bases they run in, as long as the bases
    # span the kept components; the reduced coordinates are such bases (Core Space's reference
    # bases up to a rotation), so Core Space's bases and core matrices would change nothing:
    # core-space TA / TSV / Iso-C / Iso-CTS run in the reduced coordinates directly.
    cspace = "full" if space == "core" and not elementwise else space
    c = _stage_coords(red, S, R, mask, cfg=(cspace, opts.get("variant"), rtol, ambient_in))
    if elementwise:
        la, lb, live = _elementwise_bucket(c, coef, keys, nums, cfg=(method, rtol, chunk))
        return _map_back(la, lb, live, red.qa, red.qb, not ambient_in)
    mopts = tuple((k, v) for k, v in sorted(opts.items()) if k != "variant")
    am, bm = _stage_low_rank(c.a, c.b, coef, nums, cfg=(method, mopts, rtol, cspace == "full"))
    # the result's factors are exact as they come (live columns = the nonzero ones)
    la, lb, live = _stage_decode(c, am, bm, cfg=(rtol, False))
    return _map_back(la, lb, live, red.qa, red.qb, True)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _module_dense(a, b, s, r, mask, coef, key, nums, k_top, *, cfg):
    """One module, elementwise method in full space: dense ``(d_in, d_out)`` merged update."""
    method, r_max = cfg
    k = _s.kept_components(
        a[None], b[None], s[None], r[None], mask[None], cand_rtol=default_rtol(r_max, a.dtype)
    )
    x = _s.dense_tasks(_s.full_coords(k))  # (1, M, d_in, d_out)
    return _elementwise(x, key[None], method=method, coef=coef, opts=dict(nums), k_top=k_top[None])[
        0
    ]


# TIES with scope="model": each task keeps its int(density * N) largest entries over the whole
# model (N = entries of all modules in the space's coordinates), as the original TIES and KnOTS.
# The per-task threshold is found by radix selection over the magnitudes' bit patterns, 16 bits
# per pass, each pass streaming the modules (full space) or chunks of modules (core, KnOTS) with
# only the counts kept: memory stays at one unit's dense tasks, like scope="module".


@functools.partial(jax.jit, static_argnames=("cfg",))
def _module_tasks(a, b, s, r, mask, *, cfg):
    """One module's kept dense task updates, full space: ``(1, M, d_in, d_out)``."""
    (r_max,) = cfg
    k = _s.kept_components(
        a[None], b[None], s[None], r[None], mask[None], cand_rtol=default_rtol(r_max, a.dtype)
    )
    return _s.dense_tasks(_s.full_coords(k))


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


def _ties_model(buckets, mks, *, space, variant, density, coef, dtype, m_tasks) -> dict:
    """TIES over the whole model (see the comment above); returns ``{name: module}``."""
    units = []  # (produce dense tasks, finish with the merged dense coordinates)
    n_total = 0
    results: dict[str, Any] = {}
    for bk, mk in zip(buckets, mks, strict=True):
        leaves = _tree.bucket_arrays(bk)
        if space == "full":
            stacked = _stage_stack(leaves, cfg=(bk.d_in, bk.d_out, bk.r_max, dtype))
            for j, nm in enumerate(bk.names):
                n_total += bk.d_in * bk.d_out

                def produce(j=j, st=stacked, mk=mk, r_max=bk.r_max):
                    a, b, s, r = st
                    return _module_tasks(a[j], b[j], s[j], r[j], mk[j], cfg=(r_max,))

                def finish(xm, nm=nm):
                    results[nm] = {"delta": jax.block_until_ready(xm[0])}

                units.append((produce, finish))
            continue
        rtol = _m.rank_rtol((bk.d_in, bk.d_out, m_tasks * bk.r_max), dtype)
        red, S, R = _stage_reduce(leaves, cfg=(bk.d_in, bk.d_out, bk.r_max, dtype, m_tasks))
        ambient_in = space == "knots"
        c = jax.block_until_ready(
            _stage_coords(red, S, R, mk, cfg=(space, variant, rtol, ambient_in))
        )
        qa, qb = red.qa, red.qb
        del red
        n_total += int(np.asarray(_real_entries(c), np.int64).sum())
        p, q = c.a.shape[-2], c.b.shape[-2]
        chunk = _chunk(m_tasks, p, q, jnp.dtype(dtype).itemsize, len(bk.names))
        for j0 in range(0, len(bk.names), chunk):
            sl, sqa, sqb = jax.tree.map(lambda x, j0=j0, n=chunk: x[j0 : j0 + n], (c, qa, qb))

            def produce(sl=sl):
                return _coords_tasks(sl.a, sl.b)

            def finish(xm, sl=sl, sqa=sqa, sqb=sqb, j0=j0, bk=bk, rtol=rtol, ex=not ambient_in):
                la, lb, live = _map_back(*_stage_decode_chunks(sl, [xm], cfg=(rtol,)), sqa, sqb, ex)
                ranks = np.asarray(live.sum(-1))
                for jj, rk in enumerate(ranks):
                    rk = int(rk)
                    results[bk.names[j0 + jj]] = {
                        "lora_a": la[jj, :, :rk],
                        "lora_b": lb[jj, :rk, :],
                        "scale": 1.0,
                    }

            units.append((produce, finish))
    k = int(np.floor(density * n_total * (1 + 8 * np.finfo(np.float64).eps)))
    t, room, at = _radix_threshold(units, m_tasks, k, dtype)
    flat_ties = bool(np.any(at > room))  # otherwise every entry at a threshold is kept
    t = jnp.asarray(t)
    for produce, finish in units:
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
      times ``coef``.
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
    zero columns). Use :func:`to_lora` for a truncated SVD of any module.

    Args:
      adapters: M adapters (one per task) with the same module names, as for :func:`nu.score`.
      masks: ``{name: bool (M, r_max)}`` from :func:`nu.allocate`, or None to keep every candidate.
      method: one of ``"ta"``, ``"tsv"``, ``"iso_c"``, ``"iso_cts"``, ``"ties"``, ``"dare"``,
        ``"dare_ties"``.
      space: ``"full"``, ``"core"`` or ``"knots"``.
      coef: finite scaling coefficient of the merged update.
      key: ``jax.random`` key, required by ``"dare"`` and ``"dare_ties"``.
      **options: method options (``density``, ``scope``, ``p``, ``isotropize``,
        ``common_fraction``) and space options (``variant`` for KnOTS).

    Returns:
      An adapter with the first adapter's tree and module names; each module is
      ``{"lora_a": (d_in, K), "lora_b": (K, d_out), "scale": 1.0}`` (``K`` the module's result rank,
      0 if nothing is kept) or, for TIES/DARE in full space, ``{"delta": (d_in, d_out)}``.

    Raises:
      ValueError: unknown method, space or option; density/p out of range; DARE without a key;
        non-finite coef; masks whose names or shapes do not match the adapters; bad adapters.
      TypeError: masks not a dict of bool arrays.

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
    if method in ("dare", "dare_ties") and key is None:
        raise InputError(
            f"{fn}: method={method!r} needs key= (a jax.random key, e.g. jax.random.key(0)); the "
            "drop mask is drawn fresh from it on every call."
        )
    names, buckets, m_tasks = _tree.collect(adapters, fn=fn)
    if masks is not None:
        masks = _check_masks(fn, masks, names, buckets, m_tasks)
    dtype = _tree.compute_dtype(buckets)
    coef_arr = jnp.asarray(coef, dtype)
    index = {n: i for i, n in enumerate(names)}
    if method == "ta" and opts["isotropize"]:  # the same operator: share one compiled kernel
        method, opts = "iso_c", {k: v for k, v in opts.items() if k != "isotropize"}
    static_opts, nums = _split(opts, dtype)
    results: dict[str, Any] = {}
    # buckets are merged a piece at a time: peak memory stays near one piece's stacked factors
    itemsize = jnp.dtype(dtype).itemsize
    buckets = [sub for bk in buckets for sub in _tree.split_bucket(bk, _PIECE_BYTES, itemsize)]
    if method == "ties" and opts["scope"] == "model":
        mks = [_bucket_mask(masks, bk, m_tasks) for bk in buckets]
        results = _ties_model(
            buckets,
            mks,
            space=space,
            variant=opts.get("variant"),
            density=opts["density"],
            coef=coef_arr,
            dtype=dtype,
            m_tasks=m_tasks,
        )
        return _rebuild(adapters[0], results)
    for bk in buckets:
        n = len(bk.names)
        mk = _bucket_mask(masks, bk, m_tasks)
        idx = [index[nm] for nm in bk.names]
        keys = _keys_for(key, idx) if key is not None else jnp.zeros((n,), jnp.uint32)
        leaves = _tree.bucket_arrays(bk)
        if space == "full" and method in ELEMENTWISE_METHODS:
            # module by module: at most one module's M dense task updates are alive
            A, B, S, R = _stage_stack(leaves, cfg=(bk.d_in, bk.d_out, bk.r_max, dtype))
            k_top = jnp.asarray(int(opts.get("density", 0.0) * bk.d_in * bk.d_out), jnp.int32)
            for j, nm in enumerate(bk.names):
                delta = _module_dense(
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
            del A, B, S, R
            continue
        if space == "knots":
            p, q = bk.d_in, m_tasks * bk.r_max
        else:
            p = q = m_tasks * bk.r_max
        chunk = _chunk(m_tasks, p, q, jnp.dtype(dtype).itemsize, len(bk.names))
        cfg = (method, space, static_opts, bk.d_in, bk.d_out, bk.r_max, dtype, chunk)
        la, lb, live = _bucket_merge(leaves, mk, coef_arr, keys, nums, cfg=cfg)
        ranks = np.asarray(live.sum(-1))
        for j, nm in enumerate(bk.names):
            rk = int(ranks[j])
            results[nm] = {"lora_a": la[j, :, :rk], "lora_b": lb[j, :rk, :], "scale": 1.0}
    return _rebuild(adapters[0], results)


def to_lora(module: Mapping[str, Any] | Any, rank: int) -> dict[str, Any]:
    """Best rank-``rank`` LoRA module of a merged module (truncated SVD, Eckart-Young).

    Args:
      module: ``{"delta": (d_in, d_out)}``, a dense ``(d_in, d_out)`` array, or a LoRA module
        ``{"lora_a", "lora_b"[, "scale"]}`` (truncated from its factors, never densified).
      rank: number of singular directions to keep (>= 0; capped at the module's rank).

    Returns:
      ``{"lora_a": (d_in, k), "lora_b": (k, d_out), "scale": 1.0}`` with ``lora_a = U_k S_k``.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> d = np.outer(np.arange(1.0, 5.0), np.ones(3))
      >>> m = nu.to_lora({"delta": d}, 2)
      >>> bool(np.allclose(m["lora_a"] @ m["lora_b"], d, atol=1e-4)), m["lora_a"].shape
      (True, (4, 2))
    """
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 0:
        raise InputError(f"nu.to_lora: rank={rank!r}; expected an integer >= 0.")
    if isinstance(module, Mapping) and "lora_a" in module:
        u = lora_svd(module["lora_a"], module["lora_b"], module.get("scale", 1.0))
        k = min(int(rank), u.s.shape[-1])
        return {"lora_a": u.in_dirs[:, :k] * u.s[:k], "lora_b": u.out_dirs[:, :k].T, "scale": 1.0}
    x = module["delta"] if isinstance(module, Mapping) else module
    if not hasattr(x, "shape") or len(x.shape) != 2:
        raise InputError(
            "nu.to_lora: expected {'delta': (d_in, d_out)}, a 2-D array or a LoRA module; got "
            f"{type(x).__name__} with shape {getattr(x, 'shape', None)}."
        )
    x = jnp.asarray(x, _float_at_least32(x.dtype))
    u, s, vt = jnp.linalg.svd(x, full_matrices=False)
    k = min(int(rank), s.shape[0])
    return {"lora_a": u[:, :k] * s[:k], "lora_b": vt[:k], "scale": 1.0}


def _float_at_least32(*dts) -> np.dtype:
    """float64 if any input is float64 and x64 is on, else float32 (bf16/fp16 upcast)."""
    if any(np.dtype(d) == np.float64 for d in dts):
        return np.dtype(jax.dtypes.canonicalize_dtype(np.float64))
    return np.dtype(np.float32)


def module_update(module: Mapping[str, Any]) -> jax.Array:
    """Dense ``(d_in, d_out)`` update of a merged (or input) module: ``delta`` or ``scale a b``."""
    if "delta" in module:
        return jnp.asarray(module["delta"])
    a, b = jnp.asarray(module["lora_a"]), jnp.asarray(module["lora_b"])
    dt = _float_at_least32(a.dtype, b.dtype)
    return jnp.asarray(module.get("scale", 1.0), dt) * jnp.matmul(
        a.astype(dt), b.astype(dt), precision=jax.lax.Precision.HIGHEST
    )


def fold(params: Any, merged: Any, *, kernel: str = "kernel", coef: float = 1.0) -> Any:
    """Add a merged adapter to a pytree of base kernels, for evaluation: ``W + coef * dK``.

    ``params`` mirrors the adapter's module paths: at each module's path it holds either a mapping
    with a ``kernel`` entry ``(d_in, d_out)`` (flax layout) or the kernel array itself; a flat dict
    keyed by module name works too. Modules may be low rank (``lora_a``/``lora_b``/``scale``) or
    dense (``delta``). Returns a new pytree; other leaves are shared, nothing is mutated. The
    result keeps each kernel's dtype.

    Raises:
      ValueError: a module path missing from ``params``, or a kernel whose shape differs from the
        module's ``(d_in, d_out)``.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> params = {"q": {"kernel": np.zeros((4, 3)), "bias": np.zeros(3)}}
      >>> merged = {"q": {"lora_a": np.ones((4, 1)), "lora_b": np.ones((1, 3)), "scale": 2.0}}
      >>> float(nu.fold(params, merged)["q"]["kernel"].sum())
      24.0
    """
    fn = "nu.fold"
    mods: dict[str, Mapping[str, Any]] = {}

    def walk(node, path):
        if node is None:
            return
        if _tree._is_mapping(node) and ({"lora_a", "delta"} & set(node.keys())):
            mods["/".join(path)] = node
            return
        if _tree._is_mapping(node):
            for k in node.keys():
                walk(node[k], (*path, str(k)))

    walk(merged, ())
    if not mods:
        raise InputError(f"{fn}: merged adapter has no modules ('lora_a'/'lora_b' or 'delta').")

    def add(target, name, mod):
        w = _tree._unwrap(target)
        d = module_update(mod)
        if tuple(w.shape) != tuple(d.shape):
            raise InputError(
                f"{fn}: module {name!r}: base kernel has shape {tuple(w.shape)} but the update is "
                f"(d_in, d_out) = {tuple(d.shape)}; kernels use the flax layout (d_in, d_out)."
            )
        w = jnp.asarray(w)
        return w + (coef * d).astype(w.dtype)

    def put(node, path, name, mod):
        if not path:
            if _tree._is_mapping(node):
                if kernel not in node.keys():
                    raise InputError(f"{fn}: params at {name!r} has no {kernel!r} entry.")
                out = dict(node)
                out[kernel] = add(node[kernel], name, mod)
                return out
            return add(node, name, mod)
        if not _tree._is_mapping(node) or path[0] not in node.keys():
            raise InputError(
                f"{fn}: module {name!r} has no counterpart in params (missing key {path[0]!r}); "
                "params must mirror the adapter's module paths."
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
      budget: R, average directions per module (positive integer).
      method, space, coef, key, **options: as for :func:`merge`.
      allocation: ``"net_utility"``, ``"uniform"`` or ``"all"``.
      scope: ``"global"`` or ``"local"`` for net utility; None picks the paper's default.
      alpha, lam, positive_only: as for :func:`nu.score` / :func:`nu.allocate`.

    Returns:
      ``(merged_adapter, Report)``.

    Raises:
      ValueError: unknown allocation or scope, plus everything :func:`merge` raises.

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
    if allocation not in ALLOCATIONS:
        raise InputError(f"{fn}: unknown allocation {allocation!r}; expected one of {ALLOCATIONS}.")
    if scope is None:
        scope = "local" if method in ELEMENTWISE_METHODS else "global"
    if allocation == "net_utility" and scope not in ("global", "local"):
        raise InputError(f"{fn}: scope={scope!r}; expected 'global', 'local' or None.")
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget <= 0:
        raise InputError(f"{fn}: budget={budget!r}; expected a positive integer R.")
    names, buckets, _m_tasks = _tree.collect(adapters, fn=fn)
    lam_used = alpha_used = None
    sc = None
    if allocation == "all":
        masks = None
        kept_masks = {}
        dtype = _tree.compute_dtype(buckets)
        for bk in buckets:
            a, b, s = _tree.bucket_arrays(bk)
            A, B, S, R = _tree.stack_bucket(
                a, b, s, d_in=bk.d_in, d_out=bk.d_out, r_max=bk.r_max, dtype=dtype
            )
            k = _s.kept_components(
                A,
                B,
                S,
                R,
                jnp.ones((*A.shape[:2], bk.r_max), bool),
                cand_rtol=default_rtol(bk.r_max, dtype),
            )
            keep = jax.block_until_ready(k.keep)  # one LAPACK-using computation at a time
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
