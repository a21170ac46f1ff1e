"""The SHA-256 digests a merge report records of its inputs: an adapter folder's files
(:func:`adapter_digest`) and a file's bytes (:func:`file_digest`), each taken once per run
while the files keep the identities they had when hashed (:func:`file_identity`)."""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = [
    "ADAPTER_FILES",
    "adapter_digest",
    "clear_digests",
    "file_digest",
    "file_identity",
    "seen_digest",
]

ADAPTER_FILES = re.compile(r"adapter_config\.json|adapter_model.*")
"""The files of an adapter folder that its digest covers (:func:`adapter_digest`): its config
and every weights file (safetensors, shards and their index, the pickled ``.bin``)."""


_SETTLE_NS = 2 * 10**9
"""A file is hashed once per run (:func:`adapter_digest`, :func:`file_digest`): its digest is kept
with its identity (:func:`file_identity`) and taken again only if that changed. A file modified
or changed less than this long before it was hashed is hashed again each time: its times might
not change on a second write within the file system's timestamp granularity (git's "racy"
entries)."""

_SEEN: dict[Any, tuple[Any, str]] = {}
"""This run's digests (cleared by :func:`clear_digests`): by absolute path of an adapter folder or
a moments file, its files' identities and the SHA-256 taken from them."""


def file_identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What says a file is the one hashed before: device, inode, size, modification and change
    times (ns). A write changes the modification time, a rename-over the inode, ``touch -d``
    or ``cp -p`` over it the change time."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _settled(ident: tuple[int, int, int, int, int], start_ns: int) -> bool:
    """Whether a file of identity ``ident`` hashed from ``start_ns`` on may be trusted unchanged
    while its identity is: modified and changed :data:`_SETTLE_NS` before."""
    return max(ident[3], ident[4]) < start_ns - _SETTLE_NS


def seen_digest(path: str, ident: tuple[int, int, int, int, int]) -> str | None:
    """The SHA-256 this run took of the file at ``path`` (a moments file) if it still has the
    identity ``ident`` it had then and was settled (:func:`_settled`); else None."""
    hit = _SEEN.get(("file", os.path.abspath(path)))
    return hit[1] if hit is not None and hit[0] == ident else None


def adapter_digest(folder: str, what: str) -> str:
    """The SHA-256 of an adapter folder's files as they are now (:data:`ADAPTER_FILES`, in
    name order; each file's name, size and bytes), which a merge report records per adapter so
    that a replay notices an adapter changed since.

    The files are read once per run: a folder whose files all have the identities
    (:func:`file_identity`) they had when this run hashed them, and had not just been modified
    then (:data:`_SETTLE_NS`), gets that digest again without being read.

    Raises:
      MissingFileError, FileAccessError: the folder or a file of it cannot be read (``what``
        names it).
    """
    import hashlib
    import time

    from ..errors import FileAccessError, MissingFileError

    try:
        files = sorted(
            e.name for e in os.scandir(folder) if ADAPTER_FILES.fullmatch(e.name) and e.is_file()
        )
        now = tuple(file_identity(os.stat(os.path.join(folder, n))) for n in files)
        key = ("folder", os.path.abspath(folder))
        hit = _SEEN.get(key)
        if hit is not None and hit[0] == (tuple(files), now):
            return hit[1]
        start = time.time_ns()
        h = hashlib.sha256()
        read = []
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                before = file_identity(os.fstat(f.fileno()))
                h.update(f"{name}\0{before[2]}\0".encode())
                while block := f.read(1 << 24):
                    h.update(block)
                after = file_identity(os.fstat(f.fileno()))
            read.append(before if before == after else None)
    except (FileNotFoundError, NotADirectoryError):
        raise MissingFileError(f"{what}: {folder} is gone.") from None
    except PermissionError:
        raise FileAccessError(f"{what}: {folder} cannot be read (permission denied).") from None
    except OSError as e:
        raise FileAccessError(f"{what}: {folder} cannot be read ({e.strerror or e}).") from None
    digest = h.hexdigest()
    _SEEN.pop(key, None)
    if tuple(read) == now and all(_settled(i, start) for i in now):
        _SEEN[key] = ((tuple(files), now), digest)
    return digest


def clear_digests() -> None:
    """Forget the digests taken so far: each file is hashed afresh (a new run)."""
    _SEEN.clear()


def file_digest(path: str) -> str:
    """The SHA-256 of the file at ``path`` (read in blocks), kept with its identity for
    :func:`seen_digest` if it had settled. An ``OSError`` is the caller's to word."""
    import hashlib
    import time

    h = hashlib.sha256()
    key = ("file", os.path.abspath(path))
    _SEEN.pop(key, None)
    start = time.time_ns()
    with open(path, "rb") as f:
        before = file_identity(os.fstat(f.fileno()))
        while block := f.read(1 << 24):
            h.update(block)
        after = file_identity(os.fstat(f.fileno()))
    digest = h.hexdigest()
    if before == after and _settled(before, start):  # (the merge reads the file again and
        _SEEN[key] = (before, digest)  # need not hash it again: :func:`seen_digest`)
    return digest
