"""nu.planning.plan and per-task weights against independent computations (pure Python and
numpy float64); the per-task floor (min_share) is checked in tests/allocation/test_min_share.py."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest
from _reference import CLI_MODULES
from _reference import cli_adapters as _adapters

import netutility_jax as nu
from netutility_jax.errors import InputError, InputTypeError
from netutility_jax.pipeline.planning import Plan, plan, task_names

MODULES = CLI_MODULES
D_IN, D_OUT = 24, 16  # (their shapes)


# -------------------------------------------------------------------------------- weights


def test_weighted_ta_keeping_everything_is_the_weighted_sum():
    """weights multiply each task's update: TA with every direction is sum_i w_i dK_i (numpy
    float64), with no budget given."""
    ads = _adapters()
    w = [1.5, -0.5, 2.0]
    out, rep = nu.merge_adapters(ads, allocation="all", method="ta", weights=w)
    assert rep.budget is None and rep.weights == (1.5, -0.5, 2.0)
    for n in MODULES:
        want = sum(wi * 2.0 * a[n]["lora_a"] @ a[n]["lora_b"] for wi, a in zip(w, ads, strict=True))
        got = np.asarray(nu.module_update(out[n]), np.float64)
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


def test_weights_scale_the_merge_not_the_allocation(tmp_path):
    """The scores and masks of a weighted merge are the unweighted ones; the merge is nu.merge of
    the adapters with each lora_b multiplied by its weight, with those masks (numpy float64 for
    TA: sum_i w_i of each task's kept components); the streamed merge agrees."""
    ads = _adapters()
    w = [3.0, 1.0, -0.5]
    out, rep = nu.merge_adapters(ads, budget=2, weights=w)
    _, plain = nu.merge_adapters(ads, budget=2)
    assert float(rep.lam) == float(plain.lam) and rep.heterogeneity == plain.heterogeneity
    for n in MODULES:
        np.testing.assert_array_equal(np.asarray(rep.masks[n]), np.asarray(plain.masks[n]))
        want = 0.0
        for wi, a, keep in zip(w, ads, np.asarray(rep.masks[n]), strict=True):
            u, s, vt = np.linalg.svd(2.0 * a[n]["lora_a"] @ a[n]["lora_b"], full_matrices=False)
            k = keep[: len(s)]
            want = want + wi * (u[:, : len(k)][:, k] * s[: len(k)][k]) @ vt[: len(k)][k]
        got = np.asarray(nu.module_update(out[n]), np.float64)
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), err_msg=n)
    paths = []
    for i, ad in enumerate(ads):
        nu.peft.save_adapter(ad, tmp_path / f"t{i}")
        paths.append(tmp_path / f"t{i}")
    sout, srep = nu.merge_adapters_streaming(nu.peft.open_adapters(paths), budget=2, weights=w)
    assert list(srep.kept_per_task) == list(rep.kept_per_task) and srep.weights == rep.weights
    for n in MODULES:
        np.testing.assert_allclose(
            np.asarray(nu.module_update(sout[n])), np.asarray(nu.module_update(out[n])),
            atol=1e-5,
        )  # fmt: skip


def test_weights_are_checked():
    ads = _adapters()
    with pytest.raises(InputError, match="2 weights for 3 tasks"):
        nu.merge_adapters(ads, budget=2, weights=[1.0, 2.0])
    with pytest.raises(InputError, match=r"weights\[1\]=0.*nonzero"):
        nu.merge_adapters(ads, budget=2, weights=[1.0, 0.0, 1.0])
    with pytest.raises(InputError, match=r"weights\[2\]"):
        nu.merge_adapters(ads, budget=2, weights=[1.0, 1.0, float("nan")])
    with pytest.raises(InputTypeError, match="weights="):
        nu.merge_adapters(ads, budget=2, weights="1,2,3")


def test_budget_is_needed_unless_everything_is_kept():
    with pytest.raises(InputError, match="budget=None with allocation='net_utility'"):
        nu.merge_adapters(_adapters())


# ----------------------------------------------------------------------------------- the plan


def test_plan_is_the_merge_s_allocation(tmp_path):
    """The plan keeps what the merge keeps (in memory and streamed), TA's ranks are the merge's,
    and the size is that of the tensors save_adapter writes."""
    ads = _adapters()
    p = plan(ads, budget=2, names=["a", "b", "c"])
    _, rep = nu.merge_adapters(ads, budget=2)
    assert p.tasks == ("a", "b", "c")
    assert p.kept_per_task == tuple(int(k) for k in rep.kept_per_task)
    assert p.ranks == {n: max(1, r) for n, r in rep.ranks.items()}
    for n in MODULES:
        np.testing.assert_array_equal(np.asarray(p.masks[n]), np.asarray(rep.masks[n]))
    assert p.uniform_share == (8 / 3,) * 3 and p.lam == pytest.approx(rep.lam)
    assert p.out_bytes == sum(r * (D_IN + D_OUT) * 4 for r in p.ranks.values())
    paths = []
    for i, ad in enumerate(ads):
        nu.peft.save_adapter(ad, tmp_path / f"t{i}")
        paths.append(tmp_path / f"t{i}")
    sp = plan(nu.peft.open_adapters(paths), budget=2)
    assert sp.streamed and sp.tasks == ("t0", "t1", "t2")
    assert sp.kept == p.kept
    text = str(p)
    assert "a " in text and "uniform share" in text and "kept per task" in text
    assert f"{p.budget * 4} directions" in text and "estimate: about" in text
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.budget = 3  # type: ignore[misc]


def test_plan_summarises_many_modules():
    ads = _adapters()
    p = plan(ads, budget=2)
    ranks = {f"layers.{i}.q": (i % 4) + 1 for i in range(40)}
    many = dataclasses.replace(
        p, ranks=ranks, kept={n: (1, 0, 0) for n in ranks}, shapes=dict.fromkeys(ranks, (4, 4))
    )
    text = str(many)
    assert "over 40 modules: min 1, median 3, max 4" in text
    assert "layers.0.q" not in text.split("largest:")[0]  # no table row per module
    assert len(text.splitlines()) < 15


def test_plan_of_everything_has_no_budget_or_share():
    p = plan(_adapters(), allocation="all", method="ties", rank=3)
    assert p.budget is None and p.uniform_share is None and p.lam is None
    assert set(p.ranks.values()) == {3} and p.kept_per_task == (16, 12, 16)
    assert "every direction kept" in str(p) and p.low_share() == ()
    with pytest.raises(InputError, match="names="):
        plan(_adapters(), allocation="all", names=["a", "a", "b"])


def test_task_names_tell_equal_folder_names_apart(tmp_path):
    assert task_names(["runs/a/adapter", "runs/b/adapter", "sql/"]) == [
        "a/adapter",
        "b/adapter",
        "sql",
    ]
    assert task_names(["x", "x", "y"]) == ["x", "x#2", "y"]
    assert task_names([tmp_path / "t"]) == ["t"]
    assert isinstance(Plan, type) and pathlib.Path("a").name == "a"
