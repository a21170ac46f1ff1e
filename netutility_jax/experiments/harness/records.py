"""The experiments' outputs, written once, and where they came from.

The experiments use the library through its public API only (``import netutility_jax as nu``):
what they write with is the library's public :mod:`netutility_jax.provenance`
(``nu.provenance``), named here for the experiments' modules. A reader never sees a
half-written file or folder, and a failed write leaves nothing behind:

* :func:`atomic_file` / :func:`write_json`: a temporary file in the target's folder, renamed
  over the target (``os.replace``) once it is complete.
* :func:`atomic_directory`: a private staging folder next to the target, moved into place by one
  ``os.rename`` (POSIX replaces an empty folder and refuses a non-empty one), removed on failure.
* :func:`to_jsonable`: numpy / JAX values, sets, enums and paths as plain JSON values
  (non-finite floats as ``null``).
* :func:`versions` and :func:`commit`: the installed versions (:data:`DISTRIBUTIONS`) and the
  library checkout's commit, which every ``results.json`` records.

What is moved into place gets the modes a plain ``open()`` / ``mkdir()`` would give (the user's
umask), not the private modes of ``mkstemp`` / ``mkdtemp``.

Example:
  >>> import json, pathlib, tempfile
  >>> out = pathlib.Path(tempfile.mkdtemp()) / "results.json"
  >>> write_json(out, {"seeds": {2, 0, 1}, "delta": float("nan")}, sort_keys=True)
  >>> json.loads(out.read_text())
  {'delta': None, 'seeds': [0, 1, 2]}
"""

from __future__ import annotations

from netutility_jax import provenance

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
DISTRIBUTIONS = provenance.DISTRIBUTIONS

atomic_directory = provenance.atomic_directory
atomic_file = provenance.atomic_file
commit = provenance.commit
to_jsonable = provenance.to_jsonable
versions = provenance.versions
write_json = provenance.write_json
