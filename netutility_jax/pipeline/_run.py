"""Running a merge plan: the bucket loop, its result checks, and the merged adapter's tree.

:func:`run` takes a :class:`_plan.MergePlan` and merges each job with the stages of
:mod:`netutility_jax.operators._stages` (a piece of a bucket at once, or module by module for elementwise
methods in full space), or hands a model-wide selection to :mod:`netutility_jax.operators._ties_model`.
The inputs' finiteness (counted by the first stage) and every merged module's range (reported by
the last) are checked here, eagerly, once every bucket is dispatched: the jitted stages check
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import buckets as _buckets
from .._core import mesh as _mesh
from .._core import stacking as _stacking
from .._core.host import host_constant
from .._core.linalg import settle
from ..operators import _stages, program
from ..operators._plan import Job, MergePlan
from ..operators._results import raise_nonfinite, raise_range
from ..operators._select import topk_count
from ..operators._ties_model import ties_model

__all__ = ["run"]


def _keys_for(key: jax.Array, idx: Sequence[int]) -> jax.Array:
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.asarray(np.asarray(idx, np.int32)))


def _kernel_of(plan: MergePlan) -> dict[str, str]:
    """The kernel that ran and its space, for :func:`raise_range`'s message."""
    return {"method": plan.resolved.kernel_method, "space": plan.resolved.space}


def _dense_job(plan: MergePlan, job: Job, mk, coef, keys, nums, results, checks) -> None:
    """An elementwise method in full space, module by module: at most one module's M dense task
    updates are alive, or a block of their rows when they exceed the working memory."""
    bk, cfg = job.bucket, job.cfg
    leaves = _buckets.bucket_arrays(bk)
    A, B, S, R = _stages.stage_stack(
        leaves, cfg=_stages.StackConfig(bk.d_in, bk.d_out, bk.r_max, plan.dtype)
    )
    raise_nonfinite(plan.fn, [bk], [_stages.stage_scales(A, B, S)[2]], plan.dtype)
    spec = plan.resolved.spec
    density = plan.resolved.options.get(spec.keeps_top, 0.0) if spec.keeps_top else 0.0
    k_top = jnp.asarray(topk_count(density, bk.d_in * bk.d_out), jnp.int32)
    for j, nm in enumerate(bk.names):
        args = (A[j], B[j], S[j], R[j], mk[j], coef, keys[j], nums, k_top)
        if cfg.rows is None:
            delta, check = _stages.module_dense(*args, method=cfg.method, r_max=bk.r_max)
        else:  # the module's M dense tasks exceed the working memory: blocks of rows
            delta, check = _stages.module_dense_rows(
                *args, method=cfg.method, r_max=bk.r_max, rows=cfg.rows
            )
        # one module's executable at a time on CPU: bounded memory, and no two LAPACK calls in
        # flight together (see netutility_jax._core.linalg.settle)
        results[nm] = {"delta": settle(delta)}
        checks.append(((nm,), check))


def _bucket_job(plan: MergePlan, job: Job, mk, coef, keys, nums, results, checks, bads) -> None:
    bk = job.bucket
    counts = _stages.count_input(job.cfg, plan.resolved.kernel_options, plan.m_tasks)
    if plan.mesh is None:
        # stacked on the host (numpy) or on the device, as the one-program route does: from
        # leaves, the reduction's program takes every (module, task) factor as an argument and
        # grows with the piece (14 s of compiling per bucket shape of a 60-module piece)
        x = _stacking.stacked_input(bk, plan.dtype)
        out = _stages.bucket_merge(
            _buckets.bucket_arrays(bk) if x is None else x, mk, coef, keys, nums, counts,
            cfg=job.cfg,
        )  # fmt: skip
    else:  # padded to whole modules per device, split between the mesh's devices
        n_pad = _mesh.padded(len(bk.names), plan.mesh)
        args = (
            _mesh.host_stack(bk, plan.dtype, n_pad),
            _mesh.pad_rows(mk, n_pad),
            _mesh.pad_rows(keys, n_pad),
        )
        if _mesh.spmd(plan.mesh):
            # placed now (per_device places them the same way, then keeps them), so that the
            # host copy of the stacked factors is freed before the stages run, not after
            args = _mesh.shard(args, plan.mesh)
        out = _mesh.per_device(
            lambda x: _stages.bucket_merge(x[0], x[1], coef, x[2], nums, counts, cfg=job.cfg),
            args,
            plan.mesh,
        )
    la, lb, live, check, bad = out
    n = len(bk.names)  # without the mesh's padding modules
    if live.shape[0] != n:
        bad, check = jax.tree.map(lambda x: x[:n], (bad, check))
    bads.append((bk, bad))
    checks.append((bk.names, check))
    ranks = np.asarray(live)[:n].sum(-1)  # (on the host: an eager sum compiles per shape)
    # cut per module on the host and place the pieces with one device_put: eager slices of the
    # device arrays would compile (or load from the cache) a gather per distinct kept rank
    la_h, lb_h = np.asarray(la), np.asarray(lb)
    # each piece copied to an array of its own size: placed from a view, a piece would share
    # (on CPU, without a copy) the buffer of the whole piece of the bucket, padded to its
    # largest rank, and keep all of it alive for as long as the merged module is kept
    pieces = [
        (np.array(la_h[j, :, : int(r)]), np.array(lb_h[j, : int(r), :]))
        for j, r in enumerate(ranks)
    ]
    placed = jax.device_put(pieces)
    for nm, (a, b) in zip(bk.names, placed, strict=True):
        results[nm] = {"lora_a": a, "lora_b": b, "scale": 1.0}


def run(plan: MergePlan, *, coef: Any, key: Any) -> dict[str, Any]:
    """Merge every job of ``plan``: ``{name: module}`` (checked: finite inputs, results in the
    dtype's range)."""
    coef_arr = host_constant(coef, plan.dtype)
    nums = {k: host_constant(v, plan.dtype) for k, v in plan.numeric.items()}
    results: dict[str, Any] = {}
    checks: list = []  # (module names, range status), checked once every bucket is dispatched
    if plan.model_wide:
        results = ties_model(plan, coef=coef_arr, checks=checks)
        raise_range(plan.fn, checks, plan.dtype, **_kernel_of(plan))
        return results
    if program.applies(plan):  # every bucket in one compiled program
        results, checks = program.run(plan, coef=coef_arr, nums=nums, key=key)
        raise_range(plan.fn, checks, plan.dtype, **_kernel_of(plan))
        return results
    bads: list = []
    for job in plan.jobs:
        bk = job.bucket
        mk = _stages.stack_masks(plan.masks, bk, plan.m_tasks)
        keys = (
            _keys_for(key, job.index)
            if key is not None
            else jax.device_put(np.zeros((len(bk.names),), np.uint32))  # (placed, not compiled)
        )
        if job.route == "dense":
            _dense_job(plan, job, mk, coef_arr, keys, nums, results, checks)
        else:
            _bucket_job(plan, job, mk, coef_arr, keys, nums, results, checks, bads)
    if bads:
        raise_nonfinite(plan.fn, [bk for bk, _ in bads], [bad for _, bad in bads], plan.dtype)
    raise_range(plan.fn, checks, plan.dtype, **_kernel_of(plan))
    return results
