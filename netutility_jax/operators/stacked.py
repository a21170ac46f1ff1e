"""Adapters stacked once, bucket by bucket: the engine's input, built where adapters enter.

A list of adapters is a pytree of ``2 M L`` factor leaves (and as many scales). Every jitted
call over it takes each leaf as an argument buffer of its own and traces a program whose size
grows with the number of modules, and every call walks the trees again on the host.
:func:`stack_adapters` does that walk and the stacking once: per bucket of equal
``(d_in, d_out, r_max)`` one array of every module's and task's ``lora_a`` ``(n, M, d_in, r_max)``,
one of ``lora_b`` ``(n, M, r_max, d_out)``, the scales ``(n, M)`` and the ranks ``(n, M)``
(zero-padded; a task lacking a module has rank 0 there). :class:`StackedAdapters` then goes
where a list of adapters goes:

* :func:`nu.score`, :func:`nu.heterogeneity` and :func:`nu.task_energies`: four argument buffers
  per bucket, whatever the number of modules, and no walk of the trees;
* :func:`nu.merge` and :func:`nu.merge_adapters` (one program over the buckets, or traced
  under ``jax.jit``); a ``mesh=``, model-wide TIES and the methods' row-block or per-module
  routes merge the per-module views of :meth:`StackedAdapters.unstack`. The merged adapter is a flat mapping keyed by
  module name (the stacked set keeps no tree), whose factors stay stacked per bucket
  (``_core.tables.MergedTable``: two arrays per bucket as its pytree leaves, a module sliced
  when read): under a transformation, so a jitted merge's program does not grow with the
  modules, and outside one with each module's kept columns first and its rank known, so the
  merge reads back only its flags and places nothing. A merge over a ``mesh`` or model-wide
  TIES (which take the per-module views) gives a dict.

It is a pytree (the arrays are its leaves; names, shapes, ranks and the scales' host copies are
static), so it passes through ``jax.jit`` as an argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._core import buckets as _buckets
from .._core import mesh as _mesh
from .._core import stacking as _stacking
from .._core import tree as _tree
from .._core.mesh import host_leaves
from ..errors import InputTypeError
from . import _stages

__all__ = ["StackedAdapters", "host_leaves", "stack_adapters"]


class StackedAdapters(Sequence):
    """M adapters stacked per bucket (see the module docstring); made by :func:`stack_adapters`.

    A sequence of M adapters too: ``st[i]`` (and iteration) gives task i as a flat dict of
    views of the stacked arrays (:meth:`unstack`), so a function that reads adapters one by one
    takes a stacked set as it takes a list.

    Attributes:
      names: the module names, in the first adapter's order.
      m_tasks: M.
      buckets: per bucket its names, ``(d_in, d_out, r_max)`` and its stacked arrays
        (``bucket.stacked``: ``a (n, M, d_in, r_max)``, ``b (n, M, r_max, d_out)``, ``scale
        (n, M)``, ``rank (n, M)`` int32).
    """

    __slots__ = ("_views", "buckets", "m_tasks", "names")

    def __init__(self, names: Sequence[str], buckets: Sequence[_tree.Bucket], m_tasks: int):
        self.names = tuple(names)
        self.buckets = tuple(buckets)
        self.m_tasks = int(m_tasks)
        self._views: list | None = None

    def __len__(self) -> int:
        return self.m_tasks

    def __getitem__(self, i):  # task i as a flat dict of views (made once)
        if self._views is None:
            self._views = self.unstack()
        return self._views[i]

    def __repr__(self) -> str:
        return (
            f"StackedAdapters({self.m_tasks} tasks, {len(self.names)} modules in "
            f"{len(self.buckets)} buckets)"
        )

    def _netutility_collect(self) -> tuple[list[str], list[_tree.Bucket], int]:
        """What :func:`_tree.collect` returns for these adapters (no walk, no check again)."""
        return list(self.names), list(self.buckets), self.m_tasks

    def unstack(self) -> list[dict[str, dict[str, Any] | None]]:
        """The M adapters as flat dicts ``{name: {"lora_a", "lora_b", "scale"}}`` of views of
        the stacked arrays, each module at its own rank (None where a task lacks it)."""
        out: list[dict[str, Any]] = [{} for _ in range(self.m_tasks)]
        for bk in self.buckets:
            st = bk.stacked
            for n, name in enumerate(bk.names):
                for i, mod in enumerate(bk.modules[n]):
                    if mod is None:
                        out[i][name] = None
                        continue
                    r = mod.lora_a.shape[1]
                    out[i][name] = {
                        "lora_a": st.a[n, i, :, :r],
                        "lora_b": st.b[n, i, :r, :],
                        "scale": mod.scale,
                    }
        return [{nm: ad[nm] for nm in self.names} for ad in out]

    def with_weights(self, weights: Sequence[float] | None) -> StackedAdapters:
        """Task i's scales multiplied by ``weights[i]`` (None: these adapters)."""
        if weights is None:
            return self
        w = np.asarray(weights, np.float64)
        buckets = []
        for bk in self.buckets:
            st = bk.stacked
            scale = st.scale * np.asarray(w, st.scale.dtype)
            mods = tuple(
                tuple(
                    None if m is None else dataclasses.replace(m, scale=m.scale * float(w[i]))
                    for i, m in enumerate(row)
                )
                for row in bk.modules
            )
            buckets.append(dataclasses.replace(bk, modules=mods, stacked=st._replace(scale=scale)))
        return StackedAdapters(self.names, buckets, self.m_tasks)


def _shell(bk: _tree.Bucket, scales: np.ndarray) -> tuple:
    """The bucket's modules without their factors (shapes, dtypes and the host scales: what
    the checks and messages read)."""
    return tuple(
        tuple(
            None
            if m is None
            else _tree.Module(
                jax.ShapeDtypeStruct(tuple(m.lora_a.shape), m.lora_a.dtype),
                jax.ShapeDtypeStruct(tuple(m.lora_b.shape), m.lora_b.dtype),
                float(scales[n, i]),
            )
            for i, m in enumerate(row)
        )
        for n, row in enumerate(bk.modules)
    )


def stack_adapters(adapters: Sequence[Any]) -> StackedAdapters:
    """M adapters stacked once per bucket, for the engine's programs (see the module docstring).

    Args:
      adapters: M adapters (one per task) with the same module names, as for :func:`nu.score`
        (nested dicts, flat PEFT dicts, nnx states); their scales must be concrete.

    Returns:
      :class:`StackedAdapters` in the compute dtype (float32, or float64 with x64 and float64
      factors), on the default device.

    Raises:
      InputError, InputTypeError: as :func:`nu.score` for the adapters; a traced scale.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> ads = [{f"l{i}": {"lora_a": rng.normal(size=(16, 4)), "lora_b": rng.normal(size=(4, 8))}
      ...         for i in range(3)} for _ in range(2)]
      >>> st = nu.stack_adapters(ads)
      >>> st.buckets[0].stacked.a.shape  # (modules, tasks, d_in, r_max)
      (3, 2, 16, 4)
      >>> sc, sc2 = nu.score(st), nu.score(ads)
      >>> bool(np.allclose(sc.modules["l1"].utility, sc2.modules["l1"].utility))
      True
    """
    fn = "nu.stack_adapters"
    if isinstance(adapters, StackedAdapters):
        return adapters
    names, buckets, m_tasks = _tree.collect(adapters, fn=fn)
    dtype = _tree.compute_dtype(buckets)
    out = []
    for bk in buckets:
        a, b, s = _buckets.bucket_arrays(bk)
        scales = _buckets.host_scales(s, dtype)
        if scales is None:
            raise InputTypeError(
                f"{fn}: a scale is traced; stack the adapters outside the transformation (the "
                "stacked set keeps its scales' values for its checks)."
            )
        if host_leaves(bk):  # numpy factors: stacked on the host, placed once
            st = _mesh.Stacked(*jax.device_put(tuple(_mesh.host_stack(bk, dtype, len(bk.names)))))
        elif _stacking.device_leaves(bk):  # device factors: on their device, a group at a time
            st = _stacking.device_stack(bk, dtype, len(bk.names), scales)
            st = st._replace(scale=jax.device_put(st.scale), rank=jax.device_put(st.rank))
        else:  # numpy and device factors mixed
            cfg = _stages.StackConfig(bk.d_in, bk.d_out, bk.r_max, dtype)
            st = _mesh.Stacked(*_stages.stage_stack((a, b, scales), cfg=cfg))
        out.append(dataclasses.replace(bk, modules=_shell(bk, scales), stacked=st))
    return StackedAdapters(names, out, m_tasks)


def _flatten(st: StackedAdapters):
    children = tuple(tuple(bk.stacked) for bk in st.buckets)
    shells = tuple(dataclasses.replace(bk, stacked=None) for bk in st.buckets)
    return children, (st.names, shells, st.m_tasks)


def _unflatten(aux, children) -> StackedAdapters:
    names, shells, m_tasks = aux
    buckets = [
        dataclasses.replace(bk, stacked=_mesh.Stacked(*c))
        for bk, c in zip(shells, children, strict=True)
    ]
    return StackedAdapters(names, buckets, m_tasks)


jax.tree_util.register_pytree_node(StackedAdapters, _flatten, _unflatten)
