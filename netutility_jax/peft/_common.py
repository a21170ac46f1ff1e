"""What every part of :mod:`netutility_jax.peft` shares: the checkpoint's file and key names, the
order of module names, and how values from files are quoted in messages."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import InputTypeError

__all__ = [
    "CONFIG_NAME",
    "PICKLE_NAME",
    "PREFIX",
    "WEIGHTS_NAME",
    "check_flag",
    "clip_repr",
    "natural_key",
    "safetensors_module",
    "save_tensors",
]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
PREFIX = "base_model.model."


def safetensors_module():
    """The ``safetensors`` package (with ``safetensors.numpy``); without it, an ImportError
    saying what to install."""
    try:
        import safetensors
        import safetensors.numpy
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "nu.peft needs the 'safetensors' package (no torch needed): pip install safetensors, "
            "or pip install 'netutility-jax[peft]'."
        ) from e
    return safetensors


def save_tensors(tensors: Mapping[str, Any], path: str | os.PathLike) -> None:
    """``{key: numpy array}`` written to the safetensors file ``path`` as PEFT writes its
    weights (``{"format": "pt"}`` metadata); a failed write (a full disk, a file-size limit,
    permissions) is the :class:`OSError` it is, naming ``path``."""
    # safetensors.numpy.save_file reports a failed write as its own SafetensorError
    st = safetensors_module()
    try:
        st.numpy.save_file(dict(tensors), os.fspath(path), metadata={"format": "pt"})
    except st.SafetensorError as e:
        text = str(e)
        m = re.search(r"os error (\d+)", text)
        if m is None and "I/O error" not in text:
            raise
        code = int(m[1]) if m is not None else errno.EIO
        raise OSError(code, os.strerror(code), os.fspath(path)) from e


def clip_repr(x: Any, n: int = 120) -> str:
    """``repr(x)``, cut to about ``n`` characters (values from files can be arbitrarily long)."""
    s = repr(x)
    return s if len(s) <= n else f"{s[: n - 10]}...' ({len(s)} characters)"


def natural_key(name: str) -> list[Any]:
    # "layers.2" before "layers.10"
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]


def check_flag(value: Any, name: str, *, fn: str) -> None:
    # not _checks.check_bool: the tests pin this message, which quotes the value without its type
    if not isinstance(value, (bool, np.bool_)):
        raise InputTypeError(f"{fn}: {name}={clip_repr(value)}; expected True or False.")
