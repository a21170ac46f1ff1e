"""An eager TA merge as one program: scores, lambda, allocation and merge, read once.

``nu.merge_adapters(adapters, method="ta")`` by stages runs three programs (the
scoring kernel, the allocation, the TA program) with reads between them (the scoring's status,
the masks, the merged flags, lambda and alpha for the report) and hands the masks back to the
device for the merge. Here the same functions run inside one jitted program, the scoring on its
fast route (``"raw"``), and everything the host needs comes back in one byte vector: the
scoring's status flags, lambda, the allocation's bad-field flag and masks, the merged flags and
the task energies for ``h``. The scores and a stacked set's merged factors stay on the device; a
list's buckets are stacked once, for the whole program (as the scoring stacks them), and its
modules come back as :func:`ta.merge_ta` gives them (:func:`ta.module_factors`).

Where a flag says that the fast route does not stand (the raw Grams refused, a non-finite factor,
a result beyond the dtype, no candidate for ``lam="auto"``, an ``h`` within 1e-3 of the
``alpha="auto"`` rule's threshold, a NaN or +inf field, a merged result
that is not finite), :func:`fused_ta` returns None and the caller runs the stages one by one,
which take the exact route or raise as they always did: this program is one schedule of the
same functions, never a second semantics.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core import buckets as _buckets
from .._core import stacking as _stacking
from .._core import tree as _tree
from .._core.executables import kernel
from .._core.host import host_constant
from .._core.linalg import mul_pow2
from .._core.tables import ScoreTable
from ..allocation import allocate as _allocate
from ..errors import InputError
from ..operators import ta
from ..operators._plan import check_scale_range
from ..operators.stacked import StackedAdapters
from ..scoring._kernels import (
    ANY_SIGMA,
    BEYOND,
    NONFINITE,
    RAW_OK,
    ModuleScores,
    Scores,
    default_rtol,
    score_impl,
)
from ..scoring._run import H_THRESHOLD, log_energy_variance, sum_energies
from ._report import h_of

__all__ = [
    "Fused",
    "Prepared",
    "Reader",
    "alpha_used",
    "as_bytes",
    "fused_ta",
    "prepare",
    "read_head",
    "read_tail",
    "score_allocate",
    "scores_of",
    "takes_request",
]


class _Spec(NamedTuple):
    """The fused program's static settings."""

    dtype: Any
    dims: tuple[tuple[int, int, int], ...]  # per bucket (d_in, d_out, r_max)
    lam_is_auto: bool
    alpha_is_auto: bool  # alpha="auto": both alphas scored, the heterogeneity rule picks one
    interference: str
    budget: int  # (capped at a module's slots, as nu.allocate caps it)
    scope: str
    positive_only: bool
    n_modules: int


class Fused(NamedTuple):
    """What :func:`fused_ta` returns: ``merge_adapters``'s TA results and the report's numbers
    read with them (``lam``, ``alpha``: Python floats, no second read)."""

    merged: Any  # a stacked set's MergedTable (kept columns first), or a list's modules by name
    masks: Any  # the allocation's MaskTable (host copies)
    scores: Scores
    h: float
    zeroed: tuple[str, ...]
    lam: float
    alpha: float


def _bytes(x: jax.Array) -> jax.Array:
    """``x`` raveled as bytes (bools as 0/1), for the one read."""
    if x.dtype == jnp.bool_:
        return x.ravel().astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x.ravel(), jnp.uint8).ravel()


def score_allocate(inputs, alpha, lam, perm, spec: _Spec):
    """Inside a program: score (fast route), pick lambda and allocate every bucket.

    Returns ``(stats, masks, lam, head, tail)``: per bucket the scores' fields ``(n, 4, M, r)``
    and masks ``(n, M, r)``, the lambda used, and the pieces of the byte vector the host reads
    (``head``: the status flags (4), lambda, with ``alpha="auto"`` the heterogeneity ``h`` that
    picked alpha (``alpha`` is then ``(0, 1)``, both scored from one decomposition), the
    bad-field flag and the masks (global: module order; else per bucket); ``tail``: per bucket
    the energies' mantissas and exponents). :func:`read_scores` reads them back.
    """
    rtols = tuple(jnp.asarray(default_rtol(r, spec.dtype), spec.dtype) for _, _, r in spec.dims)
    finished, _, parts = score_impl(
        inputs, alpha, lam, rtols, meta=(spec.dtype, spec.dims), lam_is_auto=spec.lam_is_auto,
        route="raw", energy=True, interference=spec.interference,
    )  # fmt: skip
    done, h = finished[0], None
    if spec.alpha_is_auto:  # (alpha = (0, 1): the rule's pick of the two, as nu.score makes it)
        h = _heterogeneity(parts)
        done = jax.tree.map(lambda a0, a1: jnp.where(h > H_THRESHOLD, a0, a1), *finished)
    stats = tuple(o.stats for o in done.outs)
    kw = {"budget": spec.budget, "scope": spec.scope, "positive_only": spec.positive_only}
    masks, bad = _allocate.allocate_stacked(stats, perm, n_modules=spec.n_modules, **kw)
    if spec.scope == "global":  # module order -> each bucket's (n, M, r)
        flat = masks
        back = flat[jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.size, dtype=perm.dtype))]
        blocks, off = [], 0
        for st in stats:
            n, _, m, r = st.shape
            blocks.append(back[off : off + n * m * r].reshape(n, m, r))
            off += n * m * r
        masks = tuple(blocks)
    else:
        flat = jnp.concatenate([m.ravel() for m in masks])
    head = [done.status, done.lam.astype(spec.dtype), (bad > 0), flat]
    if h is not None:
        head.insert(2, h.astype(spec.dtype))
    tail = [x for m, k in parts for x in (m.astype(spec.dtype), k.astype(jnp.int32))]
    return stats, tuple(masks), done.lam, head, tail


def as_bytes(pieces) -> jax.Array:
    """Arrays raveled as one uint8 vector (bools as 0/1), for the one read."""
    return jnp.concatenate([_bytes(x) for x in pieces])


# (compiled for speed of compiling in a small merge only, as the TA program: at XLA's level 0
# a large TA merge runs several times slower)
@kernel(static_argnames=("spec",), fast_compile="small")
def fused_program(inputs, alpha, lam, perm, coef, *, spec: _Spec):
    """Score, allocate and TA-merge every bucket: ``(stats, outs, lam, vector)``.

    ``stats``: per bucket the scores' fields ``(n, 4, M, r)``; ``outs``: per bucket the merged
    ``(la, lb)`` (kept columns first); ``lam``: the lambda used; ``vector``: uint8, in order
    :func:`score_allocate`'s head, the merged flags (see :func:`ta.ta_program`, ``ok`` last)
    and its tail (the energies).
    """
    stats, masks, lam_used, head, tail = score_allocate(inputs, alpha, lam, perm, spec)
    outs, flags = ta.ta_program(
        inputs, masks, coef, meta=ta.TaMeta(np.dtype(spec.dtype), spec.dims)
    )
    return stats, outs, lam_used, as_bytes((*head, flags, *tail))


def _heterogeneity(parts) -> jax.Array:
    """``h`` of the tasks' energies from the scoring's per-module parts, summed over modules
    relative to each task's largest power as :func:`log_energy_impl` sums them (NaN or inf
    where a task is zero everywhere: the caller then runs the stages, which raise)."""
    e = jnp.concatenate([m for m, _ in parts], 0)  # (modules, M)
    k = jnp.concatenate([x for _, x in parts], 0)
    live = e > 0
    kmax = jnp.max(jnp.where(live, k, jnp.iinfo(jnp.int32).min), 0)
    t = jnp.where(live, mul_pow2(e, jnp.where(live, k - kmax, 0)), 0).sum(0)
    return log_energy_variance(jnp.where(live.any(0), kmax, 0), t)


class Prepared(NamedTuple):
    """A merge's settings and inputs for a fused program (:func:`prepare`)."""

    spec: _Spec
    dtype: Any
    names: Any
    buckets: Any
    m_tasks: int
    shapes: list  # per bucket (M, r_max)
    blocks: list  # per bucket (names, (M, r_max))
    inputs: tuple  # per bucket its four stacked arrays
    args: tuple  # (alpha, lam, perm, coef), placed


def prepare(adapters: Any, req: Any, names, buckets, m_tasks: int) -> Prepared | None:
    """What a fused program takes for ``req`` (checked request), or None where the stages must
    run instead: inputs outside what the program takes (another form, a bucket without a
    candidate, data-aware scores, a task floor, task weights, ``allocation="all"``, a scale or a
    coefficient beyond the dtype)."""
    if not _takes(adapters, req, buckets):
        return None
    dtype = np.dtype(_tree.compute_dtype(buckets))
    try:  # (a scale beyond the dtype: the stages report it, in their order)
        check_scale_range(req.fn, buckets, dtype)
    except InputError:
        return None
    c = float(np.asarray(req.coef, np.float64))
    fi = np.finfo(dtype)
    if not (c == 0 or float(fi.tiny) <= abs(c) <= float(fi.max)):
        return None
    shapes = [(m_tasks, bk.r_max) for bk in buckets]
    blocks = [(tuple(bk.names), sh) for bk, sh in zip(buckets, shapes, strict=True)]
    layout = (tuple(names), tuple(blocks))
    scope = "uniform" if req.allocation == "uniform" else req.scope
    spec = _Spec(
        dtype, tuple((bk.d_in, bk.d_out, bk.r_max) for bk in buckets), isinstance(req.lam, str),
        isinstance(req.alpha, str), req.interference,
        min(req.budget, max(1, *(m * r for m, r in shapes))), scope, req.positive_only, len(names),
    )  # fmt: skip
    inputs = _inputs(adapters, buckets, dtype)
    if inputs is None:
        return None
    alpha = host_constant(np.array((0.0, 1.0)) if spec.alpha_is_auto else req.alpha, dtype)
    lam = 0.0 if spec.lam_is_auto else req.lam
    args = (alpha, lam, _allocate.placed_order(layout), host_constant(c, dtype))
    return Prepared(spec, dtype, names, buckets, m_tasks, shapes, blocks, inputs, args)


def read_head(read: Reader, prep: Prepared) -> tuple | None:
    """:func:`score_allocate`'s head read: ``(lam, h or None, masks as mask_table takes
    them)``, or None where a flag sends the merge back to the stages."""
    spec = prep.spec
    status = read.take(np.bool_, 4)
    lam_host = float(read.take(prep.dtype, 1)[0])
    h_rule = float(read.take(prep.dtype, 1)[0]) if spec.alpha_is_auto else None
    bad = bool(read.take(np.bool_, 1)[0])
    if (
        not _clear_of_threshold(h_rule)
        or not status[RAW_OK]
        or status[NONFINITE]
        or status[BEYOND]
        or (spec.lam_is_auto and not status[ANY_SIGMA])
        or bad
    ):
        return None
    n_slots = [len(bk.names) * m * r for bk, (m, r) in zip(prep.buckets, prep.shapes, strict=True)]
    flat = read.take(np.bool_, sum(n_slots))
    if spec.scope != "global":
        cuts = np.cumsum(n_slots)[:-1]
        flat = tuple(
            f.reshape(len(bk.names), *sh)
            for f, bk, sh in zip(np.split(flat, cuts), prep.buckets, prep.shapes, strict=True)
        )
    return lam_host, h_rule, flat


def read_tail(read: Reader, prep: Prepared) -> float:
    """:func:`score_allocate`'s tail read: the report's ``h`` of the task energies."""
    m_tasks = prep.m_tasks
    parts = [
        (read.take(prep.dtype, len(bk.names) * m_tasks),
         read.take(np.int32, len(bk.names) * m_tasks))
        for bk in prep.buckets
    ]  # fmt: skip
    k, t = sum_energies([(m.reshape(-1, m_tasks), e.reshape(-1, m_tasks)) for m, e in parts],
                        m_tasks)  # fmt: skip
    return h_of(k, t)


def scores_of(prep: Prepared, stats, lam_used, flat) -> tuple:
    """``(masks, scores)`` of the program's results: the :class:`MaskTable` of the read masks
    and the :class:`Scores` whose fields stay on the device."""
    masks = _allocate.mask_table(prep.names, prep.blocks, {}, flat, prep.spec.scope)
    table = ScoreTable(
        prep.names, [(bk.names, st) for bk, st in zip(prep.buckets, stats, strict=True)], {},
        ModuleScores,
    )  # fmt: skip
    alpha = prep.args[0]
    return masks, Scores(table, lam_used, jax.device_put(alpha, may_alias=False))  # (its own)


def alpha_used(req: Any, h_rule: float | None, dtype: Any) -> float:
    """The alpha the scores used: the request's, or the heterogeneity rule's pick."""
    alpha = req.alpha if h_rule is None else (0.0 if h_rule > H_THRESHOLD else 1.0)
    return float(np.asarray(alpha, dtype))


def fused_ta(adapters: Any, req: Any, names, buckets, m_tasks: int) -> Fused | None:
    """``nu.merge_adapters``'s TA (``req`` its checked request) by :func:`fused_program`, or
    None where the stages must run instead (:func:`prepare`), or a flag raised (see the module
    docstring)."""
    prep = prepare(adapters, req, names, buckets, m_tasks)
    if prep is None:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        stats, outs, lam_used, vector = fused_program(prep.inputs, *prep.args, spec=prep.spec)
        host = np.asarray(jax.device_get(vector))  # the one read
    read = Reader(host)
    head = read_head(read, prep)
    if head is None:
        return None
    lam_host, h_rule, flat = head
    n_slots = sum(len(bk.names) * m * r for bk, (m, r) in zip(buckets, prep.shapes, strict=True))
    flags = read.take(np.bool_, n_slots + len(names) + 1)  # (keep, nonzero), then ok
    if not flags[-1]:
        return None
    h = read_tail(read, prep)
    masks, sc = scores_of(prep, stats, lam_used, flat)
    done = ta.stacked_result(names, buckets, m_tasks, outs, flags)
    zeroed = tuple(nm for nm in names if done.zero[nm] and masks.host(nm).any())
    merged = done.modules  # (a stacked set's result: a MergedTable, its factors stacked)
    if not isinstance(adapters, StackedAdapters):  # each module's factors, as merge_ta gives them
        merged = ta.module_factors(names, done.modules, on_device=ta.slices_on_device(buckets))
    return Fused(merged, masks, sc, h, zeroed, lam_host, alpha_used(req, h_rule, prep.dtype))


def _clear_of_threshold(h: float | None) -> bool:
    """Whether the program's ``h`` (None: alpha given) picks alpha as ``nu.heterogeneity``'s
    would: finite and not within 1e-3 of the rule's threshold (there the energies' other order
    of summation could pick the other alpha, and the stages decide)."""
    return h is None or (np.isfinite(h) and abs(h - H_THRESHOLD) > 1e-3)


def _inputs(adapters: Any, buckets, dtype) -> tuple | None:
    """Every bucket as four arrays (:class:`_mesh.Stacked`), or None where one keeps its leaves:
    a stacked set's arrays (in the compute dtype); a list's factors stacked as the scoring stacks
    them (numpy on the host, device arrays on their device), its scales rounded as XLA does."""
    if isinstance(adapters, StackedAdapters):
        return tuple(bk.stacked for bk in buckets)
    out = []
    for bk in buckets:
        host = _buckets.host_scales(_buckets.bucket_arrays(bk)[2], dtype)
        st = None if host is None else _stacking.stacked_input(bk, dtype, scales=host)
        if st is None:  # (traced scales or factors, a bucket too large to copy)
            return None
        out.append(st._replace(scale=host))
    return tuple(out)


def takes_request(req: Any) -> bool:
    """Whether :func:`fused_program` takes ``req``'s settings (whatever the adapters): scored
    data-free, allocated by Net Utility or uniformly without a floor, unweighted."""
    if req.allocation not in ("net_utility", "uniform"):
        return False
    return req.input_moments is None and not req.min_share and req.weights is None


def _takes(adapters: Any, req: Any, buckets) -> bool:
    """Whether :func:`fused_program` takes the merge: :func:`takes_request`, and a list of
    adapters or a ``nu.stack_adapters`` set (stacked in the compute dtype) whose buckets all
    have candidates."""
    if not buckets or not takes_request(req):
        return False
    dtype = np.dtype(_tree.compute_dtype(buckets))
    for bk in buckets:
        if bk.r_max == 0 or bk.d_in == 0 or bk.d_out == 0:
            return False
        st = bk.stacked
        if isinstance(adapters, StackedAdapters) and not (
            st is not None and st.a.dtype == st.b.dtype == st.scale.dtype == dtype
        ):
            return False
    return True


class Reader:
    """Reads the program's byte vector in order, each piece as its dtype."""

    def __init__(self, data: np.ndarray):
        self._data, self._at = data, 0

    def take(self, dtype: Any, n: int) -> np.ndarray:
        dt = np.dtype(dtype)
        size = n * dt.itemsize
        piece = self._data[self._at : self._at + size]
        self._at += size
        return piece.view(np.uint8).astype(bool) if dt == np.bool_ else piece.view(dt)
