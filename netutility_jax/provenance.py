"""Recording a result: where it came from, and writing it once (``nu.provenance``).

What a script that writes results needs, with the behaviour the library's own outputs have:

* :func:`versions` and :func:`commit`: the installed versions of the library and its
  dependencies (:data:`DISTRIBUTIONS`) and the git commit of a checkout, for a results file to
  record.
* :func:`to_jsonable`: numpy / JAX values, sets, enums and paths as plain JSON values
  (non-finite floats as ``null``, as strict JSON has no NaN).
* :func:`atomic_file`, :func:`write_json` and :func:`atomic_directory`: a reader never sees a
  half-written file or folder, and a failed write leaves nothing behind. A file is written to a
  temporary file in its folder and renamed over the target once complete; a folder is built in
  a private staging folder next to it and moved into place by one rename. What is moved into
  place gets the modes a plain ``open()`` / ``mkdir()`` would give (the user's umask);
  temporaries that a killed process left behind are removed by the next write into the folder.

Example:
  >>> import json, pathlib, tempfile
  >>> import numpy as np
  >>> import netutility_jax as nu
  >>> out = pathlib.Path(tempfile.mkdtemp()) / "results.json"
  >>> nu.provenance.write_json(out, {"accuracy": np.float32(0.5), "versions": versions()})
  >>> json.loads(out.read_text())["accuracy"]
  0.5
"""

from __future__ import annotations

import os
import subprocess
from contextlib import AbstractContextManager
from typing import IO, Any, Literal

from ._core import io as _io
from ._core import provenance as _provenance

__all__ = [
    "DISTRIBUTIONS",
    "atomic_directory",
    "atomic_file",
    "commit",
    "to_jsonable",
    "versions",
    "write_json",
]

#: The distributions whose versions :func:`versions` records, in this order (those installed).
DISTRIBUTIONS: tuple[str, ...] = _provenance.DISTRIBUTIONS


def versions() -> dict[str, str]:
    """``{distribution: version}`` of the :data:`DISTRIBUTIONS` that are installed, in that
    order, and ``"python"``: Python's version.

    Example:
      >>> import platform
      >>> v = versions()
      >>> "numpy" in v, v["python"] == platform.python_version()
      (True, True)
    """
    return _provenance.versions()


def commit(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The git commit of the checkout holding the folder ``path`` (default: this library's
    package folder): ``{"head": the full hash of HEAD, "dirty": bool}``, ``dirty`` when a
    tracked file under ``path`` differs from HEAD (untracked files do not count). Both values
    are None when ``path`` is not in a git checkout (an installed wheel) or git is missing.

    Example:
      >>> c = commit()
      >>> sorted(c), c["head"] is None or len(c["head"]) == 40
      (['dirty', 'head'], True)
    """
    folder = os.path.dirname(os.path.abspath(__file__)) if path is None else os.fspath(path)
    info: dict[str, Any] = {"head": None, "dirty": None}
    for key, cmd in (
        ("head", ["git", "rev-parse", "HEAD"]),
        ("dirty", ["git", "status", "--porcelain", "--untracked-files=no", "--", "."]),
    ):
        try:
            done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return {"head": None, "dirty": None}
        if done.returncode != 0:
            return {"head": None, "dirty": None}
        info[key] = done.stdout.strip() if key == "head" else bool(done.stdout.strip())
    return info


def to_jsonable(x: Any) -> Any:
    """``x`` as plain JSON values: mappings (keys as strings), lists, numbers, strings, None.

    Arrays (numpy, JAX) become (nested) lists or scalars, numpy scalars Python scalars, sets
    sorted lists, enums their value, paths strings; non-finite floats become ``None`` (JSON has
    no NaN). Anything else is returned as it is (``json.dumps`` then says what it cannot encode).

    Example:
      >>> import numpy as np
      >>> to_jsonable({"a": np.float32(0.5), 2: {3, 1}, "b": float("nan"), "c": np.eye(2)})
      {'a': 0.5, '2': [1, 3], 'b': None, 'c': [[1.0, 0.0], [0.0, 1.0]]}
    """
    return _io.to_jsonable(x)


def atomic_file(
    path: str | os.PathLike, mode: Literal["w", "wb"] = "wb"
) -> AbstractContextManager[IO]:
    """Write ``path`` atomically: a context manager yielding a file open (``mode``: text or
    bytes) on a temporary file in ``path``'s folder, renamed over ``path`` when the block ends
    without an exception and removed otherwise (``path`` is then as it was).

    Example:
      >>> import pathlib, tempfile
      >>> d = pathlib.Path(tempfile.mkdtemp())
      >>> with atomic_file(d / "a.txt", "w") as f:
      ...     _ = f.write("done")
      >>> (d / "a.txt").read_text(), sorted(p.name for p in d.iterdir())
      ('done', ['a.txt'])
    """
    return _io.atomic_file(path, mode)


def write_json(path: str | os.PathLike, obj: Any, *, indent: int = 1, **kwargs: Any) -> None:
    """``obj`` (through :func:`to_jsonable`) as strict JSON (no NaN) in ``path``, atomically
    (:func:`atomic_file`), with a final newline; ``kwargs`` go to ``json.dumps`` (e.g.
    ``sort_keys=True``). Nothing is written when ``obj`` cannot be encoded.

    Example:
      >>> import pathlib, tempfile
      >>> p = pathlib.Path(tempfile.mkdtemp()) / "r.json"
      >>> write_json(p, {"b": 1, "a": [0.5, float("inf")]}, sort_keys=True)
      >>> print(p.read_text(), end="")
      {
       "a": [
        0.5,
        null
       ],
       "b": 1
      }
    """
    _io.write_json(path, obj, indent=indent, **kwargs)


def atomic_directory(
    path: str | os.PathLike,
    *,
    fn: str,
    on_exists: Literal["raise", "keep", "replace"] = "raise",
) -> AbstractContextManager[Any]:
    """Build a folder in a private staging folder next to ``path`` and move it there in one
    rename (``path``'s parents are made).

    Args:
      path: the folder to create. An empty folder there is replaced; a non-empty one is handled
        by ``on_exists``.
      fn: the caller's name, for messages.
      on_exists: ``"raise"``: :class:`FileExistsError` naming ``path``; ``"keep"``: the folder
        already there is kept and the new one discarded (another writer stored the same thing,
        e.g. a cache entry); ``"replace"``: the old folder is removed first.

    Returns:
      A context manager yielding the staging folder (a :class:`pathlib.Path`). When the block
      ends without an exception, the staging folder's modes are set to the user's umask and it
      is renamed to ``path``; otherwise it is removed and ``path`` is as it was.

    Example:
      >>> import pathlib, tempfile
      >>> target = pathlib.Path(tempfile.mkdtemp()) / "run"
      >>> with atomic_directory(target, fn="example") as tmp:
      ...     _ = (tmp / "results.json").write_text("{}")
      >>> sorted(p.name for p in target.iterdir())
      ['results.json']
    """
    return _io.atomic_directory(path, fn=fn, on_exists=on_exists)
