"""Compiled kernels kept on disk whole, so that a fresh process neither traces nor lowers them.

JAX's persistent compilation cache saves XLA's compilation, but its key is a hash of the lowered
module: every process still traces each jitted kernel to a jaxpr and lowers it to MLIR before it
can look the executable up. For a small merge that is most of the run (SmolLM2-135M's three
adapters: 37 programs, 2.1 s of tracing and 2.5 s of lowering for 0.9 s of loading on 2 cores).
:func:`kernel` is ``jax.jit`` with a second, earlier cache: keyed by what determines the traced
program (the kernel's name, its static arguments, the arguments' tree, shapes, dtypes, weak types
and shardings, JAX's tracing configuration), the library's source, the versions of jax and jaxlib,
the backend and ``XLA_FLAGS``, it loads the serialized executable
(:mod:`jax.experimental.serialize_executable`) and calls it. A miss traces, lowers and compiles as
``jax.jit`` does (through JAX's own cache when that is on) and stores the executable. The
executable is the one ``jax.jit`` would build (the same lowering and compile options), so the
results are the same bits.

Off unless :func:`enable` names a folder (the command line turns it on with its compilation
cache, ``<cache>/executables``): a library user's process keeps plain ``jax.jit``. CPU only: an
executable loaded without lowering needs jaxlib's LAPACK handlers set up first, which is done
here; on accelerators nothing of the kind is checked, so they keep plain ``jax.jit``. Calls
inside a trace, with dynamic keyword arguments, or while a merge method whose kernel is not the
library's own is registered (its code is not in the key) go straight to ``jax.jit``. A file
that does not load is compiled again and replaced; an executable that does not serialize is
used in this process only.

Loading an executable unpickles it and runs native code, so only files that this user owns
and nobody else can write, in a folder likewise, are read (the folder is created ``0o700``);
any other is compiled again in the process and left alone.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import pickle
import sys
import tempfile
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["Kernel", "enable", "folder", "kernel", "release", "stats"]

_FOLDER: pathlib.Path | None = None
_STATS = {"hits": 0, "loads": 0, "compiles": 0, "bypassed": 0}
_KERNELS: weakref.WeakSet[Kernel] = weakref.WeakSet()  # every kernel, for release()


def enable(path: str | os.PathLike | None) -> None:
    """Keep the kernels' executables in ``path`` (created on first store); None turns it off.
    Executables already loaded in this process stay loaded."""
    global _FOLDER
    _FOLDER = None if path is None else pathlib.Path(path)


def folder() -> pathlib.Path | None:
    """The folder set by :func:`enable` (None: off)."""
    return _FOLDER


def stats() -> dict[str, int]:
    """Counts since the process started: ``hits`` (calls served by an executable held in
    memory), ``loads`` (executables read from the folder), ``compiles`` (misses traced, lowered
    and compiled), ``bypassed`` (calls handed to ``jax.jit``)."""
    return dict(_STATS)


@functools.cache
def _sources() -> str:
    """A hash of the library's top-level modules, which every kernel is traced from (the
    subpackages, command line and experiments hold no kernel)."""
    h = hashlib.sha256()
    root = pathlib.Path(__file__).resolve().parent
    files = sorted(root.glob("*.py"))
    if not files:  # (not installed as files: nothing to key on, nothing kept)
        return ""
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


@functools.cache
def _platform() -> str:
    """What the same program compiles to differently: versions, backend, devices, XLA's flags."""
    import jaxlib

    dev = jax.devices()
    client = dev[0].client
    return repr(
        (
            jax.__version__,
            jaxlib.__version__,
            client.platform,
            client.platform_version,
            tuple((d.id, d.device_kind) for d in dev),
            os.environ.get("XLA_FLAGS", ""),
            sys.version_info[:2],
        )
    )


def _library_methods_only() -> bool:
    """Whether every registered merge method's kernel is the library's own (a user's kernel is
    code outside the key: its stages are not kept)."""
    from . import registry

    return all(
        getattr(s.kernel, "__module__", "").startswith("netutility_jax.")
        for s in registry.METHODS.values()
    )


def _stable(x: Any) -> str | None:
    """``repr(x)`` where it names ``x`` by value in every process; an object shown by address
    (JAX's axis environment) by its slots' values; None where that fails too (not keyable)."""
    text = repr(x)
    if " at 0x" not in text:
        return text
    slots = [s for s in getattr(type(x), "__slots__", ()) if s != "__weakref__"]
    if not slots:
        return None
    text = repr((type(x).__name__, [(s, getattr(x, s, None)) for s in slots]))
    return None if " at 0x" in text else text


def _context() -> str | None:
    """JAX's tracing configuration (x64, dtype promotion, matmul precision, ...) as text, or
    None where some setting has no stable text (or this JAX has no such function)."""
    try:
        from jax._src import config

        parts = [_stable(v) for v in config.trace_context()]
    except Exception:  # (a private function: a JAX without it keeps nothing)
        return None
    return None if any(p is None for p in parts) else repr(parts)


@functools.cache
def _on_cpu() -> bool:
    """Kept executables run on the CPU backend only: on CPU, what a loaded executable needs
    that lowering would have set up is known (:func:`_ensure_runtime`); elsewhere it is not
    tested, so accelerators trace and lower as ``jax.jit`` does."""
    return jax.default_backend() == "cpu"


def _sharding(x: Any) -> Any:
    if not isinstance(x, jax.Array):
        return None  # a host value: placed by the executable as jax.jit places it
    s = x.sharding
    if isinstance(s, jax.sharding.NamedSharding):
        m = s.mesh
        return ("named", m.axis_names, m.devices.shape, tuple(int(d.id) for d in m.devices.flat),
                str(s.spec), bool(x.committed))  # fmt: skip
    return (type(s).__name__, tuple(sorted(int(d.id) for d in s.device_set)), bool(x.committed))


class Kernel:
    """``jax.jit(fun, static_argnames=...)`` with its executables kept in :func:`folder`
    (see the module docstring). Everything else (``lower``, ``trace``, ...) is the jitted
    function's."""

    def __init__(self, fun: Callable, static_argnames: Sequence[str] = ()):
        self._fun = fun
        self._static = tuple(static_argnames)
        self._jit = jax.jit(fun, static_argnames=self._static)
        self._loaded: dict[str, Any] = {}
        name = getattr(fun, "__qualname__", None) or fun.__name__  # (a jnp.ufunc has no qualname)
        self._name = f"{fun.__module__}.{name}"
        functools.update_wrapper(self, fun)
        _KERNELS.add(self)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._jit, attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _FOLDER is None or any(k not in self._static for k in kwargs) or not _on_cpu():
            return self._jit(*args, **kwargs)
        leaves = jax.tree.leaves(args)
        if any(isinstance(x, jax.core.Tracer) for x in leaves) or not _library_methods_only():
            _STATS["bypassed"] += 1
            return self._jit(*args, **kwargs)
        key = self._key(args, kwargs, leaves)
        if key is None:
            _STATS["bypassed"] += 1
            return self._jit(*args, **kwargs)
        exe = self._loaded.get(key)
        if exe is None:
            exe = self._loaded[key] = self._load(key, args, kwargs)
        else:
            _STATS["hits"] += 1
        return exe(*args)

    def _key(self, args: Any, statics: dict[str, Any], leaves: list[Any]) -> str | None:
        """The hash naming the executable of this call, or None (not keyable: jax.jit)."""
        context = _context()
        if not _sources():
            return None
        text = repr(
            (
                self._name,
                sorted(statics.items()),
                str(jax.tree.structure(args)),
                [str(jax.typeof(x)) for x in leaves],
                [_sharding(x) for x in leaves],
                context,
            )
        )
        if context is None or " at 0x" in text:
            return None
        h = hashlib.sha256()
        for part in (_sources(), _platform(), text):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def _path(self, key: str) -> pathlib.Path:
        return _FOLDER / f"{self._name.rsplit('.', 1)[-1]}-{key[:40]}.exe"  # type: ignore[operator]

    def _load(self, key: str, args: Any, statics: dict[str, Any]) -> Any:
        """The executable of ``key``: read from the folder, or compiled and stored there."""
        from jax.experimental import serialize_executable as se

        path = self._path(key)
        trusted = _trusted(path)
        try:
            if not trusted:  # (loading unpickles and runs native code: never another's file)
                raise FileNotFoundError(path)
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            _ensure_runtime()
            exe = se.deserialize_and_load(payload, in_tree, out_tree)
        except FileNotFoundError:
            pass
        except Exception:  # a partial or foreign file: compiled again, and replaced
            pass
        else:
            _STATS["loads"] += 1
            return exe
        compiled = self._jit.lower(*args, **statics).compile()
        _STATS["compiles"] += 1
        if trusted:
            try:
                _store(path, pickle.dumps(se.serialize(compiled)))
            except Exception:  # not serializable, or the folder not writable: this process only
                pass
        return compiled


def _trusted(path: pathlib.Path) -> bool:
    """Whether ``path`` may be loaded (or written): it and its folder, where they exist, are
    this user's and nobody else can write them. A kept executable is a pickle whose loading runs
    native code, so a file another user could have written or replaced is never read (it is
    compiled again, in this process only), as ssh treats its key files."""
    if not hasattr(os, "getuid"):  # (no POSIX owners: the folder's access rules decide)
        return True
    for p in (path, path.parent):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        except OSError:
            return False
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return False
    return True


@functools.cache
def _ensure_runtime() -> None:
    """What lowering a kernel would have set up, before an executable that was not lowered in
    this process runs: jaxlib's CPU LAPACK handlers take their function pointers on the first
    lowering of a LAPACK call (``jax.export`` does the same before calling a deserialized
    module; without it, the first LAPACK call of a loaded executable dereferences null)."""
    from jax._src.lax import linalg

    linalg.initialize_lapack()


def _store(path: pathlib.Path, data: bytes) -> None:
    """``data`` written to ``path`` atomically (a reader never sees part of it)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # (this user's alone)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def release() -> None:
    """Drop the compiled executables of every kernel held in this process (JAX's caches of
    them, and those loaded from :func:`folder`): a later call traces and compiles, or loads,
    again. For callers that know a batch of shapes is done with (a streamed merge, once the
    last chunk of a shape is merged), so that its programs do not stay resident."""
    for k in list(_KERNELS):
        k._loaded.clear()
        k._jit.clear_cache()


def kernel(fun: Callable | None = None, *, static_argnames: Sequence[str] = ()) -> Any:
    """``jax.jit`` as a :class:`Kernel` (a decorator, with or without ``static_argnames``)."""
    if fun is None:
        return functools.partial(kernel, static_argnames=static_argnames)
    return Kernel(fun, static_argnames)
