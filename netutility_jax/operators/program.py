"""Every bucket of a merge plan as one compiled program (every method and space but TA's own).

The bucket pipeline (:func:`netutility_jax.operators._stages.bucket_merge`) is a composition of jitted
stages; run bucket by bucket and piece by piece from Python, each stage is a program of its own
per shape (27 programs for a merge of one model's seven module kinds, each traced, lowered and
loaded by every process, and per call a dispatch and argument buffers per stage and piece).
:func:`merge_program` traces the same stages once inside one ``jax.jit``: each bucket's pieces
(equal sub-buckets of at most ``_plan.PIECE_BYTES`` of factors) go through one
``lax.map``, so that the program neither grows with the number of pieces nor holds more than
one piece's working memory; :func:`run` reads every result back in one transfer and cuts each
module's live columns on the host, as the per-bucket route does.

The buckets run one after another (each one's factors made data-dependent on the previous
one's result, :func:`_linalg.after`): on CPU, jaxlib's LAPACK kernels block on the intra-op
thread pool, and two independent calls in one program can deadlock it (tests/operators/test_lapack_order.py).

Where it applies (:func:`applies`): no mesh, no model-wide selection, and no method whose
modules are merged in blocks of rows or module by module in full space (those bound their memory
by running piece by piece on purpose). The results are the same arithmetic as the per-bucket
route; XLA may round a fused multiply-add differently, which moves a merged entry by a few
units in the last place (within the 1e-4-of-the-largest-entry guarantee of docs/guarantees.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core import buckets as _buckets
from .._core import mesh as _mesh
from .._core import stacking as _stacking
from .._core.executables import kernel
from .._core.host import put_views
from .._core.linalg import after
from .._core.tables import MergedTable
from . import _stages
from . import ta as _ta

__all__ = [
    "applies",
    "device_results",
    "groups_of",
    "host_results",
    "index_counts",
    "merge_program",
    "merge_traced",
    "nonzero_rows",
    "on_device",
    "plan_groups",
    "run",
]


class Group(NamedTuple):
    """A bucket's pieces merged by one ``lax.map``: their stage configuration, how many pieces
    and the modules of each; ``plain``: its factors, stacked on the host, take the plain
    reduction (:func:`_stages.host_plain`: the program holds that branch only)."""

    cfg: Any  # _stages.BucketConfig
    pieces: int
    size: int
    plain: bool = False


def applies(plan: Any) -> bool:
    """Whether :func:`run` can merge ``plan`` (see the module docstring)."""
    return (
        plan.mesh is None
        and not plan.model_wide
        and all(job.route == "bucket" and job.cfg.rows is None for job in plan.jobs)
    )


@kernel(static_argnames=("groups",))
def merge_program(inputs, masks, key, index, coef, nums, counts, *, groups: tuple[Group, ...]):
    """Every group's :func:`_stages.bucket_merge`, ``[(la, lb, live, check, bad)]`` per group
    with the modules of all its pieces in order.

    Args:
      inputs: per group its factors, a :class:`_mesh.Stacked` ``(n, M, ...)`` or the leaves of
        :func:`_buckets.bucket_arrays` (stacked here).
      masks: per group ``(n, M, r_max)`` bool.
      key, index: the merge's key (None: the method draws nothing) and per group each module's
        position in the whole model, which the module's key folds in (as ``_pipeline`` does).
      coef, nums: the coefficient and the method's traced options.
      counts: per group the :func:`_stages.count_input` of a method that keeps top entries
        (TIES's density as data: another density runs this program again), else None.
    """
    outs = []
    # On CPU no two LAPACK calls may run at once (_linalg.after). XLA inlines the stages, so
    # every input of a group waits: on the previous group's outputs, and the first group on every
    # mask (under a jitted merge_adapters, the scoring's results: its LAPACK calls come first).
    prev = tuple(masks)
    for x, mk, idx, ct, g in zip(inputs, masks, index, counts, groups, strict=True):
        cfg = g.cfg
        if isinstance(x, _mesh.Stacked) and x.a.dtype != cfg.dtype:  # (a stacked set's dtype)
            x = x._replace(a=x.a.astype(cfg.dtype), b=x.b.astype(cfg.dtype))
        if isinstance(x, _mesh.Stacked) and x.scale.dtype != cfg.dtype:
            x = x._replace(scale=x.scale.astype(cfg.dtype))
        if key is None:
            kk = jnp.zeros(idx.shape, jnp.uint32)
        else:
            kk = jax.vmap(lambda i: jax.random.fold_in(key, i))(idx)
        if not isinstance(x, _mesh.Stacked):
            x = _mesh.Stacked(
                *_buckets.stack_bucket(
                    *x, d_in=cfg.d_in, d_out=cfg.d_out, r_max=cfg.r_max, dtype=cfg.dtype
                )
            )

        def one(args, cfg=cfg, ct=ct, plain=g.plain):
            st, m, k = args
            return _stages.bucket_merge(
                _mesh.Stacked(*st), m, coef, k, nums, ct, cfg=cfg, plain=plain
            )

        if prev:  # (CPU: two LAPACK calls at once can deadlock its thread pool)
            x = x._replace(a=after(x.a, *prev), b=after(x.b, *prev), scale=after(x.scale, *prev))
        args = (tuple(x), mk, kk)
        if g.pieces == 1:
            out = one(args)
        else:  # (lax.map: a scan, its pieces one after another)
            split = jax.tree.map(lambda y, g=g: y.reshape(g.pieces, g.size, *y.shape[1:]), args)
            out = jax.lax.map(one, split)
            out = jax.tree.map(lambda y: y.reshape(-1, *y.shape[2:]), out)
        outs.append(out)
        prev = tuple(jax.tree.leaves(out))
    return outs


def _groups(plan: Any) -> list[tuple[Group, list[Any]]]:
    """The plan's jobs grouped by bucket: consecutive pieces of one configuration and size."""
    out: list[tuple[Group, list[Any]]] = []
    for job in plan.jobs:
        n = len(job.bucket.names)
        if out and out[-1][0].cfg == job.cfg and out[-1][0].size == n:
            g, jobs = out[-1]
            out[-1] = (g._replace(pieces=g.pieces + 1), [*jobs, job])
        else:
            out.append((Group(job.cfg, 1, n), [job]))
    return out


def _inputs(jobs: Sequence[Any], dtype: Any) -> Any:
    """A group's factors as four arrays (:func:`_stacking.stacked_input`), or where they are
    traced the leaves of every piece (stacked inside the program)."""
    bk = jobs[0].bucket
    if bk.stacked is not None:  # (nu.stack_adapters: the group is its whole bucket)
        return bk.stacked
    if len(jobs) > 1:
        bk = dataclasses.replace(
            bk,
            names=tuple(nm for j in jobs for nm in j.bucket.names),
            modules=tuple(m for j in jobs for m in j.bucket.modules),
        )
    # numpy factors stacked on the host, device ones on their device (the program would stack
    # the leaves inside: the same copy, and a program that grows with the modules)
    st = _stacking.stacked_input(bk, dtype, cap=False)
    return _buckets.bucket_arrays(bk) if st is None else st


def groups_of(plan: Any) -> tuple[list[tuple[Group, list[Any]]], list[Any], tuple]:
    """``plan``'s groups (each with its jobs), each group's factors
    (:func:`_stacking.stacked_input`, or the leaves) and the per-group inputs :func:`merge_program`
    takes besides them: ``(masks, index, counts)``, masks read from ``plan.masks`` (None: every
    candidate)."""
    groups = _groups(plan)
    inputs, masks = [], []
    for k, (g, jobs) in enumerate(groups):
        inputs.append(_inputs(jobs, plan.dtype))
        groups[k] = (g._replace(plain=_stages.host_plain(inputs[-1])), jobs)
        masks.append(
            np.concatenate([_stages.stack_masks(plan.masks, j.bucket, plan.m_tasks) for j in jobs])
        )
    return groups, inputs, (tuple(masks), *index_counts(plan, groups))


def plan_groups(plan: Any) -> list[tuple[Group, list[Any]]]:
    """``plan``'s groups, each with its jobs, without their factors (:func:`groups_of` stacks
    them): for a caller that has the factors stacked already."""
    return _groups(plan)


def index_counts(plan: Any, groups: Sequence[tuple[Group, list[Any]]]) -> tuple[tuple, tuple]:
    """Per group each module's position in the model (its DARE key's fold) and the
    :func:`_stages.count_input` of a method that keeps top entries."""
    index = tuple(np.asarray([i for j in jobs for i in j.index], np.int32) for _, jobs in groups)
    options = plan.resolved.kernel_options
    counts = tuple(_stages.count_input(g.cfg, options, plan.m_tasks) for g, _ in groups)
    return index, counts


def on_device(groups: Sequence[tuple[Group, list[Any]]]) -> bool:
    """Whether the merged factors stay on the device (:func:`device_results`): a stacked set's,
    or an accelerator's factors."""
    jobs = [j for _, js in groups for j in js]
    return all(js[0].bucket.stacked is not None for _, js in groups) or _ta.slices_on_device(
        [j.bucket for j in jobs]
    )


def run(plan: Any, *, coef: Any, nums: dict[str, Any], key: Any) -> tuple[dict, list]:
    """Merge every job of ``plan`` in one program: ``(results, checks)`` as the per-bucket route
    collects them; non-finite inputs raised here."""
    from ._results import raise_nonfinite

    groups, inputs, (masks, index, counts) = groups_of(plan)
    outs = merge_program(
        tuple(inputs), masks, key, index, coef, nums, counts, groups=tuple(g for g, _ in groups),
    )  # fmt: skip
    if on_device(groups):  # the factors stay where they are
        small = jax.device_get(
            [(live, check, bad, nz) for (_, _, live, check, bad), nz in zip(
                outs, _nonzero(tuple((la, lb) for la, lb, *_ in outs)), strict=True)]
        )  # fmt: skip
        results, checks, buckets, bads = device_results(plan.names, groups, outs, small)
    else:  # one transfer: every bucket's factors, ranks and checks
        results, checks, buckets, bads = host_results(groups, jax.device_get(outs))
    raise_nonfinite(plan.fn, buckets, bads, plan.dtype)
    return results, checks


def host_results(groups: Sequence[tuple[Group, list[Any]]], outs: Sequence[Any]) -> tuple:
    """:func:`merge_program`'s outputs read to the host as ``(results, checks, buckets, bads)``:
    each module's live columns cut and placed with one ``device_put``, ``{name: module}``; the
    range checks; each piece's bucket and non-finite flags (for :func:`raise_nonfinite`)."""
    checks: list = []
    buckets: list = []
    bads: list = []
    views = []
    order = []
    for (_, jobs), (la, lb, live, check, bad) in zip(groups, outs, strict=True):
        names = _group_names(jobs, bad, buckets, bads)
        checks.append((names, check))
        ranks = np.asarray(live).sum(-1)
        for i, nm in enumerate(names):
            r = int(ranks[i])
            # copies of their own size: a view would keep the whole padded bucket alive
            views += [np.array(la[i, :, :r]), np.array(lb[i, :r, :])]
            order.append(nm)
    placed = put_views(views)
    results = {
        nm: {"lora_a": placed[2 * k], "lora_b": placed[2 * k + 1], "scale": 1.0}
        for k, nm in enumerate(order)
    }
    return results, checks, buckets, bads


def _group_names(jobs: Sequence[Any], bad: Any, buckets: list, bads: list) -> tuple[str, ...]:
    """A group's module names, in order; its buckets and each piece's non-finite flags (rows of
    ``bad``) are appended to ``buckets`` and ``bads``."""
    i0 = 0
    for j in jobs:
        n = len(j.bucket.names)
        buckets.append(j.bucket)
        bads.append(bad[i0 : i0 + n])
        i0 += n
    return tuple(nm for j in jobs for nm in j.bucket.names)


@jax.jit
def _nonzero(factors: tuple[tuple[jax.Array, jax.Array], ...]) -> tuple[jax.Array, ...]:
    """Per group and row ``(n,)``: whether ``la @ lb`` can be nonzero (neither factor all
    zero); one program for every group."""
    return tuple(nonzero_rows(la, lb) for la, lb in factors)


def nonzero_rows(la: jax.Array, lb: jax.Array) -> jax.Array:
    """Per row ``(n,)`` of stacked factors: whether ``la @ lb`` can be nonzero."""
    return jnp.any(la != 0, axis=(1, 2)) & jnp.any(lb != 0, axis=(1, 2))


def device_results(
    names: Sequence[str], groups: list, outs: Sequence[Any], small: Sequence[Any]
) -> tuple:
    """:func:`merge_program`'s results with the merged factors left on the device, stacked per
    group (each module's live columns come first): ``(MergedTable, checks, buckets, bads)``, a
    module sliced at its rank when read. ``small``: per group ``(live, check, bad, nonzero)``
    read to the host (one read)."""
    checks: list = []
    buckets, bads, blocks, counts, nonzero = [], [], [], [], []
    for (_, jobs), (la, lb, *_), (live, check, bad, nz) in zip(groups, outs, small, strict=True):
        group_names = _group_names(jobs, bad, buckets, bads)
        checks.append((group_names, check))
        blocks.append((group_names, la, lb))
        counts.append(np.asarray(live).sum(-1).tolist())
        nonzero.append(np.asarray(nz).tolist())
    return MergedTable(names, blocks, 1.0, counts, nonzero), checks, buckets, bads


def merge_traced(
    fn: str,
    adapters: Sequence[Any],
    masks: Any,
    *,
    res: Any,
    coef: Any,
    key: Any,
    weights: Any = None,
) -> MergedTable:
    """:func:`merge_program` inside a transformation (any traced input): ``{name: module}`` as a
    :class:`MergedTable` (factors stacked per bucket), each module at the program's static width
    (its live columns first, the others zero).

    ``res``: the resolved method (:func:`registry.resolve_options`); ``weights`` ``(M,)`` scale
    the tasks. The value checks of the concrete route (non-finite inputs, results beyond the
    dtype's range) are not made: they need the values.
    """
    from .._core import tree as _tree
    from ..errors import InputTypeError
    from . import _plan
    from .traced import stacked_masks

    names, buckets, m_tasks = _tree.collect(adapters, fn=fn)
    if masks is not None:
        masks = _plan.check_masks(fn, masks, names, buckets, m_tasks)
    dtype = _tree.compute_dtype(buckets)
    if res.spec.kind == "elementwise":
        _plan.check_entry_count(fn, res.space, buckets, m_tasks)
    w = None if weights is None else jnp.asarray(weights, dtype)
    position = {n: i for i, n in enumerate(names)}
    groups, inputs, mks, index = [], [], [], []
    for bk in buckets:
        cfg = _plan.bucket_config(res, bk, m_tasks, dtype, key_blocks=True)
        cfg = cfg._replace(compact=False)  # (differentiable: no SVD of a rank-deficient matrix)
        if cfg.rows is not None:
            raise InputTypeError(
                f"{fn}: method={res.spec.name!r} in {res.space} space merges module "
                f"{bk.names[0]!r} ({bk.d_in} x {bk.d_out}, {m_tasks} tasks) in blocks of rows "
                "(its dense coordinates exceed the working memory), which cannot run inside "
                "jax.jit, jax.grad or jax.vmap; call it outside the transformation."
            )
        if bk.stacked is not None:  # (nu.stack_adapters)
            a, b, s = (x.astype(dtype) for x in bk.stacked[:3])
            r = bk.stacked.rank
        else:
            a, b, s, r = _buckets.stack_bucket(
                *_buckets.bucket_arrays(bk), d_in=bk.d_in, d_out=bk.d_out, r_max=bk.r_max,
                dtype=dtype,
            )  # fmt: skip
        if w is not None:
            s = s * w
        inputs.append(_mesh.Stacked(a, b, s, r))
        mks.append(
            jnp.ones((len(bk.names), m_tasks, bk.r_max), bool)
            if masks is None
            else stacked_masks(fn, masks, bk, m_tasks)
        )
        index.append(np.asarray([position[n] for n in bk.names], np.int32))
        groups.append(Group(cfg, 1, len(bk.names)))
    nums = {k: jnp.asarray(v, dtype) for k, v in _plan.numeric_options(res).items()}
    counts = tuple(_stages.count_input(g.cfg, res.kernel_options, m_tasks) for g in groups)
    outs = merge_program(
        tuple(inputs), tuple(mks), key, tuple(index), jnp.asarray(coef, dtype), nums, counts,
        groups=tuple(groups),
    )  # fmt: skip
    blocks = []
    for bk, (la, lb, live, _, _) in zip(buckets, outs, strict=True):
        la = la * live[:, None, :].astype(la.dtype)  # (dead columns exactly zero)
        blocks.append((bk.names, la, lb))
    return MergedTable(names, blocks)
