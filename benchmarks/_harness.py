"""What every benchmark here repeats, written once: timing, memory, machine and code info, JSON, and
one fresh interpreter per case.

* Timing: :class:`Stopwatch` (laps that end when their value is ready, ``jax.block_until_ready``),
  :func:`timed` (one blocked call) and :func:`measure`: a first call (trace, compile, run), warm-up
  calls, then ``repeats`` steady calls interleaved, repetition by repetition, with reference calls
  (the irreducible work) so that load from other processes hits both alike. A :class:`Series`
  gives the steady median and minimum and the compile estimate (first call minus steady median).
* Memory (Linux ``/proc``): current RSS (``VmRSS``), its high-water mark (``VmHWM``, resettable
  through ``/proc/self/clear_refs``), the process's peak RSS (``resource.getrusage``), returning
  freed heap memory to the OS (``malloc_trim``), and the working memory of one call
  (:func:`working_memory`).
* Provenance: :func:`machine_info` (jax and jaxlib versions, backend, devices, CPUs, platform,
  memory, ``XLA_FLAGS``, load average, date) and :func:`code_info` (git HEAD, uncommitted files, a
  hash of the package sources: the library is measured as it is on disk).
* Output: :func:`write_json`, atomic (``netutility_jax._core.io``), partial results included.
* Isolation: :func:`run_worker` runs one case in a fresh interpreter (cold compile caches, its own
  peak RSS), with a wall-clock limit, and reads back the JSON record the case wrote;
  :func:`watchdog` ends a process whose call makes no progress (a hung XLA computation cannot be
  interrupted from Python) after dumping every thread's traceback.

The scripts put their checkout's root first on ``sys.path`` before importing this module, so that a
second worktree measures its own code (and so do its case subprocesses: they run the same script).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from netutility_jax._core import io as _io

__all__ = [
    "Measurement",
    "Series",
    "Stopwatch",
    "WorkerResult",
    "adapter_bytes",
    "code_info",
    "hwm_mb",
    "load_average",
    "machine_info",
    "measure",
    "peak_rss_mb",
    "reset_peak",
    "rss_mb",
    "run_worker",
    "timed",
    "trim_heap",
    "watchdog",
    "working_memory",
    "write_json",
]

# ----------------------------------------------------------------------------- timing


class Stopwatch:
    """Wall-clock laps from its creation, each ending when its value is ready.

    ``sw.lap(value)`` blocks on every array of ``value`` (``jax.block_until_ready``; other leaves
    pass through), records the time since the previous lap and returns ``value``.
    """

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.laps: list[float] = []

    def lap(self, value: Any) -> Any:
        jax.block_until_ready(value)
        now = time.perf_counter()
        self.laps.append(now - self.last)
        self.last = now
        return value

    @property
    def total(self) -> float:
        """Seconds from the start to the end of the last lap."""
        return self.last - self.start


def timed(fn: Callable[..., Any], *, laps: bool = False) -> tuple[Any, Stopwatch]:
    """One call of ``fn``, blocked on its output: ``(output, stopwatch)``.

    With ``laps``, ``fn`` receives the stopwatch and may lap intermediate results itself
    (``scores = sw.lap(score(...))``); its output ends the last lap.
    """
    sw = Stopwatch()
    out = sw.lap(fn(sw) if laps else fn())
    return out, sw


@dataclasses.dataclass
class Series:
    """The times of one callable: its first call and its steady (timed, post-warm-up) calls.

    ``laps`` holds each steady call's laps when the callable laps a stopwatch (see :func:`timed`).
    """

    first_s: float | None = None
    all_s: list[float] = dataclasses.field(default_factory=list)
    first_laps: list[float] = dataclasses.field(default_factory=list)
    laps: list[list[float]] = dataclasses.field(default_factory=list)

    def add(self, sw: Stopwatch) -> None:
        self.all_s.append(sw.total)
        self.laps.append(sw.laps)

    @property
    def median_s(self) -> float:
        return statistics.median(self.all_s)

    @property
    def min_s(self) -> float:
        return min(self.all_s)

    @property
    def compile_s(self) -> float:
        """First call minus the steady median: tracing and compiling (noise can make it < 0)."""
        return self.first_s - self.median_s

    def lap_median_s(self, k: int) -> float:
        """Median over the steady calls of lap ``k``."""
        return statistics.median(laps[k] for laps in self.laps)


@dataclasses.dataclass
class Measurement:
    """What :func:`measure` returns: the measured callable's series, the references' series (by
    name) and, with ``keep_output``, the measured callable's last output."""

    main: Series
    refs: dict[str, Series]
    result: Any = None


def measure(
    fn: Callable[..., Any],
    *,
    repeats: int,
    warmup: int = 0,
    references: Callable[[], Mapping[str, Callable[[], Any]]] | None = None,
    laps: bool = False,
    keep_output: bool = False,
    watchdog_s: float | None = None,
) -> Measurement:
    """Time ``fn`` and, interleaved with it, reference callables, each call blocked on its output.

    In this order:

    1. ``fn``'s first call (trace, compile, run), then ``warmup`` untimed calls;
    2. ``references()`` builds ``{name: callable}`` (so that whatever they hold is built after
       ``fn``'s warm-up); each reference's first call is timed, then ``warmup`` untimed rounds;
    3. ``repeats`` rounds: ``fn``, then each reference in order.

    Args:
      fn: the callable measured, without arguments (with ``laps``: the stopwatch, see :func:`timed`).
      repeats: steady calls (>= 1).
      warmup: untimed calls after each first call.
      references: builds the reference callables; None: none.
      laps: pass ``fn`` the stopwatch of each call.
      keep_output: keep ``fn``'s output until its next call returns (as ``out = fn()`` in a loop
        does) and return the last one; otherwise each output is dropped once ready, so that it
        takes no memory during the calls that follow.
      watchdog_s: every call of ``fn`` runs under :func:`watchdog` (armed outside the timing).

    Returns:
      A :class:`Measurement`; the references are released before it returns.
    """
    if repeats < 1:
        raise ValueError(f"measure: repeats must be >= 1, got {repeats}")
    kept = None

    def call() -> Stopwatch:
        nonlocal kept
        with watchdog(watchdog_s):
            out, sw = timed(fn, laps=laps)
        if keep_output:
            kept = out
        return sw

    sw = call()
    main = Series(first_s=sw.total, first_laps=sw.laps)
    for _ in range(warmup):
        call()
    ref_fns = dict(references()) if references is not None else {}
    refs = {name: Series(first_s=timed(f)[1].total) for name, f in ref_fns.items()}
    for _ in range(warmup):
        for f in ref_fns.values():
            timed(f)
    for _ in range(repeats):
        main.add(call())
        for name, f in ref_fns.items():
            refs[name].add(timed(f)[1])
    return Measurement(main, refs, kept)


@contextlib.contextmanager
def watchdog(seconds: float | None) -> Iterator[None]:
    """If the block has not ended after ``seconds``, dump every thread's Python traceback to
    stderr and exit the process (status 1; the dump starts with ``Timeout (``). None or 0: off."""
    if not seconds:
        yield
        return
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# ----------------------------------------------------------------------------- memory


def _proc_status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError):
        pass
    return None


def rss_mb() -> float | None:
    """Current resident set size (``VmRSS``), MB; None without ``/proc``."""
    return _proc_status_mb("VmRSS")


def hwm_mb() -> float | None:
    """Peak resident set size since the start or the last :func:`reset_peak` (``VmHWM``), MB."""
    return _proc_status_mb("VmHWM")


def peak_rss_mb() -> float:
    """The process's peak RSS from ``resource.getrusage`` (``ru_maxrss``), MB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB else


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS (``/proc/self/clear_refs``); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim_heap() -> None:
    """Return freed heap memory to the OS (glibc), so that RSS counts live memory only."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def working_memory(fn: Callable[[], Any]) -> tuple[Any, float | None]:
    """One call of ``fn`` after :func:`trim_heap`: ``(output, MB)``, its peak RSS increase over the
    RSS just before it (outputs included); MB is None where the peak counter cannot be reset."""
    trim_heap()
    base = rss_mb()
    if not reset_peak():
        return fn(), None
    out = fn()
    jax.block_until_ready(out)
    return out, hwm_mb() - base


def adapter_bytes(adapters) -> int:
    """Bytes of every ``lora_a`` and ``lora_b`` of flat adapters ``[{name: module}]``."""
    return sum(m["lora_a"].nbytes + m["lora_b"].nbytes for ad in adapters for m in ad.values())


# ----------------------------------------------------------------------------- provenance


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (rounded to 0.01), None where unavailable."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _mem_total_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def machine_info() -> dict[str, Any]:
    """Versions, backend, devices, CPUs, platform, memory, ``XLA_FLAGS``, load and date (UTC)."""
    import jaxlib
    import numpy as np

    import netutility_jax as nu

    try:
        cpus_usable = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus_usable = os.cpu_count()
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
        "netutility_jax": nu.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "cpu_usable": cpus_usable,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "mem_total_gib": _mem_total_gib(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_avg": load_average(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def code_info() -> dict[str, Any]:
    """The library code measured: its folder, a hash of its top-level sources, git HEAD and the
    uncommitted files in the package folder (``git status --porcelain``)."""
    import netutility_jax as nu

    pkg = os.path.dirname(os.path.abspath(nu.__file__))
    digest = hashlib.sha256()
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            with open(os.path.join(pkg, name), "rb") as f:
                digest.update(name.encode() + f.read())
    info: dict[str, Any] = {"package_dir": pkg, "sources_sha256": digest.hexdigest()[:16]}
    for key, cmd in (
        ("git_head", ["git", "rev-parse", "--short", "HEAD"]),
        ("git_dirty", ["git", "status", "--porcelain", "--", "."]),
    ):
        try:
            out = subprocess.run(cmd, cwd=pkg, capture_output=True, text=True, timeout=10)
            info[key] = out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            info[key] = None
    if info.get("git_dirty") is not None:
        info["git_dirty"] = info["git_dirty"].splitlines()
    return info


# ----------------------------------------------------------------------------- output, isolation


def write_json(path: str | os.PathLike, payload: Any, *, indent: int = 1) -> None:
    """``payload`` as JSON in ``path`` (its folder created), atomically: a temporary file in the
    same folder renamed over ``path``, nothing left behind on failure. Non-finite floats: null."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _io.write_json(path, payload, indent=indent)


@dataclasses.dataclass
class WorkerResult:
    """One case run by :func:`run_worker`: its exit status (None: killed at the time limit), its
    stderr, and the JSON record it wrote (None if it wrote none)."""

    status: int | None
    stderr: str
    record: dict | None

    @property
    def timed_out(self) -> bool:
        return self.status is None


def run_worker(
    script: str,
    argv: list[str],
    *,
    record_flag: str,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    echo: bool = False,
) -> WorkerResult:
    """Run ``python SCRIPT *argv RECORD_FLAG PATH`` in a fresh interpreter and read the record.

    The case writes its JSON record to ``PATH`` (a temporary file) and exits 0. Its stderr is
    kept, and with ``echo`` also copied to this process's stderr line by line as it comes (live
    progress); its stdout is this process's. Past ``timeout`` seconds the process is killed.
    """
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "case.json")
        cmd = [sys.executable, os.path.abspath(script), *argv, record_flag, out]
        lines: list[str] = []
        with subprocess.Popen(
            cmd, env=None if env is None else dict(env), stderr=subprocess.PIPE, text=True
        ) as proc:

            def drain() -> None:
                for line in proc.stderr:
                    if echo:
                        sys.stderr.write(line)
                        sys.stderr.flush()
                    lines.append(line)

            reader = threading.Thread(target=drain, daemon=True)
            reader.start()
            try:
                status: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                status = None
            reader.join()
        record = None
        if status == 0 and os.path.exists(out):
            with open(out) as f:
                record = json.load(f)
        return WorkerResult(status, "".join(lines), record)
