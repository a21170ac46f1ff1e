"""Buckets sharded over a device mesh: each device scores and merges its own modules.

Every per-bucket kernel is batched over a leading module axis and computes each module on its
own, so a bucket shards along that axis with no communication: with ``mesh=`` (a one-axis
:class:`jax.sharding.Mesh`, :func:`module_mesh`), :func:`nu.score`, :func:`nu.merge`,
:func:`nu.merge_adapters` and :func:`nu.merge_adapters_streaming` stack each bucket's factors on
the host, zero-padded to a whole number of modules per device (padding modules have rank 0: no
candidates, nothing merged, dropped from the results), and place them with a
``NamedSharding(mesh, P("modules"))``: each device receives only its modules' factors, and the
jitted stages, compiled as SPMD programs, run on every device at once (XLA partitions the
batched QR, ``eigh`` and SVD calls along the batch without gathering). The global steps, lambda
(a median over every direction) and the top-K selection, run once on the small per-direction
statistics of every device.

On CPU the devices' shares run in turn instead (:func:`per_device`: jaxlib's CPU LAPACK kernels
deadlock when several devices' programs run at once, and a CPU host's devices share its cores
anyway). On one device (``mesh=None``) nothing changes. The results are those of one device:
the same masks and ranks, scores to float32 rounding (a device's batch changes how XLA fuses one
elementwise step of the benefit), merged modules bit for bit at the tested shapes and to float32
rounding in general (a smaller batch can change the last bit of a batched kernel on large
factors, as a streamed chunk's can); see ``tests/operators/test_mesh.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..errors import InputError, InputTypeError
from .linalg import settle

__all__ = [
    "AXIS",
    "MODULES",
    "MeshWording",
    "Stacked",
    "check_mesh",
    "host_leaves",
    "host_stack",
    "module_mesh",
    "pad_rows",
    "padded",
    "per_device",
    "shard",
    "spmd",
]

AXIS = "modules"


class Stacked(NamedTuple):
    """A bucket's factors stacked on the host (see :func:`host_stack`), in place of its leaves."""

    a: Any  # (n, M, d_in, r_max)
    b: Any  # (n, M, r_max, d_out)
    scale: Any  # (n, M)
    rank: Any  # (n, M) int32


def module_mesh(devices: Any = None) -> Mesh:
    """A one-axis mesh (axis ``"modules"``) of ``devices`` (default: every device of this
    process, :func:`jax.local_devices`), to pass as ``mesh=``.

    Example:
      >>> import netutility_jax as nu
      >>> nu.module_mesh().axis_names
      ('modules',)
    """
    devs = jax.local_devices() if devices is None else list(devices)
    if not devs:
        raise InputError("nu.module_mesh: no devices given; pass None (every local device).")
    return Mesh(np.array(devs), (AXIS,))


class MeshWording(NamedTuple):
    """How :func:`check_mesh` words its errors for one kind of caller (each caller's messages
    are pinned by its tests).

    Attributes:
      optional: whether None is accepted (no mesh: one device).
      make: the call that makes a good mesh (``"nu.module_mesh"``).
      split: what is split over the mesh's axis (``"the modules are sharded"``).
      local: the fix for a mesh holding other processes' devices.
    """

    optional: bool
    make: str
    split: str
    local: str


MODULES = MeshWording(
    optional=True,
    make="nu.module_mesh",
    split="the modules are sharded",
    local="each process shards its own modules over its own devices: build the mesh from "
    "jax.local_devices() (nu.module_mesh()).",
)
"""The library's wording (``mesh=`` of :func:`nu.score`, :func:`nu.merge` ...)."""


def check_mesh(fn: str, mesh: Any, *, wording: MeshWording = MODULES) -> Mesh | None:
    """``mesh`` checked: a one-axis :class:`jax.sharding.Mesh` of this process's devices, or
    None where ``wording.optional``; errors name ``fn`` and are worded by ``wording``
    (:data:`MODULES` by default).

    Raises:
      InputTypeError: not a mesh (nor None where allowed).
      InputError: several axes, or devices of other processes.
    """
    if mesh is None and wording.optional:
        return None
    if not isinstance(mesh, Mesh):
        expected = "None or a jax.sharding.Mesh" if wording.optional else "a jax.sharding.Mesh"
        raise InputTypeError(
            f"{fn}: mesh is a {type(mesh).__name__}; expected {expected} with one axis "
            f"({wording.make}() makes one of every local device)."
        )
    if len(mesh.axis_names) != 1:
        raise InputError(
            f"{fn}: mesh has axes {mesh.axis_names} (shape {dict(mesh.shape)}); expected one axis, "
            f"over which {wording.split}: {wording.make}(devices)."
        )
    local = set(jax.local_devices())
    foreign = [d for d in mesh.devices.flat if d not in local]
    if foreign:
        raise InputError(
            f"{fn}: mesh holds {len(foreign)} device(s) of other processes (e.g. {foreign[0]}); "
            f"{wording.local}"
        )
    return mesh


def padded(n: int, mesh: Mesh) -> int:
    """``n`` rounded up to a whole number of modules per device."""
    d = mesh.size
    return -(-n // d) * d


def host_leaves(bucket: Any) -> bool:
    """Whether every factor of the bucket is a numpy array (on the host): such a bucket is
    stacked by :func:`host_stack` and placed as four arrays, not handed over leaf by leaf."""
    return all(
        m is None or (isinstance(m.lora_a, np.ndarray) and isinstance(m.lora_b, np.ndarray))
        for row in bucket.modules
        for m in row
    )


def host_stack(bucket: Any, dtype: Any, n_pad: int) -> Stacked:
    """A bucket's factors stacked on the host (numpy), zero-padded to ``r_max`` and to ``n_pad``
    modules (padding modules and tasks lacking a module: zeros, rank 0): what
    :func:`_buckets.stack_bucket` makes inside a jitted stage, without sending each leaf to every
    device."""
    m = len(bucket.modules[0])
    d_in, d_out, r_max = bucket.d_in, bucket.d_out, bucket.r_max
    A = np.zeros((n_pad, m, d_in, r_max), dtype)
    B = np.zeros((n_pad, m, r_max, d_out), dtype)
    S = np.zeros((n_pad, m), dtype)
    R = np.zeros((n_pad, m), np.int32)
    for j, mods in enumerate(bucket.modules):
        for i, mod in enumerate(mods):
            if mod is None:
                continue
            r = np.shape(mod.lora_a)[1]
            A[j, i, :, :r] = np.asarray(mod.lora_a, dtype)
            B[j, i, :r, :] = np.asarray(mod.lora_b, dtype)
            S[j, i] = np.asarray(mod.scale, dtype)
            R[j, i] = r
    return Stacked(A, B, S, R)


def pad_rows(x: Any, n_pad: int) -> Any:
    """``x`` with its leading axis padded to ``n_pad``: zeros (False), or copies of the first
    row for ``jax.random`` key arrays (which have no zero)."""
    extra = n_pad - x.shape[0]
    if extra == 0:
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jnp.concatenate([x, jnp.repeat(x[:1], extra, axis=0)])
    return jnp.pad(jnp.asarray(x), ((0, extra),) + ((0, 0),) * (x.ndim - 1))


def spmd(mesh: Mesh) -> bool:
    """Run a piece as one SPMD program over ``mesh`` (GPU, TPU), or its devices' shares in turn
    (CPU; see :func:`per_device`). ``NETUTILITY_MESH_SPMD=1`` forces SPMD on CPU too (for tests
    on small shapes, where jaxlib's LAPACK kernels do not split their batch)."""
    if mesh.size == 1 or mesh.devices.flat[0].platform != "cpu":
        return True
    return os.environ.get("NETUTILITY_MESH_SPMD") == "1"


def per_device(fn: Callable[[Any], Any], args: Any, mesh: Mesh) -> Any:
    """``fn(args)`` with the leading (module) axis of every array of ``args`` split between
    ``mesh``'s devices; each array's (it may differ between arrays, e.g. several buckets) must be
    a multiple of ``mesh.size`` (:func:`padded`).

    Off CPU: ``args`` are placed with :func:`shard` and ``fn``'s jitted stages compile as one SPMD
    program: each device computes its own modules, all at once. On CPU: each device's share is
    computed in turn on the default device and the outputs joined (0-d outputs, flags, are
    and-ed). A CPU host's devices share its cores and memory, and one device's batched kernels
    already use every core; and jaxlib's CPU LAPACK kernels split their batch over the shared
    thread pool and block on it, so several devices' programs in flight at once deadlock as soon
    as a batch is large enough to be split (see :func:`netutility_jax._core.linalg.settle`).
    """
    if spmd(mesh):
        return fn(shard(args, mesh))

    def share(x, d):
        k = x.shape[0] // mesh.size
        return x[d * k : (d + 1) * k]

    parts = [settle(fn(jax.tree.map(lambda x, d=d: share(x, d), args))) for d in range(mesh.size)]
    return jax.tree.map(_join, *parts)


def _join(*xs: Any) -> Any:
    """The devices' outputs end to end along the module axis, each zero-padded (False) to the
    largest of the other axes: a merge's result width is the largest rank of its batch, so a
    device whose modules keep fewer directions returns narrower factors."""
    if not jnp.ndim(xs[0]):
        return jnp.all(jnp.stack(xs))
    top = np.max([x.shape for x in xs], axis=0)
    return jnp.concatenate(
        [
            jnp.pad(
                x, [(0, 0)] + [(0, int(t - e)) for t, e in zip(top[1:], x.shape[1:], strict=True)]
            )
            for x in xs
        ]
    )


def shard(tree: Any, mesh: Mesh) -> Any:
    """Every array of ``tree`` placed with its leading (module) axis split over ``mesh``."""
    sharding = NamedSharding(mesh, PartitionSpec(AXIS))
    return jax.device_put(tree, sharding)
