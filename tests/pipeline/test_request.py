"""One merge request: the three entry points (``nu.merge_adapters``, the streamed merge, ``nu.plan``)
and the command take the same settings, check them the same way and allocate the same masks."""

from __future__ import annotations

import inspect
import types

import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax.errors import InputError, InputTypeError
from netutility_jax.folders import merge_settings
from netutility_jax.pipeline import _request
from netutility_jax.pipeline.planning import plan

ENTRY_POINTS = {
    "nu.merge_adapters": nu.merge_adapters,
    "nu.merge_adapters_streaming": nu.merge_adapters_streaming,
    "nu.plan": plan,
}


def _adapters(seed=0, m=3, layers=2):
    rng = np.random.default_rng(seed)
    return [
        {
            f"model.layers.{ell}.self_attn.q_proj": {
                "lora_a": rng.normal(size=(24, 4)).astype(np.float32),
                "lora_b": rng.normal(size=(4, 16)).astype(np.float32),
            }
            for ell in range(layers)
        }
        for _ in range(m)
    ]


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """The same three adapters in memory and on disk (an ``AdapterSet``)."""
    ads = _adapters()
    root = tmp_path_factory.mktemp("request")
    paths = [root / f"t{i}" for i in range(len(ads))]
    for ad, p in zip(ads, paths, strict=True):
        nu.peft.save_adapter(ad, p)
    return ads, paths


@pytest.mark.parametrize("fn", sorted(ENTRY_POINTS))
def test_every_entry_point_takes_the_requests_settings_with_its_defaults(fn):
    params = inspect.signature(ENTRY_POINTS[fn]).parameters
    want = _request.DEFAULTS if fn == "nu.plan" else _request.MERGE_DEFAULTS
    got = {n: params[n].default for n in want if n in params}
    assert got == dict(want), f"{fn}: {set(want) - set(got)} missing or defaults differ"
    if fn == "nu.plan":  # a plan merges nothing: no coefficient, no key
        assert "coef" not in params and "key" not in params


def test_the_request_check_takes_every_setting():
    params = inspect.signature(_request.MergeRequest.check).parameters
    assert set(_request.MERGE_DEFAULTS) <= set(params)
    # the defaults the check gives where a caller leaves a setting out are the entry points'
    for name in ("coef", "key", "weights"):
        assert params[name].default == _request.MERGE_DEFAULTS[name]


def test_the_commands_merge_arguments_are_the_requests_settings():
    job = types.SimpleNamespace(
        budget=4, method="ta", space="full", allocation="net_utility", scope=None, alpha=1.0,
        lam="auto", keep_nonpositive=False, coef=1.0, weights=None, min_share=None, devices=1,
        interference="overlap",
    )  # fmt: skip
    got = merge_settings(job, None)
    # input_moments comes from the job's file (loaded apart, once the adapters are known)
    assert set(got) == (set(_request.MERGE_DEFAULTS) - {"input_moments"}) | {"mesh"}
    assert got["positive_only"] is True


# one bad setting at a time: every entry point refuses it with the same words
BAD = [
    ({"budget": 0}, InputError, "budget=0"),
    ({"budget": 2.5}, InputTypeError, "budget=2.5"),
    ({"budget": None}, InputError, "budget=None"),
    ({"allocation": "best"}, InputError, "allocation="),
    ({"scope": "model"}, InputError, "scope="),
    ({"alpha": -1.0}, InputError, "alpha="),
    ({"lam": float("nan")}, InputError, "lam="),
    ({"positive_only": 1}, InputTypeError, "positive_only="),
    ({"min_share": 1.5}, InputError, "min_share="),
    ({"min_share": 0.5, "allocation": "uniform"}, InputError, "min_share"),
    ({"input_moments": [None, None, None], "allocation": "uniform"}, InputError, "input_moments"),
    ({"weights": [1.0, 2.0]}, InputError, "2 weights for 3 tasks"),
    ({"weights": [1.0, 0.0, 1.0]}, InputError, "weights[1]"),
    ({"method": "ties", "density": 2.0}, InputError, "density"),
    ({"method": "nope"}, InputError, "method="),
    ({"interference": "cosine"}, InputError, "interference="),
    ({"interference": "signed", "allocation": "uniform"}, InputError, "interference='signed'"),
]


def _message(call, fn, kwargs, expected):
    with pytest.raises(expected) as info:
        call()
    text = str(info.value)
    assert text.startswith(f"{fn}: "), text
    return text[len(fn) + 2 :]


@pytest.mark.parametrize(("bad", "expected", "words"), BAD, ids=[str(b[0]) for b in BAD])
def test_a_bad_setting_is_refused_alike_by_every_entry_point(sets, bad, expected, words):
    ads, paths = sets
    kwargs = {"budget": 2, **bad}
    texts = {
        "nu.merge_adapters": _message(
            lambda: nu.merge_adapters(ads, **kwargs), "nu.merge_adapters", kwargs, expected
        ),
        "nu.merge_adapters_streaming": _message(
            lambda: nu.merge_adapters_streaming(nu.peft.open_adapters(paths), **kwargs),
            "nu.merge_adapters_streaming",
            kwargs,
            expected,
        ),
        "nu.plan (memory)": _message(lambda: plan(ads, **kwargs), "nu.plan", kwargs, expected),
        "nu.plan (disk)": _message(
            lambda: plan(nu.peft.open_adapters(paths), **kwargs), "nu.plan", kwargs, expected
        ),
    }
    assert len(set(texts.values())) == 1, texts
    assert words in next(iter(texts.values()))


def test_the_checks_come_in_one_order():
    """Two bad settings: the one the order puts first is reported, by every entry point (the
    allocation before the budget's value, the budget before min_share, input_moments before
    coef)."""
    ads = _adapters()
    for kwargs, words in (
        ({"allocation": "best", "budget": 0}, "allocation="),
        ({"budget": 0, "min_share": 7.0}, "budget=0"),
        ({"input_moments": [None] * 3, "allocation": "uniform", "coef": float("inf")}, "input_mo"),
    ):
        with pytest.raises(InputError, match=words):
            nu.merge_adapters(ads, budget=kwargs.pop("budget", 2), **kwargs)


def test_a_coefficient_and_a_key_are_checked_only_for_a_merge():
    req = _request.MergeRequest.check(
        "f", budget=2, method="dare", space="full", allocation="net_utility", scope=None,
        alpha=1.0, lam="auto", positive_only=True, min_share=None, input_moments=None,
        options={"p": 0.5}, merges=False,
    )  # fmt: skip
    assert req.key is None and req.scope == "local"  # DARE's budget is per module (the paper's)
    with pytest.raises(InputError, match="key"):
        _request.MergeRequest.check(
            "f", budget=2, method="dare", space="full", allocation="net_utility", scope=None,
            alpha=1.0, lam="auto", positive_only=True, min_share=None, input_moments=None,
            options={"p": 0.5},
        )  # fmt: skip


def test_the_request_is_frozen_and_checks_weights_against_the_tasks():
    req = _request.MergeRequest.check(
        "f", budget=2, method="ta", space="full", allocation="uniform", scope=None, alpha=1.0,
        lam="auto", positive_only=True, min_share=None, input_moments=None, options={},
        weights=np.array([1, 2, 3]),
    )  # fmt: skip
    with pytest.raises(AttributeError):
        req.budget = 3  # type: ignore[misc]
    assert req.with_tasks(3).weights == (1.0, 2.0, 3.0)
    with pytest.raises(InputError, match="3 weights for 2 tasks"):
        req.with_tasks(2)
    assert req.report_scope is None  # (uniform has no scope)


@pytest.mark.parametrize("allocation", ["net_utility", "uniform", "all"])
def test_the_requests_allocation_is_the_public_one(allocation):
    """In memory: ``nu.allocate(nu.score(...))`` (Net Utility, global scope for TA), uniform
    prefixes, or every candidate; the report of the merge records the same masks."""
    ads = _adapters(seed=3)
    req = _request.MergeRequest.check(
        "nu.merge_adapters", budget=3, method="ta", space="full", allocation=allocation,
        scope=None, alpha=1.0, lam="auto", positive_only=True, min_share=None,
        input_moments=None, options={},
    )  # fmt: skip
    names, buckets, _ = nu._core.tree.collect(ads, fn="t")
    sc, masks, kept = req.allocate(ads, names, buckets, None)
    if allocation == "all":
        assert sc is None and masks is None
        for n, ad in zip(names, zip(*[list(a.values()) for a in ads], strict=True), strict=True):
            assert np.asarray(kept[n]).sum() == sum(m["lora_a"].shape[1] for m in ad)
    else:
        want = nu.allocate(
            nu.score(ads), 3, scope="global" if allocation == "net_utility" else "uniform"
        )
        assert set(kept) == set(want)
        for n in want:
            np.testing.assert_array_equal(np.asarray(kept[n]), np.asarray(want[n]))
    _, rep = nu.merge_adapters(ads, budget=3, allocation=allocation)
    for n in names:
        np.testing.assert_array_equal(np.asarray(rep.masks[n]), np.asarray(kept[n]))
    assert rep.scope == req.report_scope


def test_a_streamed_merge_and_its_plan_agree_with_memory(sets):
    ads, paths = sets
    for kwargs in ({"budget": 3, "weights": [2.0, 1.0, 0.5]}, {"allocation": "all"}):
        _, mem = nu.merge_adapters(ads, **kwargs)
        _, disk = nu.merge_adapters_streaming(nu.peft.open_adapters(paths), **kwargs)
        p = plan(nu.peft.open_adapters(paths), **kwargs)
        assert mem.weights == disk.weights == p.weights
        assert mem.ranks == disk.ranks
        for n in mem.masks:
            np.testing.assert_array_equal(np.asarray(mem.masks[n]), np.asarray(disk.masks[n]))
            np.testing.assert_array_equal(np.asarray(mem.masks[n]), np.asarray(p.masks[n]))
