"""Merging with the data-aware score: ``input_moments`` in nu.merge_adapters, the streamed merge
and nu.plan.

The reference is the composition the merge promises, written out with the public pieces:
``nu.merge(adapters, nu.allocate(nu.score(adapters, input_moments=m), R))``; the streamed merge
is compared with the in-memory one; isotropic moments (``S = c I``) must give the data-free
merge (the geometry then reduces to the paper's, docs/input_moments.md).
"""

from __future__ import annotations

import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import peft
from netutility_jax.errors import InputError, InputTypeError
from netutility_jax.pipeline.planning import plan
from netutility_jax.pipeline.streaming import merge_adapters_streaming
from netutility_jax.scoring.moments import input_moments, input_moments_dense

# by the name's last part; one shape, so that one bucket (one compilation) serves every module
D_IN = {"q_proj": 16, "up_proj": 16}
D_OUT = {"q_proj": 16, "up_proj": 16}
LAYERS = 2
M = 3
BUDGET = 3
LACKING = "model.layers.1.mlp.up_proj"  # task 2 lacks it
NAMES = [
    f"model.layers.{la}.{m}" for la in range(LAYERS) for m in ("self_attn.q_proj", "mlp.up_proj")
]


def _adapters(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(M):
        ad = {}
        for name in NAMES:
            if i == 2 and name == LACKING:
                ad[name] = None
                continue
            mod = name.rsplit(".", 1)[1]
            d_in, d_out = D_IN[mod], D_OUT[mod]
            r = 3 if i == 1 else 4
            decay = 0.7 ** np.arange(r) * (1.0 + 0.3 * i)
            a = (rng.normal(size=(d_in, r)) / np.sqrt(d_in)).astype(np.float32)
            b = (rng.normal(size=(r, d_out)) * decay[:, None]).astype(np.float32)
            ad[name] = {"lora_a": a, "lora_b": b, "scale": 1.0}
        out.append(ad)
    return out


def _activations(seed: int = 1, n: int = 40) -> list[dict]:
    """Anisotropic inputs, each task with its own dominant directions (so that the data-aware
    geometry differs from the data-free one)."""
    rng = np.random.default_rng(seed)
    acts = []
    for i in range(M):
        task = {}
        for name in NAMES:
            if i == 2 and name == LACKING:
                continue
            d = D_IN[name.rsplit(".", 1)[1]]
            mix = rng.normal(size=(d, d)) * rng.uniform(0.05, 3.0, d)
            task[name] = (rng.normal(size=(n, d)) @ mix.T).astype(np.float32)
        acts.append(task)
    return acts


@pytest.fixture(scope="module")
def ads():
    return _adapters()


@pytest.fixture(scope="module")
def moments():
    return [input_moments(a) for a in _activations()]


def _assert_masks_equal(got, want):
    assert set(got) == set(want)
    for n in want:
        np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(want[n]), err_msg=n)


def _assert_merged_equal(got, want, atol=0.0):
    assert set(got) == set(want)
    for n in want:
        g, w = nu.module_update(got[n]), nu.module_update(want[n])
        if atol:
            np.testing.assert_allclose(g, w, atol=atol * np.abs(w).max(), err_msg=n)
        else:
            np.testing.assert_array_equal(g, w, err_msg=n)


# ------------------------------------------------------------------------------ in memory


@pytest.mark.slow  # compiles the data-aware score and the merge (10-15 s on a busy CPU)
def test_merge_adapters_is_score_allocate_merge(ads, moments):
    merged, rep = nu.merge_adapters(ads, budget=BUDGET, input_moments=moments)
    sc = nu.score(ads, input_moments=moments)
    masks = nu.allocate(sc, BUDGET)
    want = nu.merge(ads, masks)
    _assert_masks_equal(rep.masks, masks)
    _assert_merged_equal(merged, want)
    assert rep.data_aware
    assert rep.lam == float(sc.lam)
    # not vacuous: the data changes the scores (and here the kept directions)
    free = nu.score(ads)
    assert not np.allclose(
        np.asarray(free.modules[NAMES[0]].benefit), np.asarray(sc.modules[NAMES[0]].benefit)
    )
    free_masks = nu.allocate(free, BUDGET)
    assert any(not np.array_equal(masks[n], free_masks[n]) for n in masks)


@pytest.mark.slow  # compiles the data-aware score and the merge (10-15 s on a busy CPU)
def test_merge_adapters_mixed_tasks_and_modules(ads, moments):
    """None for a whole task and None at a module: the score's mixing, passed through."""
    mixed = [None, {**moments[1], NAMES[0]: None}, moments[2]]
    merged, rep = nu.merge_adapters(ads, budget=BUDGET, input_moments=mixed, method="tsv")
    masks = nu.allocate(nu.score(ads, input_moments=mixed), BUDGET)
    _assert_masks_equal(rep.masks, masks)
    _assert_merged_equal(merged, nu.merge(ads, masks, method="tsv"))
    assert rep.data_aware


@pytest.mark.slow  # compiles the data-aware score and the merge (10-15 s on a busy CPU)
def test_isotropic_moments_give_the_data_free_merge(ads):
    iso = [
        {
            n: input_moments_dense({n: c * np.eye(D_IN[n.rsplit(".", 1)[1]])})[n]
            for n in ad
            if ad[n] is not None
        }
        for c, ad in zip((1.0, 3.5, 0.02), ads, strict=True)
    ]
    merged, rep = nu.merge_adapters(ads, budget=BUDGET, input_moments=iso)
    ref, ref_rep = nu.merge_adapters(ads, budget=BUDGET)
    _assert_masks_equal(rep.masks, ref_rep.masks)
    _assert_merged_equal(merged, ref, atol=1e-6)
    np.testing.assert_allclose(rep.lam, ref_rep.lam, rtol=1e-5)
    assert rep.data_aware and not ref_rep.data_aware


@pytest.mark.slow  # compiles the data-aware score and the merge (10-15 s on a busy CPU)
def test_no_data_is_the_data_free_merge(ads):
    """Every entry None (or None at every name): the data-free program, bit for bit."""
    ref, ref_rep = nu.merge_adapters(ads, budget=BUDGET)
    for none in ([None] * M, [{n: None for n in ad} for ad in ads]):
        merged, rep = nu.merge_adapters(ads, budget=BUDGET, input_moments=none)
        _assert_masks_equal(rep.masks, ref_rep.masks)
        _assert_merged_equal(merged, ref)
        assert not rep.data_aware


@pytest.mark.parametrize("allocation", ["uniform", "all"])
def test_refused_without_net_utility(ads, moments, allocation):
    budget = None if allocation == "all" else BUDGET
    for call in (nu.merge_adapters, plan):
        with pytest.raises(InputError, match=r"input_moments was given with allocation="):
            call(ads, budget=budget, allocation=allocation, input_moments=moments)


def test_bad_moments_are_the_scores_errors(ads, moments):
    with pytest.raises(InputError, match=r"input_moments has 2 entries for M = 3"):
        nu.merge_adapters(ads, budget=BUDGET, input_moments=moments[:2])
    lacking = [moments[0], {k: v for k, v in moments[1].items() if k != NAMES[1]}, moments[2]]
    with pytest.raises(InputError, match=r"input_moments\[1\] lacks"):
        nu.merge_adapters(ads, budget=BUDGET, input_moments=lacking)


@pytest.mark.slow  # compiles the data-aware score and the merge (10-15 s on a busy CPU)
def test_plan_uses_the_moments(ads, moments):
    p = plan(ads, budget=BUDGET, input_moments=moments)
    _, rep = nu.merge_adapters(ads, budget=BUDGET, input_moments=moments)
    _assert_masks_equal(p.masks, rep.masks)


# ------------------------------------------------------------------------------ streamed


@pytest.fixture(scope="module")
def paths(tmp_path_factory, ads):
    root = tmp_path_factory.mktemp("moments_merge")
    out = []
    for i, ad in enumerate(ads):
        p = root / f"task{i}"
        present = {n: m for n, m in ad.items() if m is not None}
        peft.save_adapter(present, p, base_model_name_or_path="org/base")
        out.append(str(p))
    return out


@pytest.mark.slow  # compiles the streamed passes per chunk shape (about 20 s on a busy CPU)
@pytest.mark.parametrize("alpha", [1.0, "auto"])
def test_streamed_equals_in_memory(paths, moments, alpha):
    src = peft.open_adapters(paths)
    loaded = peft.load_adapters(paths).adapters
    mixed = [moments[0], {**moments[1], NAMES[2]: None}, None]
    got, rep = merge_adapters_streaming(
        src, budget=BUDGET, input_moments=mixed, chunk_bytes=2048, alpha=alpha
    )
    ref, ref_rep = nu.merge_adapters(loaded, budget=BUDGET, input_moments=mixed, alpha=alpha)
    _assert_masks_equal(rep.masks, ref_rep.masks)
    _assert_merged_equal(got, ref, atol=1e-5)
    np.testing.assert_allclose(rep.lam, ref_rep.lam, rtol=1e-5)
    assert rep.alpha == ref_rep.alpha and rep.data_aware
    # a plan of the AdapterSet reads the same masks
    _assert_masks_equal(plan(src, budget=BUDGET, input_moments=mixed, chunk_bytes=2048).masks,
                        ref_rep.masks)  # fmt: skip


def test_streamed_refusals(paths, moments):
    src = peft.open_adapters(paths)
    with pytest.raises(InputError, match=r"input_moments was given with allocation='uniform'"):
        merge_adapters_streaming(src, budget=BUDGET, allocation="uniform", input_moments=moments)
    typo = [moments[0], {**moments[1], "model.layers.9.self_attn.q_proj": None}, moments[2]]
    with pytest.raises(
        InputError, match=r"input_moments\[1\] names .*layers\.9\.self_attn\.q_proj"
    ):
        merge_adapters_streaming(src, budget=BUDGET, input_moments=typo)
    with pytest.raises(InputError, match=r"input_moments has 2 entries for M = 3"):
        merge_adapters_streaming(src, budget=BUDGET, input_moments=moments[:2])
    with pytest.raises(InputTypeError, match=r"input_moments is a dict"):
        merge_adapters_streaming(src, budget=BUDGET, input_moments=moments[0])
    lacking = [moments[0], {k: v for k, v in moments[1].items() if k != NAMES[3]}, moments[2]]
    with pytest.raises(InputError, match=r"input_moments\[1\] lacks"):
        merge_adapters_streaming(src, budget=BUDGET, input_moments=lacking, chunk_bytes=2048)
