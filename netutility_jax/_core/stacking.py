"""A bucket's factors stacked before its stage's program, whatever device they are on.

A stage program that takes a bucket's leaves (one argument per module and task) traces and
compiles a program whose size grows with the modules: at 80 layers of seven Llama kinds and 8
tasks, 8,975 argument buffers and 11.5 s of compiling for scoring alone. Stacked first, the stage
takes four arrays per bucket (:class:`.mesh.Stacked`) and its program is the same at any depth.
Numpy factors (a PEFT folder's, a streamed chunk's) are stacked on the host
(:func:`.mesh.host_stack`). Factors already on a device are stacked there by
:func:`device_stack`, :data:`GROUP` leaves at a time: one small program per leaf shape (the last
group padded with zeros so it reuses it) and one per bucket that joins the groups, about 0.1-0.4
s of compiling at any depth; one ``concatenate`` of every leaf would take 13 s at 4,480 leaves,
and a detour through the host would copy every factor twice on an accelerator.

Stacking copies the bucket once: the merge programs made that copy inside anyway, but the
scoring kernel reads leaves a group of modules at a time without one. So for scoring a bucket of
device factors is stacked only up to :func:`stack_limit` bytes (1 GiB, or a sixteenth of an
accelerator's memory); a larger one keeps its leaves (:func:`stacked_input` returns None).
Traced factors (a call inside ``jax.jit``) are never stacked here: the caller's trace does it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import buckets as _buckets
from .mesh import Stacked, host_leaves, host_stack

__all__ = [
    "DEVICE_STACK_BYTES",
    "GROUP",
    "device_leaves",
    "device_stack",
    "reuse",
    "stack_limit",
    "stacked_input",
]

# Leaves per stacking program, and the most bytes of a bucket stacked on its device for scoring
# (at least; on a device that reports its memory, a sixteenth of it where that is more).
GROUP = 32
DEVICE_STACK_BYTES = 1 << 30


def stack_limit(leaf: jax.Array) -> int:
    """The most bytes of one bucket scoring stacks on ``leaf``'s device: :data:`DEVICE_STACK_BYTES`,
    or a sixteenth of the device's memory where it reports a larger one (an accelerator's
    ``memory_stats()['bytes_limit']``; a CPU reports none)."""
    try:
        stats = next(iter(leaf.devices())).memory_stats() or {}
    except Exception:  # (a backend without memory statistics)
        stats = {}
    limit = int(stats.get("bytes_limit", 0)) // 16
    return max(DEVICE_STACK_BYTES, limit) if DEVICE_STACK_BYTES > 0 else 0


# Inside reuse(): stacked factors by the identity of their leaves (the leaves kept alive with
# them, so an id is never another array's while the entry lives).
_REUSE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("stack_reuse", default=None)


@contextlib.contextmanager
def reuse() -> Iterator[None]:
    """Within the block, :func:`device_stack` of the same factor arrays (the same objects, at the
    same dtype and padding) returns the arrays it stacked the first time: one copy for a call
    that scores and then merges the same adapters (``nu.merge_adapters``), not one per stage.
    Nested blocks share the outermost one's entries; they are dropped when it ends."""
    token = _REUSE.set({}) if _REUSE.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _REUSE.reset(token)


def device_leaves(bucket: Any) -> bool:
    """Whether every factor of ``bucket`` is a concrete ``jax.Array`` (not numpy, not traced)."""
    return all(
        m is None
        or all(
            isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
            for x in (m.lora_a, m.lora_b)
        )
        for row in bucket.modules
        for m in row
    )


@functools.partial(jax.jit, static_argnames=("dtype",))
def _stack_group(xs: tuple, *, dtype: Any) -> jax.Array:
    return jnp.stack([x.astype(dtype) for x in xs])


def _groups(leaves: list, zero: jax.Array, dtype: Any) -> tuple:
    """``leaves`` (module-major, task-minor) stacked :data:`GROUP` at a time, the last group
    padded with ``zero`` so that every group reuses one program."""
    padded = leaves + [zero] * (-len(leaves) % GROUP)
    return tuple(
        _stack_group(tuple(padded[i : i + GROUP]), dtype=np.dtype(dtype))
        for i in range(0, len(padded), GROUP)
    )


def _cut(parts: tuple, count: int, shape: tuple[int, ...]) -> jax.Array:
    """The groups joined, their padding cut, as ``shape`` (modules beyond the bucket's: 0)."""
    x = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    x = x[:count].reshape(count // shape[1], *shape[1:])
    extra = shape[0] - x.shape[0]
    return jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1)) if extra else x


@functools.partial(jax.jit, static_argnames=("count", "shapes"))
def _join(parts_a: tuple, parts_b: tuple, *, count: int, shapes: tuple) -> tuple:
    """Both factors' groups as their stacked arrays: one program per bucket."""
    return _cut(parts_a, count, shapes[0]), _cut(parts_b, count, shapes[1])


def device_stack(bucket: Any, dtype: Any, n_pad: int, scales: Any = None) -> Stacked:
    """:func:`.mesh.host_stack` of a bucket whose factors are on a device: the same
    :class:`.mesh.Stacked` (factors zero-padded to ``r_max`` and to ``n_pad`` modules, a task
    lacking a module zeros of rank 0), its factors stacked on their device (see the module
    docstring), its scales and ranks on the host. The scales must be concrete (``scales``:
    their :func:`.buckets.host_scales`, if made already)."""
    m = len(bucket.modules[0])
    d_in, d_out, r_max = bucket.d_in, bucket.d_out, bucket.r_max
    if scales is None:
        scales = _buckets.host_scales(_buckets.bucket_arrays(bucket)[2], dtype)
    s = np.zeros((n_pad, m), dtype)
    s[: len(bucket.modules)] = scales
    ranks = np.zeros((n_pad, m), np.int32)
    for j, mods in enumerate(bucket.modules):
        for i, mod in enumerate(mods):
            ranks[j, i] = 0 if mod is None else mod.lora_a.shape[1]
    cache = _REUSE.get()
    key = (
        tuple(
            None if x is None else (id(x.lora_a), id(x.lora_b)) for r in bucket.modules for x in r
        ),
        np.dtype(dtype).str,
        n_pad,
    )
    if cache is not None and key in cache:
        return Stacked(*cache[key][1], s, ranks)
    first = next(mod.lora_a for row in bucket.modules for mod in row if mod is not None)
    place = (
        first.sharding if isinstance(first.sharding, jax.sharding.SingleDeviceSharding) else None
    )
    # zeros placed where the factors are, not made by a program
    zero_a = jax.device_put(np.zeros((d_in, r_max), dtype), place)
    zero_b = jax.device_put(np.zeros((r_max, d_out), dtype), place)
    a_leaves, b_leaves = [], []
    for mods in bucket.modules:
        for mod in mods:
            if mod is None:
                a_leaves.append(zero_a)
                b_leaves.append(zero_b)
                continue
            r = mod.lora_a.shape[1]
            a, b = mod.lora_a, mod.lora_b
            if r < r_max:  # a ragged rank (rank_pattern): padded on its own
                a = jnp.pad(a, ((0, 0), (0, r_max - r)))
                b = jnp.pad(b, ((0, r_max - r), (0, 0)))
            a_leaves.append(a)
            b_leaves.append(b)
    a, b = _join(
        _groups(a_leaves, zero_a, dtype),
        _groups(b_leaves, zero_b, dtype),
        count=len(a_leaves),
        shapes=((n_pad, m, d_in, r_max), (n_pad, m, r_max, d_out)),
    )
    if cache is not None:
        cache[key] = (bucket.modules, (a, b))
    return Stacked(a, b, s, ranks)


def stacked_input(
    bucket: Any, dtype: Any, n_pad: int | None = None, *, cap: bool = True, scales: Any = None
) -> Any:
    """The bucket as :class:`.mesh.Stacked` for a stage's program, or None where it keeps its
    leaves: numpy factors stacked on the host, concrete device factors on their device (up to
    :func:`stack_limit` with ``cap``), traced ones or traced scales never (``scales``: the
    bucket's :func:`.buckets.host_scales`, if the caller made them already)."""
    n_pad = len(bucket.names) if n_pad is None else n_pad
    if host_leaves(bucket):
        with np.errstate(over="ignore", invalid="ignore"):  # beyond the dtype: inf, as XLA casts
            return host_stack(bucket, dtype, n_pad)
    if not device_leaves(bucket):
        return None
    size = n_pad * len(bucket.modules[0]) * bucket.r_max * (bucket.d_in + bucket.d_out)
    if cap:
        first = next(m.lora_a for row in bucket.modules for m in row if m is not None)
        if size * np.dtype(dtype).itemsize > stack_limit(first):
            return None
    if scales is None:
        scales = _buckets.host_scales(_buckets.bucket_arrays(bucket)[2], dtype)
    if scales is None:
        return None
    return device_stack(bucket, dtype, n_pad, scales)
