"""Every other method's eager merge as one program: scores, lambda, allocation and the merge.

``nu.merge_adapters(adapters, method=...)`` with TSV, Iso-C, Iso-CTS, TIES, DARE or DARE-TIES
runs the scoring kernel (with the energies for ``h``), the allocation and the merge's program
(:mod:`netutility_jax.operators.program`): three programs, with the masks read to the host and
placed again between them. Here the same functions run in one jitted program, as
:mod:`._fused` runs TA's: the scoring on its fast route, the allocation's masks handed to
:func:`program.merge_program` on the device, and one read at the end (the scoring's flags,
lambda, the masks, the energies, and the merge's ranks, range checks and non-finite flags; for
a list of host factors the merged factors too, cut per module as the merge's program cuts them).

Where a flag says that the fast route does not stand (the flags of :mod:`._fused`), or the
merge's own checks fail (a non-finite input, a result beyond the dtype), :func:`fused_merge`
returns None and the caller runs the stages one by one, which take the exact route or raise as
they always did: one schedule of the same functions, never a second semantics. What the merge's
program does not take (a mesh, a model-wide selection, full-space elementwise methods merged
module by module, blocks of rows) runs by the stages too.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core.executables import kernel
from .._core.host import host_constant
from ..errors import InputError
from ..operators import _plan, program
from ..operators._results import raise_nonfinite, raise_range
from ..operators._stages import host_plain
from . import _fused

__all__ = ["fused_merge"]


def _slice(x: Any, lo: int, hi: int) -> Any:
    return jax.tree.map(lambda y: y[lo:hi], x)


# (on the CPU at LLVM's level 1: the compile of the scoring, which alone takes level 0, and of
# the merge, which level 0 slows 1.4-2.2x; _core.executables.MODERATE_COMPILE)
@kernel(static_argnames=("spec", "groups", "cuts"), fast_compile="moderate")
def fused_merge_program(inputs, alpha, lam, perm, coef, key, nums, counts, index, *, spec,
                        groups, cuts):  # fmt: skip
    """Score, allocate and merge every bucket: ``(stats, lam, vector, outs, small)``.

    ``cuts``: per group of the merge's program its bucket and rows ``(b, lo, hi)``; its factors
    and masks are those rows of the bucket's. ``outs``: per group ``(la, lb, live, check, bad)``
    (:func:`program.merge_program`); ``small``: per group ``(live, check, bad, nonzero)``;
    ``vector``: :func:`_fused.score_allocate`'s head and tail, then ``small``'s leaves, as bytes
    (the one read: ``small`` itself is returned for its shapes and dtypes).
    """
    stats, masks, lam_used, head, tail = _fused.score_allocate(inputs, alpha, lam, perm, spec)
    g_in = tuple(_slice(inputs[b], lo, hi) for b, lo, hi in cuts)
    g_mk = tuple(masks[b][lo:hi] for b, lo, hi in cuts)
    outs = program.merge_program(g_in, g_mk, key, index, coef, nums, counts, groups=groups)
    small = tuple(  # (a dead column or row need not be zero: counted live only)
        (
            live,
            check,
            bad,
            program.nonzero_rows(
                jnp.where(live[:, None, :], la, 0), jnp.where(live[:, :, None], lb, 0)
            ),
        )
        for la, lb, live, check, bad in outs
    )
    vector = _fused.as_bytes((*head, *tail, *jax.tree.leaves(small)))
    return stats, lam_used, vector, outs, small


def _cuts(groups, buckets) -> tuple | None:
    """Per group its bucket and rows ``(b, lo, hi)``, or None where a group's modules are not
    consecutive rows of one bucket."""
    where = {nm: (b, i) for b, bk in enumerate(buckets) for i, nm in enumerate(bk.names)}
    out = []
    for _, jobs in groups:
        names = [nm for j in jobs for nm in j.bucket.names]
        b, lo = where[names[0]]
        if tuple(buckets[b].names[lo : lo + len(names)]) != tuple(names):
            return None
        out.append((b, lo, lo + len(names)))
    return tuple(out)


def fused_merge(adapters: Any, req: Any, names, buckets, m_tasks: int) -> _fused.Fused | None:
    """``nu.merge_adapters`` (``req`` its checked request, a method other than TA's one
    program, no mesh) by :func:`fused_merge_program`, or None where the stages must run
    instead (see the module docstring)."""
    prep = _fused.prepare(adapters, req, names, buckets, m_tasks)
    if prep is None:
        return None
    plan = _plan.plan_merge(
        req.fn, adapters, None, method=req.method, space=req.space, coef=req.coef, key=req.key,
        options=req.options, mesh=None,
    )  # fmt: skip
    if not program.applies(plan) or plan.dtype != prep.dtype:
        return None
    groups = program.plan_groups(plan)  # (the factors: the scoring's, cut per group)
    cuts = _cuts(groups, buckets)
    if cuts is None:
        return None
    plain = [host_plain(prep.inputs[b]) for b, _, _ in cuts]
    groups = [(g._replace(plain=p), jobs) for (g, jobs), p in zip(groups, plain, strict=True)]
    index, counts = program.index_counts(plan, groups)
    nums = {k: host_constant(v, prep.dtype) for k, v in plan.numeric.items()}
    alpha, lam, perm, coef = prep.args
    with np.errstate(over="ignore", invalid="ignore"):
        stats, lam_used, vector, outs, small = fused_merge_program(
            prep.inputs, alpha, lam, perm, coef, req.key, nums, counts, index, spec=prep.spec,
            groups=tuple(g for g, _ in groups), cuts=cuts,
        )  # fmt: skip
        stay = program.on_device(groups)
        host, read_outs = jax.device_get((vector, None if stay else outs))  # the one read
    read = _fused.Reader(np.asarray(host))
    head = _fused.read_head(read, prep)
    if head is None:
        return None
    lam_host, h_rule, flat = head
    h = _fused.read_tail(read, prep)
    leaves, tree = jax.tree.flatten(small)  # (read from the vector, in its order)
    flags = jax.tree.unflatten(tree, [read.take(x.dtype, x.size).reshape(x.shape) for x in leaves])
    if stay:
        merged, checks, bks, bads = program.device_results(plan.names, groups, outs, flags)
    else:
        merged, checks, bks, bads = program.host_results(groups, read_outs)
    try:  # (the stages raise these, in their order)
        raise_nonfinite(req.fn, bks, bads, prep.dtype)
        raise_range(req.fn, checks, prep.dtype)
    except InputError:
        return None
    masks, sc = _fused.scores_of(prep, stats, lam_used, flat)
    zero = {
        nm: not nz
        for (_, jobs), (*_, nonzero) in zip(groups, flags, strict=True)
        for nm, nz in zip((n for j in jobs for n in j.bucket.names), nonzero, strict=True)
    }
    zeroed = tuple(nm for nm in names if zero[nm] and masks.host(nm).any())
    alpha = _fused.alpha_used(req, h_rule, prep.dtype)
    return _fused.Fused(merged, masks, sc, h, zeroed, lam_host, alpha)
