"""``interference="signed"`` (this project's sign-aware term, docs/math.md) through the merge
entry points: ``nu.merge_adapters`` (in memory, under ``jax.jit``), the streamed merge,
``nu.plan`` and ``netutility merge --interference``. The term itself is checked against a
float64 reference in tests/scoring/test_signed_interference.py; here: every entry point keeps the masks
that ``nu.allocate(nu.score(..., interference=...))`` gives, records the choice, and refuses it
where nothing is scored.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import cli
from netutility_jax.errors import InputError

NAMES = [f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")]
D_IN, D_OUT, M = 24, 16, 3
BUDGET = 3


def _adapters(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    shared = rng.normal(size=(D_IN, 4)).astype(np.float32)  # shared input sides: overlaps
    for t in range(M):
        ad = {}
        for n in NAMES:
            a = (shared + 0.3 * rng.normal(size=(D_IN, 4))).astype(np.float32)
            b = (rng.normal(size=(4, D_OUT)) / 4).astype(np.float32)
            ad[n] = {"lora_a": a, "lora_b": b * (-1.0 if t == 2 else 1.0), "scale": 2.0}
        out.append(ad)
    return out


def _masks(ads, interference: str) -> dict:
    sc = nu.score(ads, alpha=1.0, interference=interference)
    return {n: np.asarray(m) for n, m in nu.allocate(sc, BUDGET).items()}


def _report_masks(report) -> dict:
    return {n: np.asarray(report.masks[n]) for n in NAMES}


def test_signed_changes_the_choice_on_this_set():
    """(A guard for the tests below: on these adapters, with a third task opposing the others
    along shared input directions, the two terms keep different directions.)"""
    ads = _adapters()
    a, b = _masks(ads, "overlap"), _masks(ads, "signed")
    assert any((a[n] != b[n]).any() for n in NAMES)


@pytest.mark.parametrize("interference", ["overlap", "signed", "signed_weaker"])
def test_merge_adapters_keeps_the_masks_of_its_scores(interference):
    ads = _adapters()
    want = _masks(ads, interference)
    _, rep = nu.merge_adapters(ads, budget=BUDGET, alpha=1.0, interference=interference)
    assert rep.interference == interference
    got = _report_masks(rep)
    for n in NAMES:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)
    # under jax.jit (the traced route scores in the same trace)
    _, rep_j = jax.jit(
        lambda a: nu.merge_adapters(a, budget=BUDGET, alpha=1.0, interference=interference)
    )(ads)
    assert rep_j.interference == interference
    for n in NAMES:
        np.testing.assert_array_equal(np.asarray(rep_j.masks[n]), want[n], err_msg=n)


def test_streamed_merge_and_plan_keep_the_same_masks(tmp_path):
    ads = _adapters(1)
    paths = []
    for i, ad in enumerate(ads):
        p = tmp_path / f"t{i}"
        nu.peft.save_adapter(ad, p, base_config={"base_model_name_or_path": "x"})
        paths.append(p)
    loaded = nu.peft.load_adapters(paths).adapters
    want = _masks(loaded, "signed")
    _, rep = nu.merge_adapters_streaming(
        nu.peft.open_adapters(paths), budget=BUDGET, alpha=1.0, interference="signed"
    )
    assert rep.interference == "signed"
    for n, m in _report_masks(rep).items():
        np.testing.assert_array_equal(m, want[n], err_msg=n)
    p = nu.plan(nu.peft.open_adapters(paths), budget=BUDGET, alpha=1.0, interference="signed")
    assert list(p.kept_per_task) == [int(sum(want[n][i].sum() for n in NAMES)) for i in range(M)]


@pytest.mark.parametrize("allocation", ["uniform", "all"])
def test_signed_without_scoring_is_refused(allocation):
    with pytest.raises(InputError, match=r"interference='signed' with allocation="):
        nu.merge_adapters(
            _adapters(), budget=BUDGET, allocation=allocation, interference="signed"
        )


def test_a_bad_interference_is_refused_by_name():
    with pytest.raises(InputError, match=r"interference="):
        nu.merge_adapters(_adapters(), budget=BUDGET, interference="cosine")


@pytest.mark.parametrize("kind", ["signed", "signed_weaker"])
def test_command_line_flag_is_recorded_and_replayed(tmp_path, capsys, kind):
    ads = _adapters(2)
    paths = []
    for i, ad in enumerate(ads):
        p = tmp_path / f"task{i}"
        nu.peft.save_adapter(ad, p, base_config={"base_model_name_or_path": "x"})
        paths.append(str(p))
    out = tmp_path / "out"
    rc = cli.main(
        ["merge", *paths, "--out", str(out), "--budget", str(BUDGET), "--alpha", "1",
         "--interference", kind, "--no-plots", "--quiet"]
    )  # fmt: skip
    err = capsys.readouterr()
    assert rc == 0, err
    assert f"{kind} interference" in err.out
    report = json.loads((out / "netutility_report.json").read_text())
    assert report["interference"] == kind and report["config"]["interference"] == kind
    want = _masks(nu.peft.load_adapters(paths).adapters, kind)
    kept = [int(sum(want[n][i].sum() for n in NAMES)) for i in range(M)]
    assert report["kept_per_task"] == kept
    rc = cli.main(
        ["merge", "--config", str(out / "netutility_report.json"), "--out", str(tmp_path / "r")]
    )
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    again = json.loads((tmp_path / "r" / "netutility_report.json").read_text())
    assert again["interference"] == kind and again["kept_per_task"] == kept
    rc = cli.main(
        ["merge", *paths, "--out", str(tmp_path / "u"), "--budget", "2", "--allocation",
         "uniform", "--interference", "signed", "--quiet"]
    )  # fmt: skip
    cap = capsys.readouterr()
    assert rc == 2 and "Traceback" not in cap.err
    assert "--interference signed with --allocation uniform" in cap.err
