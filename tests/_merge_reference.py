"""Independent dense float64 reference for the merge tests (numpy only).

Nothing here imports ``netutility_jax``. Every update is formed densely in kernel layout
(``dK = scale * lora_a @ lora_b``, ``(d_in, d_out)``); the paper's ``dW = dK.T``. Bases and
spectra come from ``np.linalg.svd`` of dense matrices, following REFERENCE.md literally.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

TOL = 1e-9  # relative rank cut of the reference (float64 data with clear spectral gaps)


def make_adapters(seed, m_tasks, spec, *, dtype=np.float64, scale=True):
    """``spec``: ``[(name, d_in, d_out, ranks per task)]``; rank None = task lacks the module."""
    rng = np.random.default_rng(seed)
    ads = []
    for i in range(m_tasks):
        ad = {}
        for name, d_in, d_out, ranks in spec:
            r = ranks[i]
            if r is None:
                ad[name] = None
                continue
            mod = {
                "lora_a": rng.normal(size=(d_in, r)).astype(dtype),
                "lora_b": (rng.normal(size=(r, d_out)) / np.sqrt(d_out)).astype(dtype),
            }
            if scale:
                # float32-representable: _buckets.bucket_arrays stores scales as float32
                mod["scale"] = float(np.float32(rng.uniform(0.5, 2.0)))
            ad[name] = mod
        ads.append(ad)
    return ads


def dense(mod: Mapping[str, Any] | None, shape=None) -> np.ndarray:
    if mod is None:
        return np.zeros(shape)
    if "delta" in mod:
        return np.asarray(mod["delta"], np.float64)
    a = np.asarray(mod["lora_a"], np.float64)
    b = np.asarray(mod["lora_b"], np.float64)
    return float(np.asarray(mod.get("scale", 1.0))) * a @ b


def kept_updates(mods: Sequence[Mapping | None], d_in, d_out, mask=None):
    """Each task's kept update ``P_k diag(s_k) Q_k^T`` (slot k = k-th largest singular value)."""
    out = []
    for i, mod in enumerate(mods):
        x = dense(mod, (d_in, d_out))
        if mod is None or not np.any(x):
            out.append(np.zeros((d_in, d_out)))
            continue
        u, s, vt = np.linalg.svd(x, full_matrices=False)
        r = np.asarray(mod["lora_a"]).shape[1]
        keep = np.zeros(len(s), bool)
        keep[:r] = True
        keep &= s > TOL * s[0]
        if mask is not None:
            m = np.asarray(mask[i], bool)
            keep[: len(m)] &= m
            keep[len(m) :] = False
        out.append((u[:, keep] * s[keep]) @ vt[keep])
    return out


def svd_nz(x):
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    k = s > TOL * max(s[0] if s.size else 0, 1e-300)
    return u[:, k], s[k], vt[k].T


def polar(x):
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    k = s > TOL * s[0]
    return u[:, k] @ vt[k]


# ------------------------------------------------------------------ methods (on task matrices)


def ta(xs, coef=1.0):
    return coef * sum(xs)


def iso_c(xs, coef=1.0):
    u, s, v = svd_nz(sum(xs))
    return coef * (u * s.mean()) @ v.T


def tsv(xs, coef=1.0, isotropize=False):
    us, ss, vs = [], [], []
    for x in xs:
        if not np.any(x):
            continue
        u, s, v = svd_nz(x)
        us.append(u), ss.append(s), vs.append(v)
    u, s, v = np.concatenate(us, 1), np.concatenate(ss), np.concatenate(vs, 1)
    if isotropize:
        s = np.full_like(s, s.mean())
    return coef * (polar(u) * s) @ polar(v).T


def iso_cts(xs, coef=1.0, frac=0.8):
    uc, sc, vc = svd_nz(sum(xs))
    d = len(sc)
    kc = int(np.floor(frac * d))
    nt = (d - kc) // len(xs)
    us, ss, vs = [uc[:, :kc]], [sc[:kc]], [vc[:, :kc]]
    proj = np.eye(vc.shape[0]) - vc[:, :kc] @ vc[:, :kc].T
    for x in xs:
        if nt == 0 or not np.any(x @ proj):
            continue
        u, s, v = svd_nz(x @ proj)
        us.append(u[:, :nt]), ss.append(s[:nt]), vs.append(v[:, :nt])
    u, s, v = np.concatenate(us, 1), np.concatenate(ss), np.concatenate(vs, 1)
    return coef * (polar(u) * s.mean()) @ polar(v).T


def ties(xs, coef=1.0, density=0.2):
    trimmed = []
    for x in xs:
        flat = x.ravel()
        k = int(density * flat.size)
        keep = np.zeros(flat.size, bool)
        if k > 0:
            keep[np.argsort(-np.abs(flat), kind="stable")[:k]] = True
        trimmed.append(np.where(keep, flat, 0).reshape(x.shape))
    t = np.stack(trimmed)
    sign = np.where(t.sum(0) >= 0, 1.0, -1.0)
    agree = (t != 0) & (np.sign(t) == sign)
    return coef * np.where(agree, t, 0).sum(0) / np.maximum(agree.sum(0), 1)


def ties_model(xs_by_module, coef=1.0, density=0.2):
    """TIES with one top-k per task over ALL modules: ``xs_by_module[l][i]`` is task i's
    coordinates in module l; the kept count is int(density * total entries)."""
    m = len(xs_by_module[0])
    n = sum(xs[0].size for xs in xs_by_module)
    k = int(density * n)
    out_trim = [[None] * m for _ in xs_by_module]
    for i in range(m):
        flat = np.concatenate([xs[i].ravel() for xs in xs_by_module])
        keep = np.zeros(flat.size, bool)
        if k > 0:
            keep[np.argsort(-np.abs(flat), kind="stable")[:k]] = True
        off = 0
        for mod, xs in enumerate(xs_by_module):
            sz = xs[i].size
            out_trim[mod][i] = np.where(keep[off : off + sz], xs[i].ravel(), 0).reshape(xs[i].shape)
            off += sz
    res = []
    for trimmed in out_trim:
        t = np.stack(trimmed)
        sign = np.where(t.sum(0) >= 0, 1.0, -1.0)
        agree = (t != 0) & (np.sign(t) == sign)
        res.append(coef * np.where(agree, t, 0).sum(0) / np.maximum(agree.sum(0), 1))
    return res


# ------------------------------------------------------------------ spaces


def core_bases(mods, xs, d_in, d_out):
    """Left singular vectors of the stacked kept-projected factors (REFERENCE.md, Core)."""
    a_st, b_st = [], []
    for mod, x in zip(mods, xs, strict=True):
        if mod is None or not np.any(x):
            continue
        a = np.asarray(mod["lora_a"], np.float64)
        b = np.asarray(mod["lora_b"], np.float64)
        p, _, q = svd_nz(x)  # kept in / out directions
        a_st.append(p @ (p.T @ a))
        b_st.append(q @ (q.T @ b.T))
    left = svd_nz(np.concatenate(a_st, 1))[0]
    right = svd_nz(np.concatenate(b_st, 1))[0]
    return left, right


def in_core(method, mods, xs, d_in, d_out, **kw):
    left, right = core_bases(mods, xs, d_in, d_out)
    cores = [left.T @ x @ right for x in xs]
    return left @ method(cores, **kw) @ right.T


def knots_blocks(xs, variant="core_space"):
    """KnOTS: SVD of [dW_1 .. dW_M] (paper layout); per-task blocks, in kernel layout.

    The blocks are ``V_i = S^-1 U^T dW_i``, computed by that projection rather than read off
    the rows of the SVD's ``V^T``: both are the same matrix, but the rows' rounding error is
    relative to the largest task, the projection's to each task's own size (a task 1e30 times
    weaker than another would otherwise have blocks of pure rounding noise).
    """
    cat = np.concatenate([x.T for x in xs], 1)  # (d_out, M d_in)
    u, s, _ = np.linalg.svd(cat, full_matrices=False)
    k = s > TOL * s[0]
    u, s = u[:, k], s[k]
    blocks = [(u.T @ x.T) / s[:, None] for x in xs]  # V_i (k, d_in)
    if variant == "original":
        blocks = [s[:, None] * v for v in blocks]
        back = u
    else:
        back = u * s
    return [v.T for v in blocks], back  # X_i = V_i^T (d_in, k); dK = X back^T


def in_knots(method, xs, variant="core_space", **kw):
    blocks, back = knots_blocks(xs, variant)
    return method(blocks, **kw) @ back.T
