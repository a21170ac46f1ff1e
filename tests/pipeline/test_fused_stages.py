"""Every other method's eager merge in one program (netutility_jax/pipeline/_fused_stages.py):
the stages' merge, masks, scores and report; Iso-C of the kept directions against float64 math;
the stages' errors where a check sends the merge back to them; what it does not take."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _fused_cases import adapters, by_stages, dense, spy

import netutility_jax as nu
from netutility_jax import InputError
from netutility_jax.pipeline import _fused_stages


@pytest.fixture
def took(monkeypatch):
    """The results of the one-program route in this test (None where it declined)."""
    return spy(monkeypatch, _fused_stages, "fused_merge")


def _by_stages(monkeypatch, *args, **kwargs):
    return by_stages(monkeypatch, _fused_stages, "fused_merge", *args, **kwargs)


def _form(form, ads):
    if form == "stacked":
        return nu.stack_adapters(jax.device_put(ads))
    return ads if form == "numpy" else jax.device_put(ads)


CASES = [
    {"method": "tsv", "space": "core"},
    {"method": "tsv", "space": "full", "isotropize": True, "lam": 0.0},
    {"method": "iso_c", "space": "core", "alpha": "auto"},
    {"method": "iso_cts", "space": "knots", "scope": "global"},
    {"method": "ties", "space": "knots", "density": 0.3},
    {"method": "ties", "space": "core", "allocation": "uniform", "coef": 0.7},
    {"method": "dare", "space": "core", "p": 0.3, "seed": 1},
    {"method": "dare_ties", "space": "knots", "p": 0.2, "seed": 2, "interference": "signed"},
    {"method": "ta", "space": "core", "isotropize": True},
]


def _kw(opts):
    kw = dict(opts)
    if "seed" in kw:
        kw["key"] = jax.random.key(kw.pop("seed"))
    return kw


# every method from numpy factors; the device and stacked forms (whose factors stay on the
# device, or are stacked there) with a spectral, an elementwise and a keyed method
FORMS = [("numpy", o) for o in CASES] + [
    (form, CASES[i]) for form in ("device", "stacked") for i in (0, 4, 7)
]


@pytest.mark.parametrize(
    ("form", "opts"),
    FORMS,
    ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()),
)
def test_one_program_gives_the_stages_merge_masks_scores_and_report(monkeypatch, took, opts, form):
    st = _form(form, adapters())
    out, rep = nu.merge_adapters(st, budget=3, **_kw(opts))
    assert len(took) == 1 and took[0] is not None  # the one-program route ran
    want, wrep = _by_stages(monkeypatch, st, budget=3, **_kw(opts))
    names = list(rep.masks)
    assert list(out) == list(want) == names
    for nm in names:
        if form != "stacked":  # each module's factors at its rank, as the stages give them
            assert out[nm]["lora_a"].shape == want[nm]["lora_a"].shape
        np.testing.assert_array_equal(rep.masks[nm], wrep.masks[nm], err_msg=nm)
        got, ref = dense(out[nm]), dense(want[nm])
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max(), err_msg=nm)
        for f in ("sigma", "utility"):
            np.testing.assert_array_equal(
                np.asarray(getattr(rep.scores.modules[nm], f)),
                np.asarray(getattr(wrep.scores.modules[nm], f)),
                err_msg=f"{nm} {f}",
            )
    assert rep.lam == wrep.lam and rep.alpha == wrep.alpha
    # (alpha="auto": the stages' h is float32 nu.heterogeneity's, the program's the scoring's
    # energies summed in float64)
    assert rep.heterogeneity == pytest.approx(wrep.heterogeneity, rel=1e-6)
    assert rep.ranks == wrep.ranks and rep.zeroed == wrep.zeroed
    assert rep.budget_spent == wrep.budget_spent and rep.scope == wrep.scope


def test_iso_c_is_the_kept_directions_sum_with_a_flat_spectrum_in_float64(took):
    """Independent of both routes: each module's Iso-C update is the TA sum of the kept
    singular components (a float64 SVD of each task's dense update) with its nonzero singular
    values replaced by their mean."""
    ads = adapters(seed=3)
    out, rep = nu.merge_adapters(ads, budget=3, method="iso_c", space="core", coef=0.8)
    assert took[0] is not None
    for nm in ads[0]:
        ta = 0.0
        for i, ad in enumerate(ads):
            u, s, vt = np.linalg.svd(dense(ad[nm]), full_matrices=False)
            keep = np.zeros(s.shape, bool)
            mask = np.asarray(rep.masks[nm][i])
            keep[: mask.size] = mask[: s.size]
            ta = ta + (u[:, keep] * s[keep]) @ vt[keep]
        u, s, vt = np.linalg.svd(ta, full_matrices=False)
        live = s > 1e-6 * s[0]
        want = 0.8 * (u[:, live] * s[live].mean()) @ vt[live]
        got = dense(out[nm])
        np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), err_msg=nm)


def test_a_non_finite_factor_is_reported_by_the_stages(took):
    ads = adapters()
    ads[2]["l1.up"]["lora_b"][0, 3] = np.nan
    with pytest.raises(InputError, match=r"l1\.up"):
        nu.merge_adapters(ads, budget=4, method="tsv", space="core")
    assert took == [None]  # a flag sent it back to the stages, which named the module


def test_a_result_beyond_the_dtype_is_refused_by_the_stages(monkeypatch, took):
    """A coefficient that overflows the merged factors: the merge's range check sends the
    merge back, and the stages' error is the caller's."""
    ads = adapters()
    with pytest.raises(InputError) as got:
        nu.merge_adapters(ads, budget=4, method="ties", space="core", coef=3e38)
    assert took == [None]
    with pytest.raises(InputError) as want:
        _by_stages(monkeypatch, ads, budget=4, method="ties", space="core", coef=3e38)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize(
    "opts",
    [
        {"method": "ties", "space": "full"},  # module by module, dense
        {"method": "ties", "space": "core", "trim_scope": "model"},  # model-wide selection
        {"method": "tsv", "space": "core", "weights": [1.0, 0.5, 2.0, 1.0]},
        {"method": "tsv", "space": "core", "min_share": 0.5},
    ],
    ids=["ties_full", "model_wide", "weights", "min_share"],
)
def test_what_the_program_does_not_take_goes_to_the_stages(monkeypatch, took, opts):
    ads = adapters()
    out, rep = nu.merge_adapters(ads, budget=4, **opts)
    assert took in ([], [None])
    want, wrep = _by_stages(monkeypatch, ads, budget=4, **opts)
    assert rep.ranks == wrep.ranks
    for nm in ads[0]:
        np.testing.assert_array_equal(nu.module_update(out[nm]), nu.module_update(want[nm]))


def test_a_second_call_runs_the_same_program(took):
    """The program is traced once per shapes and settings: other adapters of the same shapes
    reuse it."""
    ads = adapters()
    nu.merge_adapters(ads, budget=3, method="tsv", space="core")
    traced = _fused_stages.fused_merge_program._cache_size()
    nu.merge_adapters(adapters(seed=9), budget=3, method="tsv", space="core")
    assert _fused_stages.fused_merge_program._cache_size() == traced
    assert took[0] is not None and took[1] is not None
