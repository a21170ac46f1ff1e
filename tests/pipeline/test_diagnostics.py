"""``nu.diagnose``: overlap against chance, task shares, lambda and rotation controls, warnings.

Every reference is a float64 numpy computation written out here, from the dense updates
``dK_i = scale * lora_a @ lora_b`` (``(d_in, d_out)``, kernel layout): the input-side singular
vectors are the left singular vectors of ``dK_i``.
"""

from __future__ import annotations

import dataclasses
import doctest
import json
from pathlib import Path

import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax._core import tree as _tree
from netutility_jax.errors import InputError, InputTypeError
from netutility_jax.pipeline import _diagnose_measures, diagnostics

M, R, L = 3, 4, 3


def _random(seed, *, d_in=32, d_out=32, decay=None, scales=None, shared=False) -> list[dict]:
    """M independent random adapters (or with one ``lora_a`` per module shared by every task);
    ``decay``: row k of ``lora_b`` scaled by ``decay**k`` (a steep spectrum)."""
    rng = np.random.default_rng(seed)
    shared_a = [rng.normal(size=(d_in, R)) for _ in range(L)]
    out = []
    for i in range(M):
        ad = {}
        for layer in range(L):
            a = shared_a[layer] if shared else rng.normal(size=(d_in, R))
            b = rng.normal(size=(R, d_out))
            if decay is not None:
                b = b * (decay ** np.arange(R))[:, None]
            scale = 1.0 if scales is None else float(scales[i])
            ad[f"m{layer}"] = {
                "lora_a": a.astype(np.float32),
                "lora_b": b.astype(np.float32),
                "scale": scale,
            }
        out.append(ad)
    return out


def _structured(seed, *, d_in=32, d_out=32) -> list[dict]:
    """Tasks that share ``lora_a`` (an orthonormal frame ``e_0..e_3`` per module) and whose
    geometry matters: every task is strong (1.0) on ``e_0``, task j also on its own ``e_{j+1}``
    (0.9) and weak (0.1) on the other two. Net Utility drops the shared ``e_0`` (it interferes
    with every other task) for the task's own direction; random rotations remove that reason."""
    rng = np.random.default_rng(seed)
    strengths = [[1, 0.9, 0.1, 0.1], [1, 0.1, 0.9, 0.1], [1, 0.1, 0.1, 0.9]]
    frames = [np.linalg.qr(rng.normal(size=(d_in, R)))[0] for _ in range(L)]
    out = []
    for j in range(M):
        ad = {}
        for layer in range(L):
            rows = np.linalg.qr(rng.normal(size=(d_out, R)))[0].T  # orthonormal rows
            ad[f"m{layer}"] = {
                "lora_a": frames[layer].astype(np.float32),
                "lora_b": (np.diag(strengths[j]) @ rows).astype(np.float32),
            }
        out.append(ad)
    return out


def _dense(mod) -> np.ndarray:
    a = np.asarray(mod["lora_a"], np.float64)
    b = np.asarray(mod["lora_b"], np.float64)
    return float(mod.get("scale", 1.0)) * a @ b


def _ref_overlaps(ads) -> dict[str, tuple[float, float]]:
    """Per module ``(mean_{i<j} ||V_i^T V_j||_F^2 / min(r_i, r_j), mean_{i<j} max(r_i, r_j) /
    d_in)`` from the dense updates' SVD (float64)."""
    out = {}
    for name in ads[0]:
        vs = []
        for ad in ads:
            u, s, _ = np.linalg.svd(_dense(ad[name]), full_matrices=False)
            vs.append(u[:, : int((s > 1e-6 * s[0]).sum())])
        d_in = vs[0].shape[0]
        ov, ch = [], []
        for i in range(len(vs)):
            for j in range(i + 1, len(vs)):
                ri, rj = vs[i].shape[1], vs[j].shape[1]
                ov.append(np.sum((vs[i].T @ vs[j]) ** 2) / min(ri, rj))
                ch.append(max(ri, rj) / d_in)
        out[name] = (float(np.mean(ov)), float(np.mean(ch)))
    return out


def _sym_diff(a, b) -> int:
    return int(sum((np.asarray(a[k]) ^ np.asarray(b[k])).sum() for k in a))


# ------------------------------------------------------------------------------------ overlap


def test_overlap_matches_dense_svd():
    ads = _random(0)
    d = nu.diagnose(ads, budget=4)
    ref = _ref_overlaps(ads)
    assert list(d.modules) == list(ref)
    for name, (ov, ch) in ref.items():
        m = d.modules[name]
        assert m.tasks == M
        assert m.overlap == pytest.approx(ov, rel=1e-4)
        assert m.chance == pytest.approx(ch, rel=1e-12)
        assert m.chance == pytest.approx(R / 32)  # equal ranks: r / d_in
        assert m.overlap_vs_chance == pytest.approx(ov / ch, rel=1e-4)
    want = np.mean([ov / ch for ov, ch in ref.values()])
    assert d.overlap_vs_chance == pytest.approx(want, rel=1e-4)


def test_overlap_is_chance_for_independent_and_large_for_shared_inputs():
    # Independent random LoRAs at d_in = 256, r = 4: for a Haar subspace tr(P_i P_j) has mean
    # r^2 / d_in and variance 2 r^2 (d-r)^2 / (d^2 (d+2) (d-1)), a relative standard deviation of
    # 0.35 per pair; the 3 modules x 3 pairs are uncorrelated (given P_i, tr(P_i P_j) and
    # tr(P_i P_k) are independent), so the mean ratio has a standard deviation of 0.35 / 3 =
    # 0.12. A tolerance of 0.4 is 3.4 standard deviations (and the seed is fixed).
    d = nu.diagnose(_random(1, d_in=256), budget=4)
    assert abs(d.overlap_vs_chance - 1) < 0.4
    # one lora_a per module for every task: every V_i spans the same 4-dim subspace, so the
    # overlap is 1 and the ratio d_in / r = 64
    d = nu.diagnose(_random(1, d_in=256, shared=True), budget=4)
    assert d.overlap_vs_chance > 5
    assert d.overlap_vs_chance == pytest.approx(256 / R, rel=1e-3)


def test_unequal_ranks_and_missing_modules():
    rng = np.random.default_rng(3)
    ads = _random(2)
    ads[1]["m0"] = {"lora_a": rng.normal(size=(32, 2)), "lora_b": rng.normal(size=(2, 32))}
    ads[2]["m1"] = None  # task 2 lacks m1
    d = nu.diagnose(ads, budget=4)
    # m0: pairs (0,1), (0,2), (1,2) with ranks 4, 2, 4; chance max(r_i, r_j) / d_in
    assert d.modules["m0"].chance == pytest.approx((4 / 32 + 4 / 32 + 4 / 32) / 3)
    dense = [[_dense(ad[n]) for n in ("m0",)] for ad in ads]
    vs = []
    for (dk,) in dense:
        u, s, _ = np.linalg.svd(dk, full_matrices=False)
        vs.append(u[:, : int((s > 1e-6 * s[0]).sum())])
    ov = [np.sum((vs[i].T @ vs[j]) ** 2) / min(vs[i].shape[1], vs[j].shape[1])
          for i, j in ((0, 1), (0, 2), (1, 2))]  # fmt: skip
    assert d.modules["m0"].overlap == pytest.approx(np.mean(ov), rel=1e-4)
    assert d.modules["m1"].tasks == 2  # one pair only
    assert d.modules["m1"].chance == pytest.approx(4 / 32)


# ----------------------------------------------------------------------------- task shares


def test_energies_and_kept_shares_match_the_library():
    ads = _random(4, scales=[1.0, 2.0, 0.5])
    d = nu.diagnose(ads, budget=4, names=["a", "b", "c"])
    energy = np.array([sum(np.sum(_dense(m) ** 2) for m in ad.values()) for ad in ads])
    sc = nu.score(ads, alpha=d.alpha)
    assert d.lam == pytest.approx(float(sc.lam), rel=1e-6)
    kept = np.asarray(nu.kept_per_task(nu.allocate(sc, 4)))
    assert [t.name for t in d.tasks] == ["a", "b", "c"]
    for i, t in enumerate(d.tasks):
        assert t.energy == pytest.approx(energy[i], rel=1e-4)
        assert t.energy_share == pytest.approx(energy[i] / energy.sum(), rel=1e-4)
        assert t.kept == kept[i]
        assert t.kept_share == pytest.approx(kept[i] / kept.sum())
        assert t.uniform_share == pytest.approx(1 / M)  # every task in every module
        assert t.kept_vs_uniform == pytest.approx(kept[i] / kept.sum() * M)
    assert d.kept == kept.sum()


def test_uniform_share_follows_coverage():
    ads = _random(5)
    ads[2]["m1"] = None
    ads[2]["m2"] = None
    d = nu.diagnose(ads, budget=3)
    # the uniform allocation keeps 3 per module: m0 split 3 ways, m1 and m2 2 ways (of 9)
    want = np.array([1 + 1.5 + 1.5, 1 + 1.5 + 1.5, 1]) / 9
    assert [t.uniform_share for t in d.tasks] == pytest.approx(want)


def test_high_energy_task_is_named_in_a_warning():
    # Net Utility's interference scales with sigma^2 of the direction and with the other tasks'
    # sigma^(2 alpha) / w, so it weighs against the task with the largest update (a tiny task
    # is favoured, not starved): the large task keeps less than half its uniform share.
    ads = _random(0, d_in=256, scales=[1.0, 1.0, 30.0])
    d = nu.diagnose(ads, budget=4, names=["small-a", "small-b", "big"])
    big = d.tasks[2]
    assert big.energy_share > 0.9 and big.kept_vs_uniform < 0.5
    named = [w for w in d.warnings if "task 2 (big)" in w]
    assert len(named) == 1 and "less than half its uniform share" in named[0]
    assert not any("small-a" in w or "small-b" in w for w in d.warnings)


# ---------------------------------------------------------------------- lambda sensitivity


def test_lambda_sensitivity():
    ads = _random(6)
    d = nu.diagnose(ads, budget=4)
    sc = nu.score(ads, alpha=d.alpha)
    masks = nu.allocate(sc, 4)
    same = _diagnose_measures.lambda_changes(ads, sc, masks, 1.0, budget=4, scope="global")
    assert same == 0
    assert set(d.lambda_changes) == {0.25, 4.0}
    for f, n in d.lambda_changes.items():
        other = nu.allocate(nu.score(ads, alpha=d.alpha, lam=f * float(sc.lam)), 4)
        assert n == _sym_diff(masks, other)


# ---------------------------------------------------------------------- rotation control


def test_rotation_keeps_every_spectrum_and_changes_the_input_side():
    ads = _random(7)
    flat = [_tree.flatten_modules(ad, fn="t", task=i) for i, ad in enumerate(ads)]
    rot = _diagnose_measures.rotated(flat, list(ads[0]), 0)
    for ad, rd in zip(ads, rot, strict=True):
        for name in ad:
            a = np.asarray(ad[name]["lora_a"], np.float64)
            ar = np.asarray(rd[name]["lora_a"], np.float64)
            # a' = Q a for an orthogonal Q  <=>  a'^T a' = a^T a (and so equal singular values)
            np.testing.assert_allclose(ar.T @ ar, a.T @ a, rtol=1e-5, atol=1e-4)
            assert np.abs(ar - a).max() > 1
            np.testing.assert_allclose(
                np.linalg.svd(_dense(rd[name]), compute_uv=False)[:R],
                np.linalg.svd(_dense(ad[name]), compute_uv=False)[:R],
                rtol=1e-4,
            )
    again = _diagnose_measures.rotated(flat, list(ads[0]), 0)
    assert all(np.array_equal(again[1][n]["lora_a"], rot[1][n]["lora_a"]) for n in ads[0])


def test_rotation_control_and_the_down_weighting_warning():
    # shared lora_a with task-specific directions: Net Utility's choice follows the geometry,
    # which the rotations destroy
    shared = nu.diagnose(_structured(0), budget=3)
    assert shared.overlap_vs_chance > 5
    assert shared.rotation_changed_fraction > 0.5
    assert not any("energy down-weighting" in w for w in shared.warnings)
    # independent random LoRAs with steep spectra: overlap at chance, and the kept set does not
    # depend on the (chance-level) geometry
    rand = nu.diagnose(_random(0, d_in=256, decay=0.5), budget=3)
    assert abs(rand.overlap_vs_chance - 1) < 0.5
    assert rand.rotation_changed_fraction < 0.1
    down = [w for w in rand.warnings if "energy down-weighting" in w]
    assert len(down) == 1 and down[0].startswith("Net Utility's choice here is close to")
    # the control's count is the symmetric difference with the rotated adapters' allocation
    sc = nu.score(_random(0, d_in=256, decay=0.5), alpha=rand.alpha)
    assert rand.kept == int(np.asarray(nu.kept_per_task(nu.allocate(sc, 3))).sum())


# ------------------------------------------------ energy alone, the interference, the advice


def test_energy_changes_are_the_difference_from_lam_zero():
    # the structured set: Net Utility drops the shared direction energy alone would keep
    for ads, budget in ((_structured(0), 3), (_random(3), 4), (_random(4), 7)):
        d = nu.diagnose(ads, budget=budget)
        masks = nu.allocate(nu.score(ads, alpha=d.alpha), budget)
        energy = nu.allocate(nu.score(ads, alpha=d.alpha, lam=0.0), budget)
        assert d.energy_changed == _sym_diff(masks, energy)
    assert nu.diagnose(_structured(0), budget=3).energy_changed > 0
    local = nu.diagnose(_structured(0), budget=3, scope="local")
    masks = nu.allocate(nu.score(_structured(0)), 3, scope="local")
    energy = nu.allocate(nu.score(_structured(0), lam=0.0), 3, scope="local")
    assert local.energy_changed == _sym_diff(masks, energy)
    assert nu.diagnose(_random(3), budget=4, lam=0.0).energy_changed == 0


def test_the_interference_option_reaches_every_scoring():
    ads = _structured(1)
    for term in ("signed", "signed_weaker"):
        d = nu.diagnose(ads, budget=3, interference=term)
        sc = nu.score(ads, interference=term)
        masks = nu.allocate(sc, 3)
        assert d.interference == term and d.lam == pytest.approx(float(sc.lam))
        assert d.kept == int(np.asarray(nu.kept_per_task(masks)).sum())
        other = nu.allocate(
            nu.score(ads, alpha=d.alpha, lam=4 * float(sc.lam), interference=term), 3
        )
        assert d.lambda_changes[4.0] == _sym_diff(masks, other)
    with pytest.raises(InputError, match="interference"):
        nu.diagnose(ads, budget=3, interference="dot")


def test_energy_alone_is_recommended_where_the_rotation_control_sees_no_geometry():
    # chance-level geometry (independent LoRAs, steep spectra): the control changes < 10%
    rand = _random(0, d_in=256, decay=0.5)
    tight = nu.diagnose(rand, budget=3)  # 1 direction per task and module
    assert tight.rotation_changed_fraction < diagnostics.ROTATION_FEW
    assert tight.recommend_energy and tight.recommendation.startswith("allocate by energy alone")
    assert "lam=0" in tight.recommendation and "allocate globally" in tight.recommendation
    # 3 per task and module (lambda fixed at 2: the median rule's lambda leaves half of the
    # directions at a negative utility there, whose margin the rotations move)
    loose = nu.diagnose(rand, budget=9, lam=2.0)
    assert loose.rotation_changed_fraction < diagnostics.ROTATION_FEW
    assert loose.recommend_energy and 'allocation="all"' in loose.recommendation
    assert "allocate globally" not in loose.recommendation
    # the command line's spelling
    cli = nu.diagnose(rand, budget=3, _cli=True)
    assert "--lam 0" in cli.recommendation and "lam=0" not in cli.recommendation
    # already energy alone
    zero = nu.diagnose(rand, budget=3, lam=0.0)
    assert zero.recommend_energy and zero.recommendation.startswith("this allocation is already")
    # geometry that matters (shared input frame, task-specific directions): no advice but a test
    shared = nu.diagnose(_structured(0), budget=3)
    assert shared.rotation_changed_fraction >= diagnostics.ROTATION_FEW
    assert not shared.recommend_energy and shared.recommendation.startswith("none:")
    assert 'interference="signed"' in shared.recommendation
    assert "chance" not in shared.recommendation  # 8x chance: shared structure
    # flat spectra at chance overlap: the rotations move many directions, which is noise
    flat = nu.diagnose(_random(0, d_in=256), budget=3)
    assert flat.rotation_changed_fraction >= diagnostics.ROTATION_FEW
    assert (
        not flat.recommend_energy
        and "x chance, so this may follow the noise" in flat.recommendation
    )
    signed = nu.diagnose(_structured(0), budget=3, interference="signed")
    assert not signed.recommend_energy and 'interference="overlap"' in signed.recommendation


def test_the_tight_budget_threshold_is_per_task_and_module():
    # budget / M at the threshold counts as tight, just above it does not
    rand = _random(0, d_in=256, decay=0.5)
    at = int(diagnostics.TIGHT_PER_TASK * M)  # 7 of 3 tasks: 2.33 per task and module
    assert at / M <= diagnostics.TIGHT_PER_TASK < (at + 1) / M
    tight, loose = (nu.diagnose(rand, budget=b, lam=2.0) for b in (at, at + 1))
    assert tight.recommend_energy and loose.recommend_energy
    assert "allocate globally" in tight.recommendation
    assert "allocate globally" not in loose.recommendation


def test_the_quoted_evidence_is_the_committed_study_s():
    """The figures the recommendation quotes are those of the pooled regime study's grid."""
    path = Path(__file__).resolve().parents[2] / "docs" / "regime" / "seeds" / "results.json"
    grid = json.loads(path.read_text())["grid"]["16"]
    for key, entry in (
        ("energy_vs_uniform_r16", grid["energy - uniform"]),
        ("net_utility_vs_energy_r16", grid["net_utility - energy"]),
    ):
        assert entry["n"] == 10
        want = (entry["estimate"], *entry["two_level_ci95"])
        assert diagnostics.EVIDENCE[key] == pytest.approx(want, abs=0.005)


# ---------------------------------------------------------------------------- the report


def test_to_dict_and_format():
    ads = _random(8)
    ads[2]["m1"] = None
    d = nu.diagnose(ads, budget=2, names=["x", "y", "z"])
    text = json.dumps(d.to_dict(), allow_nan=False)
    back = json.loads(text)
    assert back["budget"] == 2 and back["scope"] == "global"
    assert [t["name"] for t in back["tasks"]] == ["x", "y", "z"]
    assert set(back["lambda_changes"]) == {"0.25", "4"}
    assert back["rotation"]["changed"] == d.rotation_changed
    assert back["modules"]["m0"]["overlap_vs_chance"] == pytest.approx(
        d.modules["m0"].overlap_vs_chance
    )
    out = d.format()
    assert "overlap vs chance" in out and "random-rotation control" in out
    assert all(n in out for n in ("x", "y", "z"))
    assert len(out.splitlines()) == 2 + 1 + M + 3 + len(d.warnings) + 1
    assert out.splitlines()[-1] == f"recommendation: {d.recommendation}"
    assert back["recommendation"] == {"energy_only": d.recommend_energy, "text": d.recommendation}
    assert back["energy_changed"] == d.energy_changed and back["interference"] == "overlap"
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.budget = 3  # type: ignore[misc]


def test_docstring_example():
    res = doctest.testmod(diagnostics, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kwargs", "exc", "word"),
    [
        ({"budget": 0}, InputError, "budget"),
        ({"budget": -3}, InputError, "budget"),
        # a non-integer budget is refused as nu.allocate refuses it: InputTypeError (TypeError)
        ({"budget": 2.5}, InputTypeError, "budget"),
        ({"budget": "4"}, InputTypeError, "budget"),
        ({"budget": 4, "scope": "uniform"}, InputError, "scope"),
        ({"budget": 4, "names": ["a"]}, InputError, "names"),
        ({"budget": 4, "rotation_seed": -1}, InputError, "rotation_seed"),
        ({"budget": 4, "lam": -1.0}, InputError, "lam"),
    ],
)
def test_bad_options_name_the_argument(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        nu.diagnose(_random(9), **kwargs)


def test_fewer_than_two_tasks():
    with pytest.raises(InputError, match="adapters has 1 adapter"):
        nu.diagnose(_random(9)[:1], budget=4)
    with pytest.raises(InputError, match="adapters"):
        nu.diagnose([], budget=4)
    assert issubclass(InputError, ValueError)
