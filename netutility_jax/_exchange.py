"""What the processes of a distributed merge send each other, and how a failure reaches them all.

A merge over several processes (``jax.distributed``: hosts of a GPU or TPU cluster, or processes
on one machine) splits the chunks of modules between the processes (:func:`assign`); each pass
then needs a few small global results: energies, per-direction statistics, ranks. An
:class:`Exchange` all-gathers them as bytes (``multihost_utils.process_allgather`` of ``uint8``
arrays, the one dtype that crosses unchanged whatever ``jax_enable_x64`` says), packed with
:func:`pack` (a JSON header and the raw array bytes: no pickle).

Every exchange carries each process's status. A process whose share raised sends its one-line
message instead of its data; every process then raises (the failing one its own exception, the
others an :class:`InputError` naming the failing process and its message), so no process waits
forever in a collective for one that gave up. One process (``jax.process_count() == 1``, or
:data:`LOCAL`) exchanges nothing: its results are returned as they are.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import _checks
from .errors import InputError, one_line

__all__ = ["LOCAL", "Exchange", "assign", "current", "initialize", "pack", "unpack"]

Arrays = dict[str, np.ndarray]
_STATUS = struct.Struct("<qqq")  # payload bytes, message bytes, failed (0 / 1)
_MESSAGE = 1000  # characters of a failing process's message sent to the others


def pack(arrays: Mapping[str, Any]) -> bytes:
    """``{name: array}`` as bytes: the length of a JSON header ``[[name, dtype, shape], ...]``,
    the header, then each array's bytes in C order (numpy's standard dtypes only)."""
    arrs = {str(k): np.asarray(v) for k, v in arrays.items()}
    for k, a in arrs.items():
        if a.dtype.hasobject or np.dtype(a.dtype.str) != a.dtype:
            raise TypeError(f"pack: {k!r} has dtype {a.dtype}, which does not travel as bytes")
    head = json.dumps([[k, a.dtype.str, list(a.shape)] for k, a in arrs.items()]).encode()
    return b"".join([struct.pack("<Q", len(head)), head, *(a.tobytes() for a in arrs.values())])


def unpack(data: bytes) -> Arrays:
    """The arrays :func:`pack` packed (read-only views of ``data``)."""
    (n,) = struct.unpack_from("<Q", data)
    offset = 8 + n
    out: Arrays = {}
    for name, code, shape in json.loads(data[8:offset]):
        dt, count = np.dtype(code), math.prod(shape)
        out[name] = np.frombuffer(data, dt, count=count, offset=offset).reshape(tuple(shape))
        offset += dt.itemsize * count
    return out


def assign(weights: Sequence[int], count: int) -> tuple[int, ...]:
    """The process of each item (chunk), balancing ``weights`` (bytes): largest first, each to
    the least loaded process (lowest index on ties). Deterministic: every process computes the
    same assignment from the same weights."""
    load = [0] * count
    owner = [0] * len(weights)
    for k in sorted(range(len(weights)), key=lambda k: (-weights[k], k)):
        p = min(range(count), key=lambda p: (load[p], p))
        owner[k] = p
        load[p] += weights[k]
    return tuple(owner)


@dataclasses.dataclass(frozen=True)
class Exchange:
    """This process's place among ``count`` processes, and the exchanges between them."""

    index: int = 0
    count: int = 1

    def allgather(self, fn: str, work: Callable[[], Mapping[str, Any]]) -> list[Arrays]:
        """Every process's ``work()`` (``{name: array}``), in process order.

        ``work`` runs here; if it raises in any process, every process raises (see the module
        docstring) after the exchange, so all of them leave it together. ``fn`` names the caller
        in the others' message.
        """
        if self.count == 1:
            return [dict(work())]
        try:
            data, error = pack(work()), None
        except Exception as e:  # (any failure: the others must hear of it, not wait)
            data, error = b"", e
        message = b"" if error is None else one_line(error, _MESSAGE).encode()
        head = _STATUS.pack(len(data), len(message), error is not None)
        status = [_STATUS.unpack(s) for s in self._bytes(head, _STATUS.size)]
        failed = [p for p, s in enumerate(status) if s[2]]
        if failed:
            texts = self._bytes(message, max(s[1] for s in status))
            if error is not None:
                raise error
            p = failed[0]
            more = f" (and {len(failed) - 1} more processes)" if len(failed) > 1 else ""
            text = texts[p][: status[p][1]].decode(errors="replace")
            raise InputError(f"{fn}: process {p} of {self.count} failed{more}: {text}")
        blobs = self._bytes(data, max(s[0] for s in status))
        return [unpack(b[: s[0]]) for b, s in zip(blobs, status, strict=True)]

    def gather(self, fn: str, batches: Sequence[Mapping[str, Any]]) -> list[Arrays]:
        """Every process's ``batches``, as process 0 receives them (``[]`` in the others): one
        batch of every process per exchange, so the memory held at once is ``count`` batches."""
        counts = self.allgather(fn, lambda: {"n": np.asarray(len(batches), np.int64)})
        out: list[Arrays] = []
        for i in range(max(int(c["n"]) for c in counts)):
            got = self.allgather(fn, lambda i=i: batches[i] if i < len(batches) else {})
            if self.index == 0:
                out.extend(got)
        return out

    def check(self, fn: str, work: Callable[[], Any]) -> Any:
        """``work()``'s result, after every process has finished its own ``work`` (a barrier
        that also shares failures)."""
        result: list[Any] = []

        def run() -> Arrays:
            result.append(work())
            return {}

        self.allgather(fn, run)
        return result[0]

    def _bytes(self, data: bytes, size: int) -> list[bytes]:
        """Each process's ``data``, every one at most ``size`` bytes (zero-padded to it)."""
        from jax.experimental import multihost_utils

        buf = np.frombuffer(data.ljust(max(size, 1), b"\0"), np.uint8)
        return [row.tobytes() for row in multihost_utils.process_allgather(buf)]


LOCAL = Exchange()
"""One process: nothing is exchanged."""


def current(fn: str, distributed: Any) -> Exchange:
    """:data:`LOCAL`, or this process's place among ``jax.process_count()`` (``distributed``)."""
    if not _checks.check_bool(fn, "distributed", distributed):
        return LOCAL
    import jax

    return Exchange(jax.process_index(), jax.process_count())


def initialize(
    fn: str,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> Exchange:
    """``jax.distributed.initialize`` (before any JAX computation); what is not given is
    detected on SLURM, Open MPI and TPU pods. Failures are :class:`InputError`\\ s that say
    what to pass."""
    import jax

    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
        )
    except (ValueError, TypeError, RuntimeError) as e:
        raise InputError(
            f"{fn}: cannot join the distributed run ({one_line(e, 300)}); outside a SLURM, Open "
            "MPI or TPU-pod job, give the coordinator address, the number of processes and this "
            "process's index (CLI: --coordinator HOST:PORT --num-processes N --process-id I)."
        ) from e
    return Exchange(jax.process_index(), jax.process_count())
