"""A merge split between the processes of a ``jax.distributed`` run (``netutility merge
--distributed``): process 0 writes the output (:func:`write_distributed`), or, with
``keep_shards``, every process writes its own shard of it (:func:`nu.peft.write_shard`). Every
step that can fail in one process ends with an exchange of the processes' status, so that all
of them stop with an error instead of waiting for the one that failed."""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .._core import io as _io
from ..errors import FileAccessError, NetUtilityError
from ._write import (
    Merged,
    Run,
    appeared,
    staging_name,
    step,
    uniform_rank,
    write_error,
    write_extras,
    write_merge,
)

__all__ = ["write_distributed"]

_GATHER_BYTES = 256 << 20  # merged modules received at once by every process (all processes')


def write_distributed(run: Run, result: Merged) -> None:
    """Process 0 writes ``out``. By default the merged modules (low rank, small) are sent to
    it, a bounded batch of every process at a time, and it writes exactly what one process
    writes (:func:`write_merge`); ``keep_shards``: :func:`_write_shards`."""
    ex = run.ex
    if run.keep_shards:
        _write_shards(run, result)
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
    got = ex.gather(run.terms.fn, batches if batches[0] else [])

    def write() -> None:
        if ex.index == 0:
            modules: dict[str, dict[str, Any]] = {}
            for arrays in got:
                for key, a in arrays.items():
                    name, field = key.rsplit("\0", 1)
                    modules.setdefault(name, {})[field] = a
            merged = {n: modules[n] for n in result.report.ranks}
            write_merge(run, result._replace(merged=merged))

    ex.check(run.terms.fn, write)


def _write_shards(run: Run, result: Merged) -> None:
    """``keep_shards``: process 0 makes the staging folder beside ``out``; every process with
    modules writes its shard there; process 0 writes the index, the config, the report and the
    plots, and renames the folder into place. A failure anywhere removes the folder."""
    from ..peft import shard_name, write_index, write_shard

    ex, out, fn, cfg = run.ex, run.out, run.terms.fn, run.config
    serving = uniform_rank(run, result.report.ranks)
    with contextlib.ExitStack() as stack:

        def begin() -> dict[str, Any]:
            mine = {"modules": np.asarray(len(result.merged), np.int64)}
            if ex.index > 0:
                return mine
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = stack.enter_context(_io.atomic_directory(out, fn=fn, staging=staging_name(out)))
            return {**mine, "staging": np.frombuffer(os.fsencode(tmp), np.uint8)}

        started = ex.allgather(fn, _mapped(run, begin))
        tmp = pathlib.Path(os.fsdecode(started[0]["staging"].tobytes()))
        writers = [p for p, s in enumerate(started) if int(s["modules"]) > 0]
        files = {p: shard_name(q, len(writers)) for q, p in enumerate(writers)}

        def shard() -> dict[str, Any]:
            if ex.index not in files:
                return {}
            try:
                return write_shard(
                    tmp, files[ex.index], result.merged, rank=cfg.rank, dtype=cfg.dtype,
                    serving=serving, fn=fn,
                )  # fmt: skip
            except OSError as e:
                if isinstance(e, NetUtilityError):
                    raise
                raise FileAccessError(
                    f"{run.t('out')} {run.out_text}: cannot write the shard {files[ex.index]} in "
                    f"{tmp} ({e.strerror or e}); with {run.t('keep_shards')} every process writes "
                    "into the output's folder, which they must all see (a shared filesystem)."
                ) from e

        written = ex.allgather(fn, shard)
        step(run.bar, "saved adapter", "writing the report")

        def finish() -> None:
            if ex.index == 0:
                write_index(
                    tmp, [(files[p], written[p]) for p in writers], result.loaded.config, fn=fn,
                )  # fmt: skip
                write_extras(tmp, run, result)
                err = appeared(run)
                if err is not None:
                    raise err
                stack.close()  # (the rename into place)

        ex.check(fn, _mapped(run, finish))
    step(run.bar, "done")


def _mapped(run: Run, work: Callable[[], Any]) -> Callable[[], Any]:
    """``work`` with a failed write as the library's :class:`FileAccessError`."""

    def go() -> Any:
        try:
            return work()
        except OSError as e:
            if isinstance(e, NetUtilityError):
                raise
            raise write_error(run.out_text, e, run.terms) from e

    return go
