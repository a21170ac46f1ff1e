"""A bucket's arrays: stacking its modules' factors for one batched call, and cutting it in pieces.

A :class:`_tree.Bucket` holds modules of equal ``(d_in, d_out, r_max)``. The jitted kernels take
its factors stacked with a leading module axis and a task axis, zero-padded to ``r_max`` (a task
lacking a module is all zeros, with rank 0). Host-side bookkeeping on shapes, plus the traced
stacking the kernels call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InputTypeError
from .executables import kernel
from .tree import Bucket

__all__ = [
    "Leaves",
    "StackConfig",
    "StackedMoments",
    "bucket_arrays",
    "host_scales",
    "moment_iso",
    "scales_ranks",
    "split_bucket",
    "stack_bucket",
    "stack_bucket_cat",
    "stack_moments",
    "stage_stack",
]


def bucket_arrays(bucket: Bucket) -> tuple[Any, Any, Any]:
    """The raw per-(module, task) leaves of a bucket, as nested tuples for a jitted stack.

    Raises:
      InputTypeError: the bucket of a ``nu.stack_adapters`` set, whose leaves are stacked
        (the caller does not take such sets: it is told to pass ``.unstack()``).
    """
    if bucket.stacked is not None:
        raise InputTypeError(
            "this function takes adapters, not the nu.StackedAdapters of nu.stack_adapters "
            "(which nu.score, nu.heterogeneity, nu.task_energies and TA merges take); pass "
            "stacked.unstack(), the adapters as flat dicts of views."
        )
    a = tuple(tuple(None if m is None else m.lora_a for m in mods) for mods in bucket.modules)
    b = tuple(tuple(None if m is None else m.lora_b for m in mods) for mods in bucket.modules)
    s = tuple(tuple(0.0 if m is None else m.scale for m in mods) for mods in bucket.modules)
    return a, b, s


def _padders(d_in: int, d_out: int, r_max: int, dtype: Any):
    """Zero-padding of one ``lora_a`` to ``(d_in, r_max)`` and one ``lora_b`` to ``(r_max, d_out)``
    (None, a task lacking the module, gives zeros)."""

    def pad_a(x):
        if x is None:
            return jnp.zeros((d_in, r_max), dtype)
        return jnp.pad(jnp.asarray(x, dtype), ((0, 0), (0, r_max - x.shape[1])))

    def pad_b(x):
        if x is None:
            return jnp.zeros((r_max, d_out), dtype)
        return jnp.pad(jnp.asarray(x, dtype), ((0, r_max - x.shape[0]), (0, 0)))

    return pad_a, pad_b


def _scales_ranks(a: Any, s: Any, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``scale (n, M)`` and ``rank (n, M)`` int32 (0 where a task lacks the module)."""
    S = jnp.stack([jnp.stack([jnp.asarray(x, dtype) for x in row]) for row in s])
    R = np.array([[0 if x is None else x.shape[1] for x in row] for row in a], np.int32)
    return S, jnp.asarray(R)


def scales_ranks(a: Any, s: Any, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``scale (n, M)`` and ``rank (n, M)`` int32 of a bucket's leaves (traceable); ``s`` may be
    the scales stacked already (:func:`host_scales`)."""
    if isinstance(s, (tuple, list)):
        return _scales_ranks(a, s, dtype)
    R = np.array([[0 if x is None else x.shape[1] for x in row] for row in a], np.int32)
    return jnp.asarray(s, dtype), jnp.asarray(R)


def host_scales(s: Any, dtype: Any) -> np.ndarray | None:
    """The scales of :func:`bucket_arrays` as one ``(n, M)`` numpy array of ``dtype``, rounded
    as XLA converts them (to nearest), if all are concrete (else None): one argument for the
    jitted kernel instead of one per task-module."""
    leaves = [x for row in s for x in row]
    if leaves and set(map(type, leaves)) == {float}:
        # Python floats only (the common case): converted in one call, each rounded once from
        # its exact float64 value, as np.asarray(x).astype(dtype) rounds it
        with np.errstate(over="ignore", invalid="ignore"):
            return np.array(s, np.float64).astype(dtype)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    with np.errstate(over="ignore", invalid="ignore"):  # beyond the dtype: inf, as XLA converts
        return np.array([[np.asarray(x).astype(dtype) for x in row] for row in s], dtype)


@dataclasses.dataclass(frozen=True)
class Leaves:
    """A bucket's leaves (:func:`bucket_arrays`) inside a trace, for kernels that read them
    module by module (:func:`_grams.leaf_grams`) and stack them only where they must."""

    a: Any  # rows (modules) of M lora_a leaves, None where a task lacks the module
    b: Any  # likewise lora_b
    d_in: int
    d_out: int
    r_max: int
    dtype: Any

    def padders(self):
        """Zero-padding of one ``lora_a`` / ``lora_b`` leaf to ``r_max`` (see :func:`_padders`)."""
        return _padders(self.d_in, self.d_out, self.r_max, self.dtype)

    def stack(self) -> tuple[jax.Array, jax.Array]:
        """``a (n, M, d_in, r_max)``, ``b (n, M, r_max, d_out)`` as :func:`stack_bucket`."""
        pad_a, pad_b = self.padders()
        A = jnp.stack([jnp.stack([pad_a(x) for x in row]) for row in self.a])
        B = jnp.stack([jnp.stack([pad_b(x) for x in row]) for row in self.b])
        return A, B


def stack_bucket(
    a: Any, b: Any, s: Any, *, d_in: int, d_out: int, r_max: int, dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Stack (and zero-pad to r_max) the leaves of :func:`bucket_arrays` (traceable).

    Returns:
      ``a (n, M, d_in, r_max)``, ``b (n, M, r_max, d_out)``, ``scale (n, M)``, ``rank (n, M)``
      (int32, 0 where a task lacks the module).
    """

    A, B = Leaves(a, b, d_in, d_out, r_max, dtype).stack()
    S, R = scales_ranks(a, s, dtype)
    return A, B, S, R


def stack_bucket_cat(
    a: Any, b: Any, s: Any, *, d_in: int, d_out: int, r_max: int, dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`stack_bucket` with the tasks side by side, in the factors' own layouts (traceable).

    Returns:
      ``xa (n, d_in, M r_max)`` = ``[a_1 .. a_M]``, ``yb (n, M r_max, d_out)`` = ``[b_1; ..; b_M]``
      (task ``i`` in columns / rows ``i r_max .. (i + 1) r_max``, zero-padded), ``scale (n, M)`` and
      ``rank (n, M)`` as :func:`stack_bucket`. No transposes: one copy of every factor.
    """

    pad_a, pad_b = _padders(d_in, d_out, r_max, dtype)
    xa = jnp.stack([jnp.concatenate([pad_a(x) for x in row], 1) for row in a])
    # one flat concatenation (a plain copy per factor), then a free reshape
    yb = jnp.concatenate([pad_b(x) for row in b for x in row], 0).reshape(len(b), -1, d_out)
    S, R = _scales_ranks(a, s, dtype)
    return xa, yb, S, R


class StackedMoments(NamedTuple):
    """A bucket's input-moment factors stacked (:func:`stack_moments`)."""

    f: Any  # (n, M, k_max, d_in)
    iso: Any  # (n, M) bool: no factor (the data-free geometry there)


def moment_iso(rows: Any, n_pad: int | None = None) -> np.ndarray:
    """``(n, M)`` bool: True where ``rows[n][i]`` is None (and on padding modules)."""
    iso = np.ones((len(rows) if n_pad is None else n_pad, len(rows[0])), bool)
    for n, row in enumerate(rows):
        for i, f in enumerate(row):
            iso[n, i] = f is None
    return iso


def stack_moments(
    rows: Any, *, d_in: int, dtype: Any, n_pad: int | None = None, host: bool = False
) -> StackedMoments:
    """Stack one bucket's input-moment factors (:func:`netutility_jax.moments.resolve`).

    ``rows[n][i]`` is task ``i``'s factor ``(k, d_in)`` in module ``n`` (``S = F^T F``), or None
    (the data-free geometry there). Factors are zero-padded to the bucket's largest ``k`` (zero
    rows leave ``F^T F`` unchanged) and, with ``n_pad``, zero modules are appended (a mesh's
    padding). With ``jnp`` (traceable: the scoring kernel stacks its leaves itself, one copy),
    or with ``host`` in numpy (concrete factors, to be sharded over a mesh).

    Returns:
      :class:`StackedMoments`: ``f (n, M, k_max, d_in)`` in ``dtype``, ``iso (n, M)`` bool
      (numpy: it follows from which factors are None, a static structure).
    """
    n_mod = len(rows) if n_pad is None else n_pad
    m_tasks = len(rows[0])
    k_max = max(1, max((np.shape(f)[0] for row in rows for f in row if f is not None), default=1))
    iso = moment_iso(rows, n_pad)
    if host:
        out = np.zeros((n_mod, m_tasks, k_max, d_in), dtype)
        for n, row in enumerate(rows):
            for i, f in enumerate(row):
                if f is not None:
                    out[n, i, : np.shape(f)[0]] = np.asarray(f, dtype)
        return StackedMoments(out, iso)

    def pad(f):
        if f is None:
            return jnp.zeros((k_max, d_in), dtype)
        f = jnp.asarray(f, dtype)
        return f if f.shape[0] == k_max else jnp.pad(f, ((0, k_max - f.shape[0]), (0, 0)))

    zero = [None] * m_tasks
    padded = list(rows) + [zero] * (n_mod - len(rows))
    return StackedMoments(jnp.stack([jnp.stack([pad(f) for f in row]) for row in padded]), iso)


def split_bucket(bucket: Bucket, max_bytes: int, itemsize: int = 4) -> list[Bucket]:
    """A bucket as consecutive sub-buckets of equal size whose stacked factors fit ``max_bytes``.

    The size divides the bucket's module count (one compiled shape per bucket), so sub-buckets
    hold between 1 and ``n`` modules. Per-bucket kernels are free of global state, so merging a
    bucket piece by piece gives the same result with peak memory bounded by ``max_bytes``.
    """
    n = len(bucket.names)
    m_tasks = len(bucket.modules[0]) if n else 0
    per = max(1, m_tasks * bucket.r_max * (bucket.d_in + bucket.d_out) * itemsize)
    cap = max(1, min(n, max_bytes // per))
    size = max(d for d in range(1, cap + 1) if n % d == 0) if n else 1
    if size >= n:
        return [bucket]
    return [
        dataclasses.replace(
            bucket, names=bucket.names[i : i + size], modules=bucket.modules[i : i + size]
        )
        for i in range(0, n, size)
    ]


class StackConfig(NamedTuple):
    """Static shape of a bucket's stacked factors (:func:`stage_stack`)."""

    d_in: int
    d_out: int
    r_max: int
    dtype: Any


@kernel(static_argnames=("cfg",))
def stage_stack(leaves, *, cfg: StackConfig):
    """Zero-padded stacked factors of a bucket (see :func:`stack_bucket`), as given."""
    d_in, d_out, r_max, dtype = cfg
    a, b, s = leaves
    return stack_bucket(a, b, s, d_in=d_in, d_out=d_out, r_max=r_max, dtype=dtype)
