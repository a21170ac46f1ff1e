"""The planted-interference study's registered design and its plants (pre-registered
in docs/experiments.md before any run; this project's design, not the paper's).

* The design: the victim -> carrier :data:`PAIRS`, the :data:`ARMS` (conflict and agreement at
  gamma 1 and 0.5, and the unplanted null arm), the :data:`ALLOCATIONS` compared at the
  :data:`BUDGETS`, the :data:`PRIMARY` merges evaluated first, the eight registered comparisons
  (:data:`PRIMARY_DELTAS`) with their Bonferroni level and seeds, and the :data:`HEADLINE`.
* The plants (:func:`plant`): each victim's top :data:`TOP` singular components
  (:func:`top_components`) appended, in every module, to its carrier's LoRA factors scaled by
  ``-gamma`` or ``+gamma``.
* Read-out (a), exact: the masks of an allocation (:func:`masks_of`) and the fraction of each
  plant they keep (:func:`plant_kept`, :func:`readout_a`).

Part of the harness (:mod:`planting` runs a seed, :mod:`planting_report` reports the seeds);
imports no model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import netutility_jax as nu

__all__ = [
    "ALLOCATIONS",
    "ARMS",
    "BONFERRONI",
    "BUDGETS",
    "DATA_WEAKER",
    "DATA_WEAKER_DELTAS",
    "DATA_WEAKER_LEVEL",
    "DATA_WEAKER_SECONDARY",
    "HEADLINE",
    "PAIRS",
    "PRIMARY",
    "PRIMARY_DELTAS",
    "REGISTERED_SEEDS",
    "TOP",
    "Arm",
    "Plant",
    "all_merges",
    "masks_of",
    "plant",
    "plant_kept",
    "readout_a",
    "top_components",
]

#: The declared victim -> carrier pairs (docs/experiments.md, pre-registration): each of the
#: first, third and fifth of the encoder's default tasks is a victim, the next task its carrier.
PAIRS = (
    ("austen_novel", "tweet_source"),
    ("word_sentiment", "word_pos"),
    ("wordnet_supersense", "verb_supersense"),
)
#: The victim's components planted in each module.
TOP = 2


@dataclasses.dataclass(frozen=True)
class Arm:
    """A set of adapters: ``sign`` -1 conflict, +1 agreement, 0 the unplanted (null) set."""

    name: str
    sign: int
    gamma: float


ARMS = (
    Arm("null", 0, 0.0),
    Arm("conflict_g1", -1, 1.0),
    Arm("agreement_g1", 1, 1.0),
    Arm("conflict_g0.5", -1, 0.5),
    Arm("agreement_g0.5", 1, 0.5),
)

#: Every allocation of the study: ``name -> (kind, options)``; ``kind`` ``"uniform"``,
#: ``"global"`` (``nu.allocate``'s global top-K, positive-only, at the budget), ``"full"``
#: (positive-only at full capacity) or ``"all"`` (every candidate); options are ``nu.score``'s
#: (``lam_scale`` times the median rule's lambda; ``data``: the input moments).
ALLOCATIONS: dict[str, dict[str, Any]] = {
    "uniform": {"kind": "uniform"},
    "energy": {"kind": "global", "lam_scale": 0.0},
    "net_utility": {"kind": "global"},
    "lam_x4": {"kind": "global", "lam_scale": 4.0},
    "net_utility_data": {"kind": "global", "data": True},
    "signed": {"kind": "global", "interference": "signed"},
    "signed_weaker": {"kind": "global", "interference": "signed_weaker"},
    "net_utility_pos": {"kind": "full"},
    "lam_x4_pos": {"kind": "full", "lam_scale": 4.0},
    "net_utility_data_pos": {"kind": "full", "data": True},
    "signed_pos": {"kind": "full", "interference": "signed"},
    "signed_weaker_pos": {"kind": "full", "interference": "signed_weaker"},
    # the asymmetric term with the data-aware shares (registered 2026-12-01, after the study)
    "signed_weaker_data": {"kind": "global", "interference": "signed_weaker", "data": True},
    "signed_weaker_data_pos": {"kind": "full", "interference": "signed_weaker", "data": True},
    "all": {"kind": "all"},
}
BUDGETS = (16, 32)

#: The merges evaluated for accuracy first: what the pre-registered primary comparisons need
#: (gamma 1, conflict and agreement, R = 16 and full capacity: energy, Net Utility, sign-aware,
#: keep-all) and the oracle (Net Utility and keep-all on the unplanted set), as ``(arm,
#: allocation, budget)``; the rest (``--merges all``) after them.
PRIMARY = (
    *(
        (arm, alloc, r)
        for arm in ("conflict_g1", "agreement_g1")
        for alloc, r in (
            ("energy", 16),
            ("net_utility", 16),
            ("signed", 16),
            ("net_utility_pos", None),
            ("signed_pos", None),
            ("all", None),
        )
    ),
    ("null", "net_utility", 16),
    ("null", "all", None),
    # the sign-aware term on the real (unplanted) per-task adapters, against energy
    ("null", "energy", 16),
    ("null", "signed", 16),
)


def all_merges() -> tuple[tuple[str, str, int | None], ...]:
    """Every ``(arm, allocation, budget)`` of the study (``--merges all``): :data:`PRIMARY`
    first, then every arm's allocations at each budget (None: full capacity / every
    candidate)."""
    out = list(PRIMARY)
    for arm in ARMS:
        for alloc, spec in ALLOCATIONS.items():
            for r in BUDGETS if spec["kind"] in ("uniform", "global") else (None,):
                if (arm.name, alloc, r) not in out:
                    out.append((arm.name, alloc, r))
    return tuple(out)


#: The pre-registered primary comparisons: (label, arm, a, b) on the victims' normalised accuracy.
PRIMARY_DELTAS = tuple(
    (f"{a_lab} - energy, {arm.split('_')[0]}, {where}", arm, f"{a}/{r}", f"{b}/{r}")
    for arm in ("conflict_g1", "agreement_g1")
    for where, r, pairs in (
        ("R16", "R16", (("net_utility", "Net Utility"), ("signed", "sign-aware"))),
        (
            "full capacity",
            "full",
            (("net_utility_pos", "Net Utility"), ("signed_pos", "sign-aware")),
        ),
    )
    for (a, a_lab) in pairs
    for b in ("energy" if r == "R16" else "all",)
)
#: The follow-up registered on 2026-12-01 (docs/experiments.md, "Pre-registration: the asymmetric
#: term with the data-aware shares"): its 12 merges a seed (``--merges data_weaker``), its two
#: primary comparisons and their Bonferroni level (97.5%).
DATA_WEAKER = (
    *(
        (arm, alloc, r)
        for arm in ("conflict_g1", "agreement_g1")
        for alloc, r in (
            ("energy", 16),
            ("signed_weaker", 16),
            ("signed_weaker_data", 16),
            ("all", None),
            ("signed_weaker_data_pos", None),
        )
    ),
    ("null", "energy", 16),
    ("null", "signed_weaker_data", 16),
)
DATA_WEAKER_DELTAS = tuple(
    (f"signed_weaker_data - energy, {arm.split('_')[0]}, R16", arm, "signed_weaker_data/R16",
     "energy/R16")
    for arm in ("conflict_g1", "agreement_g1")
)  # fmt: skip
DATA_WEAKER_LEVEL = 1 - 0.05 / len(DATA_WEAKER_DELTAS)
#: Its secondary comparisons (one family with every all-tasks outcome of its comparisons,
#: Holm at 5%).
DATA_WEAKER_SECONDARY = (
    *(
        (f"signed_weaker_data - signed_weaker, {arm.split('_')[0]}, R16", arm,
         "signed_weaker_data/R16", "signed_weaker/R16")
        for arm in ("conflict_g1", "agreement_g1")
    ),
    *(
        (f"signed_weaker_data_pos - keep-all, {arm.split('_')[0]}", arm,
         "signed_weaker_data_pos/full", "all/full")
        for arm in ("conflict_g1", "agreement_g1")
    ),
    ("signed_weaker_data - energy, null, R16", "null", "signed_weaker_data/R16", "energy/R16"),
)  # fmt: skip

#: Bonferroni level of the eight primary comparisons (99.375%).
BONFERRONI = 1 - 0.05 / len(PRIMARY_DELTAS)

#: The seeds the registered decision rule needs (docs/experiments.md, pre-registration).
REGISTERED_SEEDS = (0, 1, 2, 3, 4)

#: The grid-level headline: each allocation's primary contrast averaged over the primary cells
#: (conflict and agreement, R = 16 and full capacity), and over each arm's two budgets.
HEADLINE = (
    ("Net Utility - energy", "Net Utility - energy"),
    ("sign-aware - energy", "sign-aware - energy"),
)


# ------------------------------------------------------------------------------ the plants


def top_components(mod: Mapping[str, Any], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(sigma (k,), x (d_in, k), y (d_out, k))``: the top ``k`` singular components of
    ``dK = scale a b`` in float64, from the factors (QR of each, an ``r x r`` SVD; no dense
    ``d_in x d_out`` matrix)."""
    a = np.asarray(mod["lora_a"], np.float64)
    b = np.asarray(mod["lora_b"], np.float64)
    qa, ra = np.linalg.qr(a)
    qb, rb = np.linalg.qr(b.T)
    u, s, vt = np.linalg.svd(float(mod.get("scale", 1.0)) * ra @ rb.T)
    return s[:k], qa @ u[:, :k], qb @ vt[:k].T


@dataclasses.dataclass(frozen=True)
class Plant:
    """One victim's plant in one module of its carrier: ``P = sum_k coef_k x_k y_k^T``."""

    pair: int
    module: str
    coef: np.ndarray  # (k,) sign * gamma * sigma_k
    x: np.ndarray  # (d_in, k)
    y: np.ndarray  # (d_out, k)


def plant(
    adapters: Sequence[Mapping[str, Any]],
    names: Sequence[str],
    arm: Arm,
    pairs: Sequence[tuple[str, str]] = PAIRS,
    k: int = TOP,
) -> tuple[list[dict[str, Any]], list[Plant]]:
    """The adapters of ``arm``: each carrier's factors with its victim's top ``k`` components
    appended, scaled by ``arm.sign * arm.gamma`` (new arrays; the inputs are not changed), and
    the plants. The null arm returns the adapters as they are and no plant.

    The appended columns are ``a_k = coef_k x_k / sqrt(|c| scale)``-balanced: ``a_k = sgn *
    sqrt(|coef_k| / |scale|) x_k``, ``b_k = sqrt(|coef_k| / |scale|) y_k`` with ``sgn`` the sign
    of ``coef_k / scale``, so ``scale a_k b_k = coef_k x_k y_k^T`` exactly (up to rounding) with
    the carrier's own scale.
    """
    out = [dict(ad) for ad in adapters]
    if arm.sign == 0:
        return out, []
    index = {n: i for i, n in enumerate(names)}
    missing = [t for pair in pairs for t in pair if t not in index]
    if missing:
        raise nu.InputError(f"plant: the tasks {missing} of the declared pairs are not merged.")
    plants = []
    for p, (victim, carrier) in enumerate(pairs):
        v, c = adapters[index[victim]], out[index[carrier]]
        for name, mod in v.items():
            sig, x, y = top_components(mod, k)
            coef = arm.sign * arm.gamma * sig
            cm = c[name]
            scale = float(cm.get("scale", 1.0))
            mag = np.sqrt(np.abs(coef) / abs(scale))
            sgn = np.sign(coef / scale)
            a_new = x * (sgn * mag)[None, :]
            b_new = (y * mag[None, :]).T
            dtype = np.asarray(cm["lora_a"]).dtype
            c[name] = {
                **cm,
                "lora_a": np.concatenate([np.asarray(cm["lora_a"]), a_new.astype(dtype)], 1),
                "lora_b": np.concatenate([np.asarray(cm["lora_b"]), b_new.astype(dtype)], 0),
            }
            plants.append(Plant(p, name, coef, x, y))
    return out, plants


def plant_kept(carrier_mod: Mapping[str, Any], keep: np.ndarray, p: Plant) -> tuple[float, float]:
    """``(kept, total)`` energy of plant ``p`` under a mask row: with ``X_K``, ``Y_K`` the kept
    singular directions of the carrier's planted update (slots ``keep``, descending sigma, as
    ``nu.score`` numbers them), ``kept = ||X_K^T P Y_K||_F^2`` and ``total = ||P||_F^2``. Every
    direction kept gives ``kept = total`` (the planted update's directions span the plant);
    none gives 0."""
    a = np.asarray(carrier_mod["lora_a"], np.float64)
    b = np.asarray(carrier_mod["lora_b"], np.float64)
    qa, ra = np.linalg.qr(a)
    qb, rb = np.linalg.qr(b.T)
    u, _, vt = np.linalg.svd(float(carrier_mod.get("scale", 1.0)) * ra @ rb.T)
    r = a.shape[1]
    kept = np.flatnonzero(np.asarray(keep, bool)[:r])
    xk, yk = qa @ u[:, kept], qb @ vt[kept].T
    core = (xk.T @ p.x) * p.coef[None, :] @ (p.y.T @ yk)
    gram_x, gram_y = p.x.T @ p.x, p.y.T @ p.y
    total = float(p.coef @ (gram_x * gram_y) @ p.coef)
    return float((core**2).sum()), total


# ------------------------------------------------------------------------------ allocations


def _scores(adapters, alpha, spec, lam0, moments, memo):
    """``nu.score`` of the allocation's options (memoised per options within one arm)."""
    import netutility_jax as nu

    key = (spec.get("lam_scale"), bool(spec.get("data")), spec.get("interference", "overlap"))
    if key not in memo:
        lam = "auto" if spec.get("lam_scale") is None else float(spec["lam_scale"]) * lam0
        kw = {"input_moments": moments()} if spec.get("data") else {}
        memo[key] = nu.score(
            adapters, alpha=alpha, lam=lam, interference=spec.get("interference", "overlap"), **kw
        )
    return memo[key]


def masks_of(adapters, alloc: str, budget: int | None, *, alpha, lam0, moments, memo):
    """``{module: bool (M, r_max)}`` of allocation ``alloc`` (:data:`ALLOCATIONS`) at ``budget``
    (None: full capacity / every candidate), and the scores it used."""
    import netutility_jax as nu

    spec = ALLOCATIONS[alloc]
    sc = _scores(adapters, alpha, spec, lam0, moments, memo)
    kind = spec["kind"]
    if kind == "all":
        return {n: np.isfinite(np.asarray(m.utility)) for n, m in sc.modules.items()}, sc
    if kind == "full":
        m_tasks = len(adapters)
        r_max = max(np.asarray(m["lora_a"]).shape[1] for ad in adapters for m in ad.values())
        budget = m_tasks * r_max  # at or above the candidates: positive-only decides
    masks = nu.allocate(sc, int(budget), scope="uniform" if kind == "uniform" else "global")
    return {n: np.asarray(v) for n, v in masks.items()}, sc


def readout_a(adapters, names, masks, plants, pairs=PAIRS) -> dict[str, Any]:
    """Read-out (a) of one merge: per pair, the fraction of its plant kept (energy-weighted over
    modules) and the fraction of the victim's top-``TOP`` directions kept."""
    index = {n: i for i, n in enumerate(names)}
    out = {}
    for p, (victim, carrier) in enumerate(pairs):
        kept = total = 0.0
        for pl in (q for q in plants if q.pair == p):
            k, t = plant_kept(
                adapters[index[carrier]][pl.module], masks[pl.module][index[carrier]], pl
            )
            kept, total = kept + k, total + t
        vk = [masks[n][index[victim], :TOP] for n in masks]
        out[f"{victim}->{carrier}"] = {
            "plant_kept": kept / total if total > 0 else None,
            "victim_top_kept": float(np.mean(np.concatenate(vk))),
        }
    return out
