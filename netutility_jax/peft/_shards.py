"""Reading an adapter's tensor shapes from its headers, and writing a merged adapter as shards.

:func:`weight_shapes` reads the names and shapes of an adapter folder's tensors without reading
a tensor (the command line estimates its output's size from them). :func:`write_shard` writes
some merged modules as one shard of a sharded PEFT adapter (Hugging Face's
``adapter_model-00001-of-00004.safetensors``; :func:`shard_name`), converted exactly as
:func:`save_adapter` converts them, and :func:`write_index` the index and the
``adapter_config.json`` of the shards written: ``netutility merge --distributed --keep-shards``
has each process write its own shard.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._core import io as _io
from . import _convert, _read, _write
from ._common import CONFIG_NAME, natural_key, save_tensors

__all__ = ["shard_name", "weight_shapes", "write_index", "write_shard"]


def weight_shapes(folder: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """Names and shapes of the tensors in ``folder/adapter_model.safetensors`` (or in the shards
    its index lists, or in the pickled ``adapter_model.bin``), from the headers only (no tensor
    is read; a bin's pickle says the shapes); None if there is no readable header (the loader
    then says why)."""
    try:
        import safetensors
    except ImportError:
        return None

    fn = "weight_shapes"
    try:
        wf = _read.weights_file(pathlib.Path(folder), fn=fn)
        with _read.open_weights(wf, fn=fn) as fh:
            return {k: tuple(int(n) for n in fh.get_slice(k).get_shape()) for k in fh.keys()}
    except (OSError, ValueError, safetensors.SafetensorError):
        return None


def shard_name(p: int, count: int) -> str:
    """Shard ``p`` of ``count`` (Hugging Face's sharded-checkpoint names)."""
    return f"adapter_model-{p + 1:05d}-of-{count:05d}.safetensors"


def write_shard(
    folder: pathlib.Path,
    file: str,
    modules: Mapping[str, Any],
    *,
    rank: int | None,
    dtype: str,
    serving: int | None,
    fn: str,
) -> dict[str, np.ndarray]:
    """``modules`` as PEFT tensors in ``folder/file`` (a temporary file renamed into place),
    converted exactly as :func:`save_adapter` converts them (dense modules truncated to
    ``rank``, written in ``dtype``, zero-padded to the rank ``serving``). Returns
    ``{"t/<tensor>": bytes, "r/<module>": rank written}``, what :func:`write_index` takes.
    A failed write raises the ``OSError``; ``fn`` names the caller in the library's errors."""
    tensors, out = {}, {}
    for name in sorted(modules, key=natural_key):
        a, b = _convert.peft_factors(name, modules[name], rank, fn=fn)
        if serving is not None:  # (zero directions: the same update)
            pad = serving - len(a)
            a, b = np.pad(a, ((0, pad), (0, 0))), np.pad(b, ((0, 0), (0, pad)))
        out[f"r/{name}"] = np.asarray(len(a), np.int64)
        for key, y in _write.written_tensors(name, a, b, dtype, fn=fn).items():
            tensors[key] = y
            out[f"t/{key}"] = np.asarray(y.nbytes, np.int64)
    tmp = folder / f".{file}.tmp"
    save_tensors(tensors, tmp)
    os.replace(tmp, folder / file)
    return out


def write_index(
    folder: pathlib.Path,
    written: Sequence[tuple[str, Mapping[str, Any]]],
    config: Mapping[str, Any],
    *,
    fn: str,
) -> None:
    """The index ``adapter_model.safetensors.index.json`` (``{"metadata": {"total_size"},
    "weight_map": {tensor: shard}}``) of the shards :func:`write_shard` wrote (``written``:
    ``(file, what it returned)`` per shard), and ``adapter_config.json`` for their ranks
    (:func:`save_adapter`'s config, carrying the source adapters' ``config``)."""
    files, ranks, total = {}, {}, 0
    for file, got in written:
        for key, v in got.items():
            if key.startswith("t/"):
                files[key[2:]] = file
                total += int(v)
            else:
                ranks[key[2:]] = int(v)
    index = {
        "metadata": {"total_size": total, "format": "pt"},
        "weight_map": dict(sorted(files.items())),
    }
    _io.write_json(folder / _read.INDEX_NAME, index, indent=2)
    cfg = _write.saved_config(config, {}, sorted(ranks, key=natural_key), ranks, fn=fn)
    with _io.atomic_file(folder / CONFIG_NAME, "w") as f:
        f.write(_write.config_text(cfg, fn=fn))
