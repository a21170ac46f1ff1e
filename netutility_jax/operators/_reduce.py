"""The reduction stage of :func:`nu.merge`'s bucket pipeline (:mod:`._stages`): a bucket's
factors, normalised per task by powers of two, in the bases of their own spans, with their task
scales, ranks, non-finite counts and units. One program where the factors are traced
(:func:`stage_reduce`, the plain or scaled branch chosen inside it); where they are stacked on the
host, the choice is made there (:func:`host_plain`, :func:`reduce_bucket`) and one branch is
compiled."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core import buckets as _buckets
from .._core import mesh as _mesh
from .._core.executables import kernel
from .._core.linalg import mul_pow2
from . import spaces as _s

__all__ = [
    "MODERATE_EXP",
    "ReduceConfig",
    "host_plain",
    "reduce_bucket",
    "stage_reduce",
    "stage_scales",
]


class ReduceConfig(NamedTuple):
    """:func:`stage_reduce`: the bucket's shapes, dtype and number of tasks; ``plain``: stacked
    factors known (:func:`host_plain`) to be of moderate size, so that the program holds only
    the plain reduction, not both branches of the choice."""

    d_in: int
    d_out: int
    r_max: int
    dtype: Any
    m_tasks: int
    plain: bool = False


@kernel
def stage_scales(a, b, s):
    """Per module the unit (:func:`spaces.module_unit`), per task the :class:`spaces.TaskScales`
    and the non-finite counts ``(n, M, 3)`` of stacked factors ``a (n, M, d_in, r)``, ``b``."""
    _, _, ts, bad = _s.normalise_tasks(a, b, s, a_axes=(2, 3), b_axes=(2, 3))
    return ts, _s.module_unit(ts), bad


def reduce_bucket(leaves, *, cfg: ReduceConfig):
    """:func:`stage_reduce`, in two programs where the factors are stacked on the host
    (:class:`_mesh.Stacked`, concrete): their scales (:func:`stage_scales`), then the reduction
    that those call for, plain or scaled (:func:`_reduce_stacked`'s two branches, decided on
    the host). One branch is compiled, not both, for the same arithmetic (in one program, the
    branch not taken was half of a cold streamed merge's compilation)."""
    if isinstance(leaves, _mesh.Stacked) and not any(
        isinstance(x, jax.core.Tracer) for x in leaves
    ):
        A, B, S, R = leaves
        ts, unit, bad = stage_scales(A, B, S)
        a_exp, b_exp = np.asarray(ts.a_exp), np.asarray(ts.b_exp)
        moderate = (np.abs(a_exp) <= MODERATE_EXP) & (np.abs(b_exp) <= MODERATE_EXP)
        if moderate.all() and not np.asarray(bad).any():
            red = _reduce_plain(A, B, ts.a_exp, ts.b_exp, m_tasks=cfg.m_tasks)
        else:
            red = _reduce_scaled(A, B, S, m_tasks=cfg.m_tasks)
        return red, ts, R, bad, unit
    return stage_reduce(leaves, cfg=cfg)


@kernel(static_argnames=("cfg",))
def stage_reduce(leaves, *, cfg: ReduceConfig):
    """A bucket's factors, normalised per task by powers of two, in the bases of their own spans
    (:class:`spaces.Reduced`); their :class:`spaces.TaskScales`, ranks, non-finite counts
    ``(n, M, 3)`` and units ``(n,)``. The only ``d``-sized work before the map back (two Grams,
    one product per side, and one read of the factors for their sizes)."""
    if isinstance(leaves, _mesh.Stacked):
        return _reduce_stacked(leaves, m_tasks=cfg.m_tasks, plain=cfg.plain)
    d_in, d_out, r_max, dtype, m_tasks = cfg[:5]
    a, b, s = leaves
    ts, bad = _s.leaf_scales(a, b, s, dtype)
    mant = tuple(tuple(ts.mant[j, i] for i in range(m_tasks)) for j in range(len(a)))

    def reduce(a, b):
        xa, yb, _, R = _buckets.stack_bucket_cat(
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

    moderate = (jnp.abs(ts.a_exp) <= MODERATE_EXP) & (jnp.abs(ts.b_exp) <= MODERATE_EXP)
    red, R = jax.lax.cond(jnp.all(moderate) & ~jnp.any(bad), plain, scaled)
    return red, ts, R, bad, _s.module_unit(ts)


def _reduce_cat(a, b, m_tasks: int):
    """:func:`spaces.reduce_factors` of stacked ``a (n, M, d_in, r)``, ``b (n, M, r, d_out)``,
    the tasks side by side as :func:`_buckets.stack_bucket_cat` lays them out."""
    n, _, d_in, r = a.shape
    xa = jnp.moveaxis(a, 1, 2).reshape(n, d_in, m_tasks * r)
    return _s.reduce_factors(xa, b.reshape(n, m_tasks * r, b.shape[-1]), m_tasks)


def _plain(A, B, a_exp, b_exp, m_tasks: int):
    """Factors of moderate size: their Grams are safe; the small reduced factors normalised."""
    red = _reduce_cat(A, B, m_tasks)
    ra = mul_pow2(red.a, -a_exp[..., None, None])
    rb = mul_pow2(red.b, -b_exp[..., None, None])
    return red._replace(a=ra, b=rb)


def _scaled(A, B, S, m_tasks: int):
    """Extreme (or non-finite) factors: normalised before any Gram."""
    a_n, b_n, _, _ = _s.normalise_tasks(A, B, S, a_axes=(2, 3), b_axes=(2, 3))
    return _reduce_cat(a_n, b_n, m_tasks)


_reduce_plain = kernel(_plain, static_argnames=("m_tasks",))
_reduce_scaled = kernel(_scaled, static_argnames=("m_tasks",))


def _reduce_stacked(st: _mesh.Stacked, *, m_tasks: int, plain: bool = False):
    """:func:`stage_reduce` of factors stacked on the host (:func:`_mesh.host_stack`, e.g.
    sharded over a mesh), traced as one program: the same arithmetic on the same values, from
    ``(n, M, ...)`` arrays (``plain``: the factors are known to be moderate, see
    :func:`host_plain`, and the choice that the program would make is made already)."""
    A, B, S, R = st
    _, _, ts, bad = _s.normalise_tasks(A, B, S, a_axes=(2, 3), b_axes=(2, 3))
    if plain:
        red = _plain(A, B, ts.a_exp, ts.b_exp, m_tasks)
    else:
        moderate = (jnp.abs(ts.a_exp) <= MODERATE_EXP) & (jnp.abs(ts.b_exp) <= MODERATE_EXP)
        red = jax.lax.cond(
            jnp.all(moderate) & ~jnp.any(bad),
            lambda: _plain(A, B, ts.a_exp, ts.b_exp, m_tasks),
            lambda: _scaled(A, B, S, m_tasks),
        )
    return red, ts, R, bad, _s.module_unit(ts)


# 2**+-24 of the largest entry: no Gram of such factors can leave float32's range
MODERATE_EXP = 24


def host_plain(st: Any) -> bool:
    """Whether factors stacked on the host (numpy :class:`_mesh.Stacked`) take
    :func:`stage_reduce`'s plain reduction: every entry finite and each (module, task) factor's
    largest entry ``2**e`` with ``|e| <= MODERATE_EXP``, the test that the program makes on the
    device (from the same values, so the same answer; a subnormal largest entry, which a device
    may flush to zero, has an exponent below -125 and answers False here, and the program keeps
    its choice). False for anything but numpy factors."""
    if not all(isinstance(x, np.ndarray) for x in st):
        return False
    A, B, S, _ = st
    if not np.isfinite(np.asarray(S, np.float32)).all():
        return False
    for x in (A, B):  # (one float32 view or copy of each factor stack, read once for both tests)
        amax = np.abs(np.asarray(x, np.float32)).max(axis=(2, 3))  # (NaN if any entry is)
        if not np.isfinite(amax).all():
            return False
        e = np.where(amax > 0, np.frexp(amax)[1], 0)
        if (np.abs(e) > MODERATE_EXP).any():
            return False
    return True
