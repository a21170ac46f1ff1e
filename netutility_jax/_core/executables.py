"""The library's jitted kernels, registered so that a caller can drop their compiled programs.

:func:`kernel` is ``jax.jit`` (with or without ``static_argnames``) whose result is a
:class:`Kernel`: the jitted function, plus a registry of every kernel so that :func:`release`
can drop all of their compiled programs at once (the streamed merge does, after the last chunk of
a shape, so that programs no chunk will use again do not stay resident).

Compiled programs outlive a process only through JAX's own persistent compilation cache (the
command line turns it on, docs/cli.md); a kernel also keeps its traced program (StableHLO, no
compiled code) where :mod:`.exports` has a folder (the command line's), so that a later process
skips tracing it (``export=False`` opts a kernel out). The library keeps no executables of its own: an earlier
version serialized them to disk, and an executable that JAX had itself loaded from its cache was
stored in a form that later processes could not load (``NOT_FOUND: Function ... not found``),
failing every merge of those shapes until the cache was deleted. Everything here is public JAX.

``kernel(..., fast_compile=True)`` marks a program whose time on a CPU is compiling, not running:
its run time is library calls (XLA's dot and LAPACK's QR and ``eigh``), which LLVM's
optimisation does not touch, and its compile time is LLVM optimising a few hundred small fused
loops. On the CPU backend such a program is compiled with :data:`FAST_COMPILE` (LLVM at level
0); on other backends, and for every program not marked, XLA's defaults. The merge programs
(``fast_compile="small"``) run elementwise loops over the factors, which level 0 slows: they
take :data:`FAST_COMPILE` only inside :func:`small_merge` of a merge whose factors are at most
:data:`SMALL_BYTES`, where the seconds of compile saved outweigh the run time lost (the
pipeline's ``sized_merge`` opens it for a TA merge only: TSV's and Iso-C's spectral steps and
the elementwise methods' dense coordinates ran several times slower at level 0). Figures: benchmarks/results/fast_compile.json.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np

from . import exports as _exports
from . import host as _host

__all__ = [
    "FAST_COMPILE",
    "MODERATE_COMPILE",
    "SMALL_BYTES",
    "Kernel",
    "factor_bytes",
    "kernel",
    "release",
    "small_merge",
]

#: XLA compiler options of a ``fast_compile`` kernel on the CPU backend.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
#: XLA compiler options of a ``fast_compile="moderate"`` kernel on the CPU backend: LLVM at
#: level 1, without the fusion emitters. The one-program merges of the methods other than TA
#: (scoring, allocation and merge in one program): their compile took 1.5 s less than at XLA's
#: defaults (TSV Core, 32 layers x 7 kinds x 8 tasks: 6.9 -> 5.3 s first call) for 0-3% of run
#: time, where level 0 ran their spectral and elementwise steps 1.4-2.2x slower.
MODERATE_COMPILE = {"xla_backend_optimization_level": 1, "xla_cpu_use_fusion_emitters": False}
#: The most bytes of adapter factors (all tasks) of a merge whose ``fast_compile="small"``
#: programs take :data:`FAST_COMPILE`.
SMALL_BYTES = 64 * 2**20

_SMALL: contextvars.ContextVar[bool] = contextvars.ContextVar("netutility_small", default=False)

_KERNELS: weakref.WeakSet[Kernel] = weakref.WeakSet()  # every kernel, for release()


class Kernel:
    """``jax.jit(fun, static_argnames=...)``, registered for :func:`release`. Everything else
    (``lower``, ``trace``, ...) is the jitted function's: with ``fast_compile`` on the CPU
    backend, the one compiled with :data:`FAST_COMPILE`."""

    def __init__(
        self,
        fun: Callable,
        static_argnames: Sequence[str] = (),
        fast_compile: bool | Literal["small", "moderate"] = False,
        export: bool = True,
    ):
        static = tuple(static_argnames)
        self._static = static
        self._export = export
        self._first_static = _first_position(fun, static)
        self._default = jax.jit(fun, static_argnames=static)
        self._fun, self._mode = fun, fast_compile
        self._options: dict[str, Any] | None = None
        self._fast_jit: Any = None  # (made at its first use: see moderate_options)
        self._only_small = fast_compile == "small"
        name = getattr(fun, "__qualname__", None) or fun.__name__  # (a jnp.ufunc has no qualname)
        self._name = f"{fun.__module__}.{name}"
        functools.update_wrapper(self, fun)
        _KERNELS.add(self)

    @property
    def _fast(self) -> Any:
        """The jitted function with this kernel's compiler options (None: it has none)."""
        if not self._mode:
            return None
        if self._fast_jit is None:
            self._options = moderate_options() if self._mode == "moderate" else FAST_COMPILE
            self._fast_jit = jax.jit(
                self._fun, static_argnames=self._static, compiler_options=self._options
            )
        return self._fast_jit

    @property
    def _jit(self) -> Any:
        """The jitted function for the default backend (read at each call: cheap, and a process
        may choose its platform after importing the library)."""
        if self._fast is None or (self._only_small and not _SMALL.get()):
            return self._default
        return self._fast if jax.default_backend() == "cpu" else self._default

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._jit, attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        jitted = self._jit
        if self._export and _exports.wanted(args, kwargs, self._static, self._first_static):
            options = self._options if jitted is self._fast else None
            return _exports.call(jitted, self._name, options, self._static, args, kwargs)
        if jitted is self._default:
            return jitted(*args, **kwargs)
        try:
            return jitted(*args, **kwargs)
        except ValueError as e:  # inside another jit, which compiles it with its own options
            if "compiler_options" not in str(e):
                raise
            return self._default(*args, **kwargs)


def moderate_options() -> dict[str, Any]:
    """:data:`MODERATE_COMPILE` less the options that ``XLA_FLAGS`` sets (read when a kernel
    first compiles): a level the user, or the test suite, chose for every program stands."""
    flags = os.environ.get("XLA_FLAGS", "")
    return {k: v for k, v in MODERATE_COMPILE.items() if k not in flags}


def _first_position(fun: Callable, static: Sequence[str]) -> int:
    """The position of ``fun``'s first static parameter that can be given positionally (a
    large number where none can)."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):  # (no signature: exported only with no positional argument)
        return 0
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for i, p in enumerate(params):
        if p.kind not in kinds:  # (*args or keyword-only: no static parameter after is positional)
            break
        if p.name in static:
            return i
    return 1 << 30


def release() -> None:
    """Drop the compiled programs of every kernel held in this process: a later call traces
    and compiles (or loads from JAX's persistent cache) again. For callers that know a batch
    of shapes is done with."""
    for k in list(_KERNELS):
        for jitted in (k._default, k._fast_jit):
            if jitted is not None:
                jitted.clear_cache()
    _exports.clear()
    _host.forget_constants()


def kernel(
    fun: Callable | None = None,
    *,
    static_argnames: Sequence[str] = (),
    fast_compile: bool | Literal["small", "moderate"] = False,
    export: bool = True,
) -> Any:
    """``jax.jit`` as a :class:`Kernel` (a decorator, with or without ``static_argnames``);
    ``fast_compile``: compiled with :data:`FAST_COMPILE` on the CPU backend (``"small"``: only
    inside :func:`small_merge` of a small merge; ``"moderate"``: with :data:`MODERATE_COMPILE`); ``export``: its traced program kept across
    processes where :mod:`~netutility_jax._core.exports` has a folder (for calls outside any
    trace that give the static arguments by keyword)."""
    if fun is None:
        return functools.partial(
            kernel, static_argnames=static_argnames, fast_compile=fast_compile, export=export
        )
    return Kernel(fun, static_argnames, fast_compile, export)


def factor_bytes(adapters: Any) -> int:
    """Bytes of every array leaf of ``adapters`` (shapes and dtypes only: traced leaves count),
    or its ``nbytes`` (a lazy :class:`nu.peft.AdapterSet`)."""
    n = getattr(adapters, "nbytes", None)
    if isinstance(n, int):
        return n
    total = 0
    for x in jax.tree.leaves(adapters):
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        if shape is not None and dtype is not None:
            total += math.prod(shape) * np.dtype(dtype).itemsize
    return total


@contextlib.contextmanager
def small_merge(nbytes: int | None) -> Any:
    """Within it, the ``fast_compile="small"`` kernels take :data:`FAST_COMPILE` (on the CPU)
    if ``nbytes`` (the merge's factors) is at most :data:`SMALL_BYTES` (None: they do not)."""
    token = _SMALL.set(nbytes is not None and nbytes <= SMALL_BYTES)
    try:
        yield
    finally:
        _SMALL.reset(token)
