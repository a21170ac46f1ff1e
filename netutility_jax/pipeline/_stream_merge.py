"""The streamed merge's second pass: each chunk read again and merged with the masks of the
first (or, with model-wide TIES, the passes over the magnitudes before it), only the merged
modules kept (:func:`merge_pass`, :func:`merge_pass_model_wide`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np

from .. import registry
from .._core import checks as _checks
from .._core import tree as _tree
from ..errors import InputError
from ..operators import _plan, _results, ta
from ..operators._ties_model import ties_model_streamed
from . import _exchange, _fused, _fused_stages, merging
from ._report import build_report, ranks_of, warn_zeroed, zeroed_modules
from ._request import all_candidates

if TYPE_CHECKING:  # the peft package is imported on first use (nu.peft), not by the core
    pass

from ._chunks import Energies, Stream, as_dtype

__all__ = [
    "all_kept",
    "merge_one_chunk",
    "merge_pass",
    "merge_pass_model_wide",
    "refuse_model_wide",
]


def merge_one_chunk(st: Stream, req: Any, mesh: Any, on_chunk: Callable | None) -> tuple | None:
    """A set that is one chunk, merged in one process on one device (``mesh`` the caller's,
    None): read once and merged as :func:`nu.merge_adapters` merges it in memory, by one
    program (:mod:`._fused` for TA, :mod:`._fused_stages` for the other methods: scores,
    lambda, allocation and merge, one read back); ``(merged, report)``, or None where that
    program does not take the merge or a flag sends it back (the passes then read the chunk as
    for any set, with their errors). The streamed merge's result is the in-memory one by
    contract; here it is the same computation."""
    if len(st.chunks) != 1 or st.ex.count != 1 or mesh is not None:
        return None
    res = req.resolved
    if res.model_wide or not _fused.takes_request(req):
        return None
    if res.spec.kind == "elementwise" and res.space == "full":  # (module by module: the passes)
        return None
    ta = merging.fast_ta(st.fn, req.method, req.space, req.options, None)
    adapters = st.source.read(list(st.source.names), host=True)  # (the chunk, in model order)
    adapters = [{n: as_dtype(m, st.dtype) for n, m in ad.items()} for ad in adapters]
    names, buckets, m_tasks = _tree.collect(adapters, fn=st.fn)
    fused = _fused.fused_ta if ta else _fused_stages.fused_merge
    done = fused(adapters, req, names, buckets, m_tasks)
    if done is None:
        return None
    merged = {n: done.merged[n] for n in st.source.names}
    if on_chunk is not None:
        merged = dict(_on_chunk(st.fn, on_chunk, merged))
    if st.progress is not None:
        st.progress.finish()  # (one read, where two were announced)
    zeroed = () if req.zero_merge else done.zeroed
    warn_zeroed(st.fn, zeroed, len(names), req.method, res.options)
    report = build_report(
        req, done.masks, done.scores, h=done.h, ranks=ranks_of(merged), zeroed=zeroed,
        lam_alpha=(done.lam, done.alpha),
    )  # fmt: skip
    return merged, report


def _merge_chunk(
    st: Stream, call: Mapping[str, Any], names, adapters, masks, index, on_chunk, zero: set
):  # fmt: skip
    """One chunk's merged modules (``masks=None``: every candidate); the names of those whose
    merged update is exactly zero are added to ``zero``."""
    part = None if masks is None else {n: masks[n] for n in names}
    one = call["mesh"] is None or call["mesh"].size == 1
    if one and merging.fast_ta(st.fn, call["method"], call["space"], call["options"], None):
        done = ta.merge_ta(st.fn, adapters, part, coef=call["coef"])  # (as nu.merge's TA)
        if done is not None:
            return _chunk_result(st.fn, adapters, done.modules, on_chunk, zero)
    # one device: every bucket of the chunk in one program (engine/program.py), its factors
    # stacked on the host as the one-device mesh would stack them
    plan = _plan.plan_merge(
        st.fn, adapters, part, **{**call, "mesh": None if one else call["mesh"]},
        module_index=index,
    )  # fmt: skip
    results = merging.run_plan(plan, coef=call["coef"], key=call["key"])
    return _chunk_result(st.fn, adapters, results, on_chunk, zero)


def _chunk_result(
    fn: str, adapters, results: dict[str, Any], on_chunk, zero: set
) -> Mapping[str, Any]:  # fmt: skip
    """A chunk's merged modules in its adapters' tree, through ``on_chunk`` if given; the names
    of the all-zero ones go to ``zero`` first (``on_chunk`` may replace them)."""
    out = _results.rebuild(adapters[0], results)
    every = dict.fromkeys(results, np.ones((1, 1), bool))  # (which were kept: decided later)
    zero.update(zeroed_modules(results, every))
    return out if on_chunk is None else _on_chunk(fn, on_chunk, out)


def all_kept(fn: str, k: int, names, adapters, kept: dict, energies: Energies) -> None:
    """``masks=None`` (every candidate kept): the chunk's kept masks and task energies, which
    the merge pass is then the first to read."""
    _, buckets, _ = _tree.collect(adapters, fn=fn)
    kept.update(all_candidates(fn, list(names), buckets))
    energies.add(k, adapters, "nu.heterogeneity", strict=False)


def merge_pass(
    st: Stream,
    call: Mapping[str, Any],
    masks: Mapping[str, Any] | None,
    *,
    on_chunk: Callable[[dict[str, Any]], Mapping[str, Any]] | None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, int | None], Energies | None, set[str]]:
    """Pass 2: ``(merged, kept masks, ranks, energies, zero)`` chunk by chunk: this process's
    merged modules; every module's kept masks (``masks=None`` keeps every candidate: the kept
    masks are then computed here, as :func:`nu.merge_adapters` does, and exchanged) and merged
    rank; the energies (only for ``masks=None``); every module whose merged update is zero."""
    fn, names_all = st.fn, st.source.names
    index = {n: i for i, n in enumerate(names_all)}
    merged: dict[str, Any] = {}
    kept: dict[str, Any] = {}
    zero: set[str] = set()
    mine = Energies()

    def work() -> dict[str, Any]:
        for k, names, adapters in st.read():
            if masks is None:
                all_kept(fn, k, names, adapters, kept, mine)
            merged.update(
                _merge_chunk(st, call, names, st.weighted(adapters), masks, index, on_chunk, zero)
            )
            del adapters  # (before the next read: one chunk alive at a time)
        out = {f"r/{n}": np.asarray(-1 if r is None else r) for n, r in ranks_of(merged).items()}
        out.update({f"m/{n}": m for n, m in kept.items()})
        out.update({f"z/{n}": np.asarray(True) for n in zero})
        return out if masks is not None else {**out, **mine.arrays()}

    shared = st.ex.allgather(fn, work)
    ranks: dict[str, int | None] = {}
    for arrays in shared:
        for name, a in arrays.items():
            if name.startswith("r/"):
                ranks[name[2:]] = None if int(a) < 0 else int(a)
            elif name.startswith("m/"):
                kept[name[2:]] = jnp.asarray(a)
            elif name.startswith("z/"):
                zero.add(name[2:])
    kept = dict(masks) if masks is not None else kept
    return (
        {n: merged[n] for n in st.names_of(st.ex.index)},
        {n: kept[n] for n in names_all},
        {n: ranks[n] for n in names_all},
        None if masks is not None else Energies.gathered(shared),
        zero,
    )


def _on_chunk(fn: str, on_chunk: Callable, out: dict[str, Any]) -> Mapping[str, Any]:
    kept = on_chunk(out)
    if not isinstance(kept, Mapping) or list(kept) != list(out):
        raise InputError(
            f"{fn}: on_chunk returned {type(kept).__name__} "
            f"{_checks.few(list(kept)) if isinstance(kept, Mapping) else ''}; expected a dict "
            f"with the chunk's modules {_checks.few(list(out))}, in that order."
        )
    return kept


def refuse_model_wide(fn: str, res: registry.Resolved, ex: _exchange.Exchange) -> None:
    if res.model_wide and ex.count > 1:
        opt, value = res.spec.model_wide
        raise InputError(
            f"{fn}: method={res.spec.name!r} with {opt}={value!r} keeps each task's largest "
            "entries over the whole model; streamed, that threshold is found by one process, "
            f"not split between {ex.count} processes. Run it in one process (without "
            f"distributed=True / --distributed), or use {opt}='module'."
        )


def merge_pass_model_wide(
    st: Stream,
    call: Mapping[str, Any],
    masks: Mapping[str, Any] | None,
    *,
    on_chunk: Callable[[dict[str, Any]], Mapping[str, Any]] | None,
    density: float,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, int | None], Energies | None, set[str]]:
    """:func:`merge_pass` for model-wide TIES (one process): every chunk read once for the
    common unit, once per radix pass and once to merge (:func:`_ties_model.ties_model_streamed`);
    the kept masks and energies of ``masks=None`` come from the first read."""
    st = dataclasses.replace(st, release_programs=False)  # (each chunk is read in several passes)
    fn, names_all = st.fn, st.source.names
    index = {n: i for i, n in enumerate(names_all)}
    merged: dict[str, Any] = {}
    kept: dict[str, Any] = {}
    zero: set[str] = set()
    mine = Energies()
    reads = [0]
    mant, exp2 = merging.coef_split(call["coef"], st.dtype)

    def plans() -> Iterator[tuple[_plan.MergePlan, Callable[[dict[str, Any]], None]]]:
        first = reads[0] == 0
        reads[0] += 1
        for k, names, adapters in st.read():
            if masks is None and first:
                all_kept(fn, k, names, adapters, kept, mine)
            part = None if masks is None else {n: masks[n] for n in names}
            adapters = st.weighted(adapters)
            plan = _plan.plan_merge(fn, adapters, part, **call, module_index=index)

            def sink(results: dict[str, Any], adapters=adapters) -> None:
                if exp2:  # (a coef outside the dtype's range: run as its mantissa)
                    results = merging.scale_results(fn, results, exp2, st.dtype, call["coef"])
                merged.update(_chunk_result(fn, adapters, results, on_chunk, zero))

            yield plan, sink
            del adapters, plan, sink  # (before the next read: one chunk alive at a time)

    ties_model_streamed(
        plans,
        m_tasks=len(st.source.paths),
        dtype=st.dtype,
        density=density,
        coef=jnp.asarray(mant, st.dtype),
    )
    ranks = ranks_of(merged)
    kept = dict(masks) if masks is not None else kept
    return (
        {n: merged[n] for n in names_all},
        {n: kept[n] for n in names_all},
        {n: ranks[n] for n in names_all},
        None if masks is not None else mine,
        zero,
    )
