"""Where a result came from: the versions of the library and its dependencies (the commit of a
checkout is :func:`netutility_jax.provenance.commit`).

One helper for every place that records provenance (``netutility --version`` style bug reports,
the experiments' ``results.json``).
"""

from __future__ import annotations

import importlib.metadata
import platform

__all__ = ["DISTRIBUTIONS", "versions"]

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
