"""The merge planner: validate a merge, resolve its options, and cut the model into jobs.

Plain Python over names, shapes and options (nothing is computed here): :func:`plan_merge`
checks every argument of :func:`nu.merge` at the boundary (options through the registry, masks,
the random key, the coefficient, the adapters' scales), groups the modules into buckets of equal
shapes (:func:`_tree.collect`), cuts each bucket into pieces whose stacked factors fit
``PIECE_BYTES``, and gives each piece its route and its frozen stage configuration
(:class:`_stages.BucketConfig`). The pipeline (:mod:`netutility_jax.pipeline._run`) runs the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np

from .. import registry
from .._core import buckets as _buckets
from .._core import checks as _checks
from .._core import mesh as _mesh
from .._core import tree as _tree
from .._core.tables import MaskTable, StackedMasks
from ..errors import InputError, InputTypeError
from . import _rng
from ._stages import DARE_KEPT, BucketConfig

__all__ = [
    "PIECE_BYTES",
    "X64_HINT",
    "Job",
    "MergePlan",
    "bucket_config",
    "check_coef",
    "check_entry_count",
    "check_key",
    "check_masks",
    "check_scale_range",
    "chunk_size",
    "numeric_options",
    "plan_merge",
]

PIECE_BYTES = 32 << 20  # stacked factors per piece of a bucket merged at once
DENSE_BYTES = 64 << 20  # dense tasks (and temporaries) of elementwise methods at once
X64_HINT = (
    "enable x64 (jax.config.update('jax_enable_x64', True)) and pass float64 factors, or rescale "
    "the adapters"
)


@dataclasses.dataclass(frozen=True)
class Job:
    """A piece of a bucket and how it is merged.

    Attributes:
      bucket: the modules (equal shapes).
      route: ``"bucket"``: the whole piece by :func:`_stages.bucket_merge`; ``"dense"``: module
        by module in full space (elementwise methods: at most one module's M dense task updates
        are alive at a time).
      cfg: the stages' static configuration.
      index: each module's position among all the adapters' modules (DARE's keys fold it in).
    """

    bucket: _tree.Bucket
    route: Literal["bucket", "dense"]
    cfg: BucketConfig
    index: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class MergePlan:
    """Everything :func:`nu.merge` will do, checked.

    Attributes:
      fn: the public function's name, for messages.
      resolved: the method, space and options (:class:`registry.Resolved`).
      names: module names in adapter order.
      m_tasks: number of tasks M.
      dtype: the compute dtype.
      numeric: the method's traced options ``{name: value}`` (passed to the stages as data).
      jobs: the pieces, in adapter order.
      model_wide: one selection over the whole model (TIES with ``trim_scope="model"``).
      masks: the checked masks, or None (every candidate).
      mesh: the one-axis mesh each piece's modules are sharded over (:mod:`_mesh`), or None.
    """

    fn: str
    resolved: registry.Resolved
    names: list[str]
    m_tasks: int
    dtype: np.dtype
    numeric: dict[str, Any]
    jobs: tuple[Job, ...]
    model_wide: bool
    masks: dict[str, Any] | None
    mesh: Any = None


def check_coef(fn: str, coef: Any) -> None:
    _checks.real_option(fn, "coef", coef, "a finite real number (the merged update's coefficient)")


def _is_key(key: Any) -> bool:
    """A ``jax.random`` key: a typed key (``jax.random.key(0)``, shape ``()``) or a legacy raw
    threefry key (``jax.random.PRNGKey(0)``: ``uint32 (2,)``)."""
    dt, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    if dt is None or shape is None:
        return False
    try:
        if jax.dtypes.issubdtype(dt, jax.dtypes.prng_key):
            return tuple(shape) == ()
        return np.dtype(dt) == np.uint32 and tuple(shape) == (2,)
    except TypeError:
        return False


def check_key(fn: str, key: Any, method: str) -> None:
    hint = (
        f"method={method!r} draws its drop mask from key=, a jax.random key: pass "
        "jax.random.key(0) (any seed), not a plain integer"
    )
    if key is None:
        raise InputError(f"{fn}: {hint}.")
    if _is_key(key):
        return
    dt = getattr(key, "dtype", None)
    what = (
        _checks.given(key)
        if dt is None
        else f"{type(key).__name__} of dtype {str(dt)[:40]} and shape "
        f"{_checks.brief(getattr(key, 'shape', None))}"
    )
    raise InputTypeError(f"{fn}: key={what}; {hint}.")


def check_masks(fn: str, masks: Any, names: list[str], buckets, m_tasks: int) -> dict:
    if not isinstance(masks, Mapping):
        raise InputTypeError(
            f"{fn}: masks is a {type(masks).__name__}; expected the {{name: bool (M, r_max)}} dict "
            "returned by nu.allocate, or None to keep every component."
        )
    if masks.keys() != set(names):  # nnx's two spellings of a layer name one module
        pairs = _tree.match_names(names, masks.keys())
        if pairs is not None:
            masks = {n: masks[k] for n, k in pairs.items()}
    differ = _tree.name_mismatch(
        names,
        masks,
        missing=lambda x: f"no mask for {_checks.few(x)}",
        extra=lambda x: f"masks for {_checks.few(x)} that the adapters lack",
    )
    if differ:
        raise InputError(
            f"{fn}: mask names do not match the adapters' modules: {differ}. Pass the "
            "masks nu.allocate returns for these same adapters."
        )
    if isinstance(masks, StackedMasks) and masks.pristine:  # (nu.allocate's, traced)
        blocks = masks.blocks()
        for bk in buckets:
            m = blocks.get(tuple(bk.names))
            if m is None:  # (laid out otherwise: read module by module below)
                break
            if tuple(m.shape) != (len(bk.names), m_tasks, bk.r_max) or m.dtype != np.bool_:
                raise InputError(
                    f"{fn}: masks of {_checks.few(bk.names)} have shape {tuple(m.shape)} and "
                    f"dtype {m.dtype}; expected bool (n, M, r_max) = ({len(bk.names)}, "
                    f"{m_tasks}, {bk.r_max})."
                )
        else:
            return masks
    pristine = isinstance(masks, MaskTable) and masks.pristine
    out = {}
    for bk in buckets:
        for name in bk.names:
            m = masks.host(name) if pristine else masks[name]  # (nu.allocate's: no transfer)
            shape = tuple(getattr(m, "shape", np.shape(m)))
            if shape != (m_tasks, bk.r_max):
                raise InputError(
                    f"{fn}: mask of module {name!r} has shape {shape}; expected (M, r_max) = "
                    f"({m_tasks}, {bk.r_max}) (tasks x the module's largest rank)."
                )
            dt = np.dtype(m.dtype if hasattr(m, "dtype") else np.asarray(m).dtype)
            if dt != np.bool_:
                raise InputTypeError(
                    f"{fn}: mask of module {name!r} has dtype {dt}; expected bool."
                )
            out[name] = m
    return masks if pristine else out


def check_scale_range(fn: str, buckets: Sequence[_tree.Bucket], dtype) -> None:
    """Scales beyond the compute dtype's range (``lora_alpha = 1e40`` with float32 factors)
    would become ``inf`` when cast: refused here, before anything is computed."""
    fi = np.finfo(dtype)
    for bk in buckets:
        if _scales_in_range(bk, float(fi.tiny), float(fi.max)):
            continue
        for name, mods in zip(bk.names, bk.modules, strict=True):
            for i, m in enumerate(mods):
                if m is None or isinstance(m.scale, jax.core.Tracer):
                    continue
                v = abs(float(np.asarray(m.scale, np.float64)))
                if v > float(fi.max) or 0 < v < float(fi.tiny):
                    raise InputError(
                        f"{fn}: scale of module {_checks.short(name)!r}, task {i}, is {v:.3g}, "
                        f"outside the range of {np.dtype(dtype).name} (normal numbers "
                        f"{fi.tiny:.3g} to {fi.max:.3g}); {X64_HINT}."
                    )


def _scales_in_range(bk: _tree.Bucket, tiny: float, big: float) -> bool:
    """Whether every concrete scale of the bucket is 0 or within ``[tiny, big]``, checked as one
    array (False: the caller looks module by module, for its message)."""
    v = bk.memo("abs_scales", lambda: _abs_scales(bk))
    return v is not None and bool(((v <= big) & ((v == 0) | (v >= tiny))).all())


def _abs_scales(bk: _tree.Bucket) -> np.ndarray | None:
    """Every scale of the bucket's modules as one float64 array of magnitudes, or None where
    one is a device array, traced, or not a real number within float64."""
    scales = [m.scale for mods in bk.modules for m in mods if m is not None]
    if any(isinstance(x, jax.Array) for x in scales):  # (device or traced: module by module)
        return None
    try:
        v = np.abs(np.asarray(scales, np.float64))
    except (TypeError, ValueError, OverflowError):  # (another form, an int beyond float64)
        return None
    return v if v.ndim == 1 else None


def _dense_shape(space: str, bk: _tree.Bucket, m_tasks: int) -> tuple[int, int]:
    """Each task's dense coordinates ``(p, q)`` in ``space`` (what elementwise methods see)."""
    return {
        "full": (bk.d_in, bk.d_out),
        "core": (m_tasks * bk.r_max,) * 2,
        "knots": (bk.d_in, m_tasks * bk.r_max),
    }[space]


def check_entry_count(fn: str, space: str, buckets, m_tasks: int) -> None:
    """Elementwise methods index a task's dense coordinates with int32: at most 2**31 - 1
    entries per task and module (a full-space 65536 x 32768 module would need 8 GiB per task)."""
    big = []
    for bk in buckets:
        p, q = _dense_shape(space, bk, m_tasks)
        if p * q > 2**31 - 1:
            big.extend((nm, p, q) for nm in bk.names)
    if big:
        _, p, q = big[0]
        raise InputError(
            f"{fn}: TIES / DARE in space={space!r} work on each task's dense ({p}, {q}) "
            f"coordinates of {_checks.few([b[0] for b in big])}: {p * q} entries, more than "
            "2**31 - 1. Use space='core' (its coordinates are (M r, M r)) or a low-rank method."
        )


def chunk_size(
    n_tasks: int, p: int, q: int, itemsize: int, n: int | None = None,
    budget_bytes: int | None = None,
) -> int:  # fmt: skip
    """Modules per chunk of dense work: within ``budget_bytes`` (default :data:`DENSE_BYTES`),
    and, given the bucket's ``n`` modules, as few chunks as that allows, as equal as they can
    be (a divisor of ``n`` where one gives as few: 60 modules at 25 a chunk are 3 chunks of 20,
    59 are 20, 20 and 19; the largest divisor, 1, made 59 chunks)."""
    budget_bytes = DENSE_BYTES if budget_bytes is None else budget_bytes
    per = max(1, 8 * n_tasks * p * q * itemsize)  # dense tasks plus a few temporaries
    c = int(max(1, budget_bytes // per))
    if n is not None and n > 0:
        k = -(-n // min(c, n))  # the fewest chunks within the budget
        c = -(-n // k)
    return c


def row_block(
    res: registry.Resolved, p: int, q: int, m_tasks: int, itemsize: int,
    budget_bytes: int | None = None, *, key_blocks: bool = True,
) -> int | None:  # fmt: skip
    """Rows per block of one module's dense coordinates for TIES, DARE and DARE-TIES (in full
    space its dense task updates), when a module's dense tasks (and temporaries) alone exceed
    ``budget_bytes``; None otherwise (whole modules, :func:`chunk_size`). TIES's trim is found by
    radix selection over blocks; DARE draws a block's rows of the module's mask
    (:func:`_rng.bernoulli_rows`), for keys with ``key_blocks`` (:func:`_rng.blockable`): other
    keys draw a whole module's mask."""
    blocked = registry.METHODS[res.kernel_method].blocked  # a user kernel: whole modules
    blocks = blocked == "ties" or (blocked in DARE_KEPT and key_blocks)
    if res.spec.kind != "elementwise" or not blocks:
        return None
    budget_bytes = DENSE_BYTES if budget_bytes is None else budget_bytes
    per_row = 8 * m_tasks * q * itemsize
    if per_row * p <= budget_bytes:
        return None
    return max(1, budget_bytes // per_row)


def numeric_options(res: registry.Resolved) -> dict[str, Any]:
    """The method's traced options (real options with ``traced=True``): passed as data."""
    traced = {o.name for o in res.spec.options if o.kind == "real" and o.traced}
    return {k: v for k, v in res.kernel_options.items() if k in traced}


def _n_pad(bk: _tree.Bucket, mesh: Any) -> int:
    return len(bk.names) if mesh is None else _mesh.padded(len(bk.names), mesh)


def bucket_config(
    res: registry.Resolved,
    bk: _tree.Bucket,
    m_tasks: int,
    dtype,
    *,
    chunk: int | None = None,
    n_pad: int | None = None,
    rows: int | Literal["auto"] | None = "auto",
    key_blocks: bool = True,
) -> BucketConfig:
    """The stages' static configuration of a bucket (``chunk``: modules per chunk of dense
    work, default :func:`chunk_size` within 64 MiB over ``n_pad``: the modules the stages see,
    default the bucket's; ``rows``: TIES's / DARE's rows per block of a module, default
    :func:`row_block`, ``key_blocks``: DARE's key draws a block's masks,
    :func:`_rng.blockable`)."""
    if res.space == "knots" or (res.space == "full" and res.spec.kind == "elementwise"):
        p, q = _dense_shape(res.space, bk, m_tasks)
    else:
        p = q = m_tasks * bk.r_max
    itemsize = np.dtype(dtype).itemsize
    if chunk is None and res.spec.needs_key and not key_blocks:
        # a key that is not threefry (rbg) draws different bits for a module batched with others
        # than alone: one module per chunk, so that its masks do not depend on the budget
        chunk = 1
    elif chunk is None:
        n = len(bk.names) if n_pad is None else n_pad
        chunk = chunk_size(m_tasks, p, q, itemsize, n)
    if rows == "auto":
        rows = row_block(res, p, q, m_tasks, itemsize, key_blocks=key_blocks)
    numeric = numeric_options(res)
    # the kept-entry option (TIES's density) reaches the stages as a host-made count table
    # (_stages.count_input), not as configuration: another density, the same programs
    counted = registry.METHODS[res.kernel_method].keeps_top
    static = tuple(
        sorted((k, v) for k, v in res.kernel_options.items() if k not in numeric and k != counted)
    )
    return BucketConfig(
        res.kernel_method,
        res.space,
        static,
        res.options.get("variant"),
        bk.d_in,
        bk.d_out,
        bk.r_max,
        dtype,
        chunk,
        rows,
    )


def plan_merge(
    fn: str,
    adapters: Sequence[Any],
    masks: Mapping[str, Any] | None,
    *,
    method: Any,
    space: Any,
    coef: Any,
    key: Any,
    options: Mapping[str, Any],
    module_index: Mapping[str, int] | None = None,
    mesh: Any = None,
) -> MergePlan:
    """Check a :func:`nu.merge` call and plan it (see the module docstring).

    ``module_index``: each module's position in the whole model, when ``adapters`` hold only a
    part of it (a streamed chunk): DARE folds it into its keys, so a model merged part by part
    draws the same masks as merged at once. Default: the position among ``adapters``' modules.
    ``mesh``: shard each piece's modules over its devices (:mod:`netutility_jax._core.mesh`; pieces
    ``mesh.size`` times larger).
    """
    res = registry.resolve_options(fn, method, space, options)
    check_coef(fn, coef)
    if res.spec.needs_key:
        check_key(fn, key, res.spec.name)
    mesh = _mesh.check_mesh(fn, mesh)
    names, buckets, m_tasks = _tree.collect(adapters, fn=fn)
    if masks is not None:
        masks = check_masks(fn, masks, names, buckets, m_tasks)
    dtype = _tree.compute_dtype(buckets)
    check_scale_range(fn, buckets, dtype)
    if res.spec.kind == "elementwise":
        check_entry_count(fn, res.space, buckets, m_tasks)
    index = {n: i for i, n in enumerate(names)} if module_index is None else dict(module_index)
    missing = [n for n in names if n not in index]
    if missing:
        raise InputError(f"{fn}: module_index lacks {_checks.few(missing)}.")
    itemsize = np.dtype(dtype).itemsize
    piece_bytes = PIECE_BYTES * (1 if mesh is None else mesh.size)  # PIECE_BYTES per device
    pieces = [sub for bk in buckets for sub in _buckets.split_bucket(bk, piece_bytes, itemsize)]
    dense = res.spec.kind == "elementwise" and res.space == "full"
    blocks = not res.spec.needs_key or _rng.blockable(key)
    jobs = tuple(
        Job(
            bk,
            "dense" if dense else "bucket",
            bucket_config(res, bk, m_tasks, dtype, n_pad=_n_pad(bk, mesh), key_blocks=blocks),
            tuple(index[nm] for nm in bk.names),
        )
        for bk in pieces
    )
    return MergePlan(
        fn, res, names, m_tasks, dtype, numeric_options(res), jobs, res.model_wide, masks, mesh
    )
