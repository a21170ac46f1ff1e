"""File output, written once: atomic files and folders, and JSON conversion.

Every file the library writes goes through here, so that a reader never sees a half-written
file or folder and a failed write leaves nothing behind:

* :func:`atomic_file` / :func:`write_json`: a temporary file in the target's folder, renamed
  over the target (``os.replace``) once it is complete.
* :func:`atomic_directory`: a private staging folder next to the target, moved into place by
  one ``os.rename`` (POSIX replaces an empty folder and refuses a non-empty one), removed on
  failure.
* :func:`to_jsonable`: numpy / JAX values, sets and enums as plain JSON values (non-finite
  floats as ``null``).

Temporary files and folders are private while they are written (``mkstemp`` / ``mkdtemp``);
what is moved into place gets the modes a plain ``open()`` would give (the user's umask). Their
names carry this host and process (``.NAME.tmp-<host>-<pid>-XXXXXXXX`` folders,
``.NAME.<host>-<pid>-XXXXXXXX.tmp`` files), so that the temporaries a killed process left behind
(``kill -9`` while writing) are removed by the next write into the same folder
(:func:`clean_stale_temporaries`): only names of exactly these patterns, made on this host by a
process that no longer exists and owned by this user.
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import pathlib
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any, Literal

import numpy as np

__all__ = [
    "atomic_directory",
    "atomic_file",
    "clean_stale_temporaries",
    "host_tag",
    "pid_alive",
    "to_jsonable",
    "umask_modes",
    "write_json",
]


def to_jsonable(x: Any) -> Any:
    """``x`` as plain JSON values: mappings (keys as strings), lists, numbers, strings, None.

    Arrays (numpy, JAX) become (nested) lists or scalars, numpy scalars Python scalars, sets sorted
    lists, enums their value, paths strings; non-finite floats become ``None`` (JSON has no NaN).
    Anything else is returned as it is (``json.dumps`` then says what it cannot encode).
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
    if isinstance(x, float):  # (np.float64 too: a float subclass, made a plain float)
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.generic) or (hasattr(x, "shape") and hasattr(x, "dtype")):
        a = np.asarray(x)
        return to_jsonable(a.tolist() if a.ndim else a.item())
    return x


def umask_modes(folder: str | os.PathLike) -> tuple[int, int]:
    """``(file mode, folder mode)`` that a plain ``open()`` / ``mkdir()`` gives in ``folder``.

    Read from a probe file rather than by setting the process umask (not thread-safe).
    """
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


def host_tag() -> str:
    """This host's name as it goes into temporary names (letters and digits, at most 32)."""
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) exists; True when there is no way to tell."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # someone else's process, or no way to tell: keep
        return True
    return True


# mkstemp / mkdtemp draw 8 characters from this alphabet
_TMP_DIR = re.compile(
    r"\.(?P<name>.+)\.tmp-(?P<host>[A-Za-z0-9]+)-(?P<pid>[1-9][0-9]*)-[a-z0-9_]{8}"
)
_TMP_FILE = re.compile(
    r"\.(?P<name>.+)\.(?P<host>[A-Za-z0-9]+)-(?P<pid>[1-9][0-9]*)-[a-z0-9_]{8}\.tmp"
)


def _tmp_prefix(name: str) -> str:
    """``NAME.`` cut so that a temporary's name stays within 255 bytes, with this host and
    process: ``NAME.<host>-<pid>-``."""
    while len(os.fsencode(name)) > 100:
        name = name[:-1]
    return f".{name}."


def clean_stale_temporaries(folder: str | os.PathLike) -> list[pathlib.Path]:
    """Remove the temporaries that killed processes left in ``folder``; return them.

    Only the names :func:`atomic_file` and :func:`atomic_directory` give (``.NAME.tmp-<host>-
    <pid>-XXXXXXXX`` folders, ``.NAME.<host>-<pid>-XXXXXXXX.tmp`` files; never a symlink), made
    on this host by a process that no longer exists, owned by the current user. A live
    process's temporaries are never touched (a reused pid keeps a stale one, never the
    reverse). Failures to look or remove are ignored: this is housekeeping.
    """
    return remove_stale(folder, ((_TMP_DIR, True), (_TMP_FILE, False)))


def remove_stale(
    folder: str | os.PathLike, patterns: Sequence[tuple[re.Pattern, bool]]
) -> list[pathlib.Path]:
    """Remove the entries of ``folder`` whose names match one of ``patterns`` (each with the
    groups ``host`` and ``pid``; ``True``: a folder, ``False``: a regular file, never a symlink),
    made on this host by a process that no longer exists and owned by the current user; return
    them. Failures to look or remove are ignored: this is housekeeping."""
    host, me = host_tag(), os.getpid()
    removed: list[pathlib.Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        found = next(
            ((m, is_dir) for pat, is_dir in patterns if (m := pat.fullmatch(entry.name))), None
        )
        if found is None or found[0]["host"] != host:
            continue
        m, want_dir = found
        pid = int(m["pid"])
        if pid == me or pid_alive(pid):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if st.st_uid != os.getuid():
                continue
            if want_dir and stat.S_ISDIR(st.st_mode):
                shutil.rmtree(entry.path)
            elif not want_dir and stat.S_ISREG(st.st_mode):
                os.unlink(entry.path)
            else:
                continue
        except OSError:
            continue
        removed.append(pathlib.Path(entry.path))
    return removed


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: Literal["w", "wb"] = "wb") -> Iterator[IO]:
    """Write ``path`` atomically: yields a file open on a temporary file in ``path``'s folder,
    renamed over ``path`` when the block ends without an exception, removed otherwise."""
    path = pathlib.Path(path)
    folder = path.parent if str(path.parent) else pathlib.Path(".")
    clean_stale_temporaries(folder)
    fd, tmp = tempfile.mkstemp(
        prefix=f"{_tmp_prefix(path.name)}{host_tag()}-{os.getpid()}-", suffix=".tmp", dir=folder
    )
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.chmod(tmp, umask_modes(folder)[0])
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, obj: Any, *, indent: int = 1, **kwargs: Any) -> None:
    """``obj`` (through :func:`to_jsonable`) as JSON in ``path``, atomically; strict JSON (no NaN)."""
    text = json.dumps(to_jsonable(obj), indent=indent, allow_nan=False, **kwargs) + "\n"
    with atomic_file(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def atomic_directory(
    path: str | os.PathLike,
    *,
    fn: str,
    staging: str | os.PathLike | None = None,
    on_exists: Literal["raise", "keep", "replace"] = "raise",
) -> Iterator[pathlib.Path]:
    """Build a folder in a private staging folder and move it to ``path`` in one rename.

    Args:
      path: the folder to create. An empty folder there is replaced; a non-empty one is handled
        by ``on_exists``.
      fn: the caller's name, for messages.
      staging: the staging folder to use (it must not exist yet; its parent must be ``path``'s);
        default a fresh ``.NAME.tmp-<host>-<pid>-XXXXXXXX`` next to ``path`` (stale ones of
        dead processes are removed first, :func:`clean_stale_temporaries`).
      on_exists: ``"raise"``: :class:`FileExistsError` naming ``path``; ``"keep"``: the folder
        already there is kept and the new one discarded (another writer stored the same thing,
        e.g. a cache entry); ``"replace"``: the old folder is removed first.

    Yields:
      The staging folder. When the block ends without an exception, its modes are set to the
      user's umask and it is renamed to ``path``; otherwise it is removed.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temporaries(path.parent)
    if staging is None:
        prefix = f"{_tmp_prefix(path.name)}tmp-{host_tag()}-{os.getpid()}-"
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=path.parent))
    else:
        tmp = pathlib.Path(staging)
        tmp.mkdir(mode=0o700)
    try:
        yield tmp
        file_mode, dir_mode = umask_modes(tmp)
        for root, dirs, files in os.walk(tmp):
            for d in dirs:
                os.chmod(os.path.join(root, d), dir_mode)
            for f in files:
                os.chmod(os.path.join(root, f), file_mode)
        os.chmod(tmp, dir_mode)
        if on_exists == "replace" and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
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
