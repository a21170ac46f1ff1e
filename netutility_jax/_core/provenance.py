"""Where a result came from: the versions of the library and its dependencies, and its commit.

One helper for every place that records provenance (``netutility --version`` style bug reports,
the experiments' ``results.json``).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from typing import Any

__all__ = ["DISTRIBUTIONS", "commit", "versions"]

#: The distributions whose versions a result or a bug report records, in this order.
DISTRIBUTIONS = ("netutility-jax", "jax", "jaxlib", "flax", "optax", "numpy", "safetensors")


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
    """The git commit of the package's checkout: ``{"head": full hash, "dirty": bool}``, with
    None values when the package is not a git checkout (an installed wheel) or git is missing."""
    pkg = os.path.dirname(os.path.abspath(__file__))
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
