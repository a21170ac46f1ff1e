"""Opening PEFT adapters without reading their weights, and reading chosen modules later.

:func:`open_adapters` makes every check :func:`load_adapters` makes (paths, configs, base model,
factor keys and shapes, per-module ``r`` / ``lora_alpha``, dtypes, shapes across tasks) from the
configs and the safetensors headers only: no tensor data is read. The :class:`AdapterSet` it
returns reads any set of modules on demand (:meth:`AdapterSet.read`), tensor by tensor through
``safe_open``, converted exactly as :func:`load_adapter` converts them. A merge streamed from disk
(:func:`netutility_jax.streaming.merge_adapters_streaming`) reads one chunk of modules at a time,
so its memory does not grow with the number of tasks and modules.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .._core.checks import few
from ..errors import InputError
from ._common import CONFIG_NAME, clip_repr, natural_key, safetensors_module
from ._config import check_placement, union_config
from ._convert import module_from_peft
from ._load import check_adapter_set, check_adapters_compatible, header_modules
from ._read import open_weights

__all__ = ["AdapterSet", "open_adapters"]


class _Entry(NamedTuple):
    """Where one task's module is in its file, and what the header and config say about it."""

    keys: tuple[str, str]  # the lora_A and lora_B keys
    scale: float
    shape_a: tuple[int, ...]  # PEFT's (r, d_in)
    shape_b: tuple[int, ...]  # PEFT's (d_out, r)
    dtypes: tuple[str, str]  # the header's dtype codes ("F32", "BF16", ...)


def _itemsize(code: str) -> int:
    """Bytes per entry of a safetensors dtype code (``"BF16"`` 2, ``"F8_E4M3"`` 1, ``"BOOL"`` 1)."""
    bits = re.match(r"[A-Z]*(\d+)", code)
    return max(1, int(bits.group(1)) // 8) if bits else 1


def _stand_in(code: str) -> np.ndarray:
    """An empty array of a header dtype, for :func:`module_from_peft`'s dtype check without the
    data; floating codes numpy lacks (BF16, F8 ...) stand as float32 (the check only asks
    "floating?")."""
    try:
        dt = safetensors_module().numpy._getdtype(code)
    except (AttributeError, KeyError):
        dt = np.float32
    return np.empty((0, 0), dt)


def _check_dtypes(entry: _Entry, wf: pathlib.Path, *, fn: str) -> None:
    """Refuse non-floating factors from the header alone, with :func:`load_adapter`'s message."""
    a, b = (_stand_in(c) for c in entry.dtypes)
    if not (np.issubdtype(a.dtype, np.floating) and np.issubdtype(b.dtype, np.floating)):
        module_from_peft(a, b, entry.scale, entry.keys, wf, fn=fn)  # raises InputTypeError


def _open_one(path: Any, *, strict: bool, fn: str) -> tuple[pathlib.Path, dict[str, _Entry]]:
    """:func:`load_adapter`'s checks for one adapter, from its config and header: its weights
    file and ``{module: _Entry}`` in natural order."""
    out: dict[str, _Entry] = {}
    with header_modules(path, strict=strict, fn=fn) as (wf, fh, modules):
        for m in modules:
            codes = tuple(fh.get_slice(k).get_dtype() for k in m.keys)
            out[m.module] = _Entry(m.keys, m.scale, *m.shapes, codes)
            _check_dtypes(out[m.module], wf, fn=fn)
    return wf, out


def _shape_only(e: _Entry) -> dict[str, jax.ShapeDtypeStruct]:
    """A module with the factor shapes of ``e`` and no data, for the compatibility checks."""
    (r, d_in), (d_out, _) = e.shape_a, e.shape_b
    return {
        "lora_a": jax.ShapeDtypeStruct((d_in, r), np.float32),
        "lora_b": jax.ShapeDtypeStruct((r, d_out), np.float32),
    }


@dataclasses.dataclass(frozen=True, eq=False)
class AdapterSet:
    """Several PEFT adapters opened for one merge, read module by module on demand.

    What :func:`open_adapters` returns; :func:`load_adapters` holds the same adapters in memory
    (``s.read(s.names)`` equals ``load_adapters(paths).adapters``, array for array).

    Attributes:
      paths: the adapter directories, one per task (as strings).
      names: the union of the adapters' modules, in natural order (``"layers.2"`` before
        ``"layers.10"``), as :attr:`LoadedAdapters.adapters` holds them.
      config: as :attr:`LoadedAdapters.config` (the first config's base-model fields, with target
        fields that cover the union).
      shapes: ``{name: (d_in, d_out, r_max)}``, ``r_max`` the largest rank of any task there.
    """

    paths: tuple[str, ...]
    names: tuple[str, ...]
    config: dict[str, Any]
    shapes: dict[str, tuple[int, int, int]]
    _files: tuple[pathlib.Path, ...] = dataclasses.field(repr=False)
    _entries: tuple[dict[str, _Entry], ...] = dataclasses.field(repr=False)

    @property
    def coverage(self) -> dict[str, tuple[int, ...]]:
        """``{module: (task indices that have it, ...)}`` in :attr:`names` order."""
        return {n: tuple(i for i, e in enumerate(self._entries) if n in e) for n in self.names}

    @property
    def nbytes(self) -> int:
        """Bytes of every task's LoRA factors as stored (bf16 2 per entry, float32 4 ...)."""
        return sum(
            math.prod(shape) * _itemsize(code)
            for entries in self._entries
            for e in entries.values()
            for shape, code in zip((e.shape_a, e.shape_b), e.dtypes, strict=True)
        )

    @property
    def stored_dtypes(self) -> tuple[str, ...]:
        """The factors' dtype codes as stored (``"BF16"``, ``"F32"``, ``"F64"`` ...), sorted."""
        return tuple(sorted({c for es in self._entries for e in es.values() for c in e.dtypes}))

    def read(
        self, names: Iterable[str], *, host: bool = False
    ) -> list[dict[str, dict[str, Any] | None]]:
        """Read the modules ``names`` of every task: one flat adapter per task.

        Each call opens the files with ``safe_open`` and reads only these modules' factors,
        converted as :func:`load_adapter` converts them (kernel layout, upcast to float32,
        ``scale`` from the config).

        Args:
          names: module names from :attr:`names`, each at most once.
          host: the factors as numpy arrays (transposed views of what was read) instead of
            device arrays: for callers that stack them on the host before any computation
            (the streamed merge), which saves a copy to the device and back per factor.

        Returns:
          ``[{name: module or None}]``, one per task, holding exactly ``names`` in that order;
          ``None`` where a task lacks the module.

        Raises:
          ValueError: (:class:`InputError`) a name not in :attr:`names` or given twice; a file
            that changed since it was opened (a factor missing or of another shape).
          TypeError: (:class:`InputTypeError`) as :func:`load_adapter`.
          FileNotFoundError, PermissionError: a file that disappeared or became unreadable.
        """
        fn = "nu.peft.AdapterSet.read"
        names = list(names)
        known = set(self.shapes)
        unknown = [n for n in names if n not in known]
        if unknown or len(set(names)) != len(names):
            what = f"{few(unknown)} not among the adapters' modules" if unknown else "repeated"
            raise InputError(f"{fn}: module names {what}; pass names from AdapterSet.names.")
        return [
            self._read_task(wf, entries, names, fn=fn, host=bool(host))
            for wf, entries in zip(self._files, self._entries, strict=True)
        ]

    @staticmethod
    def _read_task(
        wf: pathlib.Path, entries: Mapping[str, _Entry], names: Sequence[str], *, fn, host
    ):
        out: dict[str, dict[str, Any] | None] = dict.fromkeys(names)
        have = [n for n in names if n in entries]
        if not have:
            return out
        changed = (
            f"{fn}: {str(wf)!r} changed since it was opened (nu.peft.open_adapters); open the "
            "adapters again."
        )
        with open_weights(wf, fn=fn) as fh:
            for n in have:
                e = entries[n]
                try:
                    a, b = fh.get_tensor(e.keys[0]), fh.get_tensor(e.keys[1])
                except safetensors_module().SafetensorError as err:
                    raise InputError(f"{changed} ({clip_repr(str(err), 200)})") from err
                if (tuple(a.shape), tuple(b.shape)) != (e.shape_a, e.shape_b):
                    raise InputError(f"{changed} (module {clip_repr(n)})")
                out[n] = module_from_peft(a, b, e.scale, e.keys, wf, fn=fn, host=host)
        return out


def open_adapters(
    paths: Sequence[str | os.PathLike],
    *,
    strict: bool = True,
    strict_targets: bool = False,
    allow_different_base: bool = False,
) -> AdapterSet:
    """Open several PEFT adapters for one merge without reading their weights.

    Every check of :func:`load_adapters` (the same arguments, the same errors) is made from the
    configs and the safetensors headers; the factors are read later, module by module, with
    :meth:`AdapterSet.read`. This is the input of a merge streamed from disk
    (:func:`netutility_jax.streaming.merge_adapters_streaming`), whose memory holds one chunk of
    modules at a time.

    Args:
      paths, strict, strict_targets, allow_different_base: as for :func:`load_adapters`.

    Returns:
      An :class:`AdapterSet`.

    Raises:
      As :func:`load_adapters` (messages name ``nu.peft.open_adapters``); non-floating factors
      are refused from the header's dtype.

    Example:
      >>> import pathlib, tempfile
      >>> import numpy as np
      >>> from netutility_jax import peft
      >>> rng = np.random.default_rng(0)
      >>> tmp = tempfile.TemporaryDirectory()
      >>> paths = []
      >>> for i in range(2):
      ...     ad = {"model.q": {"lora_a": rng.normal(size=(8, 2)), "lora_b": rng.normal(size=(2, 4))}}
      ...     _ = peft.save_adapter(ad, pathlib.Path(tmp.name) / str(i))
      ...     paths.append(pathlib.Path(tmp.name) / str(i))
      >>> s = peft.open_adapters(paths)
      >>> s.names, s.shapes["model.q"], s.nbytes
      (('model.q',), (8, 4, 2), 192)
      >>> loaded = peft.load_adapters(paths).adapters
      >>> bool(np.array_equal(s.read(["model.q"])[1]["model.q"]["lora_b"], loaded[1]["model.q"]["lora_b"]))
      True
      >>> tmp.cleanup()
    """
    fn = "nu.peft.open_adapters"
    configs, labels = check_adapter_set(
        fn, paths, "pass [path]", strict, strict_targets, allow_different_base
    )
    opened = [_open_one(p, strict=strict, fn=fn) for p in paths]
    files = [str(pathlib.Path(os.fspath(p)) / CONFIG_NAME) for p in paths]
    check_placement(configs, labels, [list(e) for _, e in opened], files=files, fn=fn)
    stand_ins = [{n: _shape_only(e) for n, e in entries.items()} for _, entries in opened]
    check_adapters_compatible(stand_ins, labels, strict_targets=strict_targets, fn=fn)
    names = tuple(sorted({n for _, entries in opened for n in entries}, key=natural_key))
    where = f"{str(pathlib.Path(os.fspath(paths[0])) / CONFIG_NAME)!r}: "
    shapes = {}
    for n in names:
        es = [entries[n] for _, entries in opened if n in entries]
        shapes[n] = (es[0].shape_a[1], es[0].shape_b[0], max(e.shape_a[0] for e in es))
    return AdapterSet(
        paths=tuple(os.fspath(p) for p in paths),
        names=names,
        config=union_config(configs, list(names), where=where, fn=fn),
        shapes=shapes,
        _files=tuple(wf for wf, _ in opened),
        _entries=tuple(entries for _, entries in opened),
    )
