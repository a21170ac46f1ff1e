"""Merging M LoRA adapters: kept components -> space -> method -> back (paper, Algorithm 1).

The public API of the merge pipeline; the work is done in layers that never reach up:

* :mod:`netutility_jax.registry`: every method and space as a declaration (options, spaces,
  kernel);
* :mod:`netutility_jax.operators._plan`: validate a call, resolve its options, group modules into buckets
  of equal shapes and cut them into pieces (plain Python over names and shapes);
* :mod:`netutility_jax.pipeline._run`, :mod:`netutility_jax.operators._ties_model`: run the plan, bucket by
  bucket, and check the results;
* :mod:`netutility_jax.operators._stages`: the per-bucket stages (pure jitted functions, frozen static
  configs), which call the method kernels (:mod:`netutility_jax.methods`) and the selection
  kernels (:mod:`netutility_jax.operators._select`).

Results stay low rank wherever the math allows: TA, TSV, Iso-C and Iso-CTS in every space and every
method in Core and KnOTS space return ``{"lora_a" (d_in, K), "lora_b" (K, d_out), "scale": 1.0}``
with ``K`` the module's own result rank. Only TIES, DARE and DARE-TIES in full space need entry
access to ``dK``; they return ``{"delta": (d_in, d_out)}`` and are run module by module, so at most
one module's ``M`` dense task updates are alive at a time (:func:`to_lora` truncates them back).

:func:`merge_adapters` is the one-call pipeline: score, allocate, merge, report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .. import registry
from .._core import stacking as _stacking
from .._core import tree as _tree
from .._core.tables import MaskTable, MergedTable
from ..operators import _plan, _results, program, ta, traced
from ..operators._module_ops import fold as fold
from ..operators._module_ops import module_update as module_update
from ..operators._module_ops import to_lora as to_lora
from ..operators.stacked import StackedAdapters
from ..scoring._run import score_run
from . import _fused, _fused_stages
from . import _run as _pipeline
from ._coef import coef_split as coef_split
from ._coef import scale_results as scale_results
from ._report import Report as Report
from ._report import ZeroUpdateWarning as ZeroUpdateWarning
from ._report import build_report, h_of, heterogeneity_or_nan, ranks_of
from ._report import warn_zeroed as warn_zeroed
from ._report import zeroed_modules as zeroed_modules
from ._report import zeroed_text as zeroed_text
from ._request import MergeRequest, sized_merge
from ._request import check_weights as check_weights
from ._traced import merge_adapters_traced, merge_traced, refuse_traced_mesh

__all__ = [
    "ALLOCATIONS",
    "ELEMENTWISE_METHODS",
    "LOW_RANK_METHODS",
    "METHODS",
    "METHOD_OPTIONS",
    "SPACE_OPTIONS",
    "Report",
    "ZeroUpdateWarning",
    "check_weights",
    "fast_ta",
    "fold",
    "merge",
    "merge_adapters",
    "module_update",
    "to_lora",
    "weight_adapters",
]

# Views of the registry, for callers of the old tables.
METHODS = tuple(registry.METHODS)
LOW_RANK_METHODS = registry.low_rank_methods()
ELEMENTWISE_METHODS = registry.elementwise_methods()
ALLOCATIONS = registry.ALLOCATIONS
#: ``{method: {option: default}}`` (None: required), from the registry.
METHOD_OPTIONS: dict[str, dict[str, Any]] = {
    n: {o.name: (None if o.required else o.default) for o in s.options}
    for n, s in registry.METHODS.items()
}
SPACE_OPTIONS: dict[str, dict[str, Any]] = {
    n: {o.name: o.default for o in s.options} for n, s in registry.SPACES.items()
}


@sized_merge
def merge(
    adapters: Sequence[Any],
    masks: Mapping[str, Any] | None = None,
    *,
    method: str = "ta",
    space: str = "full",
    coef: float = 1.0,
    key: jax.Array | None = None,
    mesh: Any = None,
    **options: Any,
) -> Any:
    """Merge the kept components of M adapters in a space with a method (paper, Algorithm 1).

    Each task's update is decomposed (:func:`nu.lora_svd`); slot ``k`` of ``masks[name][j]`` keeps
    task j's k-th largest singular direction. The kept updates ``dK_i`` are represented in ``space``
    (see :mod:`netutility_jax.spaces`), merged by ``method``, and mapped back:

    * ``"ta"``: ``coef * sum_i dK_i`` (``isotropize=True``: Iso-C).
    * ``"tsv"``: ``coef * polar([U_i]) diag([s_i]) polar([V_i])^T`` (``isotropize=True``: the kept
      ``s`` flattened to their mean, the paper's "Iso-C + TSV").
    * ``"iso_c"``: the TA sum with its nonzero singular values replaced by their mean.
    * ``"iso_cts"``: Iso-CTS (``common_fraction=0.8`` of the TA sum's rank is common).
    * ``"ties"``: per task keep exactly ``int(density * n)`` largest-magnitude entries (``density``,
      default 0.2; ``trim_scope="module"``), elect signs (sign of the sum, 0 -> +), disjoint mean,
      times ``coef``. ``n`` is the exact number of entries (full space ``d_in d_out``; core and
      KnOTS the entries their bases span; ``trim_scope="model"`` the sum over modules) and the count
      is PEFT's ``int(density * n)`` in binary64, made on the host (:func:`methods.topk_count`):
      0.3 of 96 x 25 entries keeps 720. Entries of equal magnitude are taken in flat row-major
      order (modules in order for ``trim_scope="model"``), lower index first.
    * ``"dare"``: drop entries with probability ``p``, rescale by ``1/(1-p)``, sum, times ``coef``;
      a fresh mask per call from ``key`` (folded with the module index). ``"dare_ties"``: the
      same drop, then TIES sign election and disjoint mean.

    Spaces: ``"full"``, ``"core"`` (Core Space) and ``"knots"`` (``variant="core_space"`` unscaled
    blocks, default, or ``"original"`` scaled blocks). TA is identical in all three; TSV, Iso-C and
    Iso-CTS are identical in full, core and original-KnOTS space (the transforms are isometries on
    the spans of the kept directions). Elementwise methods depend on the space. In KnOTS's default
    variant the task blocks are unscaled (``V_i``) and the merged block maps back through ``S U^T``,
    so Iso-C and ``isotropize=True`` flatten the spectrum of the merge in those coordinates, not of
    the returned update (there, Iso-C + TSV equals TSV); use ``variant="original"`` for the
    isotropic result.

    Low-rank results are returned as they come out of the method, not re-factored: ``lora_a``'s
    columns are the merge's (nonzero) directions, so a module's rank is its number of live
    columns (TA: the kept components; TSV in full and core space: orthonormal ``lora_b`` rows).
    KnOTS elementwise merges keep the merged ``(d_in, k)`` block as ``lora_a`` (rank ``k`` but for
    zero columns), up to a power of two moved between the factors. Use :func:`to_lora` for a
    truncated SVD of any module.

    Numerics: each task's factors and scale are split into powers of two and normalised numbers
    and each module is merged in a unit of its own (:mod:`netutility_jax.spaces`), so an extreme
    but finite scale (``lora_alpha = 1e30`` in one task, float32) gives the merge of the same
    inputs in float64, rounded to the dtype. ``coef`` too: one outside the dtype's normal range
    (``1e-39`` or ``1e39`` in float32) is run as its mantissa and its power of two is applied to
    the result on the host (split between the factors where one alone cannot hold it), so
    ``coef=1e-39`` gives the exact scaled merge wherever that is representable. A merge that
    cannot be held in the dtype is refused (``InputError`` naming the modules, and the
    coefficient where it is the cause), never returned as ``inf``, NaN or zeros: a dense result
    beyond its range, factors that overflow even when balanced, or a result whose largest entry is
    below its smallest normal number. Low-rank results are factors: finite factors whose product
    would overflow the dtype are returned (:func:`fold` and :func:`module_update` check the
    product). Elementwise selections are exact on the numbers computed: an entry within rounding
    of a task's threshold (or of a zero sum in the sign election) can be selected differently in
    float32 and float64, and Iso-CTS and TSV give every kept direction unit weight in their polar
    factors, so there tasks of very different sizes make the result depend on each precision's
    rank cut.

    Args:
      adapters: M adapters (one per task) with the same module names, as for :func:`nu.score`.
      masks: ``{name: bool (M, r_max)}`` from :func:`nu.allocate`, or None to keep every candidate.
      method: one of ``"ta"``, ``"tsv"``, ``"iso_c"``, ``"iso_cts"``, ``"ties"``, ``"dare"``,
        ``"dare_ties"``.
      space: ``"full"``, ``"core"`` or ``"knots"``.
      coef: finite real scaling coefficient of the merged update (may be traced).
      key: ``jax.random`` key (``jax.random.key(0)``, or a raw ``PRNGKey``), required by
        ``"dare"`` and ``"dare_ties"``.
      mesh: a one-axis :class:`jax.sharding.Mesh` (:func:`nu.module_mesh`): each bucket's
        modules are sharded over its devices (:mod:`netutility_jax._core.mesh`; elementwise methods
        in full space and model-wide TIES run module by module on one device). None: one device.
      **options: method options (``density`` in ``[0, 1]``, a concrete number; ``trim_scope``
        ``"module"`` or ``"model"``, formerly ``scope``, which still works with a
        ``DeprecationWarning``; ``p`` in ``[0, 1)``; ``isotropize`` a bool;
        ``common_fraction`` in ``[0, 1]``) and space options (``variant`` for KnOTS:
        ``"core_space"`` or ``"original"``). Booleans must be bools and numbers real numbers
        (numpy scalars are fine); nothing is taken by its truthiness.

    Returns:
      An adapter with the first adapter's tree and module names; each module is
      ``{"lora_a": (d_in, K), "lora_b": (K, d_out), "scale": 1.0}`` (``K`` the module's result rank,
      0 if nothing is kept) or, for TIES/DARE in full space, ``{"delta": (d_in, d_out)}``.

    The methods, their options (types, defaults, ranges) and the spaces they run in are declared
    in :mod:`netutility_jax.registry` (``nu.registry.METHODS``).

    Raises:
      InputError: (a ``ValueError``) unknown method, space or option value; density, p or
        common_fraction out of range; DARE without a key; non-finite coef; masks whose names or
        shapes do not match the adapters; bad adapters (NaN or inf factors, a scale outside the
        dtype's normal range); a merged module beyond the dtype's range.
      InputTypeError: (a ``TypeError``) an option of the wrong type (a string for a bool, a
        complex coef, an int key); masks not a dict of bool arrays.

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> ads = [{"q": {"lora_a": rng.normal(size=(32, 4)), "lora_b": rng.normal(size=(4, 16))}}
      ...        for _ in range(3)]
      >>> out = nu.merge(ads, method="ta", space="core")
      >>> dk = out["q"]["lora_a"] @ out["q"]["lora_b"]
      >>> bool(np.allclose(dk, sum(a["q"]["lora_a"] @ a["q"]["lora_b"] for a in ads), atol=1e-3))
      True

    References:
      Amballa et al., "Not All Ranks Are Equal", Algorithm 1; Panariello et al. 2025 (Core Space);
      Stoica et al. 2024 (KnOTS); Ilharco et al. 2023; Yadav et al. 2023; Yu et al. 2024;
      Gargiulo et al. 2025; Marczak et al. 2025.
    """
    fn = "nu.merge"
    if traced.any_traced(adapters, masks, coef):
        res = registry.resolve_options(fn, method, space, dict(options))
        traced.refuse_untraceable(fn, res, options)
        refuse_traced_mesh(fn, mesh)
        _plan.check_coef(fn, coef)
        return _rebuild(adapters, merge_traced(fn, adapters, masks, res, coef=coef, key=key))
    if fast_ta(fn, method, space, options, mesh):
        done = ta.merge_ta(fn, adapters, masks, coef=coef)
        if done is not None:
            return _rebuild(adapters, done.modules)
    if isinstance(adapters, StackedAdapters) and (
        mesh is not None or registry.resolve_options(fn, method, space, dict(options)).model_wide
    ):  # the bucket pipeline over a mesh, or model-wide TIES, takes per-module views
        adapters = adapters.unstack()
    plan = _plan.plan_merge(
        fn, adapters, masks, method=method, space=space, coef=coef, key=key, options=options,
        mesh=mesh,
    )  # fmt: skip
    if isinstance(adapters, StackedAdapters) and not program.applies(plan):
        adapters = adapters.unstack()  # (module by module or in blocks of rows: views)
        plan = _plan.plan_merge(
            fn, adapters, masks, method=method, space=space, coef=coef, key=key,
            options=options, mesh=mesh,
        )  # fmt: skip
    return _rebuild(adapters, run_plan(plan, coef=coef, key=key))


# ------------------------------------------------------------------ coef outside the dtype's range


def run_plan(plan: Any, *, coef: Any, key: Any) -> dict[str, Any]:
    """:func:`_pipeline.run` with ``coef`` split by :func:`coef_split`: ``{name: module}``."""
    mant, exp2 = coef_split(coef, plan.dtype)
    results = _pipeline.run(plan, coef=mant, key=key)
    return scale_results(plan.fn, results, exp2, plan.dtype, coef) if exp2 else results


@sized_merge
def merge_adapters(
    adapters: Sequence[Any],
    *,
    budget: int | None = None,
    method: str = "ta",
    space: str = "full",
    allocation: str = "net_utility",
    scope: str | None = None,
    alpha: float | str = 1.0,
    lam: float | str = "auto",
    positive_only: bool = True,
    coef: float = 1.0,
    key: jax.Array | None = None,
    mesh: Any = None,
    weights: Sequence[float] | None = None,
    min_share: float | None = None,
    input_moments: Sequence[Mapping[str, Any] | None] | None = None,
    interference: str = "overlap",
    **options: Any,
) -> tuple[Any, Report]:
    """Score, allocate a budget, merge and report, in one call (paper, Algorithm 1).

    ``allocation="net_utility"`` keeps the top utilities (:func:`nu.score`, :func:`nu.allocate`)
    with ``scope`` defaulting to the paper's choice: ``"global"`` for TA, TSV, Iso-C and Iso-CTS,
    ``"local"`` (per module) for TIES, DARE and DARE-TIES. ``"uniform"`` is the paper's baseline
    (equal share per task, spectral prefixes); ``"all"`` keeps every candidate (no scoring, no
    budget).

    ``weights`` multiply each task's update in the merge (as PEFT's
    ``add_weighted_adapter(weights=...)`` scales each task's delta before combining them, and
    mergekit's per-model ``weight``): task i's ``scale`` becomes ``weights[i] * scale``, so the
    method combines the weighted kept updates ``w_i dK_i`` (TA keeping everything gives
    ``coef * sum_i w_i dK_i``). **Weights do not change the allocation**: the scores, lambda,
    ``h`` (and so ``alpha="auto"``) and the masks are those of the unweighted tasks, as trained.
    A weight does not change which directions a task has nor their order, so the masks apply to
    the weighted tasks as they are. Scoring the weighted updates instead would work against the
    weights: a direction's benefit is a share of its own task's energy, which a weight does not
    change, while its interference grows with ``w_i^2`` (and a task's part in the others'
    interference falls with ``1 / w_i^2``, each task's geometry being normalised by its own
    energy), so a task weighted up would keep fewer directions. To change the split between
    tasks, use ``min_share`` or ``allocation="uniform"``.

    ``min_share=F`` guarantees each task at least ``int(F * share)`` of its uniform share of the
    budget (``R L / M`` directions in the global scope, capped at its candidates), taken first,
    from the top of the budget; the rest goes by utility as without it
    (:mod:`netutility_jax.allocation._min_share` states it exactly). A floor that does not bind changes
    nothing.

    Args:
      adapters: M adapters, as for :func:`merge`.
      budget: R, average directions per module (a positive Python or numpy int); needed unless
        ``allocation="all"``, which ignores it.
      method, space, coef, key, mesh, **options: as for :func:`merge` (model-wide TIES:
        ``trim_scope="model"``; ``scope`` here is the budget's scope).
      allocation: ``"net_utility"``, ``"uniform"`` or ``"all"``.
      scope: ``"global"`` or ``"local"`` for net utility; None picks the paper's default.
      alpha, lam, positive_only: as for :func:`nu.score` / :func:`nu.allocate`.
      weights: M finite nonzero numbers, one per task (None: all 1); they scale the merged
        updates, not the scores.
      min_share: None or a number in ``[0, 1]``, with ``allocation="net_utility"`` only.
      input_moments: None (the paper's data-free score), or one entry per task for
        :func:`nu.score`'s data-aware geometry (``{module name: InputMoments | None}`` from
        :func:`nu.input_moments`, or None for a task without data; this project's extension,
        not the paper's: docs/input_moments.md), with ``allocation="net_utility"`` only. The
        masks are then ``nu.allocate(nu.score(adapters, input_moments=...), budget)``'s;
        :attr:`Report.data_aware` says whether any data was used.
      interference: the scores' interference term: ``"overlap"`` (the paper's), ``"signed"``
        (this project's sign-aware extension) or ``"signed_weaker"`` (its asymmetric form;
        :func:`nu.score`), with
        ``allocation="net_utility"`` only; :attr:`Report.interference` records it.

    Returns:
      ``(merged_adapter, Report)``.

    Warns:
      ZeroUpdateWarning: modules whose merged update is exactly zero although components were
        kept there (e.g. ``density=1e-300``, ``p=0.999999``); :attr:`Report.zeroed` lists them.

    Raises:
      InputError: unknown allocation or scope, budget <= 0 or missing (with an allocation that
        needs one), ``lam`` or ``alpha`` negative or not finite (they are ``"auto"`` or a finite
        number >= 0), weights of the wrong length, zero or not finite, ``min_share`` outside
        ``[0, 1]`` or with another allocation, ``input_moments`` with another allocation than
        ``"net_utility"``, plus everything :func:`merge` and :func:`nu.score` raise (for
        ``input_moments``: the wrong number of tasks, a module missing or unknown...).
      InputTypeError: an option of the wrong type (``positive_only`` not a bool, ``budget`` not
        an int, a complex ``lam``, an int ``key``, a weight that is not a real number).

    Example:
      >>> import numpy as np, netutility_jax as nu
      >>> rng = np.random.default_rng(0)
      >>> ads = [{f"m{l}": {"lora_a": rng.normal(size=(32, 4)), "lora_b": rng.normal(size=(4, 16))}
      ...         for l in range(2)} for _ in range(3)]
      >>> out, rep = nu.merge_adapters(ads, budget=4, allocation="uniform")
      >>> rep.budget_spent, sum(rep.ranks.values())
      (4.0, 8)
      >>> out, rep = nu.merge_adapters(ads, allocation="all", weights=[1.0, 0.5, 2.0])
      >>> want = sum(w * a["m0"]["lora_a"] @ a["m0"]["lora_b"] for w, a in zip([1, .5, 2], ads))
      >>> bool(np.allclose(nu.module_update(out["m0"]), want, atol=1e-3))
      True
    """
    if traced.any_traced(adapters, coef, weights, input_moments):
        merged, report = merge_adapters_traced(
            adapters, budget=budget, method=method, space=space, allocation=allocation,
            scope=scope, alpha=alpha, lam=lam, positive_only=positive_only, coef=coef, key=key,
            mesh=mesh, weights=weights, min_share=min_share, input_moments=input_moments,
            options=options, interference=interference,
        )  # fmt: skip
        return _rebuild(adapters, merged), report
    req = MergeRequest.check(
        "nu.merge_adapters", budget=budget, method=method, space=space, allocation=allocation,
        scope=scope, alpha=alpha, lam=lam, positive_only=positive_only, min_share=min_share,
        input_moments=input_moments, options=options, weights=weights, coef=coef, key=key,
        interference=interference,
    )  # fmt: skip
    fast = fast_ta(req.fn, method, space, options, mesh)
    if isinstance(adapters, StackedAdapters) and mesh is not None:  # (a mesh: module views)
        adapters = adapters.unstack()
    weighted, req = _weighted_input(adapters, req)
    names, buckets, _m_tasks = _tree.collect(adapters, fn=req.fn)
    with _stacking.reuse():  # device factors stacked once, for the scoring and the merge
        done = _merged_ta(adapters, weighted, req, names, buckets, coef) if fast else None
        if done is None and not fast and mesh is None:  # another method: one program too
            fused = _fused_stages.fused_merge(adapters, req, names, buckets, _m_tasks)
            if fused is not None:
                done = (_rebuild(weighted, fused.merged), fused.masks, fused.scores, fused.h,
                        fused.zeroed, (fused.lam, fused.alpha))  # fmt: skip
        if done is None:  # the bucket pipeline (for TA: inputs it must refuse or split, ta.py)
            if isinstance(adapters, StackedAdapters) and fast:
                return merge_adapters(
                    adapters.unstack(), budget=budget, method=method, space=space,
                    allocation=allocation, scope=scope, alpha=alpha, lam=lam,
                    positive_only=positive_only, coef=coef, key=key, mesh=mesh,
                    weights=weights, min_share=min_share, input_moments=input_moments,
                    interference=interference, **options,
                )  # fmt: skip
            done = _merged_by_stages(adapters, weighted, req, names, buckets, mesh, options)
    merged, kept_masks, sc, h, zeroed, lam_alpha = done
    zeroed = () if req.zero_merge else zeroed
    warn_zeroed(req.fn, zeroed, len(names), method, options)
    ranks = ranks_of(merged)
    report = build_report(
        req, kept_masks, sc, h=heterogeneity_or_nan(adapters) if h is None else h,
        ranks={nm: ranks[nm] for nm in names}, zeroed=zeroed, lam_alpha=lam_alpha,
    )  # fmt: skip
    return merged, report


def _merged_ta(adapters, weighted, req: MergeRequest, names, buckets, coef) -> tuple | None:
    """TA as one program over every bucket (:mod:`..operators.ta`): ``(merged, kept masks,
    scores, h, zeroed, (lam, alpha) or None)``, or None where that program must refuse or split
    the inputs. The adapters are scored, allocated and merged in one program where they can be
    (:mod:`._fused`)."""
    fused = _fused.fused_ta(adapters, req, names, buckets, len(adapters))
    if fused is not None:
        merged = _rebuild(weighted, fused.merged)
        return merged, fused.masks, fused.scores, fused.h, fused.zeroed, (fused.lam, fused.alpha)
    h = None
    if req.allocation == "all":
        sc = masks = None  # every candidate, which the TA program keeps and returns
    elif not isinstance(req.alpha, str):  # one scoring program, with the energies (for h)
        sc, masks, h = _scored_with_h(adapters, req)
    else:
        sc, masks, _ = req.allocate(adapters, names, buckets, None)
    done = ta.merge_ta("nu.merge", weighted, masks, coef=req.coef)
    if done is None:
        return None
    kept_masks = masks if masks is not None else MaskTable(done.keep)
    zeroed = tuple(nm for nm in names if done.zero[nm] and _kept_any(kept_masks, nm))
    return _rebuild(weighted, done.modules), kept_masks, sc, h, zeroed, None


def _merged_by_stages(adapters, weighted, req: MergeRequest, names, buckets, mesh, options):
    """Any method by the bucket pipeline (:func:`merge`): ``(merged, kept masks, scores, h,
    zeroed)``."""
    h = None
    if req.allocation != "all" and not isinstance(req.alpha, str) and mesh is None:
        sc, masks, h = _scored_with_h(adapters, req)
        kept_masks = masks
    else:
        sc, masks, kept_masks = req.allocate(adapters, names, buckets, mesh)
    merged = merge(
        weighted, masks, method=req.method, space=req.space, coef=req.coef, key=req.key,
        mesh=mesh, **options,
    )  # fmt: skip
    return merged, kept_masks, sc, h, tuple(zeroed_modules(_flat(merged), kept_masks)), None


def _flat(merged: Any) -> Mapping[str, Any]:
    """The merged modules by name; a stacked result as it is (no module sliced)."""
    if isinstance(merged, MergedTable):
        return merged
    return {
        "/".join(path) or "lora": node
        for path, node in _tree.walk_modules(merged, is_module=_tree.has_update, max_depth=None)
    }


def _rebuild(adapters: Any, results: Mapping[str, Any]) -> Any:
    """The merged modules in the first adapter's tree; for a ``nu.stack_adapters`` set (which
    keeps no tree) a flat dict in module order, or the :class:`MergedTable` itself (its factors
    stacked per bucket: a traced merge, or TA's)."""
    if isinstance(adapters, StackedAdapters):
        if isinstance(results, MergedTable):  # (kept stacked, a module read by slicing)
            return results
        return {nm: results[nm] for nm in adapters.names}
    return _results.rebuild(adapters[0], results)


def _scored_with_h(adapters: Any, req: MergeRequest) -> tuple[Any, Any, float]:
    """``(scores, masks, h)`` from one scoring program that also returns the task energies
    (so the report's ``h`` needs no second pass over the factors); ``req.alpha`` a number."""
    run = score_run(
        "nu.score", adapters, (req.alpha,), req.lam, None, False, None, energy=True,
        input_moments=req.input_moments, interference=req.interference,
    )  # fmt: skip
    sc = run.scores[0]
    return sc, req.select(sc), h_of(*run.energies)


def _kept_any(masks: Mapping[str, Any], name: str) -> bool:
    m = masks.host(name) if isinstance(masks, MaskTable) and masks.pristine else masks[name]
    return bool(np.asarray(m).any())


def fast_ta(fn: str, method: str, space: str, options: Mapping[str, Any], mesh: Any) -> bool:
    """Whether a concrete merge is TA without a mesh or ``isotropize``: one program over
    every bucket (:mod:`.engine.ta`). The options are checked here as the bucket pipeline
    checks them."""
    if method != "ta" or mesh is not None:
        return False
    res = registry.resolve_options(fn, method, space, dict(options))
    return res.kernel_method == "ta"


# ------------------------------------------------------------------------------ task weights


def weight_adapters(adapters: Sequence[Any], weights: Sequence[float] | None) -> list[Any]:
    """The adapters with task i's ``scale`` multiplied by ``weights[i]`` (an exact rescaling of
    its update; a weight of 1 leaves the task as it is). Trees come back as nested dicts, each
    module a dict with its keys."""
    if weights is None:
        return list(adapters)
    return [ad if w == 1.0 else _weighted(ad, w) for ad, w in zip(adapters, weights, strict=True)]


def _weighted(adapter: Any, w: float) -> Any:
    def scaled(_path, node):
        if node is None or not _tree.is_mapping(node) or not _tree.has_factor(node):
            return node
        out = {k: node[k] for k in node.keys()}
        out["scale"] = _tree.unwrap(node.get("scale", 1.0)) * w
        return out

    return _tree.map_modules(adapter, scaled)


def _weighted_input(adapters: Any, req: MergeRequest) -> tuple[Any, MergeRequest]:
    """``(adapters weighted, request with its weights checked)``, for the merge (the scores are
    the unweighted adapters'); the adapters are checked first (their own messages), so that a
    bad adapter is not reported as a bad weight."""
    if req.weights is None:
        return adapters, req
    _tree.collect(adapters, fn=req.fn)
    req = req.with_tasks(len(adapters))
    if isinstance(adapters, StackedAdapters):
        return adapters.with_weights(req.weights), req
    return weight_adapters(adapters, req.weights), req
