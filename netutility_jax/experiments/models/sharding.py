"""A model's weights sharded over a device mesh, for models that do not fit one accelerator.

:func:`model_mesh` makes a one-axis :class:`jax.sharding.Mesh`; :func:`shard_model` puts an nnx
model's state on it (:func:`shard_state` does the same to a state alone, e.g. a trainer's LoRA
state). Nothing else changes: a jitted forward pass or training step over the placed model runs
as one SPMD program that XLA partitions (GSPMD) from the arrays' shardings, and computes what the
unsharded model does up to float32 rounding (sums split over devices add in another order).

The rule (:func:`partition_spec`), per array of the state:

* a parameter (an ``nnx.Param``: frozen base weights and LoRA factors alike) of at least
  ``min_bytes`` is split along one axis whose size is a multiple of the mesh size: its preferred
  axis when that one divides (below), else its largest axis that divides (ties: the last), else
  it is replicated;
* the preferred axis, by the state path's names (the Llama, CLIP and MiniLM layer names; other
  models get the largest divisible axis): ``d_out`` (the last axis) of the kernels of the
  layers that fan out (:data:`COLUMN_LAYERS`: ``q/k/v_proj``, ``gate/up_proj``, ``fc1``,
  ``query``/``key``/``value``, ``intermediate``), ``d_in`` (the first axis) of those that fan
  back in (:data:`ROW_LAYERS`: ``o_proj``, ``down_proj``, ``out_proj``, ``fc2``, ``output``),
  as Megatron-LM's column- and row-parallel layers (Shoeybi et al., 2019); ``d_in`` of a LoRA
  ``lora_a`` ``(d_in, r)`` and ``d_out`` of a ``lora_b`` ``(r, d_out)``;
* everything else is replicated on every device: smaller parameters (norm scales, biases, the
  LoRA factors of small ranks), scalars and the state that is not a parameter (RNG keys and
  counts).

On a one-device mesh nothing is split. The batch needs no placing: a jitted function replicates
host (numpy) inputs over the mesh.

A loader places each weight as it reads it with :func:`placer` (``llama_load.build`` and
``clip_load.build`` with ``mesh=``), so that no device holds the whole model;
:func:`placement_record` is what a run records of it (``results.json``'s ``placement``).

Example (on a machine with several devices):

    mesh = sharding.model_mesh()                 # every local device, axis "model"
    model, summary = sharding.shard_model(model, mesh)
    logits = nnx.jit(llama.last_token_logits)(model, ids, mask)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...errors import InputError, InputTypeError

__all__ = [
    "COLUMN_LAYERS",
    "MIN_BYTES",
    "ROW_LAYERS",
    "ShardSummary",
    "model_mesh",
    "partition_spec",
    "placement_record",
    "placer",
    "shard_model",
    "shard_state",
]

MIN_BYTES = 1 << 20
"""Parameters smaller than this (1 MiB) are replicated: splitting them saves little memory and
adds communication."""

COLUMN_LAYERS = frozenset(
    {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "query", "key", "value"}
    | {"intermediate"}
)
"""Layers whose kernel ``(d_in, d_out)`` is split along ``d_out`` (their outputs stay split)."""

ROW_LAYERS = frozenset({"o_proj", "down_proj", "out_proj", "fc2", "output"})
"""Layers whose kernel ``(d_in, d_out)`` is split along ``d_in`` (they take split inputs)."""


def _check_mesh(fn: str, mesh: Any) -> Mesh:
    """``mesh`` checked: a one-axis :class:`jax.sharding.Mesh` of this process's devices (the
    library's own check of ``mesh=``, worded for a model's weights).

    Raises:
      InputTypeError: not a mesh.
      InputError: several axes, or devices of other processes.
    """
    if not isinstance(mesh, Mesh):
        raise InputTypeError(
            f"{fn}: mesh is a {type(mesh).__name__}; expected a jax.sharding.Mesh with one axis "
            "(sharding.model_mesh() makes one of every local device)."
        )
    if len(mesh.axis_names) != 1:
        raise InputError(
            f"{fn}: mesh has axes {mesh.axis_names} (shape {dict(mesh.shape)}); expected one axis, "
            "over which the weights are split: sharding.model_mesh(devices)."
        )
    local = set(jax.local_devices())
    foreign = [d for d in mesh.devices.flat if d not in local]
    if foreign:
        raise InputError(
            f"{fn}: mesh holds {len(foreign)} device(s) of other processes (e.g. {foreign[0]}); "
            "build it from this process' devices (sharding.model_mesh())."
        )
    return mesh


class ShardSummary(NamedTuple):
    """Where :func:`shard_model` put a model's state.

    Attributes:
      devices: the mesh's devices.
      total_bytes: the whole state's bytes (what one device held before).
      bytes_per_device: what each device holds now (a split array's share plus every
        replicated array).
      sharded: the number of arrays split over the mesh.
      replicated: the number of arrays copied on every device.
      specs: ``{state path ("/"-joined): PartitionSpec}`` of every array (``P()``: replicated).
    """

    devices: int
    total_bytes: int
    bytes_per_device: int
    sharded: int
    replicated: int
    specs: dict[str, P]


def split_key(model_devices: int, min_bytes: int = MIN_BYTES) -> dict[str, Any]:
    """What a model split over ``model_devices`` devices adds to an evaluation's cache key: a
    split model sums in another order (float32 rounding), so its results are its own. Empty on
    one device (one device's keys are unchanged); ``min_bytes`` only when it is not
    :data:`MIN_BYTES` (the keys of the default split are unchanged).

    Example:
      >>> from netutility_jax.experiments.models import sharding
      >>> sharding.split_key(1), sharding.split_key(8), sharding.split_key(8, 0)
      ({}, {'model_devices': 8}, {'model_devices': 8, 'min_bytes': 0})
    """
    if model_devices <= 1:
        return {}
    return {"model_devices": int(model_devices)} | (
        {} if min_bytes == MIN_BYTES else {"min_bytes": int(min_bytes)}
    )


def placement_record(summary: ShardSummary | None, min_bytes: int | None = None) -> dict[str, Any]:
    """Where a run's model lies, as its results record it (``results.json``'s ``placement``):
    ``model_devices`` (the mesh's size; 1 without a mesh), the devices' ``platform`` and
    ``device_kind``, and with a ``summary`` (:func:`shard_model`'s) its ``total_bytes``,
    ``bytes_per_device``, ``sharded`` and ``replicated``, and ``min_bytes`` (the size under
    which a weight was replicated) when given.

    Example:
      >>> from netutility_jax.experiments.models import sharding
      >>> sharding.placement_record(None)["model_devices"]
      1
    """
    dev = jax.local_devices()[0]
    out: dict[str, Any] = {
        "model_devices": 1 if summary is None else int(summary.devices),
        "platform": dev.platform,
        "device_kind": dev.device_kind,
    }
    if summary is not None:
        out.update(
            total_bytes=int(summary.total_bytes),
            bytes_per_device=int(summary.bytes_per_device),
            sharded=int(summary.sharded),
            replicated=int(summary.replicated),
        )
        if min_bytes is not None:
            out["min_bytes"] = int(min_bytes)
    return out


def model_mesh(devices: Any = None, *, axis: str = "model") -> Mesh:
    """A one-axis mesh (axis ``axis``) of ``devices`` to shard a model over.

    Args:
      devices: None (every device of this process, :func:`jax.local_devices`), a number ``n``
        (the first ``n`` of them) or a sequence of distinct local ``jax.Device``.
      axis: the mesh axis' name.

    Raises:
      InputTypeError: ``devices`` is not None, an int or a sequence of devices; ``axis`` is not
        a non-empty str.
      InputError: no devices, a number beyond this process' devices, a device given twice or a
        device of another process.

    Example:
      >>> import jax
      >>> from netutility_jax.experiments.models import sharding
      >>> mesh = sharding.model_mesh()
      >>> mesh.axis_names, mesh.size == len(jax.local_devices())
      (('model',), True)
    """
    fn = "sharding.model_mesh"
    if not isinstance(axis, str) or not axis:
        raise InputTypeError(f"{fn}: axis={axis!r}; expected a non-empty str (e.g. 'model').")
    local = jax.local_devices()
    if devices is None:
        devs = list(local)
    elif isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        if not 1 <= devices <= len(local):
            raise InputError(
                f"{fn}: devices={int(devices)}; this process has {len(local)} device(s): pass a "
                f"number from 1 to {len(local)}, or None for all of them."
            )
        devs = list(local[: int(devices)])
    elif isinstance(devices, (str, bytes)) or not isinstance(devices, (Sequence, np.ndarray)):
        raise InputTypeError(
            f"{fn}: devices is a {type(devices).__name__}; expected None, a number of devices or "
            "a sequence of jax.Device (e.g. jax.local_devices()[:4])."
        )
    else:
        devs = list(np.asarray(devices, dtype=object).ravel())
        bad = [d for d in devs if not isinstance(d, jax.Device)]
        if bad:
            raise InputTypeError(
                f"{fn}: devices holds a {type(bad[0]).__name__} ({bad[0]!r}); expected jax.Device "
                "entries (e.g. jax.local_devices()[:4])."
            )
    if not devs:
        raise InputError(f"{fn}: no devices given; pass None (every local device) or a number.")
    if len(set(devs)) != len(devs):
        twice = next(d for d in devs if devs.count(d) > 1)
        raise InputError(
            f"{fn}: device {twice} is given {devs.count(twice)} times; list each once."
        )
    foreign = [d for d in devs if d not in set(local)]
    if foreign:
        raise InputError(
            f"{fn}: {foreign[0]} is a device of another process; a model is sharded over this "
            "process' devices (jax.local_devices())."
        )
    return Mesh(np.array(devs), (axis,))


def partition_spec(
    path: Sequence[Any],
    shape: Sequence[int],
    nbytes: int,
    n: int,
    *,
    axis: str = "model",
    min_bytes: int = MIN_BYTES,
) -> P:
    """The :class:`~jax.sharding.PartitionSpec` of a parameter on a one-axis mesh of ``n``
    devices by the module docstring's rule: ``axis`` at the split dimension (without trailing
    ``None``, as jit writes its outputs' specs: the same spec, so a step's outputs fed back in
    do not compile it again), or ``P()`` (replicated).

    Args:
      path: the parameter's state path (``("model", "layers", 0, "mlp", "up_proj", "kernel")``).
      shape, nbytes: its shape and size in bytes.
      n: the mesh's devices.
      axis: the mesh axis' name.
      min_bytes: smaller parameters are replicated.

    Example:
      >>> from netutility_jax.experiments.models import sharding
      >>> spec = sharding.partition_spec
      >>> tuple(spec(("mlp", "down_proj", "kernel"), (64, 16), 4096, 8, min_bytes=0))
      ('model',)
      >>> tuple(spec(("mlp", "up_proj", "kernel"), (16, 64), 4096, 8, min_bytes=0))
      (None, 'model')
      >>> tuple(spec(("norm", "scale"), (16,), 64, 8))  # under MIN_BYTES: replicated
      ()
    """
    dim = _split_axis(path, tuple(shape), nbytes, n, min_bytes)
    if dim is None:
        return P()
    return P(*(axis if i == dim else None for i in range(dim + 1)))  # no trailing Nones


def placer(
    mesh: Mesh, *, min_bytes: int = MIN_BYTES, fn: str = "sharding.placer"
) -> Callable[[Sequence[Any], Any], jax.Array]:
    """``place(path, x)``: one parameter ``x`` (numpy or a ``jax.Array``, at its stored dtype)
    of state path ``path`` put on ``mesh`` by the module docstring's rule, as
    :func:`shard_model` would put it. For loaders that place each weight as they read it
    (``llama_load.build(mesh=...)``), so that no device ever holds the whole model.

    Args:
      mesh: a one-axis mesh of this process' devices (:func:`model_mesh`).
      min_bytes: parameters smaller than this are replicated.
      fn: the caller's name in error messages.

    Raises:
      InputTypeError, InputError: as :func:`shard_state` (checked here, before any array).

    Example:
      >>> import numpy as np
      >>> from netutility_jax.experiments.models import sharding
      >>> place = sharding.placer(sharding.model_mesh(1), min_bytes=0)
      >>> place(("mlp", "up_proj", "kernel"), np.ones((4, 8), np.float32)).shape
      (4, 8)
    """
    mesh = _check_mesh(fn, mesh)
    min_bytes = _check_min_bytes(fn, min_bytes)
    n, axis = mesh.size, mesh.axis_names[0]

    def place(path: Sequence[Any], x: Any) -> jax.Array:
        spec = partition_spec(path, x.shape, int(x.nbytes), n, axis=axis, min_bytes=min_bytes)
        return jax.device_put(x, NamedSharding(mesh, spec))

    return place


def _split_axis(
    path: Sequence[Any], shape: tuple[int, ...], nbytes: int, n: int, min_bytes: int
) -> int | None:
    if n <= 1 or nbytes < min_bytes or not shape:
        return None
    fits = [i for i, s in enumerate(shape) if s >= n and s % n == 0]
    if not fits:
        return None
    names = [p for p in path if isinstance(p, str)]
    leaf = names[-1] if names else ""
    layer = next((p for p in reversed(names) if p in COLUMN_LAYERS | ROW_LAYERS), None)
    want = None
    if leaf == "lora_a":
        want = 0
    elif leaf == "lora_b":
        want = len(shape) - 1
    elif leaf == "kernel" and len(shape) == 2 and layer is not None:
        want = len(shape) - 1 if layer in COLUMN_LAYERS else 0
    if want in fits:
        return want
    return max(fits, key=lambda i: (shape[i], i))


def _check_min_bytes(fn: str, min_bytes: Any) -> int:
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, (int, np.integer)):
        raise InputTypeError(
            f"{fn}: min_bytes is a {type(min_bytes).__name__}; expected an int (bytes)."
        )
    if min_bytes < 0:
        raise InputError(f"{fn}: min_bytes={int(min_bytes)}; expected 0 or more bytes.")
    return int(min_bytes)


def _key_name(k: Any) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return str(k)


def _place(fn: str, state: Any, mesh: Mesh, min_bytes: int) -> tuple[Any, ShardSummary]:
    n, axis = mesh.size, mesh.axis_names[0]
    counts = {"total": 0, "per_device": 0, "sharded": 0, "replicated": 0}
    specs: dict[str, P] = {}

    def place(keypath: Any, leaf: Any) -> Any:
        var = leaf if isinstance(leaf, nnx.Variable) else None
        x = leaf.get_value() if var is not None else leaf
        if isinstance(x, jax.ShapeDtypeStruct):
            where = "/".join(str(_key_name(k)) for k in keypath)
            raise InputError(
                f"{fn}: {where} is a placeholder (jax.ShapeDtypeStruct), not an array: load or "
                "fill the model's weights before sharding it."
            )
        if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
            return leaf  # not an array (None, a Python number): left as it is
        path = tuple(_key_name(k) for k in keypath)
        nbytes = int(x.nbytes)
        is_param = var is None or isinstance(var, nnx.Param)
        spec = (
            partition_spec(path, x.shape, nbytes, n, axis=axis, min_bytes=min_bytes)
            if is_param
            else P()
        )
        placed = jax.device_put(x, NamedSharding(mesh, spec))
        split = any(s is not None for s in spec)
        counts["total"] += nbytes
        counts["per_device"] += nbytes // n if split else nbytes
        counts["sharded" if split else "replicated"] += 1
        specs["/".join(map(str, path))] = spec
        return var.replace(placed) if var is not None else placed

    out = jax.tree_util.tree_map_with_path(
        place, state, is_leaf=lambda v: isinstance(v, nnx.Variable)
    )
    summary = ShardSummary(
        n,
        counts["total"],
        counts["per_device"],
        counts["sharded"],
        counts["replicated"],
        specs,
    )
    return out, summary


def shard_state(state: Any, mesh: Mesh, *, min_bytes: int = MIN_BYTES) -> tuple[Any, ShardSummary]:
    """``state`` (an ``nnx.State``, or any pytree of arrays) placed on ``mesh`` by the module
    docstring's rule: a new state of the same structure, and where its arrays went.

    Variables that are not an ``nnx.Param`` are replicated; bare arrays are treated as
    parameters. ``state`` itself is not changed.

    Raises:
      InputTypeError: ``mesh`` is not a ``jax.sharding.Mesh``; ``min_bytes`` not an int.
      InputError: a mesh with several axes or other processes' devices; a negative
        ``min_bytes``; a placeholder (``jax.ShapeDtypeStruct``) in ``state``.
    """
    fn = "sharding.shard_state"
    mesh = _check_mesh(fn, mesh)
    return _place(fn, state, mesh, _check_min_bytes(fn, min_bytes))


def shard_model(model: Any, mesh: Mesh, *, min_bytes: int = MIN_BYTES) -> tuple[Any, ShardSummary]:
    """Place ``model``'s state on ``mesh`` (in place) and say where it went.

    Each parameter of at least ``min_bytes`` is split along one axis that the mesh size divides
    (the module docstring's rule), the rest is replicated. The model's variables hold the
    placed arrays afterwards (``nnx.update``); other models that shared its old arrays (the base
    model an ``add_lora`` model was made from, a ``with_dtype`` view) keep those. Run it under
    ``nnx.jit`` or ``jax.jit`` (over ``nnx.split(model)``): XLA partitions the computation.

    Args:
      model: an ``nnx.Module`` with real arrays (a ``llama.Llama``, a ``clip.CLIPModel``...),
        with or without LoRA adapters.
      mesh: a one-axis mesh of this process' devices (:func:`model_mesh`).
      min_bytes: parameters smaller than this are replicated (default :data:`MIN_BYTES`).

    Returns:
      ``(model, summary)``: the same ``model``, and a :class:`ShardSummary`.

    Raises:
      InputTypeError: ``model`` is not an ``nnx.Module``; ``mesh`` not a mesh; ``min_bytes`` not
        an int.
      InputError: a mesh with several axes or other processes' devices; a negative
        ``min_bytes``; an abstract model (``nnx.eval_shape`` placeholders).
    """
    fn = "sharding.shard_model"
    if not isinstance(model, nnx.Module):
        raise InputTypeError(
            f"{fn}: model is a {type(model).__name__}; expected an nnx.Module (e.g. a "
            "llama.Llama or a clip.CLIPModel); shard a state with sharding.shard_state."
        )
    mesh = _check_mesh(fn, mesh)
    state, summary = _place(fn, nnx.state(model), mesh, _check_min_bytes(fn, min_bytes))
    nnx.update(model, state)
    return model, summary
