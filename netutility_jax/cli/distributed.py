"""``netutility merge --distributed``: the steps a process of a ``jax.distributed`` run adds.

Every process checks its flags (:func:`check_join`, the same refusals in every process) and
joins the run (:func:`join`); they agree on their inputs and settings (:func:`agreed_facts`),
each merges its share of the modules, and process 0 writes the output
(:func:`write_distributed`; with ``--keep-shards`` every process writes its own shard,
:func:`nu.peft.write_shard`). Every step that can fail in one process ends with an exchange of
the processes' status (:meth:`nu._exchange.Exchange.check`), so that all of them stop with an
error instead of waiting for the one that failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .._core import io as _io
from ..errors import FileAccessError, NetUtilityError
from ..peft import shard_name, write_index, write_shard
from ..pipeline import _exchange
from .common import PROG, UsageError, say
from .job import MergeJob
from .output import Merged, step, uniform_rank, write_extras, write_merge
from .paths import staging_name, stat_of, write_error

__all__ = ["agreed_facts", "check_join", "join", "write_distributed"]

_FN = f"{PROG} merge"
_GATHER_BYTES = 256 << 20  # merged modules received at once by every process (all processes')


def join(job: MergeJob) -> _exchange.Exchange:
    """``--distributed``: its flags checked (the same refusals in every process, before any of
    them waits for the others), then this process joins the run (``jax.distributed``, before
    any JAX computation, giving up after ``--distributed-timeout``). Without it: one process,
    and its flags refused."""
    if not check_join(job):
        return _exchange.LOCAL
    ex = _exchange.initialize(
        _FN,
        job.coordinator,
        job.num_processes,
        job.process_id,
        timeout_s=job.distributed_timeout or _exchange.DEFAULT_TIMEOUT_S,
        heartbeat_s=job.heartbeat_timeout or _exchange.DEFAULT_HEARTBEAT_S,
        on_timeout=lambda message: say("merge", "error", message),
    )
    return ex


def check_join(job: MergeJob) -> bool:
    """Whether this is a ``--distributed`` merge, after refusing the flags that do not go with
    the others (UsageError)."""
    flags = {
        "--coordinator": job.coordinator,
        "--num-processes": job.num_processes,
        "--process-id": job.process_id,
        "--keep-shards": job.keep_shards or None,
        "--distributed-timeout": job.distributed_timeout,
        "--heartbeat-timeout": job.heartbeat_timeout,
    }
    given = [f for f, v in flags.items() if v is not None]
    if not job.distributed:
        if given:
            raise UsageError(f"{given[0]} applies only with --distributed.")
        return False
    if job.in_memory:
        raise UsageError(
            "--in-memory cannot be used with --distributed: each process streams its share of "
            "the modules from disk. Drop --in-memory."
        )
    if job.option_flags.get("trim_scope") == "model":
        raise UsageError(
            "model-wide TIES (--trim-scope model) needs every module in one process; it cannot "
            "run with --distributed. Use --trim-scope module, or drop --distributed."
        )
    if job.coordinator is not None:
        _exchange.check_coordinator("--coordinator", job.coordinator)
    if None not in (job.num_processes, job.process_id) and job.process_id >= job.num_processes:
        raise UsageError(
            f"--process-id {job.process_id} with --num-processes {job.num_processes}: process "
            f"indices run from 0 to {job.num_processes - 1}."
        )
    return True


def agreed_facts(job: MergeJob) -> dict[str, str]:
    """What every process of a distributed merge must share before any work: the library
    version, every setting (as the report records them; not this process's index), and each
    adapter's path and a digest of its config and weight files' headers."""
    import hashlib

    from .. import __version__
    from .config import recorded_config

    facts = {"library version": __version__}
    config = recorded_config(job, {})
    adapters = config.pop("adapters")
    facts["number of adapters"] = str(len(adapters))
    for key in sorted(config):
        if key.replace("_", "-") not in ("process-id", "distributed-timeout", "heartbeat-timeout"):
            facts[f"--{key.replace('_', '-')}"] = json.dumps(config[key], sort_keys=True)
    for i, a in enumerate(adapters):
        digest = hashlib.sha256()
        folder = pathlib.Path(a["path"])
        for f in sorted(folder.glob("adapter_*")):
            if f.is_file():
                with open(f, "rb") as fh:
                    head = fh.read(1 << 20)
                digest.update(f"{f.name}:{f.stat().st_size}:".encode() + head)
        facts[f"adapter {i + 1}"] = (
            f"{a['path']} (weight {a['weight']}, sha256 {digest.hexdigest()[:16]})"
        )
    return facts


def write_distributed(
    out: pathlib.Path, job: MergeJob, result: Merged, bar, ex: _exchange.Exchange
) -> None:
    """``--distributed``: process 0 writes ``out``. By default the merged modules (low rank,
    small) are sent to it, a bounded batch of every process at a time, and it writes exactly
    what one process writes (:func:`write_merge`); ``--keep-shards``: :func:`_write_shards`."""
    if job.keep_shards:
        _write_shards(out, job, result, bar, ex)
        return
    batches: list[dict[str, Any]] = [{}]
    limit, size = max(1 << 20, _GATHER_BYTES // ex.count), 0
    for name, mod in result.merged.items():
        arrays = {f"{name}\0{k}": np.asarray(v) for k, v in mod.items()}
        n = sum(a.nbytes for a in arrays.values())
        if batches[-1] and size + n > limit:
            batches.append({})
            size = 0
        batches[-1].update(arrays)
        size += n
    got = ex.gather(_FN, batches if batches[0] else [])

    def write() -> None:
        if ex.index == 0:
            modules: dict[str, dict[str, Any]] = {}
            for arrays in got:
                for key, a in arrays.items():
                    name, field = key.rsplit("\0", 1)
                    modules.setdefault(name, {})[field] = a
            merged = {n: modules[n] for n in result.report.ranks}
            write_merge(out, job, result._replace(merged=merged), bar)

    ex.check(_FN, write)


def _write_shards(
    out: pathlib.Path, job: MergeJob, result: Merged, bar, ex: _exchange.Exchange
) -> None:
    """``--keep-shards``: process 0 makes the staging folder beside ``out``; every process with
    modules writes its shard there; process 0 writes the index, the config, the report and the
    plots, and renames the folder into place. A failure anywhere removes the folder."""
    serving = uniform_rank(job.serving_ranks, result.report.ranks)
    with contextlib.ExitStack() as stack:

        def begin() -> dict[str, Any]:
            mine = {"modules": np.asarray(len(result.merged), np.int64)}
            if ex.index > 0:
                return mine
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = stack.enter_context(_io.atomic_directory(out, fn=_FN, staging=staging_name(out)))
            return {**mine, "staging": np.frombuffer(os.fsencode(tmp), np.uint8)}

        started = ex.allgather(_FN, _mapped(job, begin))
        tmp = pathlib.Path(os.fsdecode(started[0]["staging"].tobytes()))
        writers = [p for p, s in enumerate(started) if int(s["modules"]) > 0]
        files = {p: shard_name(q, len(writers)) for q, p in enumerate(writers)}

        def shard() -> dict[str, Any]:
            if ex.index not in files:
                return {}
            try:
                return write_shard(
                    tmp, files[ex.index], result.merged, rank=job.rank, dtype=job.dtype,
                    serving=serving, fn=_FN,
                )  # fmt: skip
            except OSError as e:
                if isinstance(e, NetUtilityError):
                    raise
                raise FileAccessError(
                    f"--out {job.out}: cannot write the shard {files[ex.index]} in {tmp} "
                    f"({e.strerror or e}); with --keep-shards every process writes into the "
                    "output's folder, which they must all see (a shared filesystem)."
                ) from e

        written = ex.allgather(_FN, shard)
        step(bar, "saved adapter", "writing the report")

        def finish() -> None:
            if ex.index == 0:
                write_index(
                    tmp, [(files[p], written[p]) for p in writers], result.loaded.config,
                    fn=_FN,
                )  # fmt: skip
                write_extras(tmp, job, result, bar)
                if stat_of(out, f"--out {job.out}", follow=False) is not None:
                    raise UsageError(f"--out {job.out}: appeared while merging; nothing written.")
                stack.close()  # (the rename into place)

        ex.check(_FN, _mapped(job, finish))
    step(bar, "done")


def _mapped(job: MergeJob, work: Callable[[], Any]) -> Callable[[], Any]:
    """``work`` with a failed write as the library's :class:`FileAccessError` (exit code 2)."""

    def run() -> Any:
        try:
            return work()
        except OSError as e:
            if isinstance(e, NetUtilityError):
                raise
            raise write_error(job.out, e) from e

    return run
