"""A stacked set's TA merge in one program (netutility_jax/pipeline/_fused.py): the same merge,
masks, scores and report as the stages run one by one, and the stages' errors where a flag
sends it back to them."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _fused_cases import adapters, by_stages, dense, spy

import netutility_jax as nu
from netutility_jax import InputError
from netutility_jax.pipeline import _fused


@pytest.fixture
def took(monkeypatch):
    """The results of the one-program route in this test (None where it declined)."""
    return spy(monkeypatch, _fused, "fused_ta")


def _by_stages(monkeypatch, *args, **kwargs):
    return by_stages(monkeypatch, _fused, "fused_ta", *args, **kwargs)


CASES = [
    {},
    {"lam": 0.0},
    {"lam": 2.5, "positive_only": False},
    {"alpha": 0.0},
    {"scope": "local"},
    {"allocation": "uniform"},
    {"interference": "signed"},
    {"interference": "signed_weaker", "coef": 0.7},
]


def _form(form, ads):
    """The adapters as a stacked set, a list of numpy trees or a list of device trees."""
    if form == "stacked":
        return nu.stack_adapters(jax.device_put(ads))
    return ads if form == "numpy" else jax.device_put(ads)


@pytest.mark.parametrize("form", ["stacked", "numpy", "device"])
@pytest.mark.parametrize("opts", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_one_program_gives_the_stages_merge_masks_scores_and_report(monkeypatch, took, opts, form):
    st = _form(form, adapters())
    out, rep = nu.merge_adapters(st, budget=5, method="ta", **opts)
    assert len(took) == 1 and took[0] is not None  # the one-program route ran
    want, wrep = _by_stages(monkeypatch, st, budget=5, method="ta", **opts)
    names = list(rep.masks)
    assert list(out) == list(want) == names
    if form != "stacked":  # the factors at each module's rank, as the stages give them
        for nm in names:
            assert out[nm]["lora_a"].shape == want[nm]["lora_a"].shape
            assert isinstance(out[nm]["lora_a"], jax.Array)
    for nm in names:
        np.testing.assert_array_equal(rep.masks[nm], wrep.masks[nm], err_msg=nm)
        got, ref = dense(out[nm]), dense(want[nm])
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max(), err_msg=nm)
        for f in ("sigma", "benefit", "interference", "utility"):
            np.testing.assert_array_equal(
                np.asarray(getattr(rep.scores.modules[nm], f)),
                np.asarray(getattr(wrep.scores.modules[nm], f)),
                err_msg=f"{nm} {f}",
            )
    assert rep.lam == wrep.lam and rep.alpha == wrep.alpha
    assert float(rep.scores.lam) == rep.lam and float(rep.scores.alpha) == rep.alpha
    assert rep.heterogeneity == pytest.approx(wrep.heterogeneity, rel=1e-12)
    assert rep.ranks == wrep.ranks and rep.zeroed == wrep.zeroed
    assert rep.budget_spent == wrep.budget_spent and rep.scope == wrep.scope
    assert {k: v.tolist() for k, v in rep.kept.items()} == {
        k: v.tolist() for k, v in wrep.kept.items()
    }


def test_a_list_of_device_factors_is_sliced_on_the_device_as_the_stages_slice_it(monkeypatch, took):
    """The accelerator's route (each module's factors sliced on the device, nothing read
    back), forced on this CPU."""
    from netutility_jax.operators import ta

    monkeypatch.setattr(ta, "DEVICE_SLICES", True)
    ads = jax.device_put(adapters(seed=5))
    out, rep = nu.merge_adapters(ads, budget=4, method="ta")
    assert took[0] is not None
    want, wrep = _by_stages(monkeypatch, ads, budget=4, method="ta")
    for nm in rep.masks:
        np.testing.assert_array_equal(rep.masks[nm], wrep.masks[nm])
        assert out[nm]["lora_a"].shape == want[nm]["lora_a"].shape
        ref = dense(want[nm])
        np.testing.assert_allclose(dense(out[nm]), ref, atol=1e-5 * np.abs(ref).max())


def test_the_merge_is_task_arithmetic_of_the_kept_directions_in_float64(took):
    """Independent of both routes: each module's merged update is coef times the sum over tasks
    of the kept singular components, from a float64 SVD of each task's dense update."""
    ads = adapters(seed=3)
    st = nu.stack_adapters(jax.device_put(ads))
    out, rep = nu.merge_adapters(st, budget=4, method="ta", coef=0.8)
    assert took[0] is not None
    for nm in st.names:
        want = 0.0
        for i, ad in enumerate(ads):
            u, s, vt = np.linalg.svd(dense(ad[nm]), full_matrices=False)
            keep = np.zeros(s.shape, bool)
            mask = np.asarray(rep.masks[nm][i])
            keep[: mask.size] = mask[: s.size]
            want = want + (u[:, keep] * s[keep]) @ vt[keep]
        got = dense(out[nm])
        np.testing.assert_allclose(got, 0.8 * want, atol=2e-5 * np.abs(want).max(), err_msg=nm)


def test_a_non_finite_factor_is_reported_by_the_stages(took):
    ads = adapters()
    ads[2]["l1.up"]["lora_b"][0, 3] = np.nan
    st = nu.stack_adapters(jax.device_put(ads))
    with pytest.raises(InputError, match=r"l1\.up") as e:
        nu.merge_adapters(st, budget=4, method="ta")
    assert took == [None]  # the flag sent it back to the stages, which named the module
    assert "task 2" in str(e.value) or "adapters[2]" in str(e.value)


def test_extreme_factors_take_the_exact_route_of_the_stages(took):
    """Factor entries beyond the raw Grams' range (2^+-40): the stages redo the scoring on
    normalised factors, exactly."""
    ads = adapters()
    for ad in ads:
        ad["l0.q"]["lora_a"] *= np.float32(2.0**-45)
        ad["l0.q"]["lora_b"] *= np.float32(2.0**45)
    st = nu.stack_adapters(jax.device_put(ads))
    out, rep = nu.merge_adapters(st, budget=4, method="ta")
    assert took == [None]
    # the same updates (powers of two cancel exactly), merged by the one program
    plain = nu.stack_adapters(jax.device_put(adapters()))
    want, wrep = nu.merge_adapters(plain, budget=4, method="ta")
    assert took[1] is not None
    for nm in st.names:
        np.testing.assert_array_equal(rep.masks[nm], wrep.masks[nm])
        ref = dense(want[nm])
        np.testing.assert_allclose(dense(out[nm]), ref, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize(
    "opts",
    [
        {"allocation": "all"},
        {"weights": [1.0, 0.5, 2.0, 1.0]},
        {"min_share": 0.5},
    ],
    ids=["all", "weights", "min_share"],
)
def test_what_the_program_does_not_take_goes_to_the_stages(took, opts):
    st = nu.stack_adapters(jax.device_put(adapters()))
    nu.merge_adapters(st, budget=4, method="ta", **opts)
    assert took in ([], [None])  # declined (or never asked: allocation="all" scores nothing)


def test_a_scale_beyond_the_dtype_gets_the_stages_error(monkeypatch, took):
    ads = adapters()
    ads[1]["l2.k"]["scale"] = 1e40
    with np.errstate(over="ignore"):  # (stacking casts the scale: inf, which is refused)
        st = nu.stack_adapters(ads)
    with pytest.raises(InputError) as got:
        nu.merge_adapters(st, budget=4, method="ta")
    assert took == [None]
    with pytest.raises(InputError) as want:
        _by_stages(monkeypatch, st, budget=4, method="ta")
    assert str(got.value) == str(want.value) and "l2.k" in str(got.value)


def _even(seed=0):
    """Adapters of near-equal energies (h well under the alpha="auto" threshold of 1)."""
    ads = adapters(seed)
    for i, ad in enumerate(ads):
        for mod in ad.values():
            mod["lora_b"] /= np.float32(1 + i)
            mod["scale"] = 1.0
    return ads


@pytest.mark.parametrize("form", ["stacked", "numpy"])
@pytest.mark.parametrize("which", ["uneven", "even"])
def test_alpha_auto_picks_the_heterogeneity_rules_alpha_in_the_one_program(
    monkeypatch, took, which, form
):
    """Both alphas are scored from one decomposition and h picks one, as ``nu.score`` picks
    it: alpha 0 where h > 1 (the uneven set), 1 where not (the even set); masks, scores and
    merge as the stages'."""
    ads = adapters() if which == "uneven" else _even()
    h = float(nu.heterogeneity(ads))
    assert (h > 1.0) == (which == "uneven") and abs(h - 1.0) > 0.05
    st = _form(form, ads)
    out, rep = nu.merge_adapters(st, budget=5, method="ta", alpha="auto")
    assert len(took) == 1 and took[0] is not None
    want, wrep = _by_stages(monkeypatch, st, budget=5, method="ta", alpha="auto")
    assert rep.alpha == wrep.alpha == (0.0 if h > 1.0 else 1.0)
    assert rep.lam == wrep.lam
    assert rep.heterogeneity == pytest.approx(h, rel=1e-5)
    for nm in rep.masks:
        np.testing.assert_array_equal(rep.masks[nm], wrep.masks[nm], err_msg=nm)
        np.testing.assert_array_equal(
            np.asarray(rep.scores.modules[nm].utility), np.asarray(wrep.scores.modules[nm].utility)
        )
        ref = dense(want[nm])
        np.testing.assert_allclose(dense(out[nm]), ref, atol=1e-5 * np.abs(ref).max())


def test_an_h_at_the_rules_threshold_is_left_to_the_stages(monkeypatch, took):
    """Within 1e-3 of the threshold the two routes' sums could pick different alphas: the
    program declines and the stages decide."""
    ads = adapters()
    h = float(nu.heterogeneity(ads))
    monkeypatch.setattr(_fused, "H_THRESHOLD", h + 5e-4)  # (the host's check of the h read)
    nu.merge_adapters(ads, budget=4, method="ta", alpha="auto")
    assert took == [None]


def test_alpha_auto_with_a_task_zero_everywhere_gets_the_stages_error(took):
    ads = adapters()
    for mod in ads[3].values():
        mod["lora_b"][:] = 0.0
    with pytest.raises(InputError, match=r"alpha='auto'.*task 3"):
        nu.merge_adapters(ads, budget=4, method="ta", alpha="auto")
    assert took == [None]
