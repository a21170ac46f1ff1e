"""Per-module results kept stacked, made into per-module arrays only when asked for.

:func:`nu.score` computes every bucket's fields in one array ``(n, 4, M, r_max)`` and
:func:`nu.allocate` every mask in one flat array. Placing each module's four fields and its mask
as arrays of their own costs five host-to-device placements per module (thousands for a large
model), which a pipeline that goes on to allocate and merge never needs. :class:`ScoreTable` and
:class:`MaskTable` are the ``{name: ...}`` mappings of the public contract with their values made
on first access (all of them at once: one read per bucket, then the placements), while the
library's own stages read the stacked form (:meth:`ScoreTable.parts`) or the host copies
(:meth:`MaskTable.host`) directly.

:class:`MergedTable` is the same for a merge under ``jax.jit`` of a ``nu.stack_adapters`` set: its
merged factors stay stacked per bucket, so the compiled program returns two arrays per bucket
rather than two slices per module.

These tables are :class:`collections.abc.MutableMapping` s and pytrees (flattened as the dict of their
values, unflattened as a plain dict), so ``jax.tree.map``, ``dict(table)``, equality with a dict
and item assignment work as for the dicts they stand for. A table that was changed is no longer
:attr:`pristine`, and the stages then read it entry by entry, as any dict.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import jax
import numpy as np

from .host import put_views

__all__ = ["MaskTable", "MergedTable", "ScoreTable", "StackedMasks", "StackedRows"]


class _NamedTable(MutableMapping):
    """A mapping over ``_names`` whose values a subclass makes on first access (``_values``);
    setting or deleting an entry makes every value and clears ``pristine``."""

    __slots__ = ()
    _names: tuple[str, ...]
    pristine: bool

    def _values(self) -> dict[str, Any]:
        raise NotImplementedError

    def __setitem__(self, name: str, value: Any) -> None:
        values = self._values()
        if name not in values:
            self._names = (*self._names, name)
        values[name] = value
        self.pristine = False

    def __delitem__(self, name: str) -> None:
        del self._values()[name]
        self._names = tuple(n for n in self._names if n != name)
        self.pristine = False

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._names)} modules)"


class ScoreTable(_NamedTable):
    """``{name: ModuleScores}`` from each bucket's stacked fields (see the module docstring).

    Args:
      names: every module name, in the adapters' order.
      parts: per live bucket ``(names, stats)``, ``stats (n, 4, M, r_max)`` on the device (the
        fields of :class:`ModuleScores` in order).
      fixed: the entries of modules without a live bucket (no candidate anywhere).
      make: the :class:`ModuleScores` constructor.
    """

    __slots__ = ("_done", "_fixed", "_make", "_names", "_parts", "pristine")

    def __init__(
        self,
        names: Sequence[str],
        parts: Sequence[tuple[Sequence[str], jax.Array]],
        fixed: Mapping[str, Any],
        make: Any,
    ):
        self._names = tuple(names)
        self._parts = tuple((tuple(n), s) for n, s in parts)
        self._fixed = dict(fixed)
        self._make = make
        self._done: dict[str, Any] | None = None
        self.pristine = True  # as nu.score made it (no entry set or deleted)

    def parts(self) -> tuple[tuple[tuple[str, ...], jax.Array], ...]:
        """Per live bucket ``(names, stats (n, 4, M, r_max))``, as the kernel returned them."""
        return self._parts

    @property
    def fixed(self) -> dict[str, Any]:
        """The modules without a live bucket, ``{name: ModuleScores}``."""
        return self._fixed

    def _values(self) -> dict[str, Any]:
        if self._done is None and any(isinstance(s, jax.core.Tracer) for _, s in self._parts):
            # inside a transformation: each module's fields sliced in the graph, and only if
            # asked for (the library's stages read the stacked parts)
            out = dict(self._fixed)
            for names, stats in self._parts:
                out.update(
                    (nm, self._make(*(stats[i, k] for k in range(4)))) for i, nm in enumerate(names)
                )
            self._done = out
        if self._done is None:
            out = dict(self._fixed)
            host = jax.device_get([s for _, s in self._parts])  # one read per bucket
            for (names, stats), h in zip(self._parts, host, strict=True):
                views = [h[i, k] for i in range(len(names)) for k in range(4)]
                arrays = put_views(views, stats.sharding)
                out.update(
                    (nm, self._make(*arrays[4 * i : 4 * i + 4])) for i, nm in enumerate(names)
                )
            self._done = out
        return self._done

    def __getitem__(self, name: str) -> Any:
        return self._values()[name]


class MaskTable(MutableMapping):
    """``{name: bool (M, r_max)}`` masks held on the host, placed on the device on first access.

    Args:
      host: ``{name: numpy bool (M, r_max)}`` in the adapters' order (views of one array).
      sharding: where :meth:`__getitem__`'s arrays are placed (None: the default device).
    """

    __slots__ = ("_done", "_host", "_sharding", "pristine")

    def __init__(self, host: Mapping[str, np.ndarray], sharding: Any = None):
        self._host = dict(host)
        self._sharding = sharding
        self._done: dict[str, jax.Array] | None = None
        self.pristine = True  # as nu.allocate made it (no entry set or deleted)

    def host(self, name: str) -> np.ndarray:
        """The mask of ``name`` as a numpy array (no transfer)."""
        return self._host[name]

    def host_dict(self) -> dict[str, np.ndarray]:
        """Every mask as numpy (no transfer)."""
        return dict(self._host)

    def _values(self) -> dict[str, jax.Array]:
        if self._done is None:
            names = list(self._host)
            arrays = put_views([self._host[n] for n in names], self._sharding)
            self._done = dict(zip(names, arrays, strict=True))
        return self._done

    def __getitem__(self, name: str) -> jax.Array:
        if name not in self._host:
            raise KeyError(name)
        return self._values()[name]

    def __setitem__(self, name: str, value: Any) -> None:
        values = self._values()
        values[name] = value
        # the host copy follows (a traced or odd value is read where it is used, and refused
        # there as any dict's would be)
        self._host[name] = value
        self.pristine = False

    def __delitem__(self, name: str) -> None:
        del self._values()[name]
        del self._host[name]
        self.pristine = False

    def __iter__(self) -> Iterator[str]:
        return iter(self._host)

    def __len__(self) -> int:
        return len(self._host)

    def __contains__(self, name: object) -> bool:
        return name in self._host

    def __repr__(self) -> str:
        return f"MaskTable({len(self._host)} modules)"


class StackedRows(_NamedTable):
    """``{name: row}`` from blocks of rows stacked per bucket, a module's row sliced only when
    asked for (in the graph when traced), so a traced program does not grow by a slice per
    module that nothing reads (a traced report's ``kept`` counts).

    Args:
      names: every module name, in the adapters' order.
      blocks: per live bucket ``(names, rows (n, ...))``.
      fixed: the rows of the modules without a live bucket.
    """

    __slots__ = ("_blocks", "_done", "_fixed", "_names", "_row_ndims", "pristine")

    def __init__(
        self,
        names: Sequence[str],
        blocks: Sequence[tuple[Sequence[str], Any]],
        fixed: Mapping[str, Any],
        row_ndims: Sequence[int] | None = None,
    ):
        self._names = tuple(names)
        self._blocks = tuple((tuple(n), m) for n, m in blocks)
        self._fixed = dict(fixed)
        # a row's rank as made (a jax.vmap of the table adds axes in front of the blocks')
        self._row_ndims = (
            tuple(int(m.ndim) - 1 for _, m in self._blocks)
            if row_ndims is None
            else tuple(row_ndims)
        )
        self._done: dict[str, Any] | None = None
        self.pristine = True  # as it was made (no entry set or deleted)

    def blocks(self) -> dict[tuple[str, ...], Any]:
        """``{bucket's names: rows (n, ...)}`` (masks: ``(n, M, r_max)``), as they were made."""
        return dict(self._blocks)

    @property
    def fixed(self) -> dict[str, Any]:
        """The modules without a live bucket, ``{name: row}`` (masks: all False)."""
        return self._fixed

    def _values(self) -> dict[str, Any]:
        if self._done is None:
            out = dict(self._fixed)
            for (names, m), rank in zip(self._blocks, self._row_ndims, strict=True):
                axis = m.ndim - 1 - rank
                if isinstance(m, jax.core.Tracer) or not isinstance(m, jax.Array):
                    at = (slice(None),) * axis
                    out.update((nm, m[(*at, i)]) for i, nm in enumerate(names))
                else:  # (one program per shape, the row an argument)
                    out.update((nm, _row_at(m, np.int32(i), axis)) for i, nm in enumerate(names))
            self._done = {nm: out[nm] for nm in self._names}
        return self._done

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        return self._values()[name]


class StackedMasks(StackedRows):
    """``{name: bool (M, r_max)}`` masks of :func:`nu.allocate` inside a transformation, kept
    stacked per bucket as the allocation computed them: the merge reads the blocks
    (:meth:`blocks`), and a module's mask is sliced in the graph only when asked for, so the
    traced program does not grow by a slice, a stack and a check per module.

    Args:
      names: every module name, in the adapters' order.
      blocks: per live bucket ``(names, masks (n, M, r_max))``, traced bool arrays.
      fixed: the masks of the modules without a live bucket (all False).
    """

    __slots__ = ()


@functools.partial(jax.jit, static_argnums=(2,))
def _row_at(x: jax.Array, i: jax.Array, axis: int) -> jax.Array:
    """Row ``i`` of ``x`` on ``axis``: one program per shape, the row an argument."""
    return jax.lax.dynamic_index_in_dim(x, i, axis=axis, keepdims=False)


@functools.partial(jax.jit, static_argnames=("k",))
def _row_factors(
    a: jax.Array, b: jax.Array, i: jax.Array, *, k: int
) -> tuple[jax.Array, jax.Array]:
    """Row ``i`` of ``a (..., n, d_in, w)`` and ``b (..., n, w, d_out)``, their first ``k``
    columns (rows of ``b``): one program per shape and ``k``, the row an argument."""
    a_i = jax.lax.dynamic_index_in_dim(a, i, axis=a.ndim - 3, keepdims=False)
    b_i = jax.lax.dynamic_index_in_dim(b, i, axis=b.ndim - 3, keepdims=False)
    return a_i[..., :k], b_i[..., :k, :]


class MergedTable(_NamedTable):
    """``{name: {"lora_a", "lora_b", "scale"}}`` of a merge whose factors stay stacked per bucket.

    What ``nu.merge`` and ``nu.merge_adapters`` return for a ``nu.stack_adapters`` set inside a
    transformation. As a pytree a pristine table's leaves are the stacked factors, two per bucket
    (``lora_a (..., n, d_in, w)``, ``lora_b (..., n, w, d_out)``; a ``jax.vmap`` adds its axes in
    front): a jitted merge returns them as they are, and its compiled program does not grow by two
    output slices per module. A module's factors are row ``i`` of its bucket's arrays, sliced when
    the module is read (in the graph when traced; outside, by one small program per shape), and
    ``jax.tree.map`` over a pristine table maps the stacked arrays and gives a table again.
    Setting or deleting an entry makes every module's factors, and the table then flattens as the
    dict of its values, as the other tables do.

    With ``counts`` (what a merge outside a transformation returns, :func:`nu.merge_adapters` of
    a stacked set with TA), each module's live columns come first in its row and a module's rank
    is its count: reading it gives its first ``count`` columns (rows of ``lora_b``), so the merge
    itself reads back only the counts and places nothing.

    Args:
      names: every module name, in the adapters' order.
      blocks: per bucket ``(names, lora_a (n, d_in, w), lora_b (n, w, d_out))``.
      scale: every module's ``scale`` (the merged factors carry the scaling).
      counts: None (every module's rank is ``w``), or per bucket the ``n`` ranks (Python ints
        at most ``w``).
      nonzero: None, or per bucket whether each module's merged update is not exactly zero (host
        bools the merge computed on the device: :meth:`zeros` reads no factor).
    """

    __slots__ = (
        "_blocks", "_counts", "_done", "_names", "_nonzero", "_where", "pristine", "scale"
    )  # fmt: skip

    def __init__(
        self,
        names: Sequence[str],
        blocks: Sequence[tuple[Sequence[str], Any, Any]],
        scale: float = 1.0,
        counts: Sequence[Sequence[int]] | None = None,
        nonzero: Sequence[Sequence[bool]] | None = None,
    ):
        self._names = tuple(names)
        self._blocks = tuple((tuple(n), a, b) for n, a, b in blocks)
        self._counts = None if counts is None else tuple(tuple(int(c) for c in cs) for cs in counts)
        if self._counts is not None and [len(c) for c in self._counts] != [
            len(bn) for bn, _, _ in self._blocks
        ]:
            raise ValueError("MergedTable: counts must give one rank per module of each block")
        self._nonzero = (
            None if nonzero is None else tuple(tuple(bool(z) for z in zs) for zs in nonzero)
        )
        self._where = {
            nm: (k, i) for k, (bn, _, _) in enumerate(self._blocks) for i, nm in enumerate(bn)
        }
        missing = [nm for nm in self._names if nm not in self._where]
        if missing or len(self._where) != len(self._names):
            raise ValueError(f"MergedTable: modules {missing[:3]} are in no block")
        self.scale = scale
        self._done: dict[str, Any] | None = None
        self.pristine = True  # as the merge made it (no entry set or deleted)

    def blocks(self) -> tuple[tuple[tuple[str, ...], Any, Any], ...]:
        """Per bucket ``(names, lora_a (n, d_in, w), lora_b (n, w, d_out))``, as merged."""
        return self._blocks

    @property
    def counts(self) -> tuple[tuple[int, ...], ...] | None:
        """Per bucket each module's rank, or None (every rank is its bucket's width)."""
        return self._counts

    def zeros(self) -> dict[str, bool] | None:
        """Whether each module's merged update is exactly zero, as the merge flagged it (None
        when it did not: read the modules)."""
        if self._nonzero is None or not self.pristine:
            return None
        where = self._where
        return {nm: not self._nonzero[where[nm][0]][where[nm][1]] for nm in self._names}

    def ranks(self) -> dict[str, int]:
        """Each module's rank: its count, or the width ``w`` of its bucket's factors (no
        slicing)."""
        if self._counts is not None:
            where = self._where
            return {nm: self._counts[where[nm][0]][where[nm][1]] for nm in self._names}
        return {nm: int(self._blocks[self._where[nm][0]][1].shape[-1]) for nm in self._names}

    def _module(self, name: str) -> dict[str, Any]:
        k, i = self._where[name]
        _, a, b = self._blocks[k]
        w = None if self._counts is None else self._counts[k][i]
        if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
            a_i, b_i = a[..., i, :, :], b[..., i, :, :]
            if w is not None:
                a_i, b_i = a_i[..., :w], b_i[..., :w, :]
        elif w is None:
            idx = np.int32(i)
            a_i, b_i = _row_at(a, idx, a.ndim - 3), _row_at(b, idx, b.ndim - 3)
        else:
            a_i, b_i = _row_factors(a, b, np.int32(i), k=w)
        return {"lora_a": a_i, "lora_b": b_i, "scale": self.scale}

    def _values(self) -> dict[str, Any]:
        if self._done is None:
            self._done = {nm: self._module(nm) for nm in self._names}
        return self._done

    def __getitem__(self, name: str) -> Any:
        if self._done is not None:
            return self._done[name]
        if name not in self._where:
            raise KeyError(name)
        return self._module(name)


def _flatten_merged(t: MergedTable) -> tuple[list, tuple]:
    if t.pristine:
        children = [x for _, a, b in t.blocks() for x in (a, b)]
        blocks = tuple(bn for bn, _, _ in t.blocks())
        return children, ("stacked", t._names, blocks, t.scale, t.counts)
    values, names = _flatten_table(t)
    return values, ("dict", names)


def _unflatten_merged(aux: tuple, children: Sequence[Any]) -> Any:
    if aux[0] == "dict":
        return _unflatten_table(aux[1], children)
    _, names, block_names, scale, counts = aux
    it = iter(children)
    return MergedTable(names, [(bn, next(it), next(it)) for bn in block_names], scale, counts)


def _flatten_table(t: Mapping) -> tuple[list, tuple[str, ...]]:
    names = tuple(t)
    return [t[n] for n in names], names


def _unflatten_table(names: tuple[str, ...], values: Sequence[Any]) -> dict[str, Any]:
    return dict(zip(names, values, strict=True))


def _flatten_rows(t: StackedRows) -> tuple[list, tuple]:
    """A pristine table's leaves are its blocks and fixed rows (a jitted allocation returns its
    masks stacked, not one output slice per module); otherwise the dict of its values."""
    if t.pristine:
        fixed = tuple(t.fixed)
        children = [m for _, m in t._blocks] + [t.fixed[nm] for nm in fixed]
        blocks = tuple(bn for bn, _ in t._blocks)
        return children, ("stacked", type(t), t._names, blocks, fixed, t._row_ndims)
    values, names = _flatten_table(t)
    return values, ("dict", names)


def _unflatten_rows(aux: tuple, children: Sequence[Any]) -> Any:
    if aux[0] == "dict":
        return _unflatten_table(aux[1], children)
    _, cls, names, block_names, fixed, row_ndims = aux
    blocks = list(zip(block_names, children[: len(block_names)], strict=True))
    rest = dict(zip(fixed, children[len(block_names) :], strict=True))
    return cls(names, blocks, rest, row_ndims)


for _cls in (ScoreTable, MaskTable):
    jax.tree_util.register_pytree_node(_cls, _flatten_table, _unflatten_table)
for _cls in (StackedRows, StackedMasks):
    jax.tree_util.register_pytree_node(_cls, _flatten_rows, _unflatten_rows)
jax.tree_util.register_pytree_node(MergedTable, _flatten_merged, _unflatten_merged)
