"""The experiments' suites, each a model with its heads, training and evaluation: ``encoder``
(MiniLM, the built-in ``netutility demo``, with ``encoder_eval`` and ``train``), ``language``
(a Llama-family decoder scoring label words, with ``lang_eval`` and ``lang_train``), ``vision``
(CLIP's zero-shot heads) and ``nli`` (a 3-way classification head, ``nli_head``). Each is
declared in the registry, :mod:`netutility_jax.experiments.harness.suites`. Submodules are
imported explicitly; nothing is imported here.

This path was the registry's module before: its names (``suites.register``, ``suites.SUITES``,
...) are still served here, with a ``DeprecationWarning`` naming the registry's module.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__all__: list[str] = []  # nothing is re-exported: import the submodules

_REGISTRY = "netutility_jax.experiments.harness.suites"


def __getattr__(name: str) -> Any:
    registry = importlib.import_module(_REGISTRY)
    if name.startswith("__") or not hasattr(registry, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"{__name__}.{name} moved to {_REGISTRY}.{name}; import it from there (the old path "
        "will be removed)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(registry, name)
