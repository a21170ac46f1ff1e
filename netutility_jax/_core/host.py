"""Values placed on a device from the host without compiling a program.

``jnp.asarray`` of a host number compiles a one-operation conversion program per dtype pair, and
``jax.device_put`` of many small arrays spends most of its time in Python: both are fixed costs
that a small merge (a fresh process) or a many-module score (a GPU) pays again and again. These
give the same arrays (values, dtypes, placement, commitment) without either.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["forget_constants", "host_constant", "put_views"]


def host_constant(x: Any, dtype: Any, *, shared: bool = True) -> jax.Array:
    """``jnp.asarray(x, dtype)`` of a concrete host number (or numpy array) without compiling a
    conversion: numpy rounds it to ``dtype`` (to nearest, as XLA's conversion does) and it is
    placed as is (``jax.device_put``). ``jnp.asarray(0.1, jnp.float32)`` compiles a one-operation
    program per dtype pair (and ``jnp.asarray`` of a numpy array an identity one per shape),
    which a fresh process traces, lowers and loads again (about 20 ms each on 2 cores; a small
    merge made a dozen). A small value (at most :data:`_KEPT_SIZE` elements: a scalar setting,
    a tolerance, lambda) is placed once and the same device array given back after, for the
    same bits, dtype and default device: a steady call places nothing, which on an accelerator
    is a host-to-device copy per setting and call (jax arrays are immutable and the library
    donates none of its inputs, so sharing one between its programs is safe). A value handed
    to the caller (a ``Scores``' alpha) takes ``shared=False``: a copy made on the device, so
    that deleting or donating it leaves every other result whole. Anything else (a jax array,
    a tracer) goes through jnp."""
    if isinstance(x, (bool, int, float, np.generic, np.ndarray)):
        with np.errstate(over="ignore"):  # (beyond the dtype's range: inf, as XLA converts)
            host = np.asarray(x, dtype)
        if host.size > _KEPT_SIZE:
            return jax.device_put(host)
        placed = _placed(host.dtype, host.shape, host.tobytes(), _default_device_key())
        return placed if shared else jax.device_put(placed, may_alias=False)
    return jnp.asarray(x, dtype)


_KEPT_SIZE = 16
_KEPT_COUNT = 256
_kept: collections.OrderedDict[tuple, jax.Array] = collections.OrderedDict()
_kept_lock = threading.Lock()


def _default_device_key() -> Any:
    """What decides where ``jax.device_put`` places an uncommitted value now: the default device
    setting (``jax.default_device``'s context included) and the backends' platform."""
    return (jax.config.jax_default_device, jax.config.jax_platforms, jax.config.jax_enable_x64)


def _placed(dtype: np.dtype, shape: tuple[int, ...], raw: bytes, where: Any) -> jax.Array:
    """One small constant placed, from :func:`host_constant`'s store (the last
    :data:`_KEPT_COUNT` used; one a caller deleted, e.g. by donating it, is placed again)."""
    key = (dtype, shape, raw, where)
    with _kept_lock:
        arr = _kept.get(key)
        if arr is not None and not arr.is_deleted():
            _kept.move_to_end(key)
            return arr
    arr = jax.device_put(np.frombuffer(raw, dtype).reshape(shape).copy())
    if isinstance(arr, jax.core.Tracer):  # (placed inside a trace: that trace's value only)
        return arr
    with _kept_lock:
        _kept[key] = arr
        while len(_kept) > _KEPT_COUNT:
            _kept.popitem(last=False)
    return arr


def forget_constants() -> None:
    """Drop :func:`host_constant`'s placed values (with the programs, by
    :func:`executables.release`)."""
    with _kept_lock:
        _kept.clear()


try:  # the one jaxlib call jax.device_put ends in, for one array on one device (see put_views)
    from jax._src import config as _jax_config
    from jax._src import core as _jax_core
    from jax._src.interpreters.pxla import get_default_device as _default_device
    from jax._src.lib import xla_client as _xc

    _batched_put = _xc.batched_device_put
    _explicit_put = _jax_config.explicit_device_put_scope
    _ShapedArray = _jax_core.ShapedArray
except (ImportError, AttributeError):  # another jax: jax.device_put, the same arrays, slower
    _batched_put = None


@functools.lru_cache(maxsize=64)
def _put_aval(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    return _ShapedArray(shape, dtype)


def put_views(views: Sequence[np.ndarray], sharding: Any = None) -> list[jax.Array]:
    """``jax.device_put(list(views), sharding)``: the same arrays, at a few microseconds each.

    ``jax.device_put`` spends 15-20 us of Python on each array of a list (abstract values,
    sharding checks, deferred arguments, result handlers): 60 ms for the 2800 small arrays of a
    Llama-3-70B-sized score + allocate (four fields and a mask per module). For the common case,
    numpy arrays of canonical dtypes placed on one device (``sharding`` a
    :class:`~jax.sharding.SingleDeviceSharding`: committed; None: the default device,
    uncommitted, as ``jax.device_put`` does), each array is made by the jaxlib call that
    ``jax.device_put`` ends in (``batched_device_put``, same aliasing of host memory, inside
    jax's explicit-transfer scope); anything else, or a jax without that internal, takes
    ``jax.device_put`` itself. tests/core/test_host.py checks that both give the same arrays.
    """
    views = list(views)
    if _batched_put is None or not views:
        return jax.device_put(views, sharding)
    if sharding is None:
        device, committed = _default_device(), False
        sharding = jax.sharding.SingleDeviceSharding(device)
    elif isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        committed = True
    else:
        return jax.device_put(views, sharding)
    # dtypes jax keeps as they are (not float64 with x64 off, nor float0): read per call, since
    # the x64 setting can change between calls
    kept: dict[np.dtype, bool] = {}
    avals = []
    for v in views:
        if type(v) is not np.ndarray:
            return jax.device_put(views, sharding if committed else None)
        dt = v.dtype
        if dt not in kept:
            kept[dt] = dt != jax.dtypes.float0 and jax.dtypes.canonicalize_dtype(dt) == dt
        if not kept[dt]:
            return jax.device_put(views, sharding if committed else None)
        avals.append(_put_aval(v.shape, dt))
    devices = [device]
    try:
        with _explicit_put():
            return [
                _batched_put(aval, sharding, [v], devices, committed)
                for aval, v in zip(avals, views, strict=True)
            ]
    except (TypeError, AttributeError):  # a jaxlib whose call differs: the public path from now on
        _disable_batched_put()
        return jax.device_put(views, sharding if committed else None)


def _disable_batched_put() -> None:
    global _batched_put
    _batched_put = None
