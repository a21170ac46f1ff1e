""":func:`merge_folders`: PEFT adapter folders merged into a written PEFT folder, in one call.

The steps: the settings checked against the inputs; the folders opened for streaming (by
default) or read into memory; the merge (:func:`nu.merge_adapters_streaming` or
:func:`nu.merge_adapters`), a streamed merge in one process writing each chunk's modules as
they come (:class:`nu.peft.AdapterWriter`: memory stays one chunk); the output folder
assembled in a staging folder beside ``out`` and renamed into place (adapter, report with the
configuration that replays the merge, model card, plots)."""

from __future__ import annotations

import functools
import os
import pathlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import InputError, InputTypeError, PathExistsError
from ._config import MergeConfig
from ._load import read_adapters, read_moments, say_notes
from ._shards import write_distributed
from ._write import Merged, Run, Terms, assembled, chunk_steps, finish_output, step, write_merge

__all__ = ["merge_folders", "merge_settings", "mesh_of", "writes_as_it_goes"]


def merge_folders(
    paths: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    config: MergeConfig,
    *,
    progress: Any = None,
    say: Callable[[str, str], None] | None = None,
    terms: Terms | None = None,
    exchange: Any = None,
    keep_shards: bool = False,
    digests: Sequence[str | None] | None = None,
) -> Any:
    """Merge the PEFT adapter folders ``paths`` (one per task) as ``config`` says and write the
    merged PEFT adapter to the new folder ``out``; return the merge's :class:`nu.Report`.

    ``out`` holds ``adapter_config.json`` and ``adapter_model.safetensors`` (which
    ``peft.PeftModel.from_pretrained`` loads), ``netutility_report.json`` (the report, with the
    configuration that replays the merge: ``netutility merge --config`` of it, or
    :meth:`MergeConfig.from_dict` of it), a model card (``README.md``) and, unless
    ``config.no_plots``, PNG plots (``plots/``). It is assembled in a staging folder beside it
    and renamed into place: it appears complete or not at all, and an existing path is never
    written over. This is what ``netutility merge`` runs.

    By default the adapters are streamed from disk a chunk of modules at a time (at most
    ``config.chunk_mb`` MB of factors), each chunk's merged modules written as they come;
    ``config.in_memory`` reads them all first. The process's allocator is left alone
    (:func:`nu.streaming.bound_heap` is the caller's opt-in).

    Args:
      paths: the adapter folders.
      out: the output folder; must not exist.
      config: the settings (:class:`MergeConfig`).
      progress: a ``tqdm``-like bar (``update``, ``set_postfix_str``, ``total``, ``refresh``)
        advanced step by step and chunk by chunk; None: none.
      say: ``say(kind, text)`` receives the notes (``"note"``: which tasks lack which modules)
        and warnings (``"warning"``: tensors skipped by ``skip_non_lora``); default: each as a
        :class:`UserWarning`.
      terms: how messages name the caller and the settings (:class:`Terms`; the command line
        passes its flags' spelling).
      exchange: the process group of a ``jax.distributed`` run (``netutility merge
        --distributed``): each process merges its share, process 0 writes ``out``; with
        ``keep_shards`` every process writes its own shard into it.
      digests: each folder's SHA-256 (:func:`adapter_digest`) as taken before the merge (the
        report records each folder's; one that changed in between is refused); default: taken
        at the start of this call.

    Raises:
      InputTypeError: ``config`` is no :class:`MergeConfig`, or ``paths`` no list of folders.
      InputError: settings that do not fit the adapters (a weight, name or moments file per
        adapter; a dense method without ``config.rank``), or adapters that cannot be merged.
      PathExistsError: ``out`` exists.
      MissingFileError, FileAccessError: a folder or file cannot be read, or ``out`` written.

    Example:
      >>> import netutility_jax as nu
      >>> cfg = nu.MergeConfig(budget=16, method="ties", space="core")
      >>> report = nu.merge_folders(["runs/math", "runs/code"], "merged", cfg)  # doctest: +SKIP
    """
    run = _start(paths, out, config, progress, say, terms, exchange, keep_shards, digests)
    cfg = run.config
    key = _key(cfg)
    ex = run.ex
    fn = run.terms.fn
    streamed = not cfg.in_memory
    if writes_as_it_goes(cfg, distributed=ex is not None):
        loaded = _read(run, streamed=True)
        step(run.bar, "opened", "scoring, merging and writing (streamed)")
        with assembled(run) as tmp:
            report = _merge_writing(tmp, run, loaded, key)
        return report
    if streamed or ex is not None:
        loaded = (
            ex.check(fn, lambda: _read(run, streamed=True)) if ex else _read(run, streamed=True)
        )
        step(run.bar, "opened", "scoring and merging (streamed)")
        merged, report = _merge_streaming(run, loaded, key)
    else:
        loaded = _read(run, streamed=False)
        step(run.bar, "loaded", "scoring and merging")
        merged, report = _merge(run, loaded.adapters, key)
    step(run.bar, "merged", "writing the PEFT adapter")
    _check_dense(run, report)
    result = Merged(loaded, merged, report, key)
    if ex is not None:
        write_distributed(run, result)
    else:
        write_merge(run, result)
    return report


def _start(paths, out, config, progress, say, terms, exchange, keep_shards, digests) -> Run:
    """The call's arguments checked against each other; the run they describe."""
    from ..pipeline.planning import task_names
    from ._digests import adapter_digest

    terms = terms or Terms()
    if not isinstance(config, MergeConfig):
        raise InputTypeError(
            f"{terms.fn}: config is a {type(config).__name__}; expected a nu.MergeConfig "
            "(nu.MergeConfig.from_dict reads one from a mapping)."
        )
    if isinstance(paths, (str, bytes, os.PathLike)) or not isinstance(paths, Sequence) or not paths:
        raise InputTypeError(
            f"{terms.fn}: paths={paths!r}; expected a non-empty list of adapter folders."
        )
    if not all(isinstance(p, (str, os.PathLike)) for p in paths):
        raise InputTypeError(f"{terms.fn}: paths holds {paths!r}; expected folder paths.")
    if not isinstance(out, (str, os.PathLike)):
        raise InputTypeError(f"{terms.fn}: out={out!r}; expected the output folder's path.")
    paths = tuple(os.fspath(p) for p in paths)
    m = len(paths)
    for field in ("weights", "names", "input_moments"):
        given = getattr(config, field)
        if given is not None and len(given) != m:
            raise InputError(
                f"{terms.fn}: {terms.spell(field)} has {len(given)} entries for {m} adapters; "
                "give one per adapter, in order."
            )
    derived = task_names(paths)
    names = tuple(
        n if n is not None else d for n, d in zip(config.names or derived, derived, strict=True)
    )
    if len(set(names)) != m:
        raise InputError(
            f"{terms.fn}: two adapters have the same name ({names}); give distinct names."
        )
    if config.rank is None and config.dense:
        raise InputError(
            f"{terms.fn}: method {config.method} in full space gives dense updates; give "
            f"{terms.spell('rank')} K to write them as rank-K LoRA modules (truncated SVD), or "
            "use space core or knots."
        )
    out_path = pathlib.Path(os.fspath(out))
    writes = exchange is None or exchange.index == 0 or keep_shards
    if writes and os.path.lexists(out_path):
        raise PathExistsError(
            f"{terms.spell('out')} {os.fspath(out)}: exists; a merge writes a new folder (choose "
            "another, or remove it)."
        )
    if digests is None and exchange is None:
        digests = [adapter_digest(p, f"adapter {n}") for p, n in zip(paths, names, strict=True)]
    return Run(
        paths=paths, names=names, out=out_path, out_text=os.fspath(out), config=config,
        terms=terms, say=say or _warn, bar=progress, ex=exchange, keep_shards=keep_shards,
        digests=digests,
    )  # fmt: skip


def _warn(kind: str, text: str) -> None:
    warnings.warn(f"nu.merge_folders: {kind}: {text}", UserWarning, stacklevel=5)  # (the caller)


def _read(run: Run, *, streamed: bool):
    """The adapters read or opened, with the notes (in process 0 only)."""
    cfg = run.config
    loaded = read_adapters(run.paths, cfg, run.names, streamed=streamed, spell=run.t)
    if run.ex is None or run.ex.index == 0:
        say_notes(run.paths, cfg, run.names, loaded, run.say, spell=run.t)
    return loaded


def _moments(run: Run, adapters: Any) -> Any:
    moments, run.moments = read_moments(run.config.input_moments, adapters, run.names, spell=run.t)
    return moments


def _key(cfg: MergeConfig):
    """The PRNG key of ``seed`` if the method draws random masks, else None."""
    from .. import registry

    if not registry.METHODS[cfg.method].needs_key:
        return None
    import jax

    return jax.random.key(cfg.seed)


def merge_settings(cfg: Any, key: Any, *, spell: Callable[[str], str] = str) -> dict[str, Any]:
    """The settings as :func:`nu.merge_adapters`' (and the streamed merge's) keyword
    arguments (``cfg``: a :class:`MergeConfig`, or anything with its fields; ``key``: the
    PRNG key of the methods that draw)."""
    return {
        "budget": cfg.budget,
        "method": cfg.method,
        "space": cfg.space,
        "allocation": cfg.allocation,
        "scope": cfg.scope,
        "alpha": cfg.alpha,
        "lam": cfg.lam,
        "interference": cfg.interference,
        "positive_only": not cfg.keep_nonpositive,
        "coef": cfg.coef,
        "key": key,
        "mesh": mesh_of(cfg.devices, spell=spell),
        "weights": cfg.weights,
        "min_share": cfg.min_share,
    }


def mesh_of(devices: str | int, *, spell: Callable[[str], str] = str):
    """``devices``: a mesh of this process's first N (or all) devices, or None for one."""
    import jax

    from .._core.mesh import module_mesh

    local = jax.local_devices()
    n = len(local) if devices == "all" else devices
    if n > len(local):
        raise InputError(
            f"{spell('devices')} {n}: this process has {len(local)} device(s) "
            f"({local[0].platform}); pass {spell('devices')} all or at most {len(local)}."
        )
    return None if n == 1 else module_mesh(local[:n])


def writes_as_it_goes(cfg: MergeConfig, *, distributed: bool = False) -> bool:
    """Whether the merge writes each chunk's modules as they come: a streamed merge in one
    process, at each module's own rank. ``serving_ranks`` (one rank for every module, known
    only at the end) and a distributed merge write at the end."""
    return not cfg.in_memory and not distributed and cfg.serving_ranks is None


def _settings(run: Run, key: Any) -> dict[str, Any]:
    return merge_settings(run.config, key, spell=run.t)


def _merge(run: Run, adapters: Sequence[Any], key):
    """The merge in memory (:func:`nu.merge_adapters`); ``(merged, report)``."""
    from ..pipeline.merging import merge_adapters

    return merge_adapters(
        adapters, **_settings(run, key), input_moments=_moments(run, adapters),
        **run.config.method_options,
    )  # fmt: skip


def _merge_streaming(run: Run, source: Any, key):
    """The streamed merge (:func:`nu.merge_adapters_streaming`); with ``rank``, dense results
    are truncated chunk by chunk exactly as :func:`nu.peft.save_adapter` would (so memory
    stays bounded and the written adapter is the same)."""
    from ..pipeline.streaming import merge_adapters_streaming

    cfg = run.config
    on_chunk = None
    if cfg.rank is not None and cfg.dense:
        on_chunk = functools.partial(_truncate_dense, rank=cfg.rank, fn=run.terms.fn)
    return merge_adapters_streaming(
        source,
        **_settings(run, key),
        chunk_bytes=cfg.chunk_bytes,
        on_chunk=on_chunk,
        distributed=run.ex is not None,
        progress=chunk_steps(run.bar, "scoring and merging"),
        input_moments=_moments(run, source),
        **cfg.method_options,
    )


def _merge_writing(tmp: pathlib.Path, run: Run, source: Any, key) -> Any:
    """The streamed merge writing its adapter chunk by chunk into ``tmp`` (the output's staging
    folder, :class:`nu.peft.AdapterWriter`), then the report and plots; returns the report.
    Memory: one chunk, whatever the size of the merged adapter."""
    from .. import peft
    from ..pipeline.streaming import merge_adapters_streaming

    cfg = run.config
    with peft.AdapterWriter(
        tmp / "adapter", rank=cfg.rank, base_config=source.config, dtype=cfg.dtype,
        names=source.names,
    ) as writer:  # fmt: skip
        merged, report = merge_adapters_streaming(
            source,
            **_settings(run, key),
            chunk_bytes=cfg.chunk_bytes,
            on_chunk=functools.partial(_write_chunk, writer),
            input_moments=_moments(run, source),
            progress=chunk_steps(run.bar, "scoring, merging and writing"),
            **cfg.method_options,
        )
    step(run.bar, "merged and written", "writing the report")
    _check_dense(run, report)
    finish_output(tmp, run, Merged(source, merged, report, key))
    return report


def _write_chunk(writer: Any, modules: dict[str, Any]) -> dict[str, Any]:
    """``on_chunk``: a chunk's merged modules written; kept in their place: shape-only stand-ins
    (zero-strided, no memory) of the merged rank (what :attr:`nu.Report.ranks` reports: a
    dense module at its truncated rank, a module that kept nothing at 0)."""
    written = writer.add(modules)
    out = {}
    for name, mod in modules.items():
        if "delta" in mod:
            (d_in, d_out), r = mod["delta"].shape, written[name]
        else:
            (d_in, r), d_out = mod["lora_a"].shape, mod["lora_b"].shape[1]
        zero = np.zeros((), np.float32)
        out[name] = {
            "lora_a": np.broadcast_to(zero, (d_in, r)),
            "lora_b": np.broadcast_to(zero, (r, d_out)),
            "scale": 1.0,
        }
    return out


def _truncate_dense(modules: dict[str, Any], *, rank: int, fn: str) -> dict[str, Any]:
    """Dense modules of a chunk as the rank-``rank`` LoRA modules save_adapter writes."""
    from .. import peft

    return peft.truncate_dense(modules, rank, fn=fn)


def _check_dense(run: Run, report: Any) -> None:
    """Refuse dense merged modules without ``rank`` (a PEFT adapter holds LoRA factors)."""
    cfg = run.config
    dense = sorted(n for n, r in report.ranks.items() if r is None)
    if dense and cfg.rank is None:
        raise InputError(
            f"method {cfg.method} in {cfg.space} space gives dense updates ({dense[0]}"
            f"{' and more' if len(dense) > 1 else ''}); pass {run.t('rank')} K to write them as "
            "rank-K LoRA modules (truncated SVD)."
        )
