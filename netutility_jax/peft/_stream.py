"""Writing a PEFT adapter a chunk of modules at a time (:class:`AdapterWriter`).

:func:`save_adapter` needs the whole merged adapter in memory and builds every tensor (and the
safetensors library its byte buffer) before writing: about three copies of the result. A merge
streamed from disk (:func:`nu.merge_adapters_streaming`) produces its modules chunk by chunk;
:class:`AdapterWriter` converts and writes each chunk as it comes (the same conversion as
:func:`save_adapter`), so a merged 70B-sized adapter is never held at once.

The safetensors file is byte for byte what the safetensors package writes for the same tensors
(an 8-byte little-endian header length, a compact JSON header of ``dtype`` / ``shape`` /
``data_offsets`` per tensor after the ``__metadata__``, padded with spaces to 8 bytes, then the
tensors' bytes back to back in name order): the tensors' bytes go to a side file as they come,
and when the adapter is complete the header (only then known) is written and the bytes copied
after it in name order, a tensor at a time. The package has no incremental writer; its reader
(``safe_open``, ``load_file``) and PEFT read the result.
"""

from __future__ import annotations

import collections
import contextlib
import json
import pathlib
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._core import checks as _checks
from .._core.io import atomic_directory
from ..errors import InputError, InputTypeError
from ._common import CONFIG_NAME, WEIGHTS_NAME, natural_key
from ._convert import peft_factors
from ._write import (
    check_free_dir,
    check_save_options,
    config_text,
    modules_for_save,
    saved_config,
    written_tensors,
)

__all__ = ["AdapterWriter"]

_FN = "nu.peft.AdapterWriter"
#: safetensors' dtype codes of the saved dtypes
_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_DATA = ".tensors.part"  # the tensors' bytes, inside the staging folder


class AdapterWriter:
    """:func:`save_adapter`, fed a chunk of modules at a time: memory of one chunk.

    A context manager. Inside the ``with`` block, :meth:`add` converts each chunk's modules
    exactly as :func:`save_adapter` does (same tensors, dtype, ranks, rank-0 and dense modules)
    and writes their tensors; when the block ends the config (``rank_pattern`` over every module)
    and the safetensors header are written and the folder is renamed into place. If the block
    raises, nothing is left at ``path``.

    Args:
      path: output directory; must not exist or be empty.
      rank, base_config, dtype, **config: as for :func:`save_adapter` (``serving_ranks``, which
        needs every module's rank before the first is written, is not supported here).
      names: the PEFT module names the adapter will hold, if known: the config's
        ``target_modules`` are then checked against them before anything is written, and an
        unknown, repeated or missing module is an error.

    Attributes:
      config: the ``adapter_config.json`` written (after the block).
      ranks: ``{module: rank written}`` so far.

    Example:
      >>> import pathlib, tempfile
      >>> import numpy as np
      >>> from netutility_jax import peft
      >>> rng = np.random.default_rng(0)
      >>> chunks = [{f"model.layers.{i}.q_proj": {"lora_a": rng.normal(size=(8, 2)),
      ...                                          "lora_b": rng.normal(size=(2, 6))}}
      ...           for i in range(3)]
      >>> tmp = tempfile.TemporaryDirectory()
      >>> out = pathlib.Path(tmp.name) / "merged"
      >>> with peft.AdapterWriter(out, base_model_name_or_path="my/base") as w:
      ...     for chunk in chunks:
      ...         _ = w.add(chunk)
      >>> sorted(peft.load_adapter(out)) == sorted(n for c in chunks for n in c)
      True
      >>> tmp.cleanup()
    """

    def __init__(
        self,
        path: Any,
        *,
        rank: int | None = None,
        base_config: Any = None,
        dtype: str = "float32",
        names: Sequence[str] | None = None,
        **config: Any,
    ):
        check_save_options(rank, dtype, config, fn=_FN)
        self.path = pathlib.Path(path)
        check_free_dir(self.path, fn=_FN)
        self._rank, self._dtype = rank, dtype
        self._base, self._config = base_config, config
        self._names = None if names is None else _check_names(names)
        if self._names is not None:  # the config's target modules, checked before any work
            saved_config(base_config, config, self._names, dict.fromkeys(self._names, 1), fn=_FN)
        self.ranks: dict[str, int] = {}
        self.config: dict[str, Any] | None = None
        self._entries: dict[str, dict[str, Any]] = {}
        self._offset = 0
        self._ctx = self._tmp = self._data = None

    def __enter__(self) -> AdapterWriter:
        if self._ctx is not None:
            raise InputError(f"{_FN}: this writer was already used; make a new one.")
        self._ctx = atomic_directory(self.path, fn=_FN)
        self._tmp = self._ctx.__enter__()
        try:
            self._data = open(self._tmp / _DATA, "wb")
        except BaseException:
            self._ctx.__exit__(*sys.exc_info())  # the staging folder removed
            raise
        return self

    def add(self, modules: Mapping[str, Any]) -> dict[str, int]:
        """Convert and write a chunk's modules (a dict as :func:`save_adapter` takes); returns
        ``{module: rank written}`` for them (a module that kept nothing is written as rank 1
        with zero factors, as :func:`save_adapter` does)."""
        if self._data is None or self._data.closed:
            raise InputError(f"{_FN}: add() is called inside the writer's `with` block.")
        if isinstance(modules, Mapping) and not modules:
            return {}  # an empty chunk adds nothing
        mods = modules_for_save(modules, fn=_FN)
        expected = None if self._names is None else set(self._names)
        names = sorted(mods, key=natural_key)
        for name in names:
            if name in self.ranks:
                raise InputError(f"{_FN}: module {name!r} was already written; add it once.")
            if expected is not None and name not in expected:
                raise InputError(
                    f"{_FN}: module {name!r} is not among the names the writer was given "
                    f"({_checks.few(self._names)}); pass names= with every module, or None."
                )
        # every tensor of the chunk converted (and checked) before any is written: a chunk that
        # fails leaves the file as it was
        tensors, out = {}, {}
        for name in names:
            a, b = peft_factors(name, mods[name], self._rank, fn=_FN)
            tensors.update(written_tensors(name, a, b, self._dtype, fn=_FN))
            out[name] = int(a.shape[0])
        for key, y in tensors.items():
            self._write(key, y)
        self.ranks.update(out)
        return out

    def _write(self, key: str, y: np.ndarray) -> None:
        self._data.write(memoryview(np.ascontiguousarray(y).reshape(-1).view(np.uint8)))
        end = self._offset + y.nbytes
        self._entries[key] = {
            "dtype": _CODES[self._dtype],
            "shape": list(y.shape),
            "data_offsets": [self._offset, end],
        }
        self._offset = end

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is None:
                self._finish()
        except BaseException:
            try:
                self._data.close()
            finally:  # the staging folder removed, whatever closing raised
                self._ctx.__exit__(*sys.exc_info())
            raise
        # the block raised (else _finish closed the file): its error is the one to report, and
        # the staging folder goes whatever closing the file says (e.g. a full disk again)
        with contextlib.suppress(OSError):
            self._data.close()
        return bool(self._ctx.__exit__(exc_type, exc, tb))

    def _finish(self) -> None:
        names = sorted(self.ranks, key=natural_key)
        if not names:
            raise InputError(f"{_FN}: no module was added; nothing to write.")
        if self._names is not None:
            missing = [n for n in self._names if n not in self.ranks]
            if missing:
                raise InputError(
                    f"{_FN}: {len(missing)} of the {len(self._names)} modules named were never "
                    f"added ({_checks.few(missing)}); nothing was written."
                )
        self.config = saved_config(self._base, self._config, names, self.ranks, fn=_FN)
        text = config_text(self.config, fn=_FN)
        self._data.close()
        # the safetensors package's layout, byte for byte: tensors in name order (one dtype),
        # a compact JSON header padded with spaces to 8 bytes
        entries, offset = {}, 0
        for key in sorted(self._entries):
            e = self._entries[key]
            start, end = e["data_offsets"]
            entries[key] = {**e, "data_offsets": [offset, offset + end - start]}
            offset += end - start
        header = json.dumps(
            {"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")
        ).encode()
        header += b" " * (-len(header) % 8)
        with open(self._tmp / WEIGHTS_NAME, "wb") as f, open(self._tmp / _DATA, "rb") as data:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for key in entries:  # one tensor in memory at a time
                start, end = self._entries[key]["data_offsets"]
                data.seek(start)
                f.write(data.read(end - start))
        (self._tmp / _DATA).unlink()
        (self._tmp / CONFIG_NAME).write_text(text, encoding="utf-8")


def _check_names(names: Any) -> list[str]:
    """``names=``: a non-empty sequence of distinct module names (not one string)."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise InputTypeError(
            f"{_FN}: names is a {type(names).__name__}; expected a list of PEFT module names "
            "(e.g. nu.peft.open_adapters(...).names), or None."
        )
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise InputTypeError(f"{_FN}: names holds {bad[0]!r}; every name is a non-empty string.")
    if not names:
        raise InputError(f"{_FN}: names=[] names no module; pass every module's name, or None.")
    twice = sorted(n for n, c in collections.Counter(names).items() if c > 1)
    if twice:
        raise InputError(f"{_FN}: names lists {_checks.few(twice)} more than once.")
    return list(names)
