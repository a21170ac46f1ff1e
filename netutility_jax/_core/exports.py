"""Traced programs kept across processes: a kernel's ``jax.export``, so that a later process
skips tracing and lowering it.

A warm ``netutility merge`` of a small set spends most of its time after the imports in JAX
tracing and lowering its one program (about 0.8 s of 1.1 s on 2 cores) before JAX's persistent
compilation cache can even be asked for the compiled code. With a folder set
(:func:`set_folder`; the command line sets one inside its compilation cache), each kernel
(:func:`~netutility_jax._core.executables.kernel`, unless made with ``export=False``) is
exported (``jax.export.export``: StableHLO in JAX's own serialized form, flatbuffers, nothing
pickled, no compiled code) and stored under a key of
everything its trace depends on (:func:`key`): the library's source files, JAX's and jaxlib's
versions, the backend and its devices, ``jax_enable_x64``, the kernel, its compiler options,
the static arguments' reprs and every other argument's tree structure, shape, dtype and weak
type. A later process with the same key deserializes it and runs ``exported.call`` under
``jax.jit`` (the same compiler options), whose compiled code JAX's persistent cache serves.

Taken only by calls outside any trace whose array arguments each live on one device, and only
where ``flatbuffers`` (JAX's serialization needs it) is installed. Anything that fails on the
way (a kernel JAX cannot export, an unreadable or stale file, a folder that cannot be written)
leaves the call to the kernel's plain ``jax.jit``, with its results and its errors: the cache
changes how long a call takes, never what it returns. Files are written to a temporary name
and renamed into place.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

__all__ = ["SUFFIX", "call", "clear", "folder", "key", "set_folder", "wanted"]

#: The suffix of a stored export (``<key>.jaxexport``).
SUFFIX = ".jaxexport"

_FOLDER: pathlib.Path | None = None
_CALLS: dict[str, Callable] = {}  # key -> jax.jit(exported.call), this process
_FAILED: set[str] = set()  # keys JAX could not export: the plain jit from then on
_SOURCE: list[str] = []  # the library's source digest, once computed
_REGISTERED: set[type] = set()  # the library's NamedTuple types, registered with jax.export
_SCANNED: list[int] = [0]  # len(sys.modules) at the last scan


def _register() -> None:
    """Register with ``jax.export`` every NamedTuple type of the library's imported modules (a
    serialized tree names the types of its nodes, and a later process must know them before it
    reads the tree), scanning again only when modules were imported since the last scan."""
    if len(sys.modules) == _SCANNED[0]:
        return
    _SCANNED[0] = len(sys.modules)
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "netutility_jax" or name.startswith("netutility_jax.")):
            continue
        for obj in list(vars(mod).values()):
            if (
                isinstance(obj, type)
                and issubclass(obj, tuple)
                and hasattr(obj, "_fields")
                and obj.__module__ == name
                and obj not in _REGISTERED
            ):
                _REGISTERED.add(obj)
                try:
                    jax.export.register_namedtuple_serialization(
                        obj, serialized_name=f"{name}.{obj.__qualname__}"
                    )
                except ValueError:  # (registered already, by another route)
                    pass


def set_folder(path: str | os.PathLike | None) -> None:
    """Keep exports in ``path`` (created when first written), or none (None: the default)."""
    global _FOLDER
    _FOLDER = None if path is None else pathlib.Path(path)
    clear()


def folder() -> pathlib.Path | None:
    """The folder set by :func:`set_folder`, or None."""
    return _FOLDER


def clear() -> None:
    """Forget this process's loaded exports (the files stay)."""
    _CALLS.clear()
    _FAILED.clear()


def _source_digest() -> str:
    """sha256 of every source file of the library (path and contents), computed once."""
    if not _SOURCE:
        root = pathlib.Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for p in sorted(root.rglob("*.py")):
            h.update(p.relative_to(root).as_posix().encode() + b"\0")
            h.update(p.read_bytes() + b"\0")
        _SOURCE.append(h.hexdigest())
    return _SOURCE[0]


def wanted(
    args: Sequence[Any], kwargs: Mapping[str, Any], static: Sequence[str], first_static: int
) -> bool:
    """Whether a call with these arguments takes the export cache: a folder is set,
    ``flatbuffers`` is installed, no static argument is given positionally (``first_static``:
    the position of the kernel's first static parameter), and no argument is a tracer or an
    array spread over several devices."""
    if _FOLDER is None or len(args) > first_static:
        return False
    if importlib.util.find_spec("flatbuffers") is None:
        return False
    dynamic = {k: v for k, v in kwargs.items() if k not in static}
    for x in jax.tree.leaves((tuple(args), dynamic)):
        if isinstance(x, jax.core.Tracer):
            return False
        if isinstance(x, jax.Array) and len(x.sharding.device_set) != 1:
            return False
    return True


def key(
    name: str,
    options: Mapping[str, Any] | None,
    static: Mapping[str, Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> str:
    """The stored export's name: sha256 of what a trace of kernel ``name`` depends on (see the
    module docstring); ``static`` the static keyword arguments, ``kwargs`` the others."""
    leaves, tree = jax.tree.flatten((tuple(args), dict(kwargs)))
    avals = [jax.typeof(x) for x in leaves]
    dev = jax.devices()[0]
    what = {
        "source": _source_digest(),
        "jax": jax.__version__,
        "jaxlib": getattr(importlib.import_module("jaxlib"), "__version__", "?"),
        "backend": [jax.default_backend(), dev.platform, dev.device_kind, jax.device_count()],
        "x64": bool(jax.config.jax_enable_x64),
        "kernel": name,
        "options": sorted((k, repr(v)) for k, v in (options or {}).items()),
        "static": sorted((k, repr(v)) for k, v in static.items()),
        "tree": str(tree),
        "avals": [[list(a.shape), str(a.dtype), bool(a.weak_type)] for a in avals],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _load(path: pathlib.Path, tree: Any) -> Any:
    """The export stored at ``path``, or None (absent, unreadable, or not for ``tree``)."""
    try:
        data = path.read_bytes()
        exp = jax.export.deserialize(bytearray(data))
    except Exception:  # (any failure: traced again and written over)
        return None
    return exp if exp.in_tree == tree else None


def _store(path: pathlib.Path, data: bytes) -> None:
    """``data`` written to ``path`` through a temporary file renamed into place (a folder that
    cannot be written: nothing stored)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX, dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def call(
    jitted: Callable,
    name: str,
    options: Mapping[str, Any] | None,
    static: Sequence[str],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> Any:
    """``jitted(*args, **kwargs)`` through the export cache (see the module docstring):
    ``options`` the compiler options ``jitted`` compiles with, ``static`` its static argument
    names. Call only where :func:`wanted` says so."""
    assert _FOLDER is not None
    _register()
    st = {k: v for k, v in kwargs.items() if k in static}
    dynamic = {k: v for k, v in kwargs.items() if k not in static}
    try:
        k = key(name, options, st, args, dynamic)
    except Exception:  # (an argument without an abstract value: the plain jit says what)
        return jitted(*args, **kwargs)
    fn = _CALLS.get(k)
    if fn is None and k not in _FAILED:
        path = _FOLDER / f"{k}{SUFFIX}"
        exp = _load(path, jax.tree.structure((tuple(args), dynamic)))
        if exp is None:
            try:
                exp = jax.export.export(jitted)(*args, **kwargs)
                data = exp.serialize()
            except Exception:  # (one JAX cannot export: the plain jit, with its own errors)
                _FAILED.add(k)
                return jitted(*args, **kwargs)
            _store(path, bytes(data))
        fn = jax.jit(exp.call, compiler_options=dict(options)) if options else jax.jit(exp.call)
        _CALLS[k] = fn
    if fn is None:
        return jitted(*args, **kwargs)
    return fn(*args, **dynamic)
