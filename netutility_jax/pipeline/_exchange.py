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
import inspect
import ipaddress
import json
import math
import os
import re
import socket
import struct
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._core import checks as _checks
from ..errors import InputError, PeerLostError, one_line

__all__ = [
    "DEFAULT_HEARTBEAT_S",
    "DEFAULT_TIMEOUT_S",
    "LOCAL",
    "Exchange",
    "assign",
    "check_coordinator",
    "current",
    "initialize",
    "pack",
    "unpack",
]

Arrays = dict[str, np.ndarray]
_STATUS = struct.Struct("<qqq")  # payload bytes, message bytes, failed (0 / 1)
_MESSAGE = 1000  # characters of a failing process's message sent to the others
#: A collective's errors when a peer is gone: Gloo's closed or reset connections, the
#: coordination service's heartbeat and barrier failures.
_PEER_LOST = re.compile(
    r"Gloo|Connection (closed|reset) by peer|heartbeat timeout|UNAVAILABLE|DEADLINE_EXCEEDED"
)


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
        status = [_STATUS.unpack(s) for s in self._bytes(fn, head, _STATUS.size)]
        failed = [p for p, s in enumerate(status) if s[2]]
        if failed:
            texts = self._bytes(fn, message, max(s[1] for s in status))
            if error is not None:
                raise error
            p = failed[0]
            more = f" (and {len(failed) - 1} more processes)" if len(failed) > 1 else ""
            text = texts[p][: status[p][1]].decode(errors="replace")
            raise InputError(f"{fn}: process {p} of {self.count} failed{more}: {text}")
        blobs = self._bytes(fn, data, max(s[0] for s in status))
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

    def agree(self, fn: str, facts: Mapping[str, str]) -> None:
        """Check that every process has the same ``facts`` (``{what: value}``: the library
        version, the options, each adapter's path and content digest), before any work.

        Raises :class:`InputError` in every process, naming the first fact that differs, the
        processes and their values, so processes given different inputs never merge a mix of
        them. (One process: nothing to compare.)
        """
        if self.count == 1:
            return
        mine = json.dumps(dict(facts), sort_keys=True).encode()
        got = self.allgather(fn, lambda: {"facts": np.frombuffer(mine, np.uint8)})
        every = [json.loads(g["facts"].tobytes()) for g in got]
        for what in sorted(set().union(*every), key=lambda w: (w not in facts, w)):
            values = [f.get(what) for f in every]
            if len(set(map(str, values))) > 1:
                # the processes by value, process 0's first
                groups: dict[str, list[int]] = {}
                for p, v in enumerate(values):
                    groups.setdefault("(missing)" if v is None else str(v), []).append(p)
                shown = "; ".join(f"{_processes(ps)}: {_short(v)}" for v, ps in groups.items())
                raise InputError(
                    f"{fn}: the {self.count} processes were given different {what} ({shown}); "
                    "run the same command, on the same adapters, in every process."
                )

    def _bytes(self, fn: str, data: bytes, size: int) -> list[bytes]:
        """Each process's ``data``, every one at most ``size`` bytes (zero-padded to it). A
        process that stopped mid-exchange is :class:`PeerLostError` (the collective's own error
        is a Gloo or coordination-service message)."""
        from jax.experimental import multihost_utils

        buf = np.frombuffer(data.ljust(max(size, 1), b"\0"), np.uint8)
        try:
            rows = multihost_utils.process_allgather(buf)
        except Exception as e:
            if not _PEER_LOST.search(str(e)):
                raise
            raise PeerLostError(
                f"{fn}: another process of the distributed run ({self.count} processes) stopped "
                "during an exchange (killed, out of memory or crashed; see its own output): "
                f"{one_line(e, 200)}"
            ) from e
        return [row.tobytes() for row in rows]


def _processes(ps: Sequence[int]) -> str:
    return f"process {ps[0]}" if len(ps) == 1 else "processes " + ", ".join(map(str, ps))


def _short(v: str, n: int = 120) -> str:
    return v if len(v) <= n else v[: n - 3] + "..."


LOCAL = Exchange()
"""One process: nothing is exchanged."""


def current(fn: str, distributed: Any) -> Exchange:
    """:data:`LOCAL`, or this process's place among ``jax.process_count()`` (``distributed``)."""
    if not _checks.check_bool(fn, "distributed", distributed):
        return LOCAL
    import jax

    return Exchange(jax.process_index(), jax.process_count())


DEFAULT_TIMEOUT_S = 120
#: Seconds without a heartbeat after which a joined process is declared dead (JAX's default).
DEFAULT_HEARTBEAT_S = 100
"""Seconds a process waits for all the others to join (``--distributed-timeout``)."""


def check_coordinator(fn: str, address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for an IPv6 address) checked before joining: the port in
    1..65535 and the host resolvable. Returns ``(host, port)``; :class:`InputError` otherwise."""
    text = str(address)
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            host = ""
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(
            f"{fn}: the coordinator address must be HOST:PORT with a port in 1..65535 "
            f"([ADDRESS]:PORT for IPv6), got {text!r}"
        )
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise InputError(
            f"{fn}: the coordinator host {host!r} cannot be resolved here ({one_line(e, 120)}); "
            "give process 0's host name or IP address."
        ) from e
    return host, int(port)


def initialize(
    fn: str,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    on_timeout: Callable[[str], Any] | None = None,
) -> Exchange:
    """``jax.distributed.initialize`` (before any JAX computation); what is not given is
    detected on SLURM, Open MPI and TPU pods. Failures are :class:`InputError`\\ s that say
    what to pass.

    The address and indices are checked before connecting. JAX ends a process that cannot
    join with a fatal C++ error (after its own timeout); instead, a process that has not joined
    after ``timeout_s`` seconds calls ``on_timeout(message)`` (the command prints the one-line
    message and exits with status 2), or, without ``on_timeout``, writes the message to stderr
    and exits with status 2: JAX's connection cannot be abandoned from Python, so the process
    cannot go on either way. Once joined, a process that sends no heartbeat for ``heartbeat_s``
    seconds is declared dead and JAX ends every other process (``netutility merge`` turns that
    into one line, :mod:`._supervise`).
    """
    import jax

    for name, v in (("timeout_s", timeout_s), ("heartbeat_s", heartbeat_s)):
        if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
            raise InputError(f"{fn}: {name} must be a positive number of seconds, got {v!r}")
    extra = {}
    if "heartbeat_timeout_seconds" in inspect.signature(jax.distributed.initialize).parameters:
        extra["heartbeat_timeout_seconds"] = math.ceil(heartbeat_s)
    elif heartbeat_s != DEFAULT_HEARTBEAT_S:
        raise InputError(
            f"{fn}: a heartbeat timeout other than {DEFAULT_HEARTBEAT_S} s needs a JAX whose "
            f"jax.distributed.initialize takes heartbeat_timeout_seconds (this is {jax.__version__})"
        )
    if coordinator is not None:
        check_coordinator(fn, coordinator)
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise InputError(
            f"{fn}: process index {process_id} is out of range for {num_processes} processes "
            f"(indices run from 0 to {num_processes - 1})"
        )
    message = (
        f"{fn}: the {num_processes or 'expected'} processes did not all join within "
        f"{timeout_s:g} s (coordinator {coordinator or 'auto-detected'}"
        f"{'' if process_id is None else f', this is process {process_id}'}): check that every "
        "process was started with the same coordinator address and number of processes and a "
        "distinct index, that the port is free on process 0's host and reachable from the "
        "others, or allow longer (--distributed-timeout)."
    )
    watchdog = threading.Timer(timeout_s, _give_up, args=(message, on_timeout))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            # JAX's own deadline (a fatal error) only after the watchdog's
            initialization_timeout=math.ceil(timeout_s) + 60,
            **extra,
        )
    except (ValueError, TypeError, RuntimeError) as e:
        raise InputError(
            f"{fn}: cannot join the distributed run ({one_line(e, 300)}); outside a SLURM, Open "
            "MPI or TPU-pod job, give the coordinator address, the number of processes and this "
            "process's index (CLI: --coordinator HOST:PORT --num-processes N --process-id I)."
        ) from e
    finally:
        watchdog.cancel()
    return Exchange(jax.process_index(), jax.process_count())


def _give_up(message: str, on_timeout: Callable[[str], Any] | None) -> None:
    """The watchdog of :func:`initialize`: report and end this process (status 2)."""
    try:
        if on_timeout is not None:
            on_timeout(message)
        else:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
    finally:
        os._exit(2)
