"""Merging adapters streamed from disk: memory bounded by a chunk, whatever the tasks and modules.

:func:`nu.merge_adapters` holds every task's factors at once. Net Utility needs a global view of
the model, but only of small per-direction statistics: lambda is a median over every candidate
direction of every module, the budget a global top-K over the utilities, and ``alpha="auto"`` a
variance of the tasks' energies summed over modules. So :func:`merge_adapters_streaming` reads
the adapters (:class:`nu.peft.AdapterSet`) a chunk of modules at a time, in passes:

1. Each chunk is scored (:func:`nu.score`'s kernel) with ``lam=0`` (or the given lam):
   ``sigma``, ``benefit``, ``interference`` and the candidates, ``4 M r_max`` numbers per module,
   and each task's energy ``||dW_i||_F^2`` from the same Grams (summed chunk by chunk as a
   mantissa and a power of two, scale-safe, as :func:`nu.heterogeneity`); the factors are
   dropped. With ``alpha="auto"`` both geometries (alpha 0 and 1) are scored from the one
   decomposition (only the weighting of the overlaps differs), and once every chunk is scored,
   ``h`` picks one, as in memory. With ``input_moments`` (the data-aware score) each chunk is
   scored with every task's entry restricted to the chunk's modules. Then lambda
   (:func:`utility.lam_auto` over every candidate of every module), the utilities, a full
   :class:`nu.Scores` and the masks (:func:`nu.allocate`), as in memory.
2. Each chunk is read again and merged (:func:`_plan.plan_merge` with each module's position in
   the whole model, so that DARE draws the masks it draws in memory; :func:`_pipeline.run`,
   through :func:`merging.run_plan`, which applies a ``coef`` outside the dtype's range).
   Only the merged modules are kept.

A TA merge whose whole set is one chunk, in one process on one device, reads it once and runs
the in-memory merge's one TA program on it (scores, lambda, allocation and merge; see
:mod:`._fused`): the same computation as the passes, one program where they compile several.
Where that program does not take the merge (data-aware scores, weights, a task floor,
``allocation="all"``) or a flag sends it back, the passes run as for any set.

``allocation="all"`` needs no pass 1 (the energies for :attr:`Report.heterogeneity` are then
summed in pass 2). A chunk is a run of modules of equal ``(d_in, d_out,
r_max)`` in natural order whose factors (every task, in the compute dtype) fit ``chunk_bytes``,
or several such groups whole where together they fit (:func:`plan_chunks`), so every pass reads
each module once and holds one chunk at a time.

Peak memory: one chunk and its working memory, plus the statistics, plus the merged result
(rank about ``budget`` per module for the low-rank methods), plus the runtime (Python, JAX and
XLA, about 170 MB) and the compiled programs of the chunk shape at hand: chunks of one shape are
read one after another, and after the last of them its programs are dropped
(:func:`_executables.release`: the next shape, or the next pass, compiles its own). A chunk is
dropped before the next is read and the freed heap handed back to the OS
(:func:`release_heap`); each merged module is kept in an array of its own size (not a view of
its chunk's output, padded to the chunk's largest rank). A chunk's working memory is about four
times ``chunk_bytes`` (the factors as read, stacked on the host, on the device, and the
kernels' QR factors), hence the default of 64 MiB (on a Llama-3-8B-shaped set of 16 tasks,
peak 1.85 GB with 256 MiB chunks, 0.87 GB with 64 MiB; TA in Core space merged the same
modules bit for bit with both). Dense results (TIES, DARE and
DARE-TIES in full space) are ``d_in x d_out`` per module: pass ``on_chunk`` to truncate them
chunk by chunk (:func:`nu.to_lora`). Elementwise methods work on every task's dense
coordinates of a module (``d_in x M r`` in KnOTS space: 734 MB for a Llama-3-70B ``down_proj``
with 20 tasks at r = 16; ``d_in x d_out`` in full space); TIES, DARE and DARE-TIES take them a
block of rows at a time when one module's exceed ``_plan.DENSE_BYTES`` (64 MiB of working memory), DARE drawing each block's rows
of the module's mask (:mod:`netutility_jax.operators._rng`; a non-threefry key, e.g. rbg, keeps whole
modules).

The result is :func:`nu.merge_adapters`'s on the same adapters (``nu.peft.load_adapters``),
the same arithmetic per module, grouped differently: the in-memory scorer runs every bucket in
one jitted call (their small eigenproblems in one batched, padded ``eigh``) and sums the task
energies over all modules at once, the streamed one a chunk at a time (its energies from the
scoring Grams, which are the same products in another order). Scores, lambda and ``h``
therefore agree to float32 rounding (about 1e-7 relative), so the masks are the same unless two
utilities at the budget's cut are that close. The merged modules of the same masks agree exactly
or to rounding for the spectral methods (measured at most 1.3e-6 of the largest entry); TIES,
DARE and DARE-TIES in Core and KnOTS space agree within 1e-4 of it (measured up to 1.1e-5): the
coordinates' bases come from batched kernels (:func:`_stages.stage_coords`) whose last bits move
with the batch, a chunk of modules here and a piece of a bucket in memory (with the same module
alone or among three others they differ by about 1e-5 relative), and an elementwise selection
near its threshold amplifies that.

Several processes (``distributed=True`` after ``jax.distributed.initialize``: the hosts of a
GPU or TPU cluster, or processes on one machine) split the chunks between them, balanced by
bytes (:func:`_exchange.assign`, the same in every process; every process opens every header,
so all know every module's name and shape). Each process reads only its chunks, and after each
pass the small results are all-gathered (:mod:`netutility_jax.pipeline._exchange`): the ``lam=0``
statistics of each module (of both geometries for ``alpha="auto"``) and the energies' parts
(pass 1, ``4 M r_max`` numbers a module, bit for bit), the merged ranks (pass 2). Every process
then computes the same lambda, :class:`nu.Scores`, masks and :class:`Report` from the same numbers with the same code (a checksum of the masks is
compared across processes), and merges only its chunks: ``merged`` holds this process's modules,
the report all of them. A process whose chunk raises still takes part in the exchange; then
every process raises (the failing one its own error, the others an :class:`InputError` naming
it), so none waits for ever. With one process this is exactly the merge above.

Model-wide TIES (``trim_scope="model"``): each task keeps its ``int(density * N)`` largest
entries over the whole model, a threshold over every entry of every module in the space's
coordinates, not a statistic of directions. Pass 2 is then
:func:`_ties_model.ties_model_streamed`: a read of every chunk for the common unit (the largest
power of two over the live modules, as in memory); per task, a 65536-bin histogram of the top 16
bits of the magnitudes' bit patterns, summed over a second read, locates the threshold's bin
(the entries are counted on the way, for ``k``); a third read histograms the low 16 bits inside
that bin, giving the exact threshold and how many entries equal to it fit (ties taken in flat
module order, as in memory); a fourth read merges each chunk at those thresholds. Memory:
``M x 65536`` counts and one chunk; cost: four reads of every factor and four decompositions
into the space's coordinates. One process only (``distributed=True`` is refused for it).
"""

from __future__ import annotations

import dataclasses
import numbers
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .._core import checks as _checks
from .._core import mesh as _mesh
from .._core import tree as _tree
from .._core.executables import kernel
from .._core.host import host_constant
from ..errors import InputError, InputTypeError
from ..scoring import _run as _scoring
from ..scoring import utility
from ..scoring.moments import check_entries
from . import _exchange
from ._chunks import (
    CHUNK_BYTES,
    Energies,
    Progress,
    Stream,
    bound_heap,
    plan_chunks,
    reads,
)
from ._report import Report, build_report, warn_zeroed
from ._request import MergeRequest, sized_merge
from ._stream_merge import (
    all_kept,
    merge_one_chunk,
    merge_pass,
    merge_pass_model_wide,
    refuse_model_wide,
)

if TYPE_CHECKING:  # the peft package is imported on first use (nu.peft), not by the core
    from ..peft._lazy import AdapterSet

__all__ = ["CHUNK_BYTES", "bound_heap", "merge_adapters_streaming", "plan_chunks"]


@kernel(fast_compile=True)
def _utility(s: utility.ModuleScores, lam: jax.Array) -> jax.Array:
    """``benefit - lam * interference`` on candidates (where the ``lam=0`` utility is finite),
    ``-inf`` elsewhere: :func:`nu.score`'s expression, for one module (one program per module
    shape; one traced over every module's leaves took 0.2 s to trace in every process)."""
    return jnp.where(s.utility > -jnp.inf, s.benefit - lam * s.interference, -jnp.inf)


# one program, where its dozen eager operations were a program each, traced and loaded again in
# every process (the same operations: elementwise selections, medians and one division, so the
# same bits)
_lam_auto = kernel(utility.lam_auto, fast_compile=True)


def _utilities(stats: dict[str, utility.ModuleScores], lam: jax.Array) -> dict[str, jax.Array]:
    """:func:`_utility` of every module."""
    return {n: _utility(s, lam) for n, s in stats.items()}


def _global_scores(
    fn: str, stats: dict[str, utility.ModuleScores], lam: Any, alpha: float, dtype: Any
) -> utility.Scores:
    """The whole model's :class:`nu.Scores` from the chunks' ``lam=0`` statistics and ``lam``
    (``"auto"``: the median ratio over every candidate, :func:`utility.lam_auto`)."""
    if not isinstance(lam, str):
        return utility.Scores(
            stats, host_constant(lam, dtype, shared=False), host_constant(alpha, dtype, shared=False)
        )
    cand = {n: np.asarray(s.utility) > -np.inf for n, s in stats.items()}
    if not any(c.any() for c in cand.values()):
        raise InputError(
            f"{fn}: no candidate directions: the update of every task is zero (or below rtol, or "
            f"of rank 0) in all {len(stats)} modules, so lam='auto' (a median over candidates) is "
            "undefined. Check that the adapters are trained (lora_b is zero at initialisation) "
            "and loaded correctly, or pass lam= explicitly (nu.allocate then keeps nothing)."
        )
    # (joined on the host and placed: eager jnp ravels, concatenations and even jnp.asarray of
    # a numpy array each compile a program, traced and loaded again in every process)
    lam_v = _lam_auto(
        jax.device_put(np.concatenate([np.ravel(s.benefit) for s in stats.values()])),
        jax.device_put(np.concatenate([np.ravel(s.interference) for s in stats.values()])),
        jax.device_put(np.concatenate([c.ravel() for c in cand.values()])),
    )
    if lam_v.dtype != dtype:  # (a conversion to its own dtype is a program, and changes nothing)
        lam_v = jnp.asarray(lam_v, dtype)
    utils = _utilities(stats, lam_v)
    fi = np.finfo(dtype)
    lam_f = float(lam_v)
    interfering = any((cand[n] & (np.asarray(s.interference) > 0)).any() for n, s in stats.items())
    if interfering and not fi.tiny <= lam_f <= fi.max:
        raise InputError(
            f"{fn}: lam='auto' (median benefit / median interference) is {lam_f:.3g}, outside "
            f"the normal range of {np.dtype(dtype).name}: the tasks' updates differ greatly in "
            "size. Check the LoRA scales (lora_alpha / r) or pass lam= explicitly."
        )
    bad = [n for n in stats if (cand[n] & ~np.isfinite(np.asarray(utils[n]))).any()]
    if bad:
        raise InputError(
            f"{fn}: lam * interference (lam = {lam_f:.3g}) is beyond the range of "
            f"{np.dtype(dtype).name} in {_checks.few(bad)}: the tasks' updates differ too much "
            "in size. Check the LoRA scales (lora_alpha / r), pass a smaller lam, or use float64."
        )
    modules = {n: s._replace(utility=utils[n]) for n, s in stats.items()}
    return utility.Scores(modules, lam_v, host_constant(alpha, dtype, shared=False))


def _chunk_moments(moments: Any, names: Sequence[str]) -> list[Any] | None:
    """Each task's ``input_moments`` entry restricted to a chunk's modules (None stays None:
    data-free for that task), so that :func:`nu.score`'s checks apply to the chunk as to the
    whole model (a module the task has but its mapping lacks is refused in its chunk)."""
    if moments is None:
        return None
    keep = set(names)
    return [None if e is None else {n: v for n, v in e.items() if str(n) in keep} for e in moments]


def _check_moment_names(fn: str, moments: Any, source: AdapterSet) -> None:
    """What the chunks cannot see: ``input_moments``' shape (a list of one entry per task, each
    None or a mapping) and names that are no module of the adapters (a chunk's restriction
    would drop them silently)."""
    if moments is None:
        return
    check_entries(fn, moments, len(source.paths))
    known = set(source.names)
    for i, e in enumerate(moments):
        if e is None:
            continue
        if not isinstance(e, Mapping):
            raise InputTypeError(
                f"{fn}: input_moments[{i}] is a {type(e).__name__}; expected None or a mapping "
                "{module name: InputMoments | None}."
            )
        extra = sorted(str(n) for n in e if str(n) not in known)
        if extra:
            raise InputError(
                f"{fn}: input_moments[{i}] names {_checks.few(extra)} that the adapters lack; "
                "the names must be the adapters' module names (AdapterSet.names)."
            )


def _score_pass(
    st: Stream,
    *,
    alpha: float | str,
    lam: Any,
    mesh: Any = None,
    input_moments: Any = None,
    interference: str = "overlap",
) -> tuple[dict[str, utility.ModuleScores], float, Energies]:
    """Pass 1: ``(stats, alpha, energies)``: every module's scores with ``lam=0`` (``lam`` if a
    number; :func:`nu.score`'s checks and messages), every process's after the exchange (each
    module's four statistics stacked, ``(4, M, r_max)``), and the tasks' energies, from the
    scoring kernel's Grams. ``alpha="auto"``: each chunk is scored for both geometries from one
    decomposition (only the weighting of the overlaps differs), then ``h`` (from the energies)
    picks one; results beyond the compute dtype are refused only for that one, as in memory."""
    auto = isinstance(alpha, str)
    alphas = (0.0, 1.0) if auto else (float(alpha),)
    lam_k = 0.0 if isinstance(lam, str) else lam
    mine = Energies()
    checks: dict[int, list[_scoring.Deferred]] = {}

    def work() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, names, adapters in st.read():
            run = _scoring.score_run(
                "nu.score",
                adapters,
                alphas,
                lam_k,
                None,
                False,
                mesh,
                energy=True,
                defer=auto,
                input_moments=_chunk_moments(input_moments, names),
                interference=interference,
            )
            for a, sc in enumerate(run.scores):
                # stacked on the host (exact; an eager jnp.stack compiles per shape)
                out.update(
                    {
                        f"s{a}/{n}": np.stack([np.asarray(x) for x in ms])
                        for n, ms in sc.modules.items()
                    }
                )
            mine.parts[k] = run.energies
            checks[k] = run.check
            del adapters, run  # (before the next read: one chunk alive at a time)
        return {**out, **mine.arrays()}

    shared = st.ex.allgather(st.fn, work)
    energies = Energies.gathered(shared)
    pick = 0
    if auto:
        h = energies.heterogeneity(st.dtype, f"{st.fn} (alpha='auto')", strict=True)
        pick = 0 if h > _scoring.H_THRESHOLD else 1  # alphas[pick]: 0 above the threshold
        # one check over this process's chunks: the error counts all their affected modules
        mine_checks = [checks[k][pick] for k in sorted(checks)]
        st.ex.check(st.fn, lambda: mine_checks and _scoring.Deferred.join(mine_checks).check())
    stats = {
        name.split("/", 1)[1]: utility.ModuleScores(*jax.device_put(list(np.asarray(a))))
        for arrays in shared
        for name, a in arrays.items()
        if name.startswith(f"s{pick}/")
    }
    return {n: stats[n] for n in st.source.names}, alphas[pick], energies


def _agree(st: Stream, sc: utility.Scores, masks: Mapping[str, Any]) -> None:
    """Refuse masks that differ between processes (they cannot, from the same statistics and
    the same code, unless the hosts compute differently): a checksum of lambda and the masks."""
    if st.ex.count == 1:
        return
    crc = zlib.crc32(np.asarray(sc.lam).tobytes())
    for n in st.source.names:
        crc = zlib.crc32(np.asarray(masks[n], bool).tobytes(), crc)
    shared = st.ex.allgather(st.fn, lambda: {"crc": np.asarray(crc, np.int64)})
    if len({int(a["crc"]) for a in shared}) > 1:
        raise InputError(
            f"{st.fn}: the processes chose different directions from the same statistics; run "
            "every process on the same kind of machine with the same versions of jax and jaxlib."
        )


def _check_progress(fn: str, progress: Any) -> None:
    if progress is not None and not callable(progress):
        raise InputTypeError(
            f"{fn}: progress is a {type(progress).__name__}; expected None or a function "
            "progress(done, total) of the chunk reads done and planned."
        )


def _check_source(fn: str, source: Any, chunk_bytes: Any, on_chunk: Any) -> None:
    if not all(hasattr(source, a) for a in ("names", "shapes", "paths", "stored_dtypes", "read")):
        raise InputTypeError(
            f"{fn}: source is a {type(source).__name__}; expected the nu.peft.AdapterSet that "
            "nu.peft.open_adapters(paths) returns. For adapters already in memory use "
            "nu.merge_adapters."
        )
    if isinstance(chunk_bytes, (bool, np.bool_)) or not isinstance(chunk_bytes, numbers.Integral):
        raise InputTypeError(
            f"{fn}: chunk_bytes={_checks.given(chunk_bytes)}; expected a positive integer (bytes "
            "of factors read at once)."
        )
    if chunk_bytes <= 0:
        raise InputError(
            f"{fn}: chunk_bytes={chunk_bytes}; expected a positive integer (bytes of factors "
            "read at once)."
        )
    if on_chunk is not None and not callable(on_chunk):
        raise InputTypeError(
            f"{fn}: on_chunk is a {type(on_chunk).__name__}; expected None or a function of a "
            "chunk's merged modules {name: module}."
        )


def _stream(
    fn: str,
    source: AdapterSet,
    chunk_bytes: int,
    ex: _exchange.Exchange,
    weights: tuple[float, ...] | None = None,
) -> Stream:
    codes = source.stored_dtypes
    dtype = _tree.float_dtype(*(np.float64 if c == "F64" else np.float32 for c in codes))
    m_tasks = len(source.paths)
    chunks = plan_chunks(source.shapes, m_tasks, chunk_bytes=chunk_bytes, itemsize=dtype.itemsize)
    sizes = []
    for names in chunks:
        d_in, d_out, r_max = source.shapes[names[0]]
        sizes.append(len(names) * m_tasks * r_max * (d_in + d_out))
    owner = _exchange.assign(sizes, ex.count)
    return Stream(fn, source, tuple(chunks), dtype, ex, owner, weights)


def _allocation(
    st: Stream, req: MergeRequest, mesh: Any
) -> tuple[utility.Scores | None, dict[str, Any] | None, Energies | None]:
    """Pass 1 and the allocation: ``(scores, masks, energies)``, all None for
    ``allocation="all"`` (which reads nothing here: the merge pass keeps every candidate)."""
    if req.allocation == "all":
        return None, None, None
    stats, alpha_v, energies = _score_pass(
        st, alpha=req.alpha, lam=req.lam, mesh=mesh, input_moments=req.input_moments,
        interference=req.interference,
    )  # fmt: skip
    sc = _global_scores(st.fn, stats, req.lam, alpha_v, st.dtype)
    masks = req.select(sc)
    _agree(st, sc, masks)
    return sc, masks, energies


def _kept_pass(st: Stream) -> tuple[dict[str, Any], Energies]:
    """Every candidate of every module (``allocation="all"``) and the tasks' energies, read a
    chunk at a time (one process): what the merge pass computes on its way, for a plan."""
    kept: dict[str, Any] = {}
    energies = Energies()
    for k, names, adapters in st.read():
        all_kept(st.fn, k, names, adapters, kept, energies)
        del adapters  # (before the next read: one chunk alive at a time)
    return {n: kept[n] for n in st.source.names}, energies


def score_and_allocate(
    source: AdapterSet, req: MergeRequest, *, chunk_bytes: int, mesh: Any = None
) -> tuple[utility.Scores | None, dict[str, Any], float]:
    """What a streamed merge decides before merging, in one process, for a plan
    (:func:`nu.plan`): ``(scores, kept masks, h)`` for the checked request ``req``. Reads every
    chunk once (pass 1, or for ``allocation="all"`` the candidates)."""
    fn = req.fn
    _check_source(fn, source, chunk_bytes, None)
    _check_moment_names(fn, req.input_moments, source)
    mesh = _mesh.check_mesh(fn, mesh) or _mesh.module_mesh(jax.local_devices()[:1])
    st = _stream(fn, source, chunk_bytes, _exchange.LOCAL)
    if req.allocation == "all":
        kept, energies = _kept_pass(st)
        sc = None
    else:
        sc, kept, energies = _allocation(st, req, mesh)  # type: ignore[assignment]
    h = energies.heterogeneity(st.dtype, "nu.heterogeneity", strict=False)  # type: ignore[union-attr]
    return sc, {n: kept[n] for n in st.source.names}, h


@sized_merge
def merge_adapters_streaming(
    source: AdapterSet,
    *,
    budget: int | None = None,
    method: str = "ta",
    space: str = "full",
    allocation: str = "net_utility",
    scope: str | None = None,
    alpha: float | str = 1.0,
    lam: float | str = "auto",
    positive_only: bool = True,
    coef: float = 1.0,
    key: jax.Array | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    on_chunk: Callable[[dict[str, Any]], Mapping[str, Any]] | None = None,
    distributed: bool = False,
    mesh: Any = None,
    weights: Sequence[float] | None = None,
    min_share: float | None = None,
    input_moments: Sequence[Mapping[str, Any] | None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    interference: str = "overlap",
    **options: Any,
) -> tuple[dict[str, Any], Report]:
    """:func:`nu.merge_adapters` on adapters read from disk a chunk at a time (see the module
    docstring: the passes, the memory, what agrees with the in-memory merge).

    Args:
      source: the adapters, from :func:`nu.peft.open_adapters`.
      budget, method, space, allocation, scope, alpha, lam, positive_only, coef, key, weights,
        min_share, **options: as for :func:`nu.merge_adapters` (``weights`` multiply each
        task's ``scale`` in the merge pass; the scores are those of the unweighted tasks, as in
        memory).
      input_moments: as for :func:`nu.merge_adapters` (one entry per task, keyed by
        :attr:`AdapterSet.names`); each chunk is scored with every task's entry restricted to
        the chunk's modules, so the scores are the in-memory data-aware ones.
      interference: as for :func:`nu.merge_adapters`.
      chunk_bytes: every task's factors read at once, in bytes of the compute dtype (a module
        larger than that is read alone).
      on_chunk: called with each chunk's merged modules ``{name: module}``; what it returns is
        kept instead (e.g. dense modules truncated with :func:`nu.to_lora`, so that a dense
        method holds only low-rank results). :attr:`Report.ranks` describes what it returns.
      distributed: split the chunks between the ``jax.process_count()`` processes of a
        ``jax.distributed`` run (every process calls this with the same arguments; see the
        module docstring). False (default), or one process: this process merges everything.
      mesh: a one-axis :class:`jax.sharding.Mesh` of this process's devices
        (:func:`nu.module_mesh`): each chunk's modules are split between them, as
        :func:`nu.merge_adapters`'s ``mesh``. None: one device.
      progress: called as ``progress(done, total)``: once with ``done=0`` before the first
        read, announcing ``total``, the chunk reads planned (this process's chunks times the
        passes that read them: scoring and merging; merging only for ``allocation="all"``;
        model-wide TIES: the common unit, one per 16-bit radix pass, the merge), then once per
        chunk read and scored or merged, ``done`` counting up to ``total`` (a model-wide TIES
        that keeps nothing skips its last reads: one last call then gives ``done=total``).

    Returns:
      ``(merged, Report)``, what :func:`nu.merge_adapters` returns for
      ``nu.peft.load_adapters(source.paths).adapters``: a flat adapter keyed by the module names,
      in :attr:`AdapterSet.names` order. With ``distributed=True``, ``merged`` holds this
      process's modules only, and the report (identical in every process) all of them.

    Raises:
      InputError: as :func:`nu.merge_adapters`; model-wide TIES (``trim_scope="model"``) with
        ``distributed=True`` and several processes (see the module docstring);
        ``chunk_bytes`` not positive; with ``distributed=True``, another process's failure
        (naming that process and its message).
      InputTypeError: as :func:`nu.merge_adapters`; a source that is not an ``AdapterSet``;
        ``distributed`` not a bool.

    Example:
      >>> import pathlib, tempfile
      >>> import numpy as np, netutility_jax as nu
      >>> from netutility_jax.streaming import merge_adapters_streaming
      >>> rng = np.random.default_rng(0)
      >>> tmp = tempfile.TemporaryDirectory()
      >>> paths = [pathlib.Path(tmp.name) / f"task{i}" for i in range(3)]
      >>> for p in paths:
      ...     ad = {f"model.layers.{l}.q_proj": {"lora_a": rng.normal(size=(32, 4)),
      ...           "lora_b": rng.normal(size=(4, 16))} for l in range(4)}
      ...     _ = nu.peft.save_adapter(ad, p)
      >>> out, rep = merge_adapters_streaming(nu.peft.open_adapters(paths), budget=4,
      ...                                     space="core", chunk_bytes=4096)  # a module a chunk
      >>> ref, ref_rep = nu.merge_adapters(nu.peft.load_adapters(paths).adapters, budget=4,
      ...                                  space="core")
      >>> rep.ranks == ref_rep.ranks, rep.budget_spent
      (True, 4.0)
      >>> n = "model.layers.3.q_proj"
      >>> bool(np.allclose(nu.module_update(out[n]), nu.module_update(ref[n]), atol=1e-5))
      True
      >>> tmp.cleanup()
    """
    req = MergeRequest.check(
        "nu.merge_adapters_streaming", budget=budget, method=method, space=space,
        allocation=allocation, scope=scope, alpha=alpha, lam=lam, positive_only=positive_only,
        min_share=min_share, input_moments=input_moments, options=options, weights=weights,
        coef=coef, key=key, interference=interference,
    )  # fmt: skip
    fn, res = req.fn, req.resolved
    _check_source(fn, source, chunk_bytes, on_chunk)
    _check_progress(fn, progress)
    _check_moment_names(fn, input_moments, source)
    req = req.with_tasks(len(source.paths))
    # None: this process's first device, the chunks stacked on the host all the same: one small
    # program per stage and chunk shape, not one traced over every module's leaves
    given = _mesh.check_mesh(fn, mesh)
    mesh = given or _mesh.module_mesh(jax.local_devices()[:1])
    st = _stream(fn, source, chunk_bytes, _exchange.current(fn, distributed), req.weights)
    refuse_model_wide(fn, res, st.ex)
    if progress is not None:
        mine = sum(1 for p in st.owner if p == st.ex.index)
        st = dataclasses.replace(
            st, progress=Progress(progress, mine * reads(allocation, res.model_wide, st.dtype))
        )
        st.progress.start()
    one = merge_one_chunk(st, req, given, on_chunk)  # (a TA merge of one chunk: one program)
    if one is not None:
        return one
    sc, masks, energies = _allocation(st, req, mesh)
    call = {"method": method, "space": space, "coef": coef, "key": key, "options": res.options}
    call["mesh"] = mesh
    if res.model_wide:
        density = res.options["density"]
        merged, kept, ranks, e2, zero = merge_pass_model_wide(
            st, call, masks, on_chunk=on_chunk, density=density
        )
    else:
        merged, kept, ranks, e2, zero = merge_pass(st, call, masks, on_chunk=on_chunk)
    energies = energies or e2  # (the first pass that read everything summed them)
    if st.progress is not None:
        st.progress.finish()
    h = energies.heterogeneity(st.dtype, "nu.heterogeneity", strict=False)  # type: ignore[union-attr]
    zeroed = () if req.zero_merge else tuple(
        n for n in st.source.names if n in zero and np.asarray(kept[n]).any()
    )  # fmt: skip
    warn_zeroed(fn, zeroed, len(st.source.names), method, options)
    return merged, build_report(req, kept, sc, h=h, ranks=ranks, zeroed=zeroed)
