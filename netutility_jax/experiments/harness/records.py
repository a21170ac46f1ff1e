"""The experiments' outputs, written once, and where they came from.

The experiments use the library through its public API only (``import netutility_jax as nu``):
this module holds what they write with, so that no experiment reaches into the library's
private I/O. A reader never sees a half-written file or folder, and a failed write leaves
nothing behind:

* :func:`atomic_file` / :func:`write_json`: a temporary file in the target's folder, renamed
  over the target (``os.replace``) once it is complete.
* :func:`atomic_directory`: a private staging folder next to the target, moved into place by one
  ``os.rename`` (POSIX replaces an empty folder and refuses a non-empty one), removed on failure.
* :func:`to_jsonable`: numpy / JAX values, sets, enums and paths as plain JSON values
  (non-finite floats as ``null``).
* :func:`versions` and :func:`commit`: the installed versions and the checkout's commit, which
  every ``results.json`` records.

What is moved into place gets the modes a plain ``open()`` / ``mkdir()`` would give (the user's
umask), not the private modes of ``mkstemp`` / ``mkdtemp``.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from typing import IO, Any, Literal

import numpy as np

import netutility_jax as nu

__all__ = [
    "DISTRIBUTIONS",
    "atomic_directory",
    "atomic_file",
    "commit",
    "to_jsonable",
    "versions",
    "write_json",
]

#: The distributions whose versions a result records, in this order.
DISTRIBUTIONS = ("netutility-jax", "jax", "jaxlib", "flax", "optax", "numpy", "safetensors")


def to_jsonable(x: Any) -> Any:
    """``x`` as plain JSON values: mappings (keys as strings), lists, numbers, strings, None.

    Arrays (numpy, JAX) become (nested) lists or scalars, numpy scalars Python scalars, sets
    sorted lists, enums their value, paths strings; non-finite floats become ``None`` (JSON has
    no NaN). Anything else is returned as it is (``json.dumps`` then says what it cannot encode).

    Example:
      >>> to_jsonable({"a": np.float32(0.5), 2: {3, 1}, "b": float("nan")})
      {'a': 0.5, '2': [1, 3], 'b': None}
    """
    if isinstance(x, Mapping):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, (set, frozenset)):
        try:
            items = sorted(x, key=lambda v: (type(v).__name__, v))
        except TypeError:  # unorderable members: a stable order all the same
            items = sorted(x, key=repr)
        return [to_jsonable(v) for v in items]
    if isinstance(x, enum.Enum):
        return to_jsonable(x.value)
    if isinstance(x, pathlib.PurePath):
        return str(x)
    if isinstance(x, (bool, int, str)) or x is None:
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, np.generic) or (hasattr(x, "shape") and hasattr(x, "dtype")):
        a = np.asarray(x)
        return to_jsonable(a.tolist() if a.ndim else a.item())
    return x


def _umask_modes(folder: pathlib.Path) -> tuple[int, int]:
    """``(file mode, folder mode)`` that a plain ``open()`` / ``mkdir()`` gives in ``folder``
    (read from a probe file rather than by setting the process umask, which is not
    thread-safe)."""
    fd, probe = tempfile.mkstemp(prefix=".netutility-probe.", dir=folder)
    os.close(fd)
    try:
        os.unlink(probe)
        with open(probe, "x"):
            pass
        mode = os.stat(probe).st_mode & 0o666
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)
    return mode, mode | (mode & 0o444) >> 2  # x wherever r: a listable folder


def _prefix(name: str) -> str:
    """``.NAME.``, cut so that a temporary's name stays well within 255 bytes."""
    while len(os.fsencode(name)) > 100:
        name = name[:-1]
    return f".{name}.{os.getpid()}-"


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: Literal["w", "wb"] = "wb") -> Iterator[IO]:
    """Write ``path`` atomically: yields a file open on a temporary file in ``path``'s folder,
    renamed over ``path`` when the block ends without an exception, removed otherwise.

    Example:
      >>> import tempfile
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> with atomic_file(d / "a.txt", "w") as f:
      ...     _ = f.write("done")
      >>> (d / "a.txt").read_text(), sorted(p.name for p in d.iterdir())
      ('done', ['a.txt'])
    """
    path = pathlib.Path(path)
    folder = path.parent if str(path.parent) else pathlib.Path(".")
    fd, tmp = tempfile.mkstemp(prefix=_prefix(path.name), suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.chmod(tmp, _umask_modes(folder)[0])
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, obj: Any, *, indent: int = 1, **kwargs: Any) -> None:
    """``obj`` (through :func:`to_jsonable`) as JSON in ``path``, atomically; strict JSON (no
    NaN). ``kwargs`` go to ``json.dumps`` (e.g. ``sort_keys=True``)."""
    text = json.dumps(to_jsonable(obj), indent=indent, allow_nan=False, **kwargs) + "\n"
    with atomic_file(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def atomic_directory(
    path: str | os.PathLike, *, fn: str, on_exists: Literal["raise", "keep"] = "raise"
) -> Iterator[pathlib.Path]:
    """Build a folder in a private staging folder next to ``path`` and move it there in one
    rename.

    Args:
      path: the folder to create (its parents are made). An empty folder there is replaced; a
        non-empty one is handled by ``on_exists``.
      fn: the caller's name, for messages.
      on_exists: ``"raise"``: :class:`FileExistsError` naming ``path``; ``"keep"``: the folder
        already there is kept and the new one discarded (another writer stored the same thing,
        e.g. a cache entry).

    Yields:
      The staging folder. When the block ends without an exception, its modes are set to the
      user's umask and it is renamed to ``path``; otherwise it is removed.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=_prefix(path.name) + "tmp-", dir=path.parent))
    try:
        yield tmp
        file_mode, dir_mode = _umask_modes(tmp)
        for root, dirs, files in os.walk(tmp):
            for d in dirs:
                os.chmod(os.path.join(root, d), dir_mode)
            for f in files:
                os.chmod(os.path.join(root, f), file_mode)
        os.chmod(tmp, dir_mode)
        try:
            os.rename(tmp, path)
        except OSError as e:
            if on_exists == "keep" and path.exists():
                return
            raise FileExistsError(
                f"{fn}: could not move the output into {str(path)!r} ({e}); something else "
                "wrote there meanwhile. Choose another output directory."
            ) from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def versions() -> dict[str, str]:
    """``{distribution: version}`` of :data:`DISTRIBUTIONS` that are installed, and Python's.

    Example:
      >>> v = versions()
      >>> "jax" in v and "python" in v
      True
    """
    out = {}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    out["python"] = platform.python_version()
    return out


def commit() -> dict[str, Any]:
    """The git commit of the library's checkout: ``{"head": full hash, "dirty": bool}`` (dirty:
    a tracked file of the package changed), with None values when the package is not a git
    checkout (an installed wheel) or git is missing."""
    pkg = os.path.dirname(os.path.abspath(nu.__file__))
    info: dict[str, Any] = {"head": None, "dirty": None}
    for key, cmd in (
        ("head", ["git", "rev-parse", "HEAD"]),
        ("dirty", ["git", "status", "--porcelain", "--untracked-files=no", "--", "."]),
    ):
        try:
            done = subprocess.run(cmd, cwd=pkg, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return {"head": None, "dirty": None}
        if done.returncode != 0:
            return {"head": None, "dirty": None}
        info[key] = done.stdout.strip() if key == "head" else bool(done.stdout.strip())
    return info
