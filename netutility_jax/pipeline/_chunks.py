"""The streamed merge's chunks and what its passes share: the chunk plan (:func:`plan_chunks`),
the heap's release between chunks, the per-task energies summed chunk by chunk, the progress
count, and :class:`Stream` (the source, its chunks and which process reads each)."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._core import buckets as _buckets
from .._core import executables as _executables
from .._core import tree as _tree
from .._core.host import host_constant
from ..errors import InputError
from ..scoring import _run as _scoring
from . import _exchange, merging

__all__ = [
    "CHUNK_BYTES",
    "Energies",
    "Progress",
    "Stream",
    "as_dtype",
    "bound_heap",
    "plan_chunks",
    "reads",
    "release_heap",
]

if TYPE_CHECKING:  # the peft package is imported on first use (nu.peft), not by the core
    from ..peft._lazy import AdapterSet

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


def release_heap() -> None:
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


def as_dtype(m: dict[str, Any] | None, dtype: Any) -> dict[str, Any] | None:
    if m is None:
        return None
    return {
        **m,
        "lora_a": np.asarray(m["lora_a"], dtype),
        "lora_b": np.asarray(m["lora_b"], dtype),
    }


@dataclasses.dataclass
class Energies:
    """Per-task energies summed over chunks, each chunk's as ``t 2^k`` (``utility``'s form),
    kept by chunk index so that every process sums them in the same order as one process."""

    parts: dict[int, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    failed: bool = False
    # h by (dtype, chunks summed): the scoring pass's h and the report's are one value, computed
    # once (the merge pass drops the kernels' programs, which would trace h's again)
    _h: dict[tuple[str, tuple[int, ...]], float] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )

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
    def gathered(cls, shared: Sequence[Mapping[str, np.ndarray]]) -> Energies:
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
        # (the total converted on the host, exactly as XLA would: no conversion program; then
        # nu.heterogeneity's own program, so the same h as in memory)
        key = (np.dtype(dtype).str, tuple(sorted(self.parts)))
        if key not in self._h:
            k = np.asarray(kmax - kmax[0], np.int32)
            self._h[key] = float(_scoring.log_energy_variance(k, host_constant(total, dtype)))
        return self._h[key]


@dataclasses.dataclass
class Progress:
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


def reads(allocation: str, model_wide: bool, dtype: Any) -> int:
    """How many times a streamed merge reads each chunk: the scoring pass (none for
    ``allocation="all"``), then the merge pass; model-wide TIES reads every chunk for the common
    unit, once per 16-bit radix pass of the magnitudes' bit patterns, and to merge
    (:func:`_ties_model.ties_model_streamed`)."""
    merge = 2 + np.dtype(dtype).itemsize * 8 // 16 if model_wide else 1
    return (0 if allocation == "all" else 1) + merge


@dataclasses.dataclass(frozen=True)
class Stream:
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
    progress: Progress | None = None
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
                adapters = [{n: as_dtype(m, self.dtype) for n, m in ad.items()} for ad in adapters]
            yield k, names, adapters
            # (the caller asks for the next: this one is done, and the caller has dropped it)
            del adapters
            if self.release_programs and (
                i + 1 == len(mine) or self._shape(mine[i + 1]) != self._shape(k)
            ):
                # the last chunk of its shape in this read: its compiled programs are done with
                # (chunks of one shape are consecutive), dropped rather than held to the end
                _executables.release()
            release_heap()
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
