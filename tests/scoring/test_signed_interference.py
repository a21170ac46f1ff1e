"""nu.score(..., interference="signed"): the sign-aware interference (this project's extension,
docs/math.md, "Sign-aware interference"), against a dense float64 reference written out here.

For task j's k-th component ``c_jk = s_jk u_jk v_jk^T`` of the paper's ``dW = (scale a b)^T``
(``v`` input side, ``u`` output side, from ``np.linalg.svd``), the rank-1 cosine with task i's
m-th component is ``kappa = (u_jk . u_im)(v_jk . v_im)``, and::

    interference_jk = s_jk^2 sum_{i != j} sum_m s_im^(2a) / w_i min(0, kappa)^2

with ``w_i = sum_m s_im^(2 + 2a)``; with input moments ``S_i`` (``C_i = V_i^T S_i V_i``)::

    W_i = sum_m s_im^(2+2a) C_i[m, m],   interference_jk = s_jk^2 sum_{i != j} z^T C_i z / W_i,
    z_m = s_im^a (v_jk . v_im) |u_jk . u_im|  where kappa < 0, else 0

(``z_m^2 = s_im^(2a) min(0, kappa)^2``: with ``C_i = I`` the two formulas agree).
``interference="signed_weaker"`` (its asymmetric form) counts task i's component ``m`` in the sum
of ``(j, k)`` only where ``benefit_jk <= benefit_im``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax.errors import InputError

INTERFERENCES = ("overlap", "signed", "signed_weaker")

SHAPES = (("q", 14, 11, (3, 4, 2)), ("v", 14, 11, (4, 2, 3)), ("up", 9, 17, (2, 3, 3)))


def _adapters(seed: int, dtype=np.float64) -> list[dict]:
    rng = np.random.default_rng(seed)
    ads: list[dict] = [{} for _ in range(3)]
    for name, d_in, d_out, ranks in SHAPES:
        for j, r in enumerate(ranks):
            ads[j][name] = {
                "lora_a": rng.normal(size=(d_in, r)).astype(dtype),
                "lora_b": rng.normal(size=(r, d_out)).astype(dtype),
                "scale": float(rng.uniform(0.5, 2.0)) * (-1.0 if (j, name) == (2, "up") else 1.0),
            }
    return ads


def _svd(mod) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(s, V (d_in, r), U (d_out, r))`` of the paper's ``dW = (scale a b)^T``, float64."""
    dk = float(mod["scale"]) * (
        np.asarray(mod["lora_a"], np.float64) @ np.asarray(mod["lora_b"], np.float64)
    )
    r = mod["lora_a"].shape[1]
    vd, s, uh = np.linalg.svd(dk, full_matrices=False)
    return s[:r], vd[:, :r], uh[:r].T


def _kappa(uj, ui, vj, vi):
    """The conflicting part of ``v_jk . v_im``: ``(v . v) |u . u|`` where the rank-1 cosine
    ``(u . u)(v . v)`` is negative, else 0 (its square is ``min(0, kappa)^2``; its sign is the
    input overlap's, so flipping a component's ``(u, v)`` flips it with ``C_i``'s row)."""
    ou, ov = uj @ ui, vj @ vi
    return ov * abs(ou) if ou * ov < 0 else 0.0


def _reference(ads, alpha, lam, moments=None, weaker=False):
    """Dense float64 benefit, interference, utility (per module (M, r_max)) and lambda;
    ``weaker``: each conflict charged to the side with the smaller (or equal) benefit."""
    out = {}
    for name, *_ in SHAPES:
        comps = [_svd(ad[name]) for ad in ads]
        m_tasks, r_max = len(ads), max(c[0].size for c in comps)
        cm = []
        for i, (s, v, _) in enumerate(comps):
            if moments is None or moments[i] is None:
                cm.append(np.eye(s.size))
            else:
                cm.append(v.T @ moments[i][name] @ v)
        w = [
            sum(s[m] ** (2 + 2 * alpha) * cm[i][m, m] for m in range(s.size))
            for i, (s, _, _) in enumerate(comps)
        ]
        ben = np.zeros((m_tasks, r_max))
        inter = np.zeros((m_tasks, r_max))
        for j, (sj, _, _) in enumerate(comps):
            for k in range(sj.size):
                ben[j, k] = sj[k] ** (2 + 2 * alpha) * cm[j][k, k] / w[j]
        for j, (sj, vj, uj) in enumerate(comps):
            for k in range(sj.size):
                total = 0.0
                for i, (si, vi, ui) in enumerate(comps):
                    if i == j:
                        continue
                    z = np.array(
                        [
                            si[m] ** alpha * _kappa(uj[:, k], ui[:, m], vj[:, k], vi[:, m])
                            if not weaker or ben[j, k] <= ben[i, m]
                            else 0.0
                            for m in range(si.size)
                        ]
                    )
                    total += sj[k] ** 2 * (z @ cm[i] @ z) / w[i]
                inter[j, k] = total
        out[name] = (ben, inter, np.array([c[0].size for c in comps]))
    if lam == "auto":
        b = np.concatenate([o[0][o[0] > 0] for o in out.values()])
        it = np.concatenate([o[1][j, : o[2][j]] for o in out.values() for j in range(len(ads))])
        mi = np.median(it)
        lam = np.median(b) / (mi if mi > 0 else np.median(it[it > 0]))
    return out, lam


def _check(sc, ref, lam, rtol):
    np.testing.assert_allclose(float(sc.lam), lam, rtol=rtol)
    for name, (ben, inter, ranks) in ref.items():
        ms = sc.modules[name]
        for j, r in enumerate(ranks):
            np.testing.assert_allclose(np.asarray(ms.benefit)[j, :r], ben[j, :r], rtol=rtol)
            np.testing.assert_allclose(
                np.asarray(ms.interference)[j, :r], inter[j, :r], rtol=rtol, atol=rtol * 1e-3
            )
            np.testing.assert_allclose(
                np.asarray(ms.utility)[j, :r], ben[j, :r] - lam * inter[j, :r], rtol=rtol,
                atol=rtol * 1e-3,
            )  # fmt: skip


@pytest.mark.parametrize("alpha", [1.0, 0.0])
def test_signed_matches_the_float64_reference(alpha):
    assert not jax.config.x64_enabled
    with jax.enable_x64(True):
        ads = _adapters(0)
        sc = nu.score(ads, alpha=alpha, interference="signed")
        assert sc.modules["q"].interference.dtype == jnp.float64
        ref, lam = _reference(ads, alpha, "auto")
        _check(sc, ref, lam, 1e-8)
        # a conflict is never more than the paper's overlap term, and here it is less
        paper = nu.score(ads, alpha=alpha)
        for name in ref:
            s_i = np.asarray(sc.modules[name].interference)
            p_i = np.asarray(paper.modules[name].interference)
            assert (s_i <= p_i * (1 + 1e-12)).all() and s_i.sum() < 0.9 * p_i.sum()
    assert not jax.config.x64_enabled


@pytest.mark.parametrize("alpha", [1.0, 0.0])
def test_signed_weaker_matches_the_float64_reference(alpha):
    with jax.enable_x64(True):
        ads = _adapters(0)
        sc = nu.score(ads, alpha=alpha, interference="signed_weaker")
        ref, lam = _reference(ads, alpha, "auto", weaker=True)
        _check(sc, ref, lam, 1e-8)
        # it charges a subset of the signed term's pairs: never more, here less
        signed = nu.score(ads, alpha=alpha, interference="signed")
        for name in ref:
            w_i = np.asarray(sc.modules[name].interference)
            s_i = np.asarray(signed.modules[name].interference)
            assert (w_i <= s_i * (1 + 1e-12)).all() and w_i.sum() < 0.9 * s_i.sum()


def test_signed_weaker_with_input_moments_matches_the_reference():
    rng = np.random.default_rng(7)
    with jax.enable_x64(True):
        ads = _adapters(3)
        dense = [
            None if j == 2 else {
                name: (lambda x: x.T @ x / 30)(rng.normal(size=(30, d_in)))
                for name, d_in, _, _ in SHAPES
            }
            for j in range(3)
        ]  # fmt: skip
        moms = [None if d is None else nu.input_moments_dense(d) for d in dense]
        sc = nu.score(ads, alpha=1.0, interference="signed_weaker", input_moments=moms)
        ref, lam = _reference(ads, 1.0, "auto", moments=dense, weaker=True)
        _check(sc, ref, lam, 1e-7)


def test_signed_weaker_charges_the_plant_not_the_victim():
    """A victim task's top component, planted negated in a carrier task that has its own
    directions besides: the two conflict exactly (kappa = -1) with equal singular values; the
    symmetric terms charge both, the asymmetric one only the plant, whose share of its task's
    energy is the smaller. Two tasks with equal spectra (a tie) are charged as by "signed"."""
    rng = np.random.default_rng(11)
    q, _ = np.linalg.qr(rng.normal(size=(16, 6)))
    p, _ = np.linalg.qr(rng.normal(size=(10, 6)))
    victim = {"m": {"lora_a": q[:, :2] * [3.0, 1.0], "lora_b": p[:, :2].T}}
    carrier = {  # its own two directions, then the victim's first, negated
        "m": {"lora_a": np.c_[q[:, 2:4] * [2.5, 2.0], q[:, :1] * 3.0], "lora_b": np.r_[
            p[:, 2:4].T, -p[:, :1].T]}
    }  # fmt: skip
    ads = [{"m": {k: v.astype(np.float32) for k, v in ad["m"].items()}} for ad in (victim, carrier)]
    sig = {k: nu.score(ads, lam=1.0, interference=k).modules["m"] for k in INTERFERENCES}
    ben = np.asarray(sig["signed"].benefit)
    assert ben[0, 0] > ben[1, 0]  # the victim's share is larger (the carrier has more energy)
    it = {k: np.asarray(m.interference) for k, m in sig.items()}
    assert it["signed"][0, 0] > 0.1 and it["signed"][1, 0] > 0.1  # both sides charged
    assert abs(it["signed_weaker"][0, 0]) < 1e-6  # the victim's direction: not charged
    np.testing.assert_allclose(it["signed_weaker"][1, 0], it["signed"][1, 0], rtol=1e-5)
    tie = _pair(-1.0)
    np.testing.assert_allclose(
        np.asarray(nu.score(tie, lam=1.0, interference="signed_weaker").modules["m"].interference),
        np.asarray(nu.score(tie, lam=1.0, interference="signed").modules["m"].interference),
        rtol=1e-5,
    )


def test_signed_float32_is_the_reference_to_float32_rounding():
    ads = _adapters(1, np.float32)
    sc = nu.score(ads, interference="signed", lam=0.7)
    ref, lam = _reference(ads, 1.0, 0.7)
    _check(sc, ref, lam, 2e-3)


def test_signed_with_input_moments_matches_the_reference():
    """Also: flipping components' signs (the SVD's choice) must not change it (C_i's off-diagonal
    entries flip with them)."""
    rng = np.random.default_rng(5)
    with jax.enable_x64(True):
        ads = _adapters(2)
        dense = []
        for j in range(3):
            if j == 1:
                dense.append(None)  # data-free for this task: C = I
                continue
            mods = {}
            for name, d_in, _, _ in SHAPES:
                x = rng.normal(size=(40, d_in)) * rng.uniform(0.2, 3.0, size=d_in)
                mods[name] = x.T @ x / 40
            dense.append(mods)
        moms = [None if d is None else nu.input_moments_dense(d) for d in dense]
        sc = nu.score(ads, alpha=1.0, interference="signed", input_moments=moms)
        ref, lam = _reference(ads, 1.0, "auto", moments=dense)
        _check(sc, ref, lam, 1e-7)


def _pair(sign: float, *, orthogonal: bool = False):
    """Two tasks of one module; task 1's update is ``sign`` times task 0's (or, ``orthogonal``,
    on input directions orthogonal to task 0's)."""
    rng = np.random.default_rng(3)
    q, _ = np.linalg.qr(rng.normal(size=(12, 6)))
    a0 = q[:, :3] * np.array([3.0, 2.0, 1.0])
    b0 = rng.normal(size=(3, 8))
    a1 = q[:, 3:] if orthogonal else a0
    return [
        {"m": {"lora_a": a0.astype(np.float32), "lora_b": b0.astype(np.float32)}},
        {"m": {"lora_a": a1.astype(np.float32), "lora_b": (sign * b0).astype(np.float32)}},
    ]


def test_opposite_tasks_conflict_fully_agreeing_ones_not_at_all():
    opposite, same = _pair(-1.0), _pair(1.0)
    overlap = np.asarray(nu.score(opposite, lam=1.0).modules["m"].interference)
    assert (overlap > 0).all()
    # task 1 = -task 0: every kappa is -1 on its partner and 0 elsewhere, so the conflict is the
    # largest it can be, the paper's overlap term itself
    conflict = np.asarray(
        nu.score(opposite, lam=1.0, interference="signed").modules["m"].interference
    )
    np.testing.assert_allclose(conflict, overlap, rtol=1e-4)
    # the paper's term cannot tell agreement from conflict; the signed one gives agreement none
    np.testing.assert_allclose(
        np.asarray(nu.score(same, lam=1.0).modules["m"].interference), overlap, rtol=1e-5
    )
    agree = np.asarray(nu.score(same, lam=1.0, interference="signed").modules["m"].interference)
    assert np.abs(agree).max() < 1e-5 * overlap.max()


def test_orthogonal_tasks_have_no_interference_either_way():
    ads = _pair(-1.0, orthogonal=True)
    for kind in INTERFERENCES:
        it = np.asarray(nu.score(ads, lam=1.0, interference=kind).modules["m"].interference)
        assert np.abs(it).max() < 1e-6, kind


def test_signed_under_jit_and_on_a_stacked_set_is_the_eager_score():
    ads = _adapters(4, np.float32)
    eager = nu.score(ads, interference="signed")
    jitted = jax.jit(lambda a: nu.score(a, interference="signed"))(ads)
    stacked = nu.score(nu.stack_adapters(ads), interference="signed")
    for other in (jitted, stacked):
        np.testing.assert_allclose(float(other.lam), float(eager.lam), rtol=1e-5)
        for name, ms in eager.modules.items():
            np.testing.assert_allclose(
                np.asarray(other.modules[name].interference), np.asarray(ms.interference),
                rtol=1e-4, atol=1e-7,
            )  # fmt: skip


def test_signed_is_invariant_to_the_factors_own_signs():
    """Flipping a component's input and output sides together leaves the update unchanged, and
    the score with it (the sign is the update's, not the factors')."""
    ads = _adapters(6, np.float32)
    flipped = [
        {
            k: {**m, "lora_a": -m["lora_a"], "lora_b": -m["lora_b"]} if j == 1 else m
            for k, m in ad.items()
        }
        for j, ad in enumerate(ads)
    ]
    a = nu.score(ads, interference="signed", lam=1.0)
    b = nu.score(flipped, interference="signed", lam=1.0)
    for name in a.modules:
        np.testing.assert_allclose(
            np.asarray(b.modules[name].interference), np.asarray(a.modules[name].interference),
            rtol=1e-4, atol=1e-7,
        )  # fmt: skip


@pytest.mark.parametrize("bad", ["Signed", "gram", "", None, 1, ("signed",)])
def test_bad_interference_is_refused_naming_the_argument(bad):
    with pytest.raises(InputError, match=r"^nu\.score: interference=.*expected 'overlap'"):
        nu.score(_adapters(0, np.float32), interference=bad)
