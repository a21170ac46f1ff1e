"""Reading a PEFT adapter directory: its paths, ``adapter_config.json`` as JSON, and the keys,
shapes and tensors of ``adapter_model.safetensors`` (which keys are LoRA factors of which module).

Every file of a checkpoint is read here, and only here. A folder without
``adapter_model.safetensors`` (or a sharded adapter's index) may hold the pickled
``adapter_model.bin`` that ``save_pretrained(..., safe_serialization=False)`` writes instead: it
is read in torch's zip format by :mod:`._torch_pickle`, without torch and without running its
pickle (only torch's tensor rebuilders are admitted, as stand-ins that call nothing), behind the
same interface as ``safe_open`` (:class:`_Pickled`), so every reader of this package takes either.
"""

from __future__ import annotations

import json
import os
import pathlib
import stat
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import FileAccessError, InputError, InputTypeError, MissingFileError
from ._common import CONFIG_NAME, PICKLE_NAME, PREFIX, WEIGHTS_NAME, clip_repr, safetensors_module
from ._torch_pickle import LegacyFormat, TorchArchive

__all__ = [
    "INDEX_NAME",
    "READABLE_DTYPES",
    "adapter_directory",
    "check_readable_dtype",
    "factor_keys",
    "factor_pair",
    "load_config",
    "open_weights",
    "read_shapes",
    "read_tensors",
    "weights_file",
]

#: The safetensors dtype codes of floating factors this package reads (float8 through
#: ``ml_dtypes``, which JAX installs; every factor is upcast to float32 when loaded).
READABLE_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


# ---------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------


def _kind(p: pathlib.Path, *, fn: str) -> str:
    """``"missing"``, ``"dir"``, ``"file"`` or ``"other"`` (a pipe, a device ...) for path ``p``."""
    try:
        st = p.stat()
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    except PermissionError as e:
        raise FileAccessError(
            f"{fn}: cannot look at {str(p)!r} (permission denied): a folder on its path is not "
            "accessible to this user. Fix the permissions (chmod) or run as a user who can read "
            "it."
        ) from e
    except OSError as e:  # a symlink loop, a name too long ...
        raise MissingFileError(f"{fn}: cannot use the path {str(p)!r} ({e.strerror or e}).") from e
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    return "file" if stat.S_ISREG(st.st_mode) else "other"


def _readable_file(f: pathlib.Path, what: str, *, fn: str) -> None:
    """Refuse ``f`` unless it is a regular file this process can read."""
    kind = _kind(f, fn=fn)
    if kind == "missing":
        raise MissingFileError(
            f"{fn}: {str(f)!r} does not exist; a PEFT LoRA adapter directory holds {WEIGHTS_NAME} "
            f"and {CONFIG_NAME} (PeftModel.save_pretrained writes both)."
        )
    if kind == "dir":
        raise MissingFileError(
            f"{fn}: {str(f)!r} is a folder, expected {what} (a file); the adapter directory is "
            "malformed: save the adapter again with PEFT's save_pretrained."
        )
    if kind == "other":
        raise InputError(
            f"{fn}: {str(f)!r} is not a regular file (a pipe, socket or device), expected {what}."
        )
    try:
        with open(f, "rb"):
            pass
    except PermissionError as e:
        raise FileAccessError(
            f"{fn}: {str(f)!r} exists but cannot be read (permission denied); make it readable "
            "(chmod a+r) or run as a user who can read it."
        ) from e


def adapter_directory(path: Any, *, fn: str) -> pathlib.Path:
    if not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(
            f"{fn}: an adapter path is a {type(path).__name__} ({clip_repr(path)}); expected a str "
            "or os.PathLike naming the adapter directory."
        )
    p = pathlib.Path(os.fspath(path))
    kind = _kind(p, fn=fn)
    if kind == "missing":
        raise MissingFileError(
            f"{fn}: no such directory {str(p)!r}. Pass the local directory PEFT's save_pretrained "
            f"wrote (it holds {CONFIG_NAME} and {WEIGHTS_NAME}); for a Hugging Face Hub id, "
            "download it first with huggingface_hub.snapshot_download(repo_id)."
        )
    if kind != "dir":
        raise MissingFileError(
            f"{fn}: {str(p)!r} is a file, expected an adapter folder containing {CONFIG_NAME} and "
            f"{WEIGHTS_NAME}; pass its folder (here: {str(p.parent)!r})."
        )
    return p


def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read a PEFT adapter's ``adapter_config.json``.

    Args:
      path: the adapter directory.

    Returns:
      The config as a dict, as written (fields PEFT fills with defaults may be absent). Pass it as
      ``base_config`` to :func:`save_adapter` to carry over the base model, task type and target
      modules.

    Raises:
      FileNotFoundError: (:class:`MissingFileError`) no such directory, no
        ``adapter_config.json`` in it, ``path`` is a file, or ``adapter_config.json`` is a folder.
      PermissionError: (:class:`FileAccessError`) the file exists but cannot be read.
      ValueError: (:class:`InputError`) the file is not valid JSON or not a JSON object.

    Example:
      >>> import json, pathlib, tempfile
      >>> from netutility_jax import peft
      >>> tmp = tempfile.TemporaryDirectory()
      >>> d = pathlib.Path(tmp.name)
      >>> _ = (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
      >>> peft.load_config(d)["r"]
      4
      >>> tmp.cleanup()
    """
    fn = "nu.peft.load_config"
    d = adapter_directory(path, fn=fn)
    f = d / CONFIG_NAME
    _readable_file(f, f"the JSON file {CONFIG_NAME}", fn=fn)
    try:
        with open(f, encoding="utf-8") as fh:
            cfg = json.loads(fh.read())
    except PermissionError as e:
        raise FileAccessError(
            f"{fn}: {str(f)!r} exists but cannot be read (permission denied); make it readable "
            "(chmod a+r) or run as a user who can read it."
        ) from e
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(
            f"{fn}: {str(f)!r} is not valid JSON ({clip_repr(str(e), 200)}); the file is corrupt "
            "or truncated: re-save the adapter with PEFT's save_pretrained."
        ) from e
    if not isinstance(cfg, dict):
        raise InputError(
            f"{fn}: {str(f)!r} holds a JSON {type(cfg).__name__}, expected an object with the "
            "LoraConfig fields (peft_type, r, lora_alpha, target_modules, ...)."
        )
    return cfg


# ---------------------------------------------------------------------------------------------
# Weights: the LoRA factors' keys and shapes
# ---------------------------------------------------------------------------------------------


def weights_file(d: pathlib.Path, *, fn: str) -> pathlib.Path:
    """``d/adapter_model.safetensors``, readable, or else its index (a sharded adapter, as
    ``netutility merge --distributed --keep-shards`` writes), or else the pickled
    ``adapter_model.bin`` (what PEFT writes with ``safe_serialization=False``)."""
    wf = d / WEIGHTS_NAME
    if _kind(wf, fn=fn) == "missing" and _kind(d / INDEX_NAME, fn=fn) == "file":
        return d / INDEX_NAME
    if _kind(wf, fn=fn) == "missing" and _kind(d / PICKLE_NAME, fn=fn) != "missing":
        _readable_file(d / PICKLE_NAME, f"the torch file {PICKLE_NAME}", fn=fn)
        return d / PICKLE_NAME
    _readable_file(wf, f"the safetensors file {WEIGHTS_NAME}", fn=fn)
    return wf


def open_weights(f: pathlib.Path, *, fn: str):
    """``safe_open(f)``, or for an index a :class:`_Sharded` file, or for a pickled
    ``adapter_model.bin`` a :class:`_Pickled` file, with the same interface."""
    if f.name == INDEX_NAME:
        return _Sharded(f, _read_index(f, fn=fn), fn=fn)
    if f.name == PICKLE_NAME:
        return _Pickled(f, fn=fn)
    st = safetensors_module()
    try:
        # numpy: no device copy per tensor (callers upcast and place them); bf16 reads as
        # ml_dtypes.bfloat16, which jax registers with numpy on import
        return _SafeFile(st.safe_open(str(f), framework="numpy"), f, fn=fn)
    except st.SafetensorError as e:
        raise InputError(
            f"{fn}: {str(f)!r} is not a readable safetensors file ({clip_repr(str(e), 200)}); it "
            "is corrupt or truncated (an interrupted download or copy): download or save it again."
        ) from e
    except FileNotFoundError as e:  # safetensors reports any failure to open this way
        _readable_file(f, f"the safetensors file {WEIGHTS_NAME}", fn=fn)
        raise MissingFileError(f"{fn}: could not open {str(f)!r} ({e}).") from e


def _float8_dtypes() -> dict[str, Any]:
    import ml_dtypes

    return {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def check_readable_dtype(f: pathlib.Path, key: str, code: str, *, fn: str) -> None:
    """Refuse a floating dtype code this package cannot read (F4, F6, F8_E8M0 ...), naming the
    file, the tensor and the code; integer codes are left to the factors' dtype check."""
    if code in READABLE_DTYPES or not (code.startswith("F") or code.startswith("BF")):
        return
    what = " (4-bit floats, two to a byte)" if code == "F4" else ""
    raise InputError(
        f"{fn}: {str(f)!r} stores the tensor {clip_repr(key)} as {code}{what}, a dtype this "
        f"library cannot read; LoRA factors are read from {', '.join(READABLE_DTYPES)} "
        "(float8 upcast to float32). Save the adapter in one of these (e.g. bfloat16)."
    )


class _SafeFile:
    """A ``safe_open`` handle whose ``get_tensor`` also reads float8 tensors (the safetensors
    package's numpy reader asks numpy for ``float8_e4m3fn``, which numpy lacks): their bytes
    are read from the file at the header's offsets and viewed as ``ml_dtypes``' float8. Other
    floating dtypes it cannot read (F4 ...) are refused naming the file, tensor and dtype."""

    def __init__(self, handle: Any, f: pathlib.Path, *, fn: str):
        self._h, self._f, self._fn = handle, f, fn
        self._header: tuple[int, dict[str, Any]] | None = None

    def __enter__(self) -> _SafeFile:
        self._h.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._h.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:  # keys, get_slice, metadata ...
        return getattr(self._h, name)

    def get_tensor(self, key: str) -> Any:
        code = self._h.get_slice(key).get_dtype()
        f8 = _float8_dtypes().get(code)
        if f8 is None:
            check_readable_dtype(self._f, key, code, fn=self._fn)
            return self._h.get_tensor(key)
        start, entry = self._entry(key)
        shape = tuple(int(n) for n in entry["shape"])
        lo, hi = (int(x) for x in entry["data_offsets"])
        if hi - lo != int(np.prod(shape, dtype=np.int64)):
            raise InputError(
                f"{self._fn}: {str(self._f)!r} gives {clip_repr(key)} ({code}, shape {shape}) "
                f"{hi - lo} bytes; the file is corrupt: save it again."
            )
        data = np.fromfile(self._f, dtype=np.uint8, count=hi - lo, offset=start + lo)
        if data.size != hi - lo:
            raise InputError(f"{self._fn}: {str(self._f)!r} is truncated at {clip_repr(key)}.")
        return data.view(f8).reshape(shape)

    def _entry(self, key: str) -> tuple[int, dict[str, Any]]:
        """``(offset of the data in the file, the header's entry of key)``."""
        if self._header is None:
            with open(self._f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            self._header = (8 + n, header)
        start, header = self._header
        return start, header[key]


INDEX_NAME = "adapter_model.safetensors.index.json"
"""The index of a sharded adapter: ``{"metadata": {...}, "weight_map": {tensor: shard file}}``
(Hugging Face's layout for sharded checkpoints; PEFT itself reads only ``WEIGHTS_NAME``)."""


def _read_index(f: pathlib.Path, *, fn: str) -> dict[str, pathlib.Path]:
    """``{tensor: shard path}`` from the index ``f``; shards are files beside it."""
    _readable_file(f, f"the JSON index {INDEX_NAME}", fn=fn)
    try:
        index = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(f"{fn}: {str(f)!r} is not valid JSON ({clip_repr(str(e), 200)}).") from e
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise InputError(
            f'{fn}: {str(f)!r} has no weight_map; expected {{"weight_map": {{tensor: shard '
            "file}}}} (a sharded adapter's index)."
        )
    out: dict[str, pathlib.Path] = {}
    for key, name in wmap.items():
        if not isinstance(name, str) or pathlib.Path(name).name != name or name in ("", ".", ".."):
            raise InputError(
                f"{fn}: {str(f)!r} maps {clip_repr(key)} to {clip_repr(name)}; expected the name "
                "of a shard file in the same folder."
            )
        out[str(key)] = f.parent / name
    return out


class _Sharded:
    """The tensors of a sharded adapter behind ``safe_open``'s interface (``keys``,
    ``get_slice``, ``get_tensor``, a context manager): each shard is opened on first use, and
    checked to hold the tensors the index gives it."""

    def __init__(self, index: pathlib.Path, files: dict[str, pathlib.Path], *, fn: str):
        self._index, self._files, self._fn = index, files, fn
        self._open: dict[pathlib.Path, Any] = {}

    def __enter__(self) -> _Sharded:
        return self

    def __exit__(self, *exc: Any) -> None:
        handles, self._open = list(self._open.values()), {}
        for h in handles:
            h.__exit__(None, None, None)

    def keys(self) -> list[str]:
        return list(self._files)

    def _shard(self, key: str) -> Any:
        path = self._files[key]
        if path not in self._open:
            _readable_file(path, f"the shard {path.name} of {INDEX_NAME}", fn=self._fn)
            h = open_weights(path, fn=self._fn).__enter__()
            self._open[path] = h
            have = set(h.keys())
            lost = [k for k, p in self._files.items() if p == path and k not in have]
            if lost:
                raise InputError(
                    f"{self._fn}: {str(self._index)!r} places {clip_repr(lost[0])} in "
                    f"{str(path)!r}, which does not hold it; the sharded adapter is incomplete: "
                    "write it again."
                )
        return self._open[path]

    def get_slice(self, key: str) -> Any:
        return self._shard(key).get_slice(key)

    def get_tensor(self, key: str) -> Any:
        return self._shard(key).get_tensor(key)


class _Pickled:
    """The tensors of a pickled ``adapter_model.bin`` (torch's zip format) behind
    ``safe_open``'s interface (``keys``, ``get_slice`` with ``get_shape`` / ``get_dtype``,
    ``get_tensor``, a context manager).

    Opening reads the archive's directory and its pickle (:class:`._torch_pickle.TorchArchive`:
    nothing in it is run), which gives every tensor's shape and dtype; ``get_tensor`` reads that
    tensor's bytes only, so a merge streamed from disk reads a bin module by module as it reads
    a safetensors file. The legacy (non-zip) format is refused, saying how to re-save it.
    """

    def __init__(self, f: pathlib.Path, *, fn: str):
        self._f, self._fn = f, fn
        try:
            self._archive = TorchArchive(f, fn=fn)
        except LegacyFormat as e:
            raise InputError(
                f"{fn}: {str(f)!r} is in torch's legacy pickle format (torch.save(..., "
                "_use_new_zipfile_serialization=False)), which is not read here: only torch's "
                "default zip format is (without running its pickle). The folder holds only the "
                f"pickled {PICKLE_NAME}: re-save it in the zip format (torch.save(torch.load(f, "
                "weights_only=True), f)), or convert it once with PEFT: "
                "PeftModel.from_pretrained(base_model, dir).save_pretrained(out, "
                f"safe_serialization=True), which writes {WEIGHTS_NAME}."
            ) from e

    def __enter__(self) -> _Pickled:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._archive.close()

    def keys(self) -> list[str]:
        return self._archive.keys()

    def _known(self, key: str) -> str:
        if key not in self._archive.tensors:  # (safe_open raises its own error here)
            raise InputError(
                f"{self._fn}: {str(self._f)!r} holds no tensor {clip_repr(key)}; did the file "
                "change since it was opened?"
            )
        return key

    def get_slice(self, key: str) -> _PickledSlice:
        return _PickledSlice(self._archive.tensors[self._known(key)])

    def get_tensor(self, key: str) -> Any:
        return self._archive.read(self._known(key))


class _PickledSlice:
    """``get_slice``'s answer for a tensor of a pickled file: its shape and dtype code."""

    def __init__(self, info: Any):
        self._info = info

    def get_shape(self) -> list[int]:
        return list(self._info.shape)

    def get_dtype(self) -> str:
        return self._info.code


def read_shapes(fh: Any, wf: pathlib.Path, *, fn: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the open file ``fh``, from its header, in the file's key order."""
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        for k in list(fh.keys()):
            shapes[k] = tuple(fh.get_slice(k).get_shape())
    except safetensors_module().SafetensorError as e:
        raise InputError(
            f"{fn}: {str(wf)!r} is not a readable safetensors file ({clip_repr(str(e), 200)}); it "
            "is corrupt or truncated: download or save it again."
        ) from e
    return shapes


def _split_key(key: str) -> tuple[str, str | None, str | None, str]:
    """``(module, kind, adapter_name, param)``; kind None for a tensor that is not a LoRA part."""
    body = key.removeprefix(PREFIX)
    parts = body.split(".")
    for i, p in enumerate(parts):
        if p.startswith("lora_"):
            rest = parts[i + 1 :]
            param = rest[-1] if rest and rest[-1] in ("weight", "bias") else ""
            names = rest[:-1] if param else rest
            adapter = names[0] if len(names) == 1 else None
            if len(names) > 1:
                return ".".join(parts[:i]), None, None, ""
            return ".".join(parts[:i]), p, adapter, param
    return body, None, None, ""


def factor_keys(
    shapes: Mapping[str, tuple[int, ...]], wf: pathlib.Path, *, strict: bool, fn: str
) -> dict[str, dict[str, str]]:
    """``{module: {"lora_A": key, "lora_B": key}}`` (either may be missing) for the keys of one
    adapter; other tensors are refused (``strict``) or skipped, and non-LoRA parts refused."""
    factors: dict[str, dict[str, str]] = {}
    adapter_names: set[str] = set()
    for k in shapes:
        module, kind, adapter_name, param = _split_key(k)
        if kind is None:
            if strict:
                raise InputError(
                    f"{fn}: {str(wf)!r} holds {clip_repr(k)} {shapes[k]}, which is not a LoRA "
                    "factor (a modules_to_save copy, trainable tokens or a trained bias). A "
                    "merge of LoRA updates cannot carry it; pass strict=False (CLI: "
                    "--skip-non-lora) to skip such tensors."
                )
            continue
        _check_part(k, module, kind, param, wf, fn=fn)
        if adapter_name is not None:
            adapter_names.add(adapter_name)
        slot = factors.setdefault(module, {})
        if kind in slot:
            raise InputError(
                f"{fn}: {str(wf)!r} holds two {kind} tensors for module {clip_repr(module)} "
                f"({clip_repr(slot[kind])} and {clip_repr(k)}); keep one adapter per directory."
            )
        slot[kind] = k
    if len(adapter_names) > 1:
        names = sorted(adapter_names)
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise InputError(
            f"{fn}: {str(wf)!r} holds several adapters "
            f"([{', '.join(clip_repr(n) for n in names[:3])}{more}]); save each with PEFT's "
            "save_pretrained(..., selected_adapters=[name]) and load them one by one."
        )
    if not factors:
        raise InputError(
            f"{fn}: {str(wf)!r} holds no LoRA factors (no '...lora_A.weight' / "
            "'...lora_B.weight' keys); it is not a LoRA adapter."
        )
    return factors


def _check_part(k: str, module: str, kind: str, param: str, wf: pathlib.Path, *, fn: str) -> None:
    """Refuse LoRA-named tensors that are not a plain ``lora_A`` / ``lora_B`` weight."""
    if kind == "lora_magnitude_vector":
        raise InputError(
            f"{fn}: {str(wf)!r} holds the DoRA magnitude {clip_repr(k)}: DoRA adapters are "
            "not scale * B A updates and cannot be merged as LoRA."
        )
    if kind in ("lora_embedding_A", "lora_embedding_B"):
        raise InputError(
            f"{fn}: {str(wf)!r} holds {clip_repr(k)}: LoRA on an embedding layer "
            f"({clip_repr(module)}) is not supported; train the adapter without embedding "
            "layers in target_modules."
        )
    if kind not in ("lora_A", "lora_B"):
        raise InputError(
            f"{fn}: {str(wf)!r} holds {clip_repr(k)} ({clip_repr(kind)}), which is not part of a "
            "LoRA adapter (lora_A / lora_B); was it saved by another PEFT method?"
        )
    if param == "bias":
        raise InputError(
            f"{fn}: {str(wf)!r} holds the bias {clip_repr(k)}: an adapter trained with "
            "lora_bias=true is not a pure scale * B A update and cannot be merged as LoRA."
        )


def factor_pair(
    module: str,
    slot: Mapping[str, str],
    shapes: Mapping[str, tuple[int, ...]],
    wf: pathlib.Path,
    *,
    fn: str,
) -> tuple[str, str]:
    """The ``(lora_A, lora_B)`` keys of ``module``; a factor without its partner is refused."""
    for have, need in (("lora_A", "lora_B"), ("lora_B", "lora_A")):
        if have in slot and need not in slot:
            raise InputError(
                f"{fn}: {str(wf)!r} has {clip_repr(slot[have])} {shapes[slot[have]]} but no "
                f"{need} for module {clip_repr(module)}; the file is incomplete: save the "
                "adapter again."
            )
    return slot["lora_A"], slot["lora_B"]


def read_tensors(folder: str | os.PathLike, *, fn: str) -> tuple[pathlib.Path, dict[str, Any]]:
    """Every tensor of the adapter in ``folder``, as stored: ``(weights file, {key: numpy
    array})``, names, shapes, dtypes and values unchanged (``adapter_model.safetensors``, a
    sharded adapter's index, or the pickled ``adapter_model.bin`` read without torch and without
    running its pickle). ``fn`` starts the messages.

    Raises:
      InputError: a corrupt or truncated file, or one that holds no tensors.
      FileAccessError: a file that cannot be read; MissingFileError: one that vanished.
    """
    st = safetensors_module()
    d = pathlib.Path(folder)
    try:
        wf = weights_file(d, fn=fn)
        with open_weights(wf, fn=fn) as fh:
            tensors = {k: np.ascontiguousarray(fh.get_tensor(k)) for k in fh.keys()}
    except st.SafetensorError as e:
        raise InputError(
            f"{fn}: its tensors cannot be read ({e}); the file is corrupt or truncated: "
            "download or save it again."
        ) from e
    except PermissionError as e:
        raise FileAccessError(f"{fn}: cannot be read ({e}).") from e
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:  # changed under us
        raise MissingFileError(f"{fn}: cannot be read ({e}).") from e
    if not tensors:
        raise InputError(f"{fn}: {str(wf)!r} holds no tensors.")
    return wf, tensors
