"""One task's input moments as a file (``.safetensors`` or ``.npz``, read without pickle, an
``.npz`` bounded before anything is decompressed): :func:`save_input_moments` and
:func:`load_input_moments`, re-exported by :mod:`netutility_jax.scoring.moments`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._core import tree as _tree
from .._core.checks import brief, short
from ..errors import InputError, InputTypeError
from ._moment_core import InputMoments, from_dense

__all__ = [
    "MOMENTS_FORMAT",
    "NPZ_MAX_RATIO",
    "NPZ_MIN_BYTES",
    "load_input_moments",
    "save_input_moments",
]

# ------------------------------------------------------------------------------------------------
# Files: one task's moments, for `netutility merge --input-moments`
# ------------------------------------------------------------------------------------------------

MOMENTS_FORMAT = "netutility-input-moments"
"""The ``format`` a moments file written by :func:`save_input_moments` declares."""
_NPZ_HEADER = "__netutility__"  # an .npz's header: a 0-d string array holding JSON
NPZ_MAX_RATIO = 64
"""By default an ``.npz`` moments file's arrays may take this many times the file's size once
decompressed (:func:`load_input_moments`; ``np.savez`` stores them uncompressed, ratio 1, and
float data deflates little), or :data:`NPZ_MIN_BYTES`, whichever is more."""
NPZ_MIN_BYTES = 32 * 2**20
"""The least an ``.npz`` moments file's arrays may take once decompressed, by default."""
_NPZ_CHUNK = 2**20  # bytes decompressed at a time
_FORMS = ("second_moment", "factor")


def _suffix(fn: str, path: Any) -> str:
    import os

    name = os.fspath(path)
    suffix = name.rsplit(".", 1)[-1].lower() if "." in os.path.basename(name) else ""
    if suffix not in ("safetensors", "npz"):
        raise InputError(
            f"{fn}: {name} is neither a .safetensors nor an .npz file; a moments file is one of "
            "the two (docs/input_moments.md)."
        )
    return suffix


def save_input_moments(
    moments: Mapping[str, InputMoments | None], path: str | Any, *, form: str = "factor"
) -> None:
    """Write one task's input moments to ``path`` (``.safetensors`` or ``.npz``), the file
    ``netutility merge --input-moments`` reads (one per task, in the adapters' order).

    One array per module, keyed by its name: ``form="factor"`` (default) writes each
    ``InputMoments.factor`` ``(k, d_in)`` as it is, so the merge reads back exactly the moments
    given (bit for bit: the same scores as ``nu.merge_adapters(..., input_moments=[moments,
    ...])``); ``form="second_moment"`` writes ``S = factor^T factor`` ``(d_in, d_in)`` in float64
    (any program can write that form: the file needs no header, see below). Modules whose
    value is None (the data-free geometry) are listed in the header. float32 and float64
    factors are kept as they are; bf16/fp16 ones are written as float32 (exactly).

    The header (safetensors ``__metadata__``, or the ``.npz`` key ``__netutility__`` holding a
    JSON string) is ``{"format": "netutility-input-moments", "version": "1", "form": ...,
    "data_free": [names]}``. A file without one holds second moments ``(d_in, d_in)``.

    Args:
      moments: ``{module name: InputMoments | None}``, as :func:`input_moments` returns.
      path: the file to write (replaced atomically if it exists); its suffix picks the format.
      form: ``"factor"`` or ``"second_moment"``.

    Raises:
      InputError: a suffix other than ``.safetensors``/``.npz``, an unknown ``form``, an empty
        mapping, a reserved name (``__netutility__``), a factor that is not ``(k, d_in)``.
      InputTypeError: a value that is neither an InputMoments nor None.

    Example:
      >>> import numpy as np, tempfile, os
      >>> from netutility_jax.moments import input_moments, save_input_moments, load_input_moments
      >>> x = np.random.default_rng(0).normal(size=(12, 8)).astype(np.float32)
      >>> m = input_moments({"q": x, "v": None})
      >>> path = os.path.join(tempfile.mkdtemp(), "task0.safetensors")
      >>> save_input_moments(m, path)
      >>> back = load_input_moments(path)
      >>> bool(np.array_equal(back["q"].factor, m["q"].factor)), back["v"]
      (True, None)
    """
    import json

    from .._core import io as _io

    fn = "nu.moments.save_input_moments"
    suffix = _suffix(fn, path)
    if form not in _FORMS:
        raise InputError(f"{fn}: form={form!r}; expected 'factor' or 'second_moment'.")
    if not isinstance(moments, Mapping) or not moments:
        raise InputTypeError(
            f"{fn}: expected a non-empty mapping {{module name: InputMoments | None}}, got "
            f"{brief(moments)}."
        )
    arrays: dict[str, np.ndarray] = {}
    data_free = []
    for name, v in moments.items():
        name = str(name)
        if name == _NPZ_HEADER:
            raise InputError(f"{fn}: the module name {name!r} is reserved for the file's header.")
        if v is None:
            data_free.append(name)
            continue
        if not isinstance(v, InputMoments):
            raise InputTypeError(
                f"{fn}: module {short(name)!r} is {brief(v)}; expected an InputMoments (from "
                "nu.input_moments or nu.input_moments_dense) or None."
            )
        f = np.asarray(_tree.unwrap(v.factor))
        if f.ndim != 2 or 0 in f.shape:
            raise InputError(
                f"{fn}: module {short(name)!r} has a factor of shape {f.shape}; expected (k, d_in)."
            )
        if f.dtype not in (np.float32, np.float64):
            f = f.astype(np.float32)
        if form == "second_moment":
            f64 = f.astype(np.float64)
            f = f64.T @ f64
        arrays[name] = np.ascontiguousarray(f)
    header = {"format": MOMENTS_FORMAT, "version": "1", "form": form, "data_free": data_free}
    with _io.atomic_file(path, "wb") as fh:
        if suffix == "safetensors":
            from safetensors.numpy import save

            meta = {**header, "data_free": json.dumps(data_free)}
            fh.write(save(arrays, metadata=meta))
        else:
            np.savez(fh, **arrays, **{_NPZ_HEADER: np.asarray(json.dumps(header))})


def _safetensors_header(fn: str, data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's bytes (``{}`` if none)."""
    import json

    if len(data) < 8:
        raise InputError(f"{fn}: not a safetensors file (only {len(data)} bytes).")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise InputError(f"{fn}: not a safetensors file (its header runs past the end).")
    try:
        head = json.loads(data[8 : 8 + n])
    except (ValueError, UnicodeDecodeError):
        raise InputError(f"{fn}: not a safetensors file (its header is not JSON).") from None
    meta = head.get("__metadata__") if isinstance(head, dict) else None
    return dict(meta) if isinstance(meta, dict) else {}


def _default_max_bytes(size: int) -> int:
    """What the arrays of an ``.npz`` of ``size`` bytes may take once decompressed, by default:
    :data:`NPZ_MAX_RATIO` times the file, at least :data:`NPZ_MIN_BYTES`."""
    return max(NPZ_MIN_BYTES, NPZ_MAX_RATIO * size)


def _read_npz(fn: str, data: bytes, max_bytes: int | None, hint: str) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` archive's bytes, read without pickles and within ``max_bytes``
    decompressed bytes (default :func:`_default_max_bytes`).

    Every member's uncompressed size as the zip's central directory declares it is checked
    (each, and their sum) before anything is decompressed, so a zip bomb is refused at once; the
    members are then decompressed a chunk at a time into a buffer of the declared size, from a
    stream that yields no more than that (a header that under-declares its member cannot make
    it read more: the zip's CRC refuses it), and each ``.npy`` header's shape and dtype must
    account for exactly the bytes read (no array is allocated from a header alone)."""
    import io
    import zipfile
    import zlib

    limit = _default_max_bytes(len(data)) if max_bytes is None else max_bytes
    # (a damaged zip: BadZipFile; a damaged compressed member: zlib.error; an encrypted one:
    # RuntimeError; an unknown compression: NotImplementedError; a cut member: EOFError)
    broken = (
        ValueError, OSError, zipfile.BadZipFile, EOFError, zlib.error, KeyError, RuntimeError,
        NotImplementedError, TypeError, OverflowError, MemoryError,
    )  # fmt: skip
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except broken as e:
        raise InputError(
            f"{fn}: cannot be read as .npz without pickles ({_one(e)}); a moments file holds "
            "plain float arrays."
        ) from None
    with zf:
        infos = zf.infolist()
        seen: set[str] = set()
        total = 0
        for info in infos:
            name = info.filename
            if name in seen:
                raise InputError(f"{fn}: the archive holds member {name!r} twice.")
            seen.add(name)
            total += info.file_size
            if info.file_size > limit or total > limit:
                what = (
                    f"member {name!r} declares {info.file_size:,} bytes once decompressed "
                    f"(from {info.compress_size:,} compressed)"
                    if info.file_size > limit
                    else f"its members declare {total:,} bytes once decompressed (up to member "
                    f"{name!r})"
                )
                raise InputError(
                    f"{fn}: {what}, more than the {limit:,} bytes allowed for this "
                    f"{len(data):,}-byte file (a zip bomb?); moments files are written "
                    f"uncompressed (np.savez, nu.moments.save_input_moments){hint}."
                )
        arrays: dict[str, np.ndarray] = {}
        for info in infos:
            name = info.filename
            key = name[:-4] if name.endswith(".npy") else name
            try:
                arrays[key] = _npz_member(fn, zf, info)
            except InputError:
                raise
            except broken as e:
                raise InputError(
                    f"{fn}: member {name!r} cannot be read ({_one(e)}); the archive is damaged "
                    "(a moments file holds plain float arrays: np.savez, or "
                    "nu.moments.save_input_moments)."
                ) from None
    return arrays


def _npz_member(fn: str, zf: Any, info: Any) -> np.ndarray:
    """One ``.npz`` member as an array: at most its declared size read (then the zip's CRC), its
    ``.npy`` header parsed first and checked against the bytes there are."""
    import io

    name, size = info.filename, info.file_size
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    with zf.open(info) as fh:
        while got < size:
            n = fh.readinto(view[got : min(size, got + _NPZ_CHUNK)])
            if not n:
                break
            got += n
        extra = fh.read(1)  # (the stream itself stops at the declared size; this says so)
    view.release()
    if got != size or extra:
        raise InputError(
            f"{fn}: member {name!r} holds {'more' if extra else f'only {got:,}'} bytes "
            f"{'than' if extra else 'of'} the {size:,} its header declares; the archive is "
            "damaged."
        )
    fp = io.BytesIO(buf)
    fmt = np.lib.format
    if not buf.startswith(fmt.MAGIC_PREFIX):
        raise InputError(
            f"{fn}: member {name!r} is not a .npy array; a moments file holds one plain float "
            "array per module (np.savez, or nu.moments.save_input_moments)."
        )
    version = fmt.read_magic(fp)
    if version == (1, 0):
        shape, fortran, dtype = fmt.read_array_header_1_0(fp)
    elif version == (2, 0):
        shape, fortran, dtype = fmt.read_array_header_2_0(fp)
    else:
        raise InputError(
            f"{fn}: member {name!r} is a .npy array of format version {version}; expected 1.0 or "
            "2.0 (np.savez of a plain float array)."
        )
    if dtype.hasobject:
        raise InputError(
            f"{fn}: cannot be read as .npz without pickles (member {name!r} holds Python "
            f"objects, dtype {dtype}); a moments file holds plain float arrays."
        )
    count = 1
    for d in shape:
        count *= int(d)
    start = fp.tell()
    if count * dtype.itemsize != size - start:
        raise InputError(
            f"{fn}: member {name!r} declares a {dtype} array of shape {tuple(shape)} "
            f"({count * dtype.itemsize:,} bytes) but holds {size - start:,} bytes of data; the "
            "archive is damaged."
        )
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=start)
    if fortran:
        return arr.reshape(tuple(shape)[::-1]).transpose()
    return arr.reshape(tuple(shape))


def _read_file(
    fn: str, suffix: str, data: bytes, max_bytes: int | None = None, hint: str = ""
) -> tuple[dict[str, np.ndarray], dict]:
    """``(arrays by name, header)`` of a moments file's bytes."""
    import json

    if suffix == "safetensors":
        try:
            from safetensors.numpy import load
        except ImportError:
            raise InputError(
                f"{fn}: reading .safetensors needs safetensors (pip install safetensors); or "
                "write the moments as .npz."
            ) from None
        meta = _safetensors_header(fn, data)
        try:
            arrays = load(data)
        except Exception as e:  # (safetensors raises its own SafetensorError, or TypeError)
            raise InputError(f"{fn}: cannot be read as safetensors ({_one(e)}).") from None
        header = dict(meta)
        if "data_free" in header:
            try:
                header["data_free"] = json.loads(header["data_free"])
            except ValueError:
                raise InputError(f"{fn}: its header's data_free is not a JSON list.") from None
    else:
        if not data.startswith((b"PK\x03\x04", b"PK\x05\x06")):  # (np.load would take a .npy)
            what = "a single .npy array" if data.startswith(b"\x93NUMPY") else "no zip archive"
            raise InputError(
                f"{fn}: not an .npz archive ({what}); a moments file holds one plain float "
                "array per module (np.savez, or nu.moments.save_input_moments)."
            )
        arrays = _read_npz(fn, data, max_bytes, hint)
        header = {}
        raw = arrays.pop(_NPZ_HEADER, None)
        if raw is not None:
            try:
                header = json.loads(str(raw[()]))
            except (ValueError, TypeError, IndexError):
                raise InputError(f"{fn}: its {_NPZ_HEADER} entry is not a JSON header.") from None
            if not isinstance(header, dict):
                raise InputError(f"{fn}: its {_NPZ_HEADER} entry is not a JSON mapping.")
    return arrays, header


def _one(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def load_input_moments(
    path: str | Any,
    *,
    data: bytes | None = None,
    what: str | None = None,
    max_bytes: int | None = None,
) -> dict[str, InputMoments | None]:
    """One task's input moments from a file written by :func:`save_input_moments` (or by any
    program: arrays ``(d_in, d_in)`` ``E[x x^T]`` keyed by module name, in ``.safetensors`` or
    ``.npz``; the latter read with ``allow_pickle=False``).

    Second moments are checked as :func:`input_moments_dense` checks them (square, finite,
    symmetric, positive semidefinite, nonzero) and factored; factors (``form: factor`` in the
    header) are checked 2-D, floating, finite and nonzero, and kept as they are. Names in the
    header's ``data_free`` list come back as None (the data-free geometry there).

    Args:
      path: the ``.safetensors`` or ``.npz`` file.
      data: its bytes, if already read (``netutility merge`` reads each file once, for its
        digest too).
      what: how messages name the file (default ``nu.moments.load_input_moments(<path>)``).
      max_bytes: the most bytes an ``.npz``'s arrays may take once decompressed, checked against
        the sizes the archive declares before anything is decompressed (a zip bomb is refused
        at once, in little memory) and enforced while reading. Default: :data:`NPZ_MAX_RATIO`
        (64) times the file's size, at least :data:`NPZ_MIN_BYTES` (32 MiB); files written by
        :func:`save_input_moments` or ``np.savez`` (uncompressed) always fit.

    Returns:
      ``{module name: InputMoments | None}``: one task's entry of ``input_moments=``.

    Raises:
      InputError: another suffix; a file that cannot be read as its format (an ``.npz`` whose
        members declare more than ``max_bytes`` decompressed, or hold other than they declare,
        named by file and member); an unknown header
        ``format`` or ``form``; an array that is not 2-D floating, or (second moments) not
        square, finite, symmetric, PSD; a name both in the file and its data_free list; no
        module at all.
      MissingFileError, FileAccessError: no file at ``path``, or it cannot be read.
    """
    import os

    fn = what or f"nu.moments.load_input_moments({os.fspath(path)!r})"
    suffix = _suffix(fn, path)
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)):
            raise InputTypeError(
                f"nu.moments.load_input_moments: max_bytes is {brief(max_bytes)}; expected a "
                "number of bytes (an int) or None for the default."
            )
        if max_bytes < 0:
            raise InputError(
                f"nu.moments.load_input_moments: max_bytes={int(max_bytes)}; expected >= 0."
            )
    if data is None:
        data = _read_bytes(fn, path)
    hint = "" if what is not None else ", or pass a larger max_bytes="
    arrays, header = _read_file(
        fn, suffix, data, None if max_bytes is None else int(max_bytes), hint
    )
    fmt = header.get("format", MOMENTS_FORMAT)
    if fmt != MOMENTS_FORMAT:
        raise InputError(f"{fn}: its header says format {fmt!r}; expected {MOMENTS_FORMAT!r}.")
    form = header.get("form", "second_moment")
    if form not in _FORMS:
        raise InputError(f"{fn}: its header says form {form!r}; expected one of {_FORMS}.")
    data_free = header.get("data_free", [])
    if not isinstance(data_free, list) or not all(isinstance(n, str) for n in data_free):
        raise InputError(f"{fn}: its header's data_free is not a list of module names.")
    both = sorted(set(data_free) & set(arrays))
    if both:
        raise InputError(
            f"{fn}: module {short(both[0])!r} is both in the file and in its data_free list."
        )
    if not arrays and not data_free:
        raise InputError(f"{fn}: holds no module; expected {{module name: array}}.")
    out: dict[str, InputMoments | None] = {
        name: _loaded(fn, name, arr, form) for name, arr in arrays.items()
    }
    for name in data_free:
        out[name] = None
    return out


def _read_bytes(fn: str, path: Any) -> bytes:
    """The file's bytes, or :class:`MissingFileError` / :class:`FileAccessError` naming it."""
    from ..errors import FileAccessError, MissingFileError

    try:
        with open(path, "rb") as fh:
            return fh.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise MissingFileError(f"{fn}: no such file.") from None
    except PermissionError:
        raise FileAccessError(f"{fn}: cannot be read (permission denied).") from None
    except OSError as e:
        raise FileAccessError(f"{fn}: cannot be read ({e.strerror or e}).") from None


def _loaded(fn: str, name: str, arr: np.ndarray, form: str) -> InputMoments:
    """One module's array of the file as :class:`InputMoments`: a second moment checked and
    factored, or a factor checked (2-D, finite, nonzero) and kept as it is."""
    if not np.issubdtype(arr.dtype, np.floating):
        raise InputTypeError(
            f"{fn}: module {short(name)!r} has dtype {arr.dtype}; expected floating arrays."
        )
    if form == "second_moment":
        # (a signalling NaN in the file would warn as it is cast; the check refuses it)
        with np.errstate(invalid="ignore"):
            return from_dense(fn, name, arr)
    if arr.ndim != 2 or 0 in arr.shape:
        raise InputError(
            f"{fn}: module {short(name)!r} has a factor of shape {tuple(arr.shape)}; "
            "expected (k, d_in) with S = factor^T factor."
        )
    bad = int((~np.isfinite(arr)).sum())
    if bad:
        raise InputError(
            f"{fn}: module {short(name)!r} (factor {tuple(arr.shape)}) has {bad} non-finite "
            "entries (NaN or Inf)."
        )
    if not arr.any():
        raise InputError(
            f"{fn}: module {short(name)!r} (factor {tuple(arr.shape)}) is zero; list the "
            "module as data-free instead (None when saving)."
        )
    return InputMoments(jnp.asarray(arr))
