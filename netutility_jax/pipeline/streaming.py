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
(:func:`_release_heap`); each merged module is kept in an array of its own size (not a view of
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

import ctypes
import dataclasses
import functools
import numbers
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import registry
from .._core import buckets as _buckets
from .._core import checks as _checks
from .._core import mesh as _mesh
from .._core import tree as _tree
from .._core.executables import kernel, release
from .._core.host import host_constant
from ..errors import InputError, InputTypeError
from ..operators import _plan, _results, ta
from ..operators._ties_model import ties_model_streamed
from ..scoring import _run as _scoring
from ..scoring import utility
from ..scoring.moments import check_entries
from . import _exchange, merging
from ._report import Report, build_report, ranks_of, warn_zeroed, zeroed_modules
from ._request import MergeRequest, all_candidates

if TYPE_CHECKING:  # the peft package is imported on first use (nu.peft), not by the core
    from ..peft._lazy import AdapterSet

__all__ = ["CHUNK_BYTES", "bound_heap", "merge_adapters_streaming", "plan_chunks"]

CHUNK_BYTES = 64 << 20  # every task's factors of one chunk, in the compute dtype


def plan_chunks(
    shapes: Mapping[str, tuple[int, int, int]], m_tasks: int, *, chunk_bytes: int, itemsize: int
) -> list[tuple[str, ...]]:
    """The chunks of a streamed merge: module names grouped by ``(d_in, d_out, r_max)`` (groups
    in order of first appearance, names in their order). A group whose stacked factors (``M
    r_max (d_in + d_out) itemsize`` bytes per module) exceed ``chunk_bytes`` is cut into runs of
    equal length that fit: :func:`_buckets.split_bucket`'s rule (one length per group, so one
    compiled shape), or one module where a single module is larger. Consecutive groups that fit
    whole share a chunk while their sum fits: a small set is one chunk, scored and merged by one
    program per pass (the in-memory engine's), not one per shape."""
    groups: dict[tuple[int, int, int], list[str]] = {}
    for name, shape in shapes.items():
        groups.setdefault(tuple(shape), []).append(name)
    chunks: list[tuple[str, ...]] = []
    packed: list[str] = []  # whole groups gathered into the chunk being filled
    packed_bytes = 0
    for (d_in, d_out, r_max), names in groups.items():
        # a bucket of shapes only: split_bucket reads the names, shapes and task count
        shell = _tree.Bucket(tuple(names), d_in, d_out, r_max, ((None,) * m_tasks,) * len(names))
        pieces = _buckets.split_bucket(shell, chunk_bytes, itemsize)
        size = len(names) * m_tasks * r_max * (d_in + d_out) * itemsize
        if len(pieces) == 1 and size <= chunk_bytes:
            if packed and packed_bytes + size > chunk_bytes:
                chunks.append(tuple(packed))
                packed, packed_bytes = [], 0
            packed += names
            packed_bytes += size
            continue
        if packed:
            chunks.append(tuple(packed))
            packed, packed_bytes = [], 0
        chunks.extend(p.names for p in pieces)
    if packed:
        chunks.append(tuple(packed))
    return chunks


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS, Windows)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


@functools.cache
def bound_heap() -> None:
    """Opt-in, for a process that streams large merges: glibc's allocation thresholds fixed,
    once per process. :func:`nu.merge_adapters_streaming` never calls it (a library does not
    change the allocator of the process it runs in); ``netutility merge`` does, before it
    streams. Blocks of 1 MiB or more (a chunk's
    factors, its stacks, XLA's buffers) mapped on their own and unmapped when freed, and free
    space over 1 MiB at the top of a heap returned as it is freed. By default both thresholds
    grow with the largest block freed (up to 32 and 64 MiB), and the tops of the heaps that
    XLA's threads allocate from are not returned by ``malloc_trim`` at all: freed, a chunk's
    memory stayed resident (on a Llama-3-70B-shaped set of 20 tasks, 32 layers: the peak fell
    from 987 to 766 MiB with this). The settings stay for the rest of the process (glibc cannot
    go back to its adaptive thresholds); large allocations elsewhere are then mapped and
    unmapped on their own too. Elsewhere (musl, macOS, Windows) nothing."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD


def _release_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim(0)``; elsewhere nothing),
    once a chunk is dropped. A chunk's factors are many arrays of about a megabyte, which glibc
    serves from its heaps once its mmap threshold has risen past them (it does on the first
    free of such a block), and XLA's threads allocate from arenas of their own: freed, those
    pages stay in the process (on the Llama-3-8B-shaped set of 16 tasks, 256 MiB chunks: 1.2 GB
    resident once the merge had returned, 0.8 GB when released chunk by chunk, the 0.17 GB
    result held in both). A few milliseconds a chunk."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@dataclasses.dataclass
class _Energies:
    """Per-task energies summed over chunks, each chunk's as ``t 2^k`` (``utility``'s form),
    kept by chunk index so that every process sums them in the same order as one process."""

    parts: dict[int, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    failed: bool = False

    def add(self, chunk: int, adapters: Sequence[Any], fn: str, *, strict: bool) -> None:
        try:
            k, t, _ = _scoring.log_energies(adapters, fn, False, stacked=True)
        except ValueError:
            if strict:
                raise
            self.failed = True  # as nu.merge_adapters' report: h is then NaN
            return
        self.parts[chunk] = (np.asarray(k, np.int64), np.asarray(t, np.float64))

    def arrays(self) -> dict[str, np.ndarray]:
        """The parts as arrays for :meth:`Exchange.allgather` (:meth:`gathered` reads them)."""
        out = {"e/failed": np.asarray(self.failed)}
        for c, (k, t) in self.parts.items():
            out[f"e/k/{c}"], out[f"e/t/{c}"] = k, t
        return out

    @classmethod
    def gathered(cls, shared: Sequence[Mapping[str, np.ndarray]]) -> _Energies:
        """Every process's parts, from their :meth:`arrays`."""
        out = cls()
        for arrays in shared:
            out.failed |= bool(arrays.get("e/failed", False))
            for name, k in arrays.items():
                if name.startswith("e/k/"):
                    c = int(name[4:])
                    out.parts[c] = (k, arrays[f"e/t/{c}"])
        return out

    def heterogeneity(self, dtype: Any, fn: str, *, strict: bool) -> float:
        """``h = Var_i log ||dW_i||_F^2`` (paper Eq. h), as :func:`nu.heterogeneity` computes
        it; a task zero everywhere raises (``strict``) or gives NaN."""
        if self.failed:
            return float("nan")
        # each chunk's (k, t) is a (mantissa, exponent) pair like a module's: summed the same way
        kmax, total = _scoring.sum_energies(
            [(self.parts[c][1][None], self.parts[c][0][None]) for c in sorted(self.parts)],
            len(next(iter(self.parts.values()))[0]),
        )
        zero = np.flatnonzero(total <= 0)
        if zero.size:
            if not strict:
                return float("nan")
            i = int(zero[0])  # (word for word nu.score's refusal, as in memory)
            err = InputError(
                f"{fn}: alpha='auto' applies the heterogeneity rule, which needs every task's "
                f"log-energy, but task {i} (adapters[{i}]) has a zero update in every module. "
                "Drop that adapter, or pass a number for alpha= (1.0 Gram geometry, 0.0 row "
                "space)."
            )
            err.task_index, err.argument = i, "alpha"
            raise err
        # (converted on the host, exactly as XLA would: no conversion programs to load; each
        # operation its own kept program, as eagerly: fused, XLA rounds some h differently)
        rel = _add(host_constant(kmax - kmax[0], dtype), _log2(host_constant(total, dtype)))
        return float(_var(_multiply(rel, np.log(2.0).astype(dtype))))


@dataclasses.dataclass
class _Progress:
    """``merge_adapters_streaming``'s ``progress`` callback and its count: ``total`` chunk reads
    planned (this process's chunks times the passes that read them), ``done`` so far."""

    report: Callable[[int, int], None]
    total: int
    done: int = 0

    def start(self) -> None:
        self.report(0, self.total)

    def tick(self) -> None:
        self.done += 1
        self.report(self.done, self.total)

    def finish(self) -> None:
        """A search that stopped early (model-wide TIES keeping nothing) skips its last reads:
        the count jumps to the total, in one call."""
        if self.done < self.total:
            self.done = self.total
            self.report(self.done, self.total)


def _reads(allocation: str, model_wide: bool, dtype: Any) -> int:
    """How many times a streamed merge reads each chunk: the scoring pass (none for
    ``allocation="all"``), then the merge pass; model-wide TIES reads every chunk for the common
    unit, once per 16-bit radix pass of the magnitudes' bit patterns, and to merge
    (:func:`_ties_model.ties_model_streamed`)."""
    merge = 2 + np.dtype(dtype).itemsize * 8 // 16 if model_wide else 1
    return (0 if allocation == "all" else 1) + merge


@dataclasses.dataclass(frozen=True)
class _Stream:
    """What every pass shares: the source, its chunks, the merge's compute dtype, and the
    processes: ``owner[k]`` reads chunk ``k`` (all 0 with one process); ``weights``: the tasks'
    weights, which the merge pass applies to each chunk (:meth:`weighted`; None: none)."""

    fn: str
    source: AdapterSet
    chunks: tuple[tuple[str, ...], ...]
    dtype: np.dtype
    ex: _exchange.Exchange
    owner: tuple[int, ...]
    weights: tuple[float, ...] | None = None
    progress: _Progress | None = None
    release_programs: bool = True  # drop each shape's compiled programs after its last chunk

    def names_of(self, p: int) -> list[str]:
        """Process ``p``'s modules, in :attr:`AdapterSet.names` order."""
        mine = {n for k, names in enumerate(self.chunks) if self.owner[k] == p for n in names}
        return [n for n in self.source.names if n in mine]

    def read(self) -> Iterator[tuple[int, tuple[str, ...], list[dict[str, Any]]]]:
        """``(chunk index, names, adapters)`` of each of this process's chunks, read from disk,
        in the compute dtype (float32 factors become float64 when another task's are float64
        and x64 is on, as in memory)."""
        mine = [k for k in range(len(self.chunks)) if self.owner[k] == self.ex.index]
        for i, k in enumerate(mine):
            names = self.chunks[k]
            adapters = self.source.read(names, host=True)  # stacked on the host (_mesh)
            if self.dtype == np.float64:
                adapters = [{n: _as(m, self.dtype) for n, m in ad.items()} for ad in adapters]
            yield k, names, adapters
            # (the caller asks for the next: this one is done, and the caller has dropped it)
            del adapters
            if self.release_programs and (
                i + 1 == len(mine) or self._shape(mine[i + 1]) != self._shape(k)
            ):
                # the last chunk of its shape in this read: its compiled programs are done with
                # (chunks of one shape are consecutive), dropped rather than held to the end
                release()
            _release_heap()
            if self.progress is not None:
                self.progress.tick()

    def _shape(self, k: int) -> tuple[Any, int]:
        """What chunk ``k``'s compiled programs are specific to: its modules' shape, their count."""
        names = self.chunks[k]
        return tuple(self.source.shapes[names[0]]), len(names)

    def weighted(self, adapters: list[dict[str, Any]]) -> list[Any]:
        """A chunk's adapters with the tasks' weights applied (the merge pass's input; the
        scores and the kept candidates are those of the unweighted tasks, as in memory)."""
        return merging.weight_adapters(adapters, self.weights)


def _as(m: dict[str, Any] | None, dtype: Any) -> dict[str, Any] | None:
    if m is None:
        return None
    return {
        **m,
        "lora_a": np.asarray(m["lora_a"], dtype),
        "lora_b": np.asarray(m["lora_b"], dtype),
    }


# The heterogeneity's operations, one program each as jnp runs them eagerly (the same programs,
# so the same h), kept whole (:mod:`._executables`): not traced and lowered in every process.
_log2 = kernel(jnp.log2)
_add = kernel(jnp.add)
_multiply = kernel(jnp.multiply)
_var = kernel(jnp.var)


@kernel
def _utility(s: utility.ModuleScores, lam: jax.Array) -> jax.Array:
    """``benefit - lam * interference`` on candidates (where the ``lam=0`` utility is finite),
    ``-inf`` elsewhere: :func:`nu.score`'s expression, for one module (one program per module
    shape; one traced over every module's leaves took 0.2 s to trace in every process)."""
    return jnp.where(s.utility > -jnp.inf, s.benefit - lam * s.interference, -jnp.inf)


# one program, where its dozen eager operations were a program each, traced and loaded again in
# every process (the same operations: elementwise selections, medians and one division, so the
# same bits)
_lam_auto = kernel(utility.lam_auto)


def _utilities(stats: dict[str, utility.ModuleScores], lam: jax.Array) -> dict[str, jax.Array]:
    """:func:`_utility` of every module."""
    return {n: _utility(s, lam) for n, s in stats.items()}


def _global_scores(
    fn: str, stats: dict[str, utility.ModuleScores], lam: Any, alpha: float, dtype: Any
) -> utility.Scores:
    """The whole model's :class:`nu.Scores` from the chunks' ``lam=0`` statistics and ``lam``
    (``"auto"``: the median ratio over every candidate, :func:`utility.lam_auto`)."""
    if not isinstance(lam, str):
        return utility.Scores(stats, host_constant(lam, dtype), host_constant(alpha, dtype))
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
    return utility.Scores(modules, lam_v, host_constant(alpha, dtype))


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
    st: _Stream,
    *,
    alpha: float | str,
    lam: Any,
    mesh: Any = None,
    input_moments: Any = None,
    interference: str = "overlap",
) -> tuple[dict[str, utility.ModuleScores], float, _Energies]:
    """Pass 1: ``(stats, alpha, energies)``: every module's scores with ``lam=0`` (``lam`` if a
    number; :func:`nu.score`'s checks and messages), every process's after the exchange (each
    module's four statistics stacked, ``(4, M, r_max)``), and the tasks' energies, from the
    scoring kernel's Grams. ``alpha="auto"``: each chunk is scored for both geometries from one
    decomposition (only the weighting of the overlaps differs), then ``h`` (from the energies)
    picks one; results beyond the compute dtype are refused only for that one, as in memory."""
    auto = isinstance(alpha, str)
    alphas = (0.0, 1.0) if auto else (float(alpha),)
    lam_k = 0.0 if isinstance(lam, str) else lam
    mine = _Energies()
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
    energies = _Energies.gathered(shared)
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


def _agree(st: _Stream, sc: utility.Scores, masks: Mapping[str, Any]) -> None:
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


def _merge_chunk(
    st: _Stream, call: Mapping[str, Any], names, adapters, masks, index, on_chunk, zero: set
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


def _all_kept(fn: str, k: int, names, adapters, kept: dict, energies: _Energies) -> None:
    """``masks=None`` (every candidate kept): the chunk's kept masks and task energies, which
    the merge pass is then the first to read."""
    _, buckets, _ = _tree.collect(adapters, fn=fn)
    kept.update(all_candidates(fn, list(names), buckets))
    energies.add(k, adapters, "nu.heterogeneity", strict=False)


def _merge_pass(
    st: _Stream,
    call: Mapping[str, Any],
    masks: Mapping[str, Any] | None,
    *,
    on_chunk: Callable[[dict[str, Any]], Mapping[str, Any]] | None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, int | None], _Energies | None, set[str]]:
    """Pass 2: ``(merged, kept masks, ranks, energies, zero)`` chunk by chunk: this process's
    merged modules; every module's kept masks (``masks=None`` keeps every candidate: the kept
    masks are then computed here, as :func:`nu.merge_adapters` does, and exchanged) and merged
    rank; the energies (only for ``masks=None``); every module whose merged update is zero."""
    fn, names_all = st.fn, st.source.names
    index = {n: i for i, n in enumerate(names_all)}
    merged: dict[str, Any] = {}
    kept: dict[str, Any] = {}
    zero: set[str] = set()
    mine = _Energies()

    def work() -> dict[str, Any]:
        for k, names, adapters in st.read():
            if masks is None:
                _all_kept(fn, k, names, adapters, kept, mine)
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
        None if masks is not None else _Energies.gathered(shared),
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


def _refuse_model_wide(fn: str, res: registry.Resolved, ex: _exchange.Exchange) -> None:
    if res.model_wide and ex.count > 1:
        opt, value = res.spec.model_wide
        raise InputError(
            f"{fn}: method={res.spec.name!r} with {opt}={value!r} keeps each task's largest "
            "entries over the whole model; streamed, that threshold is found by one process, "
            f"not split between {ex.count} processes. Run it in one process (without "
            f"distributed=True / --distributed), or use {opt}='module'."
        )


def _merge_pass_model_wide(
    st: _Stream,
    call: Mapping[str, Any],
    masks: Mapping[str, Any] | None,
    *,
    on_chunk: Callable[[dict[str, Any]], Mapping[str, Any]] | None,
    density: float,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, int | None], _Energies | None, set[str]]:
    """:func:`_merge_pass` for model-wide TIES (one process): every chunk read once for the
    common unit, once per radix pass and once to merge (:func:`_ties_model.ties_model_streamed`);
    the kept masks and energies of ``masks=None`` come from the first read."""
    st = dataclasses.replace(st, release_programs=False)  # (each chunk is read in several passes)
    fn, names_all = st.fn, st.source.names
    index = {n: i for i, n in enumerate(names_all)}
    merged: dict[str, Any] = {}
    kept: dict[str, Any] = {}
    zero: set[str] = set()
    mine = _Energies()
    reads = [0]
    mant, exp2 = merging.coef_split(call["coef"], st.dtype)

    def plans() -> Iterator[tuple[_plan.MergePlan, Callable[[dict[str, Any]], None]]]:
        first = reads[0] == 0
        reads[0] += 1
        for k, names, adapters in st.read():
            if masks is None and first:
                _all_kept(fn, k, names, adapters, kept, mine)
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


def _stream(
    fn: str,
    source: AdapterSet,
    chunk_bytes: int,
    ex: _exchange.Exchange,
    weights: tuple[float, ...] | None = None,
) -> _Stream:
    codes = source.stored_dtypes
    dtype = _tree.float_dtype(*(np.float64 if c == "F64" else np.float32 for c in codes))
    m_tasks = len(source.paths)
    chunks = plan_chunks(source.shapes, m_tasks, chunk_bytes=chunk_bytes, itemsize=dtype.itemsize)
    sizes = []
    for names in chunks:
        d_in, d_out, r_max = source.shapes[names[0]]
        sizes.append(len(names) * m_tasks * r_max * (d_in + d_out))
    owner = _exchange.assign(sizes, ex.count)
    return _Stream(fn, source, tuple(chunks), dtype, ex, owner, weights)


def _allocation(
    st: _Stream, req: MergeRequest, mesh: Any
) -> tuple[utility.Scores | None, dict[str, Any] | None, _Energies | None]:
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


def _kept_pass(st: _Stream) -> tuple[dict[str, Any], _Energies]:
    """Every candidate of every module (``allocation="all"``) and the tasks' energies, read a
    chunk at a time (one process): what the merge pass computes on its way, for a plan."""
    kept: dict[str, Any] = {}
    energies = _Energies()
    for k, names, adapters in st.read():
        _all_kept(st.fn, k, names, adapters, kept, energies)
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
    mesh = _mesh.check_mesh(fn, mesh) or _mesh.module_mesh(jax.local_devices()[:1])
    st = _stream(fn, source, chunk_bytes, _exchange.current(fn, distributed), req.weights)
    _refuse_model_wide(fn, res, st.ex)
    if progress is not None:
        mine = sum(1 for p in st.owner if p == st.ex.index)
        st = dataclasses.replace(
            st, progress=_Progress(progress, mine * _reads(allocation, res.model_wide, st.dtype))
        )
        st.progress.start()
    sc, masks, energies = _allocation(st, req, mesh)
    call = {"method": method, "space": space, "coef": coef, "key": key, "options": res.options}
    call["mesh"] = mesh
    if res.model_wide:
        density = res.options["density"]
        merged, kept, ranks, e2, zero = _merge_pass_model_wide(
            st, call, masks, on_chunk=on_chunk, density=density
        )
    else:
        merged, kept, ranks, e2, zero = _merge_pass(st, call, masks, on_chunk=on_chunk)
    energies = energies or e2  # (the first pass that read everything summed them)
    if st.progress is not None:
        st.progress.finish()
    h = energies.heterogeneity(st.dtype, "nu.heterogeneity", strict=False)  # type: ignore[union-attr]
    zeroed = () if req.zero_merge else tuple(
        n for n in st.source.names if n in zero and np.asarray(kept[n]).any()
    )  # fmt: skip
    warn_zeroed(fn, zeroed, len(st.source.names), method, options)
    return merged, build_report(req, kept, sc, h=h, ranks=ranks, zeroed=zeroed)
