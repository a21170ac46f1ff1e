"""Orbax checkpoints of adapters, merge results, :class:`nu.Scores` and :class:`nu.Report`.

:func:`save` writes one orbax checkpoint directory with two items:

* ``arrays``: every non-empty array of the object, in a flat dict under index keys ``"a0"``,
  ``"a1"``, ... (module names such as ``"model.layers.0.self_attn.q_proj"`` or
  ``"layers/0/attention/query"`` never become orbax key paths, where "/" and "." are special);
* ``meta``: JSON describing the object's structure (dict keys, NamedTuple and dataclass types,
  Python scalars, each array's kind, shape and dtype), so :func:`restore` rebuilds the same object.

Python floats are stored exactly (``float.hex``, NaN and inf included); empty arrays (a rank-0
merged module's ``(d_in, 0)`` factor) live in the JSON alone, as orbax does not store zero-size
arrays. Orbax writes to a temporary directory and renames it when complete, so a checkpoint either
exists whole or not at all.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from ._core import tree as _tree
from .errors import InputError, InputTypeError, MissingFileError
from .pipeline.merging import Report
from .scoring.decompose import LoraSVD
from .scoring.utility import ModuleScores, Scores

__all__ = ["DATACLASSES", "FORMAT", "NAMED_TUPLES", "VERSION", "restore", "save"]

FORMAT = "netutility-jax"
VERSION = 1
# Types restored by name: a checkpoint never names an arbitrary class to import.
NAMED_TUPLES: dict[str, type] = {"Scores": Scores, "ModuleScores": ModuleScores, "LoraSVD": LoraSVD}
DATACLASSES: dict[str, type] = {"Report": Report}


def _encode(x: Any, arrays: list, where: str) -> dict[str, Any]:
    if x is None:
        return {"t": "none"}
    if isinstance(x, np.generic):  # before float: np.float64 is a float subclass
        return _encode_array(np.asarray(x), "numpy_scalar", arrays, where)
    if isinstance(x, bool):
        return {"t": "bool", "v": x}
    if isinstance(x, int):
        return {"t": "int", "v": int(x)}
    if isinstance(x, float):
        return {"t": "float", "v": float.hex(x)}
    if isinstance(x, str):
        return {"t": "str", "v": x}
    if isinstance(x, jax.Array):
        if isinstance(x, jax.core.Tracer):
            raise InputTypeError(
                f"nu.checkpoint.save: {where} is a traced array; save concrete values, outside jit."
            )
        return _encode_array(x, "jax", arrays, where)
    if isinstance(x, np.ndarray):
        return _encode_array(x, "numpy", arrays, where)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        name = type(x).__name__
        if NAMED_TUPLES.get(name) is not type(x):
            raise InputTypeError(
                f"nu.checkpoint.save: {where} is a {name} NamedTuple; only {sorted(NAMED_TUPLES)} "
                "are restored by type. Convert it to a dict (x._asdict()) first."
            )
        fields = [[f, _encode(getattr(x, f), arrays, f"{where}.{f}")] for f in x._fields]
        return {"t": "namedtuple", "type": name, "fields": fields}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        name = type(x).__name__
        if DATACLASSES.get(name) is not type(x):
            raise InputTypeError(
                f"nu.checkpoint.save: {where} is a {name} dataclass; only {sorted(DATACLASSES)} "
                "are restored by type. Convert it to a dict (dataclasses.asdict) first."
            )
        fields = [
            [f.name, _encode(getattr(x, f.name), arrays, f"{where}.{f.name}")]
            for f in dataclasses.fields(x)
        ]
        return {"t": "dataclass", "type": name, "fields": fields}
    if isinstance(x, (list, tuple)):
        items = [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(x)]
        return {"t": type(x).__name__, "items": items}
    if _tree.is_mapping(x):  # dicts, flax.nnx.State
        items = []
        for k in x.keys():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise InputTypeError(
                    f"nu.checkpoint.save: {where} has a key {k!r} of type {type(k).__name__}; "
                    "keys must be str or int."
                )
            items.append([k, _encode(x[k], arrays, f"{where}[{k!r}]")])
        return {"t": "dict", "items": items}
    if hasattr(x, "get_value"):  # a flax.nnx Variable: its value
        return _encode(x.get_value(), arrays, where)
    raise InputTypeError(
        f"nu.checkpoint.save: {where} is a {type(x).__name__}; expected nested dicts, lists and "
        "tuples of arrays, Python scalars, strings and None, or nu.Scores / nu.Report."
    )


def _encode_array(x: Any, kind: str, arrays: list, where: str) -> dict[str, Any]:
    dtype = np.dtype(x.dtype)
    if not (jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_):
        raise InputTypeError(
            f"nu.checkpoint.save: {where} has dtype {dtype}; only numeric and bool arrays are "
            "stored."
        )
    spec = {"t": "array", "kind": kind, "shape": list(x.shape), "dtype": dtype.name}
    if x.size == 0:  # orbax refuses zero-size arrays; shape and dtype are all there is
        spec["i"] = None
    else:
        spec["i"] = len(arrays)
        arrays.append(x)
    return spec


def save(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` to a new orbax checkpoint directory at ``path`` (never overwrites).

    ``obj`` may be an adapter or merged adapter (nested dicts of arrays and Python scalars, module
    names with "/" and "."), a list of them, a :class:`nu.Scores` (or ``nu.ModuleScores``,
    ``nu.LoraSVD``), a :class:`nu.Report`, or any nesting of dicts (str or int keys), lists,
    tuples, ``jax.Array`` / ``np.ndarray`` (any numeric dtype, bf16 included), numpy scalars,
    Python scalars, strings and None. ``flax.nnx`` Variables are stored as their values and
    ``nnx.State`` as a dict.

    Args:
      path: directory to create; its parent is created if needed.
      obj: the object to store.

    Raises:
      FileExistsError: ``path`` exists (a ``nu.NetUtilityError``).
      TypeError: a leaf of unsupported type (the message gives its location in ``obj``).

    Example:
      >>> import os, tempfile, numpy as np, netutility_jax as nu
      >>> ad = {"model.layers.0.q_proj": {"lora_a": np.ones((4, 2), np.float32),
      ...                                 "lora_b": np.ones((2, 3), np.float32), "scale": 0.5}}
      >>> path = os.path.join(tempfile.mkdtemp(), "adapter")
      >>> nu.checkpoint.save(path, ad)
      >>> back = nu.checkpoint.restore(path)
      >>> back["model.layers.0.q_proj"]["scale"], back["model.layers.0.q_proj"]["lora_b"].shape
      (0.5, (2, 3))
    """
    fn = "nu.checkpoint.save"
    path = os.path.abspath(os.fspath(path))
    if os.path.lexists(path):
        from .errors import PathExistsError

        raise PathExistsError(
            f"{fn}: {path!r} already exists; checkpoints are never overwritten. Pick a new path or "
            "delete the old checkpoint first."
        )
    arrays: list = []
    spec = _encode(obj, arrays, "obj")
    meta = {"format": FORMAT, "version": VERSION, "type": type(obj).__name__, "tree": spec}
    items: dict[str, Any] = {"meta": ocp.args.JsonSave(meta)}
    if arrays:
        items["arrays"] = ocp.args.StandardSave({f"a{i}": a for i, a in enumerate(arrays)})
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
        ckpt.save(path, ocp.args.Composite(**items))


def _is_array_spec(node: Any) -> bool:
    return isinstance(node, dict) and node.get("t") == "array"


def _array_specs(spec: Any) -> list[dict[str, Any]]:
    """The array entries of a saved structure (plain JSON: dicts and lists, walked by jax.tree)."""
    leaves = jax.tree.leaves(spec, is_leaf=_is_array_spec)
    return [x for x in leaves if _is_array_spec(x)]


def _decode(spec: dict[str, Any], arrays: Mapping[str, Any]) -> Any:
    t = spec["t"]
    if t == "none":
        return None
    if t in ("bool", "int", "str"):
        return spec["v"]
    if t == "float":
        return float.fromhex(spec["v"])
    if t == "array":
        dtype = jnp.dtype(spec["dtype"])
        if spec["i"] is None:
            x = np.zeros(spec["shape"], dtype)
        else:
            x = arrays[f"a{spec['i']}"]
        if spec["kind"] == "jax":
            return jnp.asarray(x) if spec["i"] is None else x
        x = np.asarray(x)
        return x[()] if spec["kind"] == "numpy_scalar" else x
    if t == "namedtuple":
        cls = NAMED_TUPLES[spec["type"]]
        return cls(**{k: _decode(v, arrays) for k, v in spec["fields"]})
    if t == "dataclass":
        cls = DATACLASSES[spec["type"]]
        return cls(**{k: _decode(v, arrays) for k, v in spec["fields"]})
    if t == "list":
        return [_decode(v, arrays) for v in spec["items"]]
    if t == "tuple":
        return tuple(_decode(v, arrays) for v in spec["items"])
    if t == "dict":
        return {k: _decode(v, arrays) for k, v in spec["items"]}
    raise InputError(f"unknown node type {t!r}")


def restore(path: str | os.PathLike) -> Any:
    """Read back an object written by :func:`save`, with the same structure and types.

    Dicts come back as ``dict``; NamedTuples and dataclasses as their ``nu`` types (``nu.Scores``
    with its ``nu.ModuleScores``, ``lam`` and ``alpha``; ``nu.Report``); ``jax.Array`` leaves as
    ``jax.Array`` on the default device and ``np.ndarray`` leaves as ``np.ndarray``, each with its
    saved dtype and bitwise-equal values; Python scalars as the same Python scalars.

    Args:
      path: a checkpoint directory written by :func:`save`.

    Returns:
      the saved object.

    Raises:
      MissingFileError: nothing at ``path`` (a ``FileNotFoundError``).
      InputError: ``path`` is not a netutility-jax checkpoint, or is incomplete or corrupt (a
        ``ValueError``).

    Example:
      >>> import os, tempfile, numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> ads = [{"q": {"lora_a": rng.normal(size=(8, 2)), "lora_b": rng.normal(size=(2, 4))}}
      ...        for _ in range(2)]
      >>> sc = nu.score(ads)
      >>> path = os.path.join(tempfile.mkdtemp(), "scores")
      >>> nu.checkpoint.save(path, sc)
      >>> back = nu.checkpoint.restore(path)
      >>> type(back).__name__, bool((back.modules["q"].utility == sc.modules["q"].utility).all())
      ('Scores', True)
    """
    fn = "nu.checkpoint.restore"
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise MissingFileError(
            f"{fn}: no checkpoint at {path!r}; pass the directory nu.checkpoint.save wrote."
        )
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
        try:
            meta = ckpt.restore(path, ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:
            raise _unreadable(fn, path, e) from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or "tree" not in meta:
            raise InputError(
                f"{fn}: {path!r} is an orbax checkpoint but not one nu.checkpoint.save wrote (no "
                f"{FORMAT!r} metadata); restore it with orbax directly."
            )
        if not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
            raise InputError(
                f"{fn}: {path!r} has format version {meta.get('version')!r}; this netutility-jax "
                f"reads versions up to {VERSION}. Upgrade netutility-jax."
            )
        specs = [s for s in _array_specs(meta["tree"]) if s["i"] is not None]
        for s in specs:
            dt = jnp.dtype(s["dtype"])
            if s["kind"] == "jax" and jax.dtypes.canonicalize_dtype(dt) != dt:
                raise InputError(
                    f"{fn}: {path!r} holds a {dt} jax.Array {tuple(s['shape'])}, saved with "
                    "jax_enable_x64; enable it (jax.config.update('jax_enable_x64', True)) "
                    "before restoring, so the values are not truncated."
                )
        arrays: dict[str, Any] = {}
        try:
            if specs:
                sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
                abstract = {
                    f"a{s['i']}": (
                        jax.ShapeDtypeStruct(
                            tuple(s["shape"]), jnp.dtype(s["dtype"]), sharding=sharding
                        )
                        if s["kind"] == "jax"
                        else np.empty(tuple(s["shape"]), jnp.dtype(s["dtype"]))
                    )
                    for s in specs
                }
                arrays = ckpt.restore(
                    path, ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract))
                )["arrays"]
            return _decode(meta["tree"], arrays)
        except Exception as e:
            raise _unreadable(fn, path, e) from e


def _unreadable(fn: str, path: str, e: Exception) -> InputError:
    return InputError(
        f"{fn}: {path!r} is not a readable netutility-jax checkpoint ({type(e).__name__}: {e}); "
        "it may be incomplete, corrupt, or written by another tool. Write it again with "
        "nu.checkpoint.save."
    )
