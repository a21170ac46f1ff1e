"""Reading the tensors of a file ``torch.save`` wrote, without torch and without running code.

``torch.save`` (its default zip format, torch >= 1.6) writes a zip archive whose entries sit in
one top folder (named after the file; any name is accepted here):

* ``<top>/data.pkl``: a pickle of the saved object, here a state dict (``dict`` or
  ``collections.OrderedDict``) of tensor names to tensors. Each tensor is pickled as a call of
  ``torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
  backward_hooks[, metadata])``, and each storage as a persistent id ``("storage",
  storage_type, key, location, numel)``: ``storage_type`` is ``torch.FloatStorage``,
  ``torch.BFloat16Storage`` ... (``numel`` elements of its dtype), or ``torch.UntypedStorage``
  (``numel`` bytes, with the dtype given to ``_rebuild_tensor_v3``);
* ``<top>/data/<key>``: each storage's raw bytes;
* ``<top>/byteorder``: ``little`` or ``big`` (absent in old files: little).

:class:`TorchArchive` reads ``data.pkl`` with a restricted unpickler (a subclass of
``pickle.Unpickler`` overriding ``find_class`` and ``persistent_load``) that admits only what a
tensor checkpoint needs, the globals of ``torch.load(weights_only=True)``'s contract for plain
tensors: the tensor rebuilders of ``torch._utils`` (``_rebuild_tensor``, ``_rebuild_tensor_v2``,
``_rebuild_tensor_v3``, ``_rebuild_parameter``), ``collections.OrderedDict``, the storage types
and torch's dtypes. Each is replaced by an inert stand-in of this module: a rebuilder records
where the tensor's data is (:class:`TensorInfo`), it reads nothing and calls nothing else. Any
other global (``os.system``, ``builtins.eval``, ``subprocess.Popen`` ...) is refused when the
unpickler meets its name, before any object is built from it, so nothing the file names is ever
called. No other code unpickles the file.

The tensors' bytes are read on demand (:meth:`TorchArchive.read`): a storage's record, then the
tensor's view of it (offset, sizes, strides, which were checked against the record's size when
the pickle was read), copied into a C-contiguous array in native byte order. Two tensors may
view one storage. bfloat16 and float8 arrays are ``ml_dtypes`` types (which JAX installs).

The legacy format (``torch.save(..., _use_new_zipfile_serialization=False)``: several pickles
back to back, then the raw storages) is refused with a message saying how to re-save the file.
"""

from __future__ import annotations

import collections
import io
import math
import pathlib
import pickle
import pickletools
import zipfile
import zlib
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from ..errors import FileAccessError, InputError, MissingFileError
from ._common import clip_repr

__all__ = ["LegacyFormat", "TensorInfo", "TorchArchive"]

_MAX_PICKLE = 1 << 28
"""Largest ``data.pkl`` read (bytes); a state dict of 100k tensors pickles to a few MB."""


class _Dtype(NamedTuple):
    """A torch dtype: its name, the numpy dtype that holds it, its safetensors code."""

    name: str
    numpy: np.dtype
    code: str


_DTYPES = {
    d.name: d
    for d in (
        _Dtype("float32", np.dtype(np.float32), "F32"),
        _Dtype("float64", np.dtype(np.float64), "F64"),
        _Dtype("float16", np.dtype(np.float16), "F16"),
        _Dtype("bfloat16", np.dtype(ml_dtypes.bfloat16), "BF16"),
        _Dtype("float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn), "F8_E4M3"),
        _Dtype("float8_e5m2", np.dtype(ml_dtypes.float8_e5m2), "F8_E5M2"),
        _Dtype("int64", np.dtype(np.int64), "I64"),
        _Dtype("int32", np.dtype(np.int32), "I32"),
        _Dtype("int16", np.dtype(np.int16), "I16"),
        _Dtype("int8", np.dtype(np.int8), "I8"),
        _Dtype("uint64", np.dtype(np.uint64), "U64"),
        _Dtype("uint32", np.dtype(np.uint32), "U32"),
        _Dtype("uint16", np.dtype(np.uint16), "U16"),
        _Dtype("uint8", np.dtype(np.uint8), "U8"),
        _Dtype("bool", np.dtype(np.bool_), "BOOL"),
    )
}
# torch's typed storage classes (the name torch pickles) -> the dtype of their elements
_STORAGES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}
# (module, name) of torch's byte storage; its numel counts bytes
_UNTYPED = {("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage")}


class TensorInfo(NamedTuple):
    """Where one tensor's data is, as the pickle says, checked against its storage record.

    Attributes:
      shape: the tensor's sizes.
      dtype: its numpy dtype (``ml_dtypes.bfloat16`` for bfloat16).
      code: its safetensors dtype code (``"F32"``, ``"BF16"`` ...).
      storage: the key of its storage record (``<top>/data/<key>``).
      offset: the index of its first element in the storage, in elements of ``dtype``.
      stride: its strides, in elements.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    code: str
    storage: str
    offset: int
    stride: tuple[int, ...]


class _StorageType(NamedTuple):
    """What the unpickler gives for a storage class: the dtype of its elements (None: bytes)."""

    dtype: _Dtype | None


class _Storage(NamedTuple):
    """A storage of the archive: its record's key, the dtype of its elements, their number."""

    key: str
    dtype: _Dtype
    numel: int


class _TensorRef:
    """A rebuilt tensor, before its data is read. Not a dict, not settable: a pickle's BUILD
    opcode on it is refused."""

    __slots__ = ("info",)

    def __init__(self, info: TensorInfo):
        object.__setattr__(self, "info", info)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(name)

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError("a tensor takes no state")


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _Unpickler(pickle.Unpickler):
    """``data.pkl``'s unpickler: admits only the globals a tensor checkpoint needs (module
    docstring), each as an inert stand-in; refuses everything else as it is named."""

    def __init__(self, data: bytes, archive: TorchArchive):
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._archive = archive
        self._storages: dict[str, _Storage] = {}
        self._globals = {
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("torch._utils", "_rebuild_tensor"): self._rebuild_tensor,
            ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_tensor_v2,
            ("torch._utils", "_rebuild_tensor_v3"): self._rebuild_tensor_v3,
            ("torch._utils", "_rebuild_parameter"): self._rebuild_parameter,
        }

    # -- what the pickle may name ------------------------------------------------------------

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in self._globals:
            return self._globals[key]
        if module == "torch" and name in _STORAGES:
            return _StorageType(_DTYPES[_STORAGES[name]])
        if key in _UNTYPED:
            return _StorageType(None)
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        raise self._archive._error(
            f"its data.pkl names the global {_named(module, name)}, which is not part of a "
            "tensor checkpoint (only torch's tensor rebuilders, storage types and dtypes, and "
            "collections.OrderedDict are admitted). It was refused before anything was built "
            "or run; torch.load(weights_only=False) would have called it. Do not load this "
            "file with torch unless you trust where it came from."
        )

    def persistent_load(self, pid: Any) -> _Storage:
        a = self._archive
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
            and isinstance(pid[3], str)
            and _int(pid[4])
            and pid[4] >= 0
        ):
            raise a._error(
                f"its data.pkl refers to the persistent object {clip_repr(pid)}; a torch "
                "checkpoint refers only to storages ('storage', storage type, key, location, "
                "numel)."
            )
        _, kind, key, _, numel = pid
        dtype = kind.dtype or _DTYPES["uint8"]
        nbytes = numel * dtype.numpy.itemsize
        have = a._record_size(key)
        if have < nbytes:
            raise a._error(
                f"storage {clip_repr(key)} is {numel} {dtype.name} elements ({nbytes} bytes), but "
                f"its record holds {have} bytes; the file is truncated or corrupt: save it again."
            )
        known = self._storages.get(key)
        if known is not None and known.numel * known.dtype.numpy.itemsize != nbytes:
            raise a._error(
                f"storage {clip_repr(key)} is referred to with two sizes ({known.numel} "
                f"{known.dtype.name}, {numel} {dtype.name}); the file is corrupt."
            )
        self._storages[key] = _Storage(key, dtype, numel)
        return self._storages[key]

    # -- the tensor rebuilders' stand-ins ----------------------------------------------------

    def _rebuild_tensor(self, storage, storage_offset, size, stride) -> _TensorRef:
        return self._tensor(storage, storage_offset, size, stride, None)

    def _rebuild_tensor_v2(
        self, storage, storage_offset, size, stride, requires_grad, backward_hooks,
        metadata=None,
    ) -> _TensorRef:  # fmt: skip
        # (requires_grad, backward hooks and metadata do not change the values: ignored)
        return self._tensor(storage, storage_offset, size, stride, None)

    def _rebuild_tensor_v3(
        self, storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype,
        metadata=None,
    ) -> _TensorRef:  # fmt: skip
        if not isinstance(dtype, _Dtype):
            raise self._archive._error(
                f"a tensor's dtype is {clip_repr(dtype)}; expected one of torch's dtypes."
            )
        return self._tensor(storage, storage_offset, size, stride, dtype)

    def _rebuild_parameter(self, data, requires_grad, backward_hooks) -> _TensorRef:
        if not isinstance(data, _TensorRef):
            raise self._archive._error(
                f"a parameter wraps {type(data).__name__}, not a tensor; the file is corrupt."
            )
        return data

    def _tensor(self, storage, offset, size, stride, dtype: _Dtype | None) -> _TensorRef:
        a = self._archive
        if not isinstance(storage, _Storage):
            raise a._error(f"a tensor's storage is {clip_repr(storage)}; the file is corrupt.")
        dtype = dtype or storage.dtype
        if not (
            _int(offset)
            and isinstance(size, tuple)
            and isinstance(stride, tuple)
            and len(size) == len(stride)
            and all(_int(n) for n in (*size, *stride))
        ):
            raise a._error(
                f"a tensor of storage {clip_repr(storage.key)} has offset {clip_repr(offset)}, "
                f"sizes {clip_repr(size)} and strides {clip_repr(stride)}; expected integers, one "
                "stride per size."
            )
        if len(size) > 32 or any(n >= 1 << 62 for n in (*size, *stride, offset)):
            raise a._error(
                f"a tensor of storage {clip_repr(storage.key)} has {len(size)} sizes "
                f"{clip_repr(size)}; that is not a tensor a checkpoint holds (at most 32 axes, "
                "each below 2**62)."
            )
        if offset < 0 or any(n < 0 for n in (*size, *stride)):
            raise a._error(
                f"a tensor of storage {clip_repr(storage.key)} has offset {offset}, sizes "
                f"{size} and strides {stride}; negative values are not a torch tensor."
            )
        elements = storage.numel * storage.dtype.numpy.itemsize // dtype.numpy.itemsize
        numel = math.prod(size)
        if numel:
            last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
            if last >= elements:
                raise a._error(
                    f"a {dtype.name} tensor of shape {size} (strides {stride}, offset {offset}) "
                    f"needs {last + 1} elements of storage {clip_repr(storage.key)}, which holds "
                    f"{elements}; the file is corrupt."
                )
            if numel > elements:
                raise a._error(
                    f"a {dtype.name} tensor of shape {size} (strides {stride}) views "
                    f"{elements} elements of storage {clip_repr(storage.key)}, a broadcast or "
                    "overlapping view, which is not read; save a contiguous copy "
                    "(tensor.contiguous()) instead."
                )
        info = TensorInfo(size, dtype.numpy, dtype.code, storage.key, offset, stride)
        return _TensorRef(info)


class TorchArchive:
    """The tensors of a file ``torch.save`` wrote (its zip format), read without torch.

    Opening reads the archive's directory and its pickle (:class:`_Unpickler`: torch's tensor
    globals only, nothing called); :meth:`read` reads a tensor's bytes. A context manager;
    :meth:`close` closes the file.

    Args:
      path: the file (e.g. a PEFT ``adapter_model.bin``).
      fn: the caller's name, for messages.

    Attributes:
      tensors: ``{name: TensorInfo}`` in the file's order.

    Raises:
      ValueError: (:class:`InputError`) naming ``path``: not a zip archive (the legacy format,
        a truncated or corrupt file, something else), no ``data.pkl``, a pickle that names any
        global but torch's tensor ones or is not a state dict of tensors, a storage missing or
        smaller than a tensor's view of it.
      FileNotFoundError, PermissionError: (:class:`MissingFileError`,
        :class:`FileAccessError`) the file is missing or cannot be read.

    Example:
      >>> import pickle, pathlib, tempfile, zipfile
      >>> import numpy as np
      >>> from netutility_jax.peft._torch_pickle import TorchArchive
      >>> tmp = tempfile.TemporaryDirectory()
      >>> f = pathlib.Path(tmp.name) / "adapter_model.bin"
      >>> pkl = (b"\\x80\\x02}X\\x01\\x00\\x00\\x00wctorch._utils\\n_rebuild_tensor_v2\\n(("
      ...        b"X\\x07\\x00\\x00\\x00storagectorch\\nFloatStorage\\nX\\x01\\x00\\x00\\x000"
      ...        b"X\\x03\\x00\\x00\\x00cpuK\\x06tQK\\x00K\\x02K\\x03\\x86K\\x01K\\x02\\x86\\x89}tRs.")
      >>> with zipfile.ZipFile(f, "w") as z:
      ...     z.writestr("anything/data.pkl", pkl)
      ...     z.writestr("anything/data/0", np.arange(6, dtype="<f4").tobytes())
      >>> with TorchArchive(f, fn="example") as t:
      ...     t.tensors["w"].shape, t.read("w").tolist()  # a (2, 3) view with strides (1, 2)
      ((2, 3), [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]])
      >>> tmp.cleanup()
    """

    def __init__(self, path: str | pathlib.Path, *, fn: str):
        self.path, self._fn = pathlib.Path(path), fn
        self._zip = self._open()
        try:
            self._top, self._records = self._layout()
            self._big = self._byteorder()
            self.tensors = self._unpickle()
        except BaseException:
            self._zip.close()
            raise

    def __enter__(self) -> TorchArchive:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._zip.close()

    def keys(self) -> list[str]:
        return list(self.tensors)

    def _error(self, what: str) -> InputError:
        return InputError(f"{self._fn}: {str(self.path)!r}: {what}")

    # -- the archive -------------------------------------------------------------------------

    def _open(self) -> zipfile.ZipFile:
        try:
            return zipfile.ZipFile(self.path)
        except FileNotFoundError as e:
            raise MissingFileError(f"{self._fn}: {str(self.path)!r} does not exist.") from e
        except PermissionError as e:
            raise FileAccessError(
                f"{self._fn}: {str(self.path)!r} exists but cannot be read (permission denied)."
            ) from e
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as e:
            raise self._not_zip(e) from e
        except OSError as e:  # a folder, a device ...
            raise self._error(f"cannot be read as a file ({e.strerror or e}).") from e

    def _not_zip(self, e: BaseException) -> InputError:
        """The error for a file that is not a readable zip archive, by what its start shows."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(512)
        except OSError:
            head = b""
        if head[:2] == b"PK":
            return self._error(
                f"is a corrupt or truncated zip archive ({e}); an interrupted download or copy? "
                "Download or save it again."
            )
        if len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5:  # a pickle's PROTO
            return LegacyFormat(
                f"{self._fn}: {str(self.path)!r} is in torch's legacy pickle format "
                "(torch.save(..., _use_new_zipfile_serialization=False)), which is not read "
                "here: only torch's default zip format is (without running its pickle). Re-save "
                "it in the zip format, e.g. torch.save(torch.load(f, weights_only=True), f), or "
                "as safetensors (safe_serialization=True)."
            )
        if head[257:262] == b"ustar":
            return self._error(
                "is a tar archive (torch's oldest checkpoint format), which is not read; re-save "
                "it with a current torch.save, or as safetensors."
            )
        return self._error(
            "is not a file torch.save writes (a zip archive with data.pkl); expected a torch "
            "checkpoint."
        )

    def _layout(self) -> tuple[str, dict[str, zipfile.ZipInfo]]:
        """The archive's top folder and ``{name: entry}`` (an entry named twice is refused)."""
        records: dict[str, zipfile.ZipInfo] = {}
        for info in self._zip.infolist():
            if info.filename in records:
                raise self._error(
                    f"holds the entry {clip_repr(info.filename)} twice; it is corrupt."
                )
            records[info.filename] = info
        tops = [n[: -len("/data.pkl")] for n in records if n.endswith("/data.pkl")]
        tops = [t for t in tops if t and "/" not in t]
        if not tops:
            raise self._error(
                "is a zip archive without <folder>/data.pkl, so not one torch.save wrote; "
                "expected a torch checkpoint."
            )
        if len(tops) > 1:
            raise self._error(
                f"holds {len(tops)} pickles ({', '.join(clip_repr(t) for t in tops[:3])} ...); a "
                "torch checkpoint holds one."
            )
        return tops[0], records

    def _byteorder(self) -> bool:
        """Whether the storages are big-endian (``<top>/byteorder``; absent: little)."""
        info = self._records.get(f"{self._top}/byteorder")
        if info is None:
            return False
        order = self._bytes(info, 16, "byteorder").strip()
        if order not in (b"little", b"big"):
            raise self._error(
                f"its byteorder record says {clip_repr(order)}; expected 'little' or 'big'."
            )
        return order == b"big"

    def _bytes(self, info: zipfile.ZipInfo, limit: int, what: str) -> bytes:
        """The first ``limit`` bytes of a record (all of it, if shorter)."""
        try:
            with self._zip.open(info) as f:
                return f.read(limit)
        except (zipfile.BadZipFile, EOFError, zlib.error, RuntimeError, NotImplementedError) as e:
            # (RuntimeError: an encrypted entry; NotImplementedError: an unknown compression)
            raise self._error(
                f"its {what} record cannot be read ({e}); the file is corrupt or truncated: "
                "save it again."
            ) from e

    def _record_size(self, key: str) -> int:
        info = self._records.get(f"{self._top}/data/{key}")
        if info is None:
            raise self._error(
                f"its pickle refers to the storage {clip_repr(key)}, which the archive does not "
                f"hold (no {clip_repr(f'{self._top}/data/{key}')}); the file is corrupt or "
                "incomplete."
            )
        return info.file_size

    # -- the pickle --------------------------------------------------------------------------

    def _unpickle(self) -> dict[str, TensorInfo]:
        info = self._records[f"{self._top}/data.pkl"]
        if info.file_size > _MAX_PICKLE:
            raise self._error(
                f"its data.pkl is {info.file_size} bytes; a state dict of tensors pickles to "
                f"far less (at most {_MAX_PICKLE} bytes are read)."
            )
        data = self._bytes(info, _MAX_PICKLE + 1, "data.pkl")
        self._check_opcodes(data)
        try:
            obj = _Unpickler(data, self).load()
        except InputError:
            raise
        except RecursionError as e:
            raise self._error("its data.pkl nests too deeply to be a state dict.") from e
        except Exception as e:  # whatever a malformed pickle raises: bad input
            raise self._error(
                f"its data.pkl is not a pickled state dict of tensors ({type(e).__name__}: "
                f"{clip_repr(str(e), 200)}); the file is corrupt or not a torch checkpoint."
            ) from e
        if not isinstance(obj, dict):
            raise self._error(
                f"it holds a pickled {type(obj).__name__}, not a state dict; expected a dict of "
                "tensor names to tensors (what PEFT's save_pretrained writes)."
            )
        out: dict[str, TensorInfo] = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise self._error(
                    f"its state dict has the key {clip_repr(k)}; tensor names are strings."
                )
            if not isinstance(v, _TensorRef):
                raise self._error(
                    f"its state dict holds {clip_repr(k)}: a {type(v).__name__}, not a tensor; "
                    "expected a dict of tensor names to tensors (what PEFT's save_pretrained "
                    "writes)."
                )
            out[k] = v.info
        return out

    def _check_opcodes(self, data: bytes) -> None:
        """Refuse the extension-registry opcodes before unpickling: the C unpickler answers
        them from ``copyreg``'s process-wide cache, without asking :meth:`find_class`.
        (``pickletools.genops`` only parses; it builds and calls nothing.)"""
        try:
            for op, arg, _ in pickletools.genops(data):
                if op.name in ("EXT1", "EXT2", "EXT4"):
                    raise self._error(
                        f"its data.pkl uses the pickle opcode {op.name} (code {clip_repr(arg)}), a "
                        "reference to copyreg's extension registry, which a tensor checkpoint "
                        "never uses; refused before anything was built."
                    )
        except InputError:
            raise
        except Exception as e:  # a malformed pickle: let the unpickler's error not matter
            raise self._error(
                f"its data.pkl is not a valid pickle ({type(e).__name__}: "
                f"{clip_repr(str(e), 200)}); the file is corrupt or truncated: save it again."
            ) from e

    # -- the tensors -------------------------------------------------------------------------

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name``: a new C-contiguous array in native byte order.

        Raises:
          KeyError: no such tensor.
          ValueError: (:class:`InputError`) its storage record is shorter than the pickle said
            (the file changed or is corrupt).
        """
        t = self.tensors[name]
        if math.prod(t.shape) == 0:
            return np.zeros(t.shape, t.dtype)
        info = self._records[f"{self._top}/data/{t.storage}"]
        itemsize = t.dtype.itemsize
        needed = (t.offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride, strict=True))) + 1
        buf = self._bytes(info, needed * itemsize, f"storage {t.storage!r}")
        if len(buf) < needed * itemsize:
            raise self._error(
                f"storage {clip_repr(t.storage)} holds {len(buf)} bytes, but tensor "
                f"{clip_repr(name)} of shape {t.shape} needs {needed * itemsize}; the file is "
                "truncated or changed while read: save it again."
            )
        if self._big and itemsize > 1:
            raw = np.frombuffer(buf, np.dtype(f">u{itemsize}"), count=needed)
            base = raw.astype(f"<u{itemsize}").view(t.dtype)
        else:
            base = np.frombuffer(buf, t.dtype, count=needed)
        view = np.lib.stride_tricks.as_strided(
            base[t.offset :],
            shape=t.shape,
            strides=tuple(s * itemsize for s in t.stride),
            writeable=False,
        )
        return np.array(view, order="C", copy=True)


class LegacyFormat(InputError):
    """A file in torch's legacy (non-zip) pickle format (refused)."""


def _named(module: Any, name: Any) -> str:
    """``'module.name'``, and the Python 3 name a protocol-2 pickle's Python 2 name stands for
    (``__builtin__.eval`` is ``builtins.eval``, ``commands.call`` is ``subprocess.call``)."""
    shown = clip_repr(f"{module}.{name}")
    try:
        import _compat_pickle  # (pickle's own table of the renamed modules)

        m3, n3 = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        m3 = _compat_pickle.IMPORT_MAPPING.get(m3, m3)
    except (ImportError, TypeError):  # (unhashable names from a malformed pickle)
        return shown
    return shown if (m3, n3) == (module, name) else f"{shown} (Python 3's {m3}.{n3})"
