"""The library's jitted kernels, registered so that a caller can drop their compiled programs.

:func:`kernel` is ``jax.jit`` (with or without ``static_argnames``) whose result is a
:class:`Kernel`: the jitted function, plus a registry of every kernel so that :func:`release`
can drop all of their compiled programs at once (the streamed merge does, after the last chunk of
a shape, so that programs no chunk will use again do not stay resident).

Compiled programs outlive a process only through JAX's own persistent compilation cache (the
command line turns it on, docs/cli.md). The library keeps no executables of its own: an earlier
version serialized them to disk, and an executable that JAX had itself loaded from its cache was
stored in a form that later processes could not load (``NOT_FOUND: Function ... not found``),
failing every merge of those shapes until the cache was deleted. Everything here is public JAX.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["Kernel", "kernel", "release"]

_KERNELS: weakref.WeakSet[Kernel] = weakref.WeakSet()  # every kernel, for release()


class Kernel:
    """``jax.jit(fun, static_argnames=...)``, registered for :func:`release`. Everything else
    (``lower``, ``trace``, ...) is the jitted function's."""

    def __init__(self, fun: Callable, static_argnames: Sequence[str] = ()):
        self._jit = jax.jit(fun, static_argnames=tuple(static_argnames))
        name = getattr(fun, "__qualname__", None) or fun.__name__  # (a jnp.ufunc has no qualname)
        self._name = f"{fun.__module__}.{name}"
        functools.update_wrapper(self, fun)
        _KERNELS.add(self)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._jit, attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._jit(*args, **kwargs)


def release() -> None:
    """Drop the compiled programs of every kernel held in this process: a later call traces
    and compiles (or loads from JAX's persistent cache) again. For callers that know a batch
    of shapes is done with."""
    for k in list(_KERNELS):
        k._jit.clear_cache()


def kernel(fun: Callable | None = None, *, static_argnames: Sequence[str] = ()) -> Any:
    """``jax.jit`` as a :class:`Kernel` (a decorator, with or without ``static_argnames``)."""
    if fun is None:
        return functools.partial(kernel, static_argnames=static_argnames)
    return Kernel(fun, static_argnames)
