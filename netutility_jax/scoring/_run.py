"""One scoring run over an adapter set: what :func:`nu.score`, the streamed merge and the
task energies share.

:func:`score_run` collects the adapters into buckets, places their inputs (leaves, or stacked
over a mesh), runs :func:`_score_kernels.score_impl` for one or several alphas from one
decomposition, reads the flags back in one transfer and raises on bad input (or defers the range
check, :class:`Deferred`, for the streamed merge, whose chunks are checked together).
:func:`log_energies` gives each task's energy as a mantissa and a power of two (scale-safe), and
:func:`sum_energies` sums chunks of it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._core import buckets as _buckets
from .._core import mesh as _mesh
from .._core import stacking as _stacking
from .._core import tree as _tree
from .._core.checks import brief, check_auto, check_real, real_option, real_value
from .._core.executables import kernel
from .._core.host import host_constant, put_views
from .._core.linalg import mul_pow2, settle
from .._core.tables import ScoreTable
from ..errors import InputError
from . import moments
from ._errors import checkify_score, raise_blind_moments, raise_unrepresentable
from ._grams import PER_TASK, safe_grams
from ._kernels import (
    ANY_SIGMA,
    BEYOND,
    INTERFERENCES,
    NONFINITE,
    RAW_OK,
    BucketOut,
    Finished,
    ModuleScores,
    Scores,
    default_rtol,
    score_by_device,
    score_impl,
)

__all__ = [
    "H_THRESHOLD",
    "Deferred",
    "Run",
    "check_interference",
    "check_options",
    "log_energies",
    "score_inputs",
    "score_run",
    "sum_energies",
]

#: ``alpha="auto"``'s threshold on ``h``: this project's choice, between the paper's NLI
#: (h = 0.63, alpha 1) and vision (h = 1.83, alpha 0) adapters; the paper gives no cut-off
#: (docs/math.md, section 7).
H_THRESHOLD = 1.0

_ALPHA_EXPECTED = (
    "a finite number >= 0 (1.0 Gram geometry, 0.0 row-space heuristic, values in between allowed) "
    "or 'auto'"
)
_LAM_EXPECTED = "a finite number >= 0 (the interference weight) or 'auto'"


def check_options(fn: str, alpha: Any, lam: Any, rtol: Any, h_threshold: Any) -> None:
    for name, value, expected in (("alpha", alpha, _ALPHA_EXPECTED), ("lam", lam, _LAM_EXPECTED)):
        if isinstance(value, str) and value != "auto":  # messages without the type: tests pin them
            raise InputError(f"{fn}: {name}={brief(value)}; expected {expected}.")
        check_auto(fn, name, value, expected)
    if rtol is not None:
        check_real(fn, "rtol", rtol, "None or a number with 0 <= rtol < 1")
        real_option(fn, "rtol", rtol, "0 <= rtol < 1", lambda v: 0 <= v < 1)
    check_real(fn, "h_threshold", h_threshold, "a finite number")
    v = real_value(h_threshold)  # None under a trace
    if v is not None and not np.isfinite(v):
        raise InputError(f"{fn}: h_threshold={brief(h_threshold)}; expected a finite number.")


def check_interference(fn: str, interference: Any) -> str:
    """``interference`` as one of :data:`INTERFERENCES`, or :class:`InputError` naming it."""
    if not isinstance(interference, str) or interference not in INTERFERENCES:
        raise InputError(
            f"{fn}: interference={brief(interference)}; expected 'overlap' (the paper's "
            "input-overlap term, the default), 'signed' (sign-aware: only conflicting "
            "directions count; this project's extension) or 'signed_weaker' (the same, each "
            "conflict charged to the side with the smaller share of its task's energy)."
        )
    return interference


def _traced(*trees: Any) -> bool:
    """Is any leaf abstract (the call runs under jit, vmap, grad...)?"""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


def _dead(bk: _tree.Bucket) -> bool:
    """A bucket whose updates are empty (rank 0, or d_in or d_out 0): no candidates."""
    return bk.r_max == 0 or bk.d_in == 0 or bk.d_out == 0


def _score_moments(
    fn: str, buckets: Sequence[_tree.Bucket], rows: Sequence[Any], dtype: Any, mesh: Any
) -> tuple:
    """The live buckets' input moments for :func:`score_impl`: :func:`moments.resolve`'s rows
    (stacked inside the kernel), or with a mesh stacked on the host and zero-padded like
    :func:`score_inputs` (:class:`_buckets.StackedMoments`)."""
    live = [r for bk, r in zip(buckets, rows, strict=True) if not _dead(bk)]
    if mesh is None:
        return tuple(live)
    if _traced(live):
        raise InputError(
            f"{fn}: mesh= stacks the input moments on the host, so it needs concrete arrays, "
            "not traced ones: call it outside the transformation, or leave mesh=None."
        )
    live_bk = [bk for bk in buckets if not _dead(bk)]
    return tuple(
        _buckets.stack_moments(
            r, d_in=bk.d_in, dtype=dtype, n_pad=_mesh.padded(len(bk.names), mesh), host=True
        )
        for bk, r in zip(live_bk, live, strict=True)
    )


def _stacked_input(bk: _tree.Bucket, dtype: Any) -> _mesh.Stacked:
    """A stacked bucket's arrays in the compute ``dtype`` (they are made in it)."""
    st = bk.stacked
    if st.a.dtype == dtype and st.b.dtype == dtype and st.scale.dtype == dtype:
        return st
    return _mesh.Stacked(st.a.astype(dtype), st.b.astype(dtype), st.scale.astype(dtype), st.rank)


def _leaf_input(bk: _tree.Bucket, leaves: tuple, dtype: Any) -> Any:
    """One bucket's input without a mesh: its factors stacked where they are
    (:func:`_stacking.stacked_input`: numpy factors on the host, concrete device factors on
    their device) and handed over as four arrays (:class:`_mesh.Stacked`), which the merge
    programs take too: no argument per leaf, and the program's size does not grow with the
    modules. Traced factors, and a bucket of device factors too large to copy, stay leaves,
    which the kernel reads a group of modules at a time (:func:`_grams.leaf_grams`); their
    concrete scales become one ``(n, M)`` array (one argument, not one per scale)."""
    a, b, s = leaves
    host = _buckets.host_scales(s, dtype)
    if host is None:
        return a, b, s
    st = _stacking.stacked_input(bk, dtype, scales=host)
    if st is not None:
        return st._replace(scale=host)  # (the scales as XLA rounds them)
    return a, b, host


def score_inputs(fn: str, live: Sequence[_tree.Bucket], dtype: Any, mesh: Any) -> tuple:
    """The live buckets' inputs of :func:`score_impl`: their leaves, or with a mesh their
    factors stacked on the host and sharded over it (:mod:`netutility_jax._core.mesh`); the
    stacked arrays of a ``nu.stack_adapters`` set as they are."""
    if any(bk.stacked is not None for bk in live):
        if _mesh.check_mesh(fn, mesh) is not None:
            raise InputError(
                f"{fn}: mesh= shards the adapters' leaves; a nu.StackedAdapters set is stacked "
                "on one device already: pass stacked.unstack() with mesh=, or no mesh."
            )
        return tuple(_stacked_input(bk, dtype) for bk in live)
    leaves = tuple(_buckets.bucket_arrays(bk) for bk in live)
    if _mesh.check_mesh(fn, mesh) is None:
        return tuple(_leaf_input(bk, x, dtype) for bk, x in zip(live, leaves, strict=True))
    if _traced(leaves):
        raise InputError(
            f"{fn}: mesh= stacks the factors on the host, so it needs concrete arrays, not "
            "traced ones (a call inside jax.jit or vmap): call it outside the transformation, "
            "or shard the inputs of the jitted function yourself and leave mesh=None."
        )
    return tuple(_mesh.host_stack(bk, dtype, _mesh.padded(len(bk.names), mesh)) for bk in live)


class Run(NamedTuple):
    """What :func:`score_run` returns."""

    scores: list[Scores]  # one per alpha
    energies: tuple[np.ndarray, np.ndarray] | None  # per task (k, t): energy t 2^k, or None
    check: list[Deferred]  # with defer: per alpha, the range check not yet made


class Deferred(NamedTuple):
    """A range check of :func:`score_run` not made yet (``defer``): what
    :func:`raise_unrepresentable` reads, the buckets without their factors (:func:`_shell`)."""

    fn: str
    buckets: list[_tree.Bucket]
    outs: list[Any]
    lam: Any
    lam_bad: Any
    dtype: Any
    lam_is_auto: bool
    # whether the kernel flagged a result beyond the dtype (Finished.status): if not, check()
    # has nothing to find and reads nothing back
    flagged: bool = True

    def check(self) -> None:
        """Raise :class:`InputError` if a result is beyond the compute dtype (as :func:`score`)."""
        if not self.flagged:
            return
        raise_unrepresentable(
            self.fn, self.buckets, self.outs, self.lam, self.lam_bad, dtype=self.dtype,
            lam_is_auto=self.lam_is_auto,
        )  # fmt: skip

    @classmethod
    def join(cls, parts: Sequence[Deferred]) -> Deferred:
        """One check over several calls' buckets (streamed chunks of one model with the same
        lam, in the model's bucket order), so the error counts every affected module."""
        p0 = parts[0]
        return p0._replace(
            buckets=[b for p in parts for b in p.buckets],
            outs=[o for p in parts for o in p.outs],
            lam_bad=any(bool(np.asarray(p.lam_bad)) for p in parts),
            flagged=any(p.flagged for p in parts),
        )


def score_run(
    fn: str,
    adapters: Sequence[Any],
    alphas: Sequence[Any],
    lam: Any,
    rtol: Any,
    checked: bool,
    mesh: Any,
    *,
    energy: bool = False,
    defer: bool = False,
    input_moments: Any = None,
    interference: str = "overlap",
) -> Run:
    """:func:`score` for each of ``alphas`` (checked numbers) from one decomposition.

    ``energy``: also each task's energy over the modules (concrete inputs), from the scoring
    Grams. ``defer``: results beyond the compute dtype are not raised here (whether they occur
    depends on alpha) but by ``check[a]()``, which holds the modules' names and scales only.
    ``input_moments``: as :func:`score` (checked here). ``interference``: as :func:`score`
    (checked here).
    """
    interference = check_interference(fn, interference)
    names, buckets, m_tasks = _tree.collect(adapters, fn=fn)
    mrows = moments.resolve(fn, input_moments, buckets, m_tasks)
    lam_is_auto = isinstance(lam, str)
    lam_val = 0.0 if lam_is_auto else lam
    dtype = _tree.compute_dtype(buckets)
    live = [bk for bk in buckets if not _dead(bk)]
    by_name = _dead_scores(buckets, m_tasks, dtype, len(alphas))
    if live:
        k = _Kernel(fn, live, dtype, mesh, lam_is_auto, energy, interference)
        finished, parts, traced, status, stacked_moments = k.run(
            buckets, mrows, alphas, lam_val, rtol
        )
    else:
        none = Finished((), jnp.asarray(lam_val, dtype), jnp.asarray(False), None, None)
        finished, parts, stacked_moments = (none,) * len(alphas), None, None
        traced = _traced(alphas, lam_val)
        status = np.zeros((len(alphas), 4), bool)
    if mesh is not None and live:  # drop the padding modules of each bucket
        # (no eager slice without padding: each would compile a gather)
        cut = functools.partial(_unpad, sizes=[len(bk.names) for bk in live])
        finished = tuple(f._replace(outs=cut(f.outs)) for f in finished)
        parts = None if parts is None else cut(parts)
    checks: list[Deferred] = []
    if traced:
        if checked:
            for f in finished:
                checkify_score(fn, names, live, f.outs, f.lam_bad)
    else:
        checks = _check_concrete(
            fn, names, buckets, live, finished, status, mrows, stacked_moments, dtype,
            lam_is_auto, defer,
        )  # fmt: skip
    scores = [
        # kept stacked: each module's fields are sliced (in the graph, or made on the host)
        # only when read (see _core.tables)
        Scores(_table(names, live, f, d), f.lam, host_constant(a, dtype, shared=False))
        for d, f, a in zip(by_name, finished, alphas, strict=True)
    ]
    energies = sum_energies(parts, m_tasks) if energy else None
    return Run(scores, energies, checks)


def _table(names, live, finished: Finished, dead: dict) -> Any:
    """One alpha's scores: a :class:`ScoreTable` over the live buckets' stats (the dead ones'
    entries given), or with no live bucket the dead entries as a dict in module order."""
    if not live:
        return {k: dead[k] for k in names}
    stats = [(bk.names, o.stats) for bk, o in zip(live, finished.outs, strict=True)]
    return ScoreTable(names, stats, dead, ModuleScores)


def _dead_scores(buckets, m_tasks: int, dtype: Any, n_alpha: int) -> list[dict]:
    """Per alpha, the scores of the modules of dead buckets (:func:`_dead`): no candidate."""
    by_name: list[dict[str, ModuleScores]] = [{} for _ in range(n_alpha)]
    for bk in buckets:
        if _dead(bk):
            zeros = jnp.zeros((m_tasks, bk.r_max), dtype)
            empty = ModuleScores(
                zeros, zeros, zeros, jnp.full((m_tasks, bk.r_max), -jnp.inf, dtype)
            )
            for d in by_name:
                d.update((nm, empty) for nm in bk.names)
    return by_name


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """The scoring kernel over the live buckets: :meth:`run` places the inputs, calls it by the
    route the inputs allow and reads its flags back."""

    fn: str
    live: list
    dtype: Any
    mesh: Any
    lam_is_auto: bool
    energy: bool
    interference: str

    def run(self, buckets, mrows, alphas, lam_val, rtol) -> tuple:
        """``(finished, parts, traced, status, stacked_moments)``: per alpha the kernel's
        :class:`Finished`, the energies' parts, whether the values are abstract, the flags
        ``(A, 4)`` on the host (None if traced) and the moments as handed over."""
        fn, live, dtype, mesh = self.fn, self.live, self.dtype, self.mesh
        meta = (dtype, tuple((bk.d_in, bk.d_out, bk.r_max) for bk in live))
        rtols = tuple(
            host_constant(default_rtol(bk.r_max, dtype) if rtol is None else rtol, dtype)
            for bk in live
        )
        inputs = score_inputs(fn, live, dtype, mesh)
        if all(isinstance(a, (bool, int, float, np.generic)) for a in alphas):
            alpha_arg = host_constant(alphas[0] if len(alphas) == 1 else np.asarray(alphas), dtype)
        else:
            alpha_arg = jnp.asarray(alphas[0] if len(alphas) == 1 else jnp.stack(alphas), dtype)
        kw = {"meta": meta, "lam_is_auto": self.lam_is_auto, "energy": self.energy}
        kw["interference"] = self.interference
        stacked_moments = None
        if mrows is not None:
            stacked_moments = _score_moments(fn, buckets, mrows, dtype, mesh)
            kw["moments"] = stacked_moments
        traced = _traced(inputs, alpha_arg, lam_val, stacked_moments)
        impl = score_impl if mesh is None else functools.partial(score_by_device, mesh=mesh)
        args = (inputs, alpha_arg, lam_val, rtols)
        status = None
        # float64 values beyond float32 become inf when cast: counted and reported later
        with np.errstate(over="ignore"):
            finished, raw_ok, parts = impl(*args, **kw, route="cond" if traced else "raw")
            if not traced and isinstance(raw_ok, jax.core.Tracer):
                # concrete inputs inside an outer transformation (constants closed over by a
                # jitted function): its values are unknown too, so the traced route
                traced = True
                finished, _, parts = impl(*args, **kw, route="cond")
            if not traced:
                # every alpha's flags in one transfer; the details are read only where one is set
                status = _status(finished)
                # extreme or non-finite factors: the exact route (after the first call is done:
                # one LAPACK-using executable in flight at a time, see eigh_batched)
                if not status[0, RAW_OK]:
                    finished, _, parts = impl(*args, **kw, route="normalise")
                    status = _status(finished)
        return finished, parts, traced, status, stacked_moments


def _check_concrete(
    fn, names, buckets, live, finished, status, mrows, stacked_moments, dtype, lam_is_auto, defer
) -> list[Deferred]:
    """The checks of concrete scores: non-finite factors, blind input moments, results beyond
    the dtype (raised, or per alpha a :class:`Deferred` with ``defer``), and ``lam="auto"``
    without a candidate. Returns the deferred checks (empty without ``defer``)."""
    checks = []
    # (the non-finite counts come from the Grams: the same for every alpha)
    if status[0, NONFINITE]:
        _tree.raise_nonfinite(fn, live, [o.nonfinite for o in finished[0].outs], dtype=dtype)
    if stacked_moments is not None:
        isos = [
            _buckets.moment_iso(r) for bk, r in zip(buckets, mrows, strict=True) if not _dead(bk)
        ]
        host0 = jax.device_get([o.stats for o in finished[0].outs])
        raise_blind_moments(fn, live, host0, isos)
    held = [_shell(bk) for bk in live] if defer else live
    for a, f in enumerate(finished):
        check = Deferred(
            fn, held, list(f.outs), f.lam, f.lam_bad, dtype, lam_is_auto, bool(status[a, BEYOND])
        )
        if defer:
            checks.append(check)
        else:
            check.check()
    if lam_is_auto and not status[0, ANY_SIGMA]:
        raise InputError(
            f"{fn}: no candidate directions: the update of every task is zero (or below "
            f"rtol, or of rank 0) in all {len(names)} modules, so lam='auto' (a median over "
            "candidates) is undefined. Check that the adapters are trained (lora_b is zero "
            "at initialisation) and loaded correctly; with lam= given explicitly the scores "
            "are defined (every utility -inf) and nu.allocate keeps nothing."
        )
    return checks


def _status(finished: Sequence[Finished]) -> np.ndarray:
    """Every alpha's :attr:`Finished.status` ``(A, 4)`` on the host, in one transfer, once the
    kernel is done (on CPU: one LAPACK-using executable in flight, see _linalg.settle)."""
    settle(finished)
    return np.stack(jax.device_get([f.status for f in finished]))


def _module_scores(
    buckets: Sequence[_tree.Bucket], outs: Sequence[BucketOut], host: Sequence[np.ndarray]
) -> dict[str, ModuleScores]:
    """Each module's :class:`ModuleScores` from its bucket's fields on the host ``host[b]``
    ``(n, 4, M, r)``: numpy views, placed by :func:`put_views` all at once, on the device (and
    with the sharding) of the kernel's output."""
    out: dict[str, ModuleScores] = {}
    for bk, o, h in zip(buckets, outs, host, strict=True):
        n = len(bk.names)
        arrays = put_views([h[i, k] for i in range(n) for k in range(4)], o.stats.sharding)
        out.update((nm, ModuleScores(*arrays[4 * i : 4 * i + 4])) for i, nm in enumerate(bk.names))
    return out


def _unpad(tree: Any, *, sizes: Sequence[int]) -> Any:
    """Per bucket (``tree[b]``), its first ``sizes[b]`` modules: the mesh's padding dropped."""
    return tuple(
        jax.tree.map(lambda x, n=n: x if x.shape[0] == n else x[:n], o)
        for o, n in zip(tree, sizes, strict=True)
    )


def _shell(bk: _tree.Bucket) -> _tree.Bucket:
    """``bk`` without its factors (names, shapes and scales: what an error message reads)."""
    mods = tuple(
        tuple(None if m is None else _tree.Module(None, None, m.scale) for m in row)
        for row in bk.modules
    )
    return dataclasses.replace(bk, modules=mods)


@kernel
def log_energy_variance(k: jax.Array, t: jax.Array) -> jax.Array:
    """``Var_i log(t_i 2^k_i)`` (population variance, in ``t``'s dtype): the heterogeneity
    ``h`` of each task's energy ``t_i 2^k_i``, the integer parts centred exactly before the
    float math. One program, shared by :func:`nu.heterogeneity` and the streamed merge, so both
    compute the same bits (its eager operations were eight programs, each traced and loaded in
    every process)."""
    rel = (k - k[0]).astype(t.dtype) + jnp.log2(t)
    return jnp.var(rel * np.log(2.0).astype(t.dtype))


def sum_energies(parts: Any, m_tasks: int) -> tuple[np.ndarray, np.ndarray]:
    """Per task ``(k, t)``, the energy summed over modules as ``t 2^k`` (``t`` float64, each
    module's part taken relative to the task's largest power, so nothing overflows), from each
    bucket's ``(mantissa, exponent)`` (:func:`_module_energies`); no module: zeros."""
    if not parts:
        return np.zeros(m_tasks, np.int64), np.zeros(m_tasks)
    e = np.concatenate([np.asarray(m, np.float64) for m, _ in parts])  # (modules, M)
    k = np.concatenate([np.asarray(x, np.int64) for _, x in parts])
    live = e > 0
    kmax = np.where(live, k, np.iinfo(np.int64).min).max(0)
    t = np.where(live, e * np.exp2(np.where(live, k - kmax, 0)), 0.0).sum(0)
    return np.where(live.any(0), kmax, 0), t


@kernel(static_argnames=("meta", "route"), fast_compile=True)
def log_energy_impl(inputs, *, meta, route="raw"):
    """Per task ``||dW_i||_F^2 = t_i 2^k_i`` summed over modules, scale-safe.

    Returns ``(k (M,) int32, t (M,))``, per bucket the ``(n, M, 3)`` non-finite counts, and
    ``raw_ok`` (see :func:`safe_grams`: False means redo with ``route="normalise"``). Each
    module's energy ``s^2 sum((a^T a) * (b b^T))`` is computed from normalised factors as a
    mantissa and a power of two, and the sum over modules is taken relative to the task's
    largest power, so nothing overflows whatever the scales.
    """
    dtype = meta[0]
    mant, expo, bads, oks = [], [], [], []
    for x, (d_in, d_out, r_max) in zip(inputs, meta[1], strict=True):
        if isinstance(x, _mesh.Stacked):  # stacked on the host (the streamed merge)
            A, B, S, _ = x
        else:
            A, B, S, _ = _buckets.stack_bucket(*x, d_in=d_in, d_out=d_out, r_max=r_max, dtype=dtype)
        gaa, gbb, s2, e, nonfinite, raw_ok = safe_grams(A, B, S, PER_TASK, route)
        oks.append(raw_ok)
        mant.append(((s2**2)[..., None, None] * gaa * gbb).sum((2, 3)))  # (n, M)
        expo.append(2 * e)
        bads.append(nonfinite)
    e = jnp.concatenate(mant, 0)  # (L, M)
    k = jnp.concatenate(expo, 0)
    live = e > 0
    kmax = jnp.max(jnp.where(live, k, jnp.iinfo(jnp.int32).min), 0)
    t = jnp.where(live, mul_pow2(e, jnp.where(live, k - kmax, 0)), 0).sum(0)
    kmax = jnp.where(live.any(0), kmax, 0)
    # a task with a NaN/Inf input has an undefined energy (eager calls raise; traces see NaN)
    bad_task = jnp.concatenate([(b > 0).any(-1) for b in bads], 0).any(0)
    t = jnp.where(bad_task, jnp.nan, t)
    return kmax, t, tuple(bads), jnp.stack(oks).all()


def log_energies(adapters: Sequence[Any], fn: str, checked: bool, *, stacked: bool = False):
    """``(k, t, buckets)`` of :func:`log_energy_impl`, with the eager finiteness check.
    ``stacked``: stack each bucket's (concrete) factors on the host first
    (:func:`_mesh.host_stack`): the same values, and a small program whatever the modules."""
    _, buckets, m_tasks = _tree.collect(adapters, fn=fn)
    dtype = _tree.compute_dtype(buckets)
    live = [bk for bk in buckets if not _dead(bk)]
    if not live:
        return jnp.zeros((m_tasks,), jnp.int32), jnp.zeros((m_tasks,), dtype), dtype
    meta = (dtype, tuple((bk.d_in, bk.d_out, bk.r_max) for bk in live))
    if any(bk.stacked is not None for bk in live):  # (nu.stack_adapters: stacked already)
        inputs = tuple(_stacked_input(bk, dtype) for bk in live)
        stacked = False
    else:
        inputs = tuple(_buckets.bucket_arrays(bk) for bk in live)
    traced = _traced(inputs)
    if stacked and not traced:
        inputs = tuple(_mesh.host_stack(bk, dtype, len(bk.names)) for bk in live)
    with np.errstate(over="ignore"):  # values beyond the dtype: counted and reported below
        k, t, bads, raw_ok = log_energy_impl(inputs, meta=meta, route="cond" if traced else "raw")
        if not traced and isinstance(raw_ok, jax.core.Tracer):  # inside an outer transformation
            traced = True
            k, t, bads, raw_ok = log_energy_impl(inputs, meta=meta, route="cond")
        # extreme or non-finite factors: the exact route (no LAPACK here, no ordering needed)
        if not traced and not bool(raw_ok):
            k, t, bads, _ = log_energy_impl(inputs, meta=meta, route="normalise")
    if not isinstance(t, jax.core.Tracer):
        _tree.raise_nonfinite(fn, live, bads, dtype=dtype)
    elif checked:
        from jax.experimental import checkify

        for bad in bads:
            checkify.check(
                ~(bad > 0).any(),
                f"{fn}: a factor or scale has {{count}} non-finite entries (NaN or Inf).",
                count=bad.sum(),
            )
    return k, t, dtype
