"""Independent dense float64 reference for the tests (numpy only).

Nothing here imports ``netutility_jax``: every quantity is formed from the dense update
``dK = scale * lora_a @ lora_b`` (kernel layout, ``(d_in, d_out)``), the paper's ``dW = dK.T`` and
``np.linalg.svd``, and the paper's formulas are written out as explicit sums over tasks ``i != j``
and components ``n`` (Eq. net-utility for alpha = 1, App. A.4 for alpha = 0, API.md for the rest).
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

F32_EPS = float(np.finfo(np.float32).eps)
F64_EPS = float(np.finfo(np.float64).eps)


# --------------------------------------------------------------------------------------------
# Random adapters
# --------------------------------------------------------------------------------------------

# (name, d_in, d_out, ranks per task: None = task lacks the module, 0 = zero update (lora_b = 0))
# Two shapes (two modules each, so buckets batch), ragged ranks across tasks and modules, a zero
# update and a missing module.
RICH_SPEC: tuple[tuple[str, int, int, tuple[int | None, ...]], ...] = (
    ("layers/0/attn/query", 16, 12, (4, 6, 3, 5)),
    ("layers/0/mlp/up", 10, 20, (3, 2, -5, 4)),  # task 2: rank-5 factors with lora_b all zero
    ("layers/1/attn/query", 16, 12, (4, None, 6, 2)),  # task 1 lacks the module
    ("layers/1/mlp/up", 10, 20, (5, 3, 4, 5)),
)


def make_adapters(
    seed: int,
    m_tasks: int = 4,
    spec: Sequence[tuple[str, int, int, Sequence[int | None]]] = RICH_SPEC,
    *,
    dtype: Any = np.float32,
    with_scale: bool = True,
    negative_scale: bool = True,
) -> list[dict[str, Any]]:
    """Random nested-dict adapters, one per task.

    A rank ``r < 0`` gives factors of rank ``|r|`` with ``lora_b`` all zero (a zero update);
    ``None`` puts ``None`` at the module's path (the task lacks it). Scales are drawn in
    ``[0.5, 2]``; with ``negative_scale`` the last task's scale in the last module is negated.
    """
    rng = np.random.default_rng(seed)
    adapters: list[dict[str, Any]] = [{} for _ in range(m_tasks)]
    for mi, (name, d_in, d_out, ranks) in enumerate(spec):
        for j in range(m_tasks):
            r = ranks[j]
            if r is None:
                mod = None
            else:
                rr = abs(r)
                a = rng.normal(size=(d_in, rr))
                b = np.zeros((rr, d_out)) if r < 0 else rng.normal(size=(rr, d_out))
                mod = {"lora_a": a.astype(dtype), "lora_b": b.astype(dtype)}
                if with_scale:
                    sc = rng.uniform(0.5, 2.0)
                    if negative_scale and mi == len(spec) - 1 and j == m_tasks - 1:
                        sc = -sc
                    mod["scale"] = np.asarray(sc, dtype)
            node = adapters[j]
            *parents, leaf = name.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = mod
    return adapters


# --------------------------------------------------------------------------------------------
# Tree walking (independent of netutility_jax._core.tree)
# --------------------------------------------------------------------------------------------


def flat_modules(adapter: Mapping[str, Any]) -> dict[str, Mapping[str, Any] | None]:
    """``{"/"-joined path: module dict or None}`` in insertion order."""
    out: dict[str, Mapping[str, Any] | None] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if node is None:
            out["/".join(path)] = None
        elif "lora_a" in node:
            out["/".join(path)] = node
        else:
            for k, v in node.items():
                walk(v, (*path, str(k)))

    walk(adapter, ())
    return out


def dense_update(mod: Mapping[str, Any] | None, d_in: int = 0, d_out: int = 0) -> np.ndarray:
    """``dK = scale * lora_a @ lora_b`` in float64 (kernel layout ``(d_in, d_out)``)."""
    if mod is None:
        return np.zeros((d_in, d_out))
    a = np.asarray(mod["lora_a"], np.float64)
    b = np.asarray(mod["lora_b"], np.float64)
    scale = float(np.asarray(mod.get("scale", 1.0), np.float64))
    return scale * a @ b


# --------------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------------


class RefModule(NamedTuple):
    sigma: np.ndarray  # (M, r_max), 0 on non-candidates
    benefit: np.ndarray  # (M, r_max), 0 on non-candidates
    interference: np.ndarray  # (M, r_max), 0 on non-candidates
    candidate: np.ndarray  # (M, r_max) bool
    in_dirs: np.ndarray  # (M, d_in, r_max), paper's V


class RefScores(NamedTuple):
    modules: dict[str, RefModule]
    utility: dict[str, np.ndarray]  # (M, r_max), -inf on non-candidates
    lam: float


def default_rtol(r_max: int, eps: float = F32_EPS) -> float:
    return float(np.sqrt(10.0 * r_max * eps))


def ref_module(
    mods: Sequence[Mapping[str, Any] | None],
    *,
    alpha: float,
    rtol: float | None = None,
    eps: float = F32_EPS,
    overlap_atol: float = 0.0,
) -> RefModule:
    """Benefit and interference of one module from dense float64 SVDs.

    ``overlap_atol``: overlaps ``|v_jk . v_in|`` below it count as exactly 0 (for test data built
    with exactly orthogonal supports, where the dense SVD leaves ~1e-16 round-off).
    """
    present = [m for m in mods if m is not None]
    d_in = np.asarray(present[0]["lora_a"]).shape[0]
    np.asarray(present[0]["lora_b"]).shape[1]
    ranks = [0 if m is None else np.asarray(m["lora_a"]).shape[1] for m in mods]
    r_max = max(ranks)
    if rtol is None:
        rtol = default_rtol(r_max, eps)
    m_tasks = len(mods)
    sigma = np.zeros((m_tasks, r_max))
    cand = np.zeros((m_tasks, r_max), bool)
    v = np.zeros((m_tasks, d_in, r_max))
    for j, m in enumerate(mods):
        if m is None:
            continue
        dw = dense_update(m).T  # paper layout (d_out, d_in)
        _, s, vt = np.linalg.svd(dw, full_matrices=False)
        k = min(ranks[j], s.size)
        if s[0] <= 0:
            continue
        for n in range(k):
            if s[n] > rtol * s[0]:
                cand[j, n] = True
                sigma[j, n] = s[n]
                v[j, :, n] = vt[n]

    w = np.array(
        [
            sum(sigma[i, n] ** (2 + 2 * alpha) for n in range(r_max) if cand[i, n])
            for i in range(m_tasks)
        ]
    )
    benefit = np.zeros((m_tasks, r_max))
    interference = np.zeros((m_tasks, r_max))
    for j in range(m_tasks):
        for k in range(r_max):
            if not cand[j, k]:
                continue
            benefit[j, k] = sigma[j, k] ** (2 + 2 * alpha) / w[j]
            total = 0.0
            for i in range(m_tasks):
                if i == j:
                    continue
                for n in range(r_max):
                    if not cand[i, n]:
                        continue
                    overlap = float(v[j, :, k] @ v[i, :, n])
                    if abs(overlap) < overlap_atol:
                        overlap = 0.0
                    total += sigma[i, n] ** (2 * alpha) / w[i] * overlap**2
            interference[j, k] = sigma[j, k] ** 2 * total
    return RefModule(sigma, benefit, interference, cand, v)


def ref_lam_auto(mods: Sequence[RefModule]) -> float:
    """median(benefit) / median(interference) over all candidates, with the documented fallback."""
    ben = np.concatenate([m.benefit[m.candidate] for m in mods])
    inter = np.concatenate([m.interference[m.candidate] for m in mods])
    mi = float(np.median(inter))
    if mi > 0:
        return float(np.median(ben)) / mi
    pos = inter[inter > 0]
    if pos.size == 0:
        return 0.0
    return float(np.median(ben)) / float(np.median(pos))


def ref_scores(
    adapters: Sequence[Mapping[str, Any]],
    *,
    alpha: float = 1.0,
    lam: float | str = "auto",
    rtol: float | None = None,
    eps: float = F32_EPS,
    overlap_atol: float = 0.0,
) -> RefScores:
    flats = [flat_modules(ad) for ad in adapters]
    names = list(flats[0])
    mods = {
        name: ref_module(
            [f[name] for f in flats], alpha=alpha, rtol=rtol, eps=eps, overlap_atol=overlap_atol
        )
        for name in names
    }
    lam_val = ref_lam_auto(list(mods.values())) if lam == "auto" else float(lam)
    utility = {
        name: np.where(m.candidate, m.benefit - lam_val * m.interference, -np.inf)
        for name, m in mods.items()
    }
    return RefScores(mods, utility, lam_val)


def ref_heterogeneity(adapters: Sequence[Mapping[str, Any]]) -> float:
    e = ref_task_energies(adapters)
    return float(np.var(np.log(e)))


def ref_task_energies(adapters: Sequence[Mapping[str, Any]]) -> np.ndarray:
    out = []
    for ad in adapters:
        tot = 0.0
        for mod in flat_modules(ad).values():
            if mod is not None:
                tot += float(np.sum(dense_update(mod).T ** 2))
        out.append(tot)
    return np.array(out)


# --------------------------------------------------------------------------------------------
# Allocation (from the API.md definitions)
# --------------------------------------------------------------------------------------------


def ref_allocate(
    utility: Mapping[str, np.ndarray],
    sigma: Mapping[str, np.ndarray],
    budget: int,
    *,
    scope: str,
    positive_only: bool,
) -> dict[str, np.ndarray]:
    """Masks ``{name: bool (M, r_max)}``; candidates are the finite utilities."""
    masks = {k: np.zeros(u.shape, bool) for k, u in utility.items()}
    if scope == "global":
        entries = [
            (float(u[j, k]), name, j, k)
            for name, u in utility.items()
            for j in range(u.shape[0])
            for k in range(u.shape[1])
            if np.isfinite(u[j, k])
        ]
        entries.sort(key=lambda e: -e[0])
        for val, name, j, k in entries[: budget * len(utility)]:
            if positive_only and val <= 0:
                break
            masks[name][j, k] = True
        return masks
    if scope == "local":
        for name, u in utility.items():
            entries = [
                (float(u[j, k]), j, k)
                for j in range(u.shape[0])
                for k in range(u.shape[1])
                if np.isfinite(u[j, k])
            ]
            entries.sort(key=lambda e: -e[0])
            for val, j, k in entries[:budget]:
                if positive_only and val <= 0:
                    break
                masks[name][j, k] = True
        return masks
    if scope == "uniform":
        for name, u in utility.items():
            s = sigma[name]
            cand = np.isfinite(u)
            n_cand = cand.sum(1)
            tasks = [j for j in range(u.shape[0]) if n_cand[j] > 0]
            if not tasks:
                continue
            base = budget // len(tasks)
            kept = {j: min(base, int(n_cand[j])) for j in tasks}
            share = {j: s[j, cand[j]] ** 2 / np.sum(s[j, cand[j]] ** 2) for j in tasks}
            target = min(budget, int(n_cand.sum()))
            while sum(kept.values()) < target:
                open_tasks = [j for j in tasks if kept[j] < n_cand[j]]
                best = max(open_tasks, key=lambda j: share[j][kept[j]])
                kept[best] += 1
            for j in tasks:
                # candidates are a prefix of each task's slots
                masks[name][j, : kept[j]] = True
        return masks
    raise ValueError(scope)


def selection_margin(
    utility: Mapping[str, np.ndarray],
    sigma: Mapping[str, np.ndarray],
    budget: int,
    *,
    scope: str,
    positive_only: bool,
) -> float:
    """Smallest relative gap that decides the reference selection (to check data is not near-tied).

    Returns the smallest |difference| between the last kept and first dropped competing key, and
    (with ``positive_only``) the smallest |utility| near 0, relative to the largest |key|.
    """
    groups: list[tuple[np.ndarray, int]] = []
    if scope == "global":
        vals = np.concatenate([u[np.isfinite(u)] for u in utility.values()])
        groups.append((vals, budget * len(utility)))
    elif scope == "local":
        for u in utility.values():
            groups.append((u[np.isfinite(u)], budget))
    else:
        for name, u in utility.items():
            s = sigma[name]
            cand = np.isfinite(u)
            tasks = [j for j in range(u.shape[0]) if cand[j].any()]
            if not tasks:
                continue
            base = budget // len(tasks)
            pool = []
            spent = 0
            for j in tasks:
                sh = s[j, cand[j]] ** 2 / np.sum(s[j, cand[j]] ** 2)
                b = min(base, sh.size)
                spent += b
                pool.append(sh[b:])
            target = min(budget, int(cand.sum()))
            groups.append((np.concatenate(pool), target - spent))
    gaps = [np.inf]
    for vals, k in groups:
        if vals.size == 0:
            continue
        v = np.sort(vals)[::-1]
        scale = max(float(np.max(np.abs(v))), 1e-300)
        if 0 < k < v.size:
            gaps.append(abs(v[k - 1] - v[k]) / scale)
        if positive_only and scope != "uniform" and k > 0:
            gaps.append(float(np.min(np.abs(v[: k + 1]))) / scale)
    return float(min(gaps))


# --------------------------------------------------------------------------------------------
# Comparison helpers
# --------------------------------------------------------------------------------------------


def assert_rel_close(actual: Any, expected: Any, rtol: float, *, what: str = "") -> None:
    """``max|actual - expected| <= rtol * max|expected|`` (error relative to the quantity's scale)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    if expected.size == 0:
        return
    scale = float(np.max(np.abs(expected)))
    err = float(np.max(np.abs(actual - expected)))
    assert err <= rtol * max(scale, 1e-300), f"{what}: max abs err {err:.3e}, scale {scale:.3e}"


def assert_scores_match(lib: Any, ref: RefScores, rtol: float) -> None:
    """Library ``nu.Scores`` against a :class:`RefScores`, module by module, and lambda."""
    assert list(lib.modules) == list(ref.modules)
    for name, rm in ref.modules.items():
        ms = lib.modules[name]
        for field in ("sigma", "benefit", "interference"):
            assert_rel_close(getattr(ms, field), getattr(rm, field), rtol, what=f"{name}.{field}")
        u = np.asarray(ms.utility, np.float64)
        ru = ref.utility[name]
        cand = np.isfinite(ru)
        np.testing.assert_array_equal(np.isfinite(u), cand, err_msg=f"{name}: candidate set")
        assert np.all(u[~cand] == -np.inf), f"{name}: non-candidates must have utility -inf"
        assert np.all(np.asarray(ms.sigma)[~cand] == 0), f"{name}: non-candidates must have sigma 0"
        if cand.any():
            assert_rel_close(u[cand], ru[cand], rtol, what=f"{name}.utility")
    lam = float(lib.lam)
    assert abs(lam - ref.lam) <= rtol * max(abs(ref.lam), 1e-300), (lam, ref.lam)


def np_masks(masks: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in masks.items()}


# one small module with ragged ranks, for tests that only need some data (compiles fast)
SMALL_SPEC: tuple[tuple[str, int, int, tuple[int | None, ...]], ...] = (("q", 12, 9, (3, 4, 2, 4)),)


@functools.cache
def rich_adapters(m_tasks: int, seed: int = 0) -> list[dict[str, Any]]:
    """Cached :func:`make_adapters` on :data:`RICH_SPEC`; treat as read-only."""
    return make_adapters(seed, m_tasks)


@functools.cache
def rich_reference(m_tasks: int, alpha: float, seed: int = 0) -> RefScores:
    return ref_scores(rich_adapters(m_tasks, seed), alpha=alpha)


def paper_objective(
    mods: Sequence[Mapping[str, Any] | None], z: np.ndarray, *, lam: float, alpha: float
) -> float:
    """The paper's separable objective for one module, summed over tasks (App. A.3 / A.4).

    ``sum_i [||dW_i - K_i||_{G_i}^2 + lam sum_{j != i} ||K_j||_{G_i}^2] / ||dW_i||_{G_i}^2`` with
    ``G_i = V_i S_i^(2 alpha) V_i^T`` (alpha = 1: the Gram geometry up to kappa_i; alpha = 0: the
    row-space heuristic), ``K_j = sum_k z_jk s_jk u_jk v_jk^T`` and ``||X||_G^2 = tr(X G X^T)``,
    formed with dense matrices. Tasks with a zero update are omitted. By Prop. A.3 it equals
    ``M' - sum z * utility``.
    """
    svds = []
    for m in mods:
        if m is None:
            svds.append(None)
            continue
        u, s, vt = np.linalg.svd(dense_update(m).T, full_matrices=False)
        k = min(np.asarray(m["lora_a"]).shape[1], s.size)
        svds.append(None if s[0] == 0 else (u[:, :k], s[:k], vt[:k]))

    def k_of(j: int) -> np.ndarray | None:
        if svds[j] is None:
            return None
        u, s, vt = svds[j]
        sel = z[j, : s.size].astype(float)
        return (u * (s * sel)) @ vt

    def g_norm(x: np.ndarray, g: np.ndarray) -> float:
        return float(np.trace(x @ g @ x.T))

    total = 0.0
    for i, sv in enumerate(svds):
        if sv is None:
            continue
        u, s, vt = sv
        g = vt.T @ np.diag(s ** (2 * alpha)) @ vt
        dw = (u * s) @ vt
        num = g_norm(dw - k_of(i), g)
        for j in range(len(mods)):
            kj = k_of(j) if j != i else None
            if kj is not None:
                num += lam * g_norm(kj, g)
        total += num / g_norm(dw, g)
    return total


def folder_digest(folder: str) -> str:
    """An adapter folder's digest, computed here: its config and weight files in name order,
    each as name, NUL, size, NUL, bytes."""
    h = hashlib.sha256()
    for f in sorted(pathlib.Path(folder).iterdir()):
        if f.name == "adapter_config.json" or f.name.startswith("adapter_model"):
            data = f.read_bytes()
            h.update(f"{f.name}\0{len(data)}\0".encode() + data)
    return h.hexdigest()


# The command-line tests' adapters (tests/cli): 2 layers x (q_proj, v_proj), d_in 24, d_out 16;
# tests elsewhere use the same shapes so that a worker compiles their programs once.
CLI_MODULES = tuple(
    f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")
)


def cli_adapters(ranks=(4, 3, 4), seed=0) -> list[dict]:
    """One float32 adapter per rank in ``ranks`` (scale 2), drawn from one generator."""
    rng = np.random.default_rng(seed)
    return [
        {
            n: {
                "lora_a": rng.normal(size=(24, r)).astype(np.float32),
                "lora_b": (rng.normal(size=(r, 16)) / 4).astype(np.float32),
                "scale": 2.0,
            }
            for n in CLI_MODULES
        }
        for r in ranks
    ]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``netutility ARGV`` in this process: (exit code, stdout, stderr)."""
    from netutility_jax import cli

    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # (argparse's refusals)
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# Five small modules in three buckets with flat names (the scoring and allocation fixed-cost tests)
FIVE_MODULES = (  # three buckets, flat names
    ("l0.q", 24, 16, (3, 4, 2)),
    ("l0.v", 24, 8, (3, 4, 2)),
    ("l1.q", 24, 16, (3, 4, 2)),
    ("l1.v", 24, 8, (3, 4, 2)),
    ("l2.o", 16, 24, (2, 2, 2)),
)
