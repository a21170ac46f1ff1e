"""``netutility merge --distributed``: the steps a process of a ``jax.distributed`` run adds.

Every process checks its flags (:func:`check_join`, the same refusals in every process) and
joins the run (:func:`join`); they agree on their inputs and settings (:func:`agreed_facts`),
then each makes the command's one call, :func:`nu.merge_folders` with the run's process group:
each merges its share of the modules, and process 0 writes the output (with ``--keep-shards``
every process writes its own shard, :func:`nu.peft.write_shard`). Every step that can fail in
one process ends with an exchange of
the processes' status (:meth:`netutility_jax.pipeline._exchange.Exchange.check`), so that all of them stop with an
error instead of waiting for the one that failed.
"""

from __future__ import annotations

import json
import os
import pathlib

from ..pipeline import _exchange
from .common import PROG, UsageError, say
from .job import MergeJob

__all__ = ["agreed_facts", "check_join", "join"]

_FN = f"{PROG} merge"


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
    if job.settings.in_memory:
        raise UsageError(
            "--in-memory cannot be used with --distributed: each process streams its share of "
            "the modules from disk. Drop --in-memory."
        )
    if job.settings.method_options.get("trim_scope") == "model":
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

    facts = {"library version": __version__}
    config = job.settings.to_dict()
    weights = config.pop("weights", None) or [1.0] * len(job.adapters)
    config.pop("names", None)
    facts["number of adapters"] = str(len(job.adapters))
    for key in sorted(config):
        facts[f"--{key}"] = json.dumps(config[key], sort_keys=True)
    for i, (path, weight) in enumerate(zip(job.adapters, weights, strict=True)):
        a = {"path": os.path.abspath(path), "weight": float(weight)}
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
