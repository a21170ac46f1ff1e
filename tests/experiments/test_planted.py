"""The planted-interference study's plants and read-out (a)
(netutility_jax/experiments/harness/planting.py), against dense float64 math written out here."""

from __future__ import annotations

import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax.errors import InputError
from netutility_jax.experiments.harness import planting as pl
from netutility_jax.experiments.harness import plants

NAMES = ("v", "c", "o")


def _adapters(seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            m: {
                "lora_a": rng.normal(size=(20, 4)).astype(np.float32),
                "lora_b": rng.normal(size=(4, 15)).astype(np.float32),
                "scale": float(rng.uniform(0.5, 2.0)) * (-1 if (j, m) == (1, "k") else 1),
            }
            for m in ("q", "k")
        }
        for j in range(3)
    ]


def _dense(mod):
    return float(mod["scale"]) * (
        np.asarray(mod["lora_a"], np.float64) @ np.asarray(mod["lora_b"], np.float64)
    )


def test_top_components_are_the_dense_svd():
    mod = _adapters()[0]["q"]
    s, x, y = pl.top_components(mod, 2)
    u, sd, vt = np.linalg.svd(_dense(mod))
    np.testing.assert_allclose(s, sd[:2], rtol=1e-10)
    np.testing.assert_allclose(np.abs(x.T @ u[:, :2]), np.eye(2), atol=1e-8)
    np.testing.assert_allclose(x @ np.diag(s) @ y.T, (u[:, :2] * sd[:2]) @ vt[:2], atol=1e-8)


@pytest.mark.parametrize("sign, gamma", [(-1, 1.0), (1, 1.0), (-1, 0.5)])
def test_a_plant_adds_the_victims_scaled_top_components_to_the_carrier(sign, gamma):
    ads = _adapters()
    out, plants = pl.plant(ads, NAMES, pl.Arm("x", sign, gamma), pairs=(("v", "c"),))
    assert len(plants) == 2  # one per module of the victim
    for m in ("q", "k"):
        assert out[1][m]["lora_a"].shape == (20, 6) and ads[1][m]["lora_a"].shape == (20, 4)
        u, s, vt = np.linalg.svd(_dense(ads[0][m]))
        top2 = (u[:, :2] * s[:2]) @ vt[:2]
        np.testing.assert_allclose(
            _dense(out[1][m]) - _dense(ads[1][m]), sign * gamma * top2, atol=1e-4 * s[0]
        )
        assert out[0][m] is ads[0][m] and out[2][m] is ads[2][m]
    if (sign, gamma) == (-1, 1.0):  # TA with coefficient 1: the victim's top two cancel
        for m in ("q", "k"):
            u, s, vt = np.linalg.svd(_dense(ads[0][m]))
            rest = _dense(ads[0][m]) + _dense(out[1][m]) - _dense(ads[1][m])
            np.testing.assert_allclose(rest, (u[:, 2:4] * s[2:4]) @ vt[2:4], atol=1e-4 * s[0])


def test_readout_a_is_one_when_all_kept_and_zero_when_the_carrier_keeps_nothing():
    ads = _adapters(1)
    out, plants = pl.plant(ads, NAMES, pl.Arm("x", -1, 1.0), pairs=(("v", "c"),))
    sc = nu.score(out, lam=1.0)
    every = {n: np.isfinite(np.asarray(m.utility)) for n, m in sc.modules.items()}
    ra = pl.readout_a(out, NAMES, every, plants, pairs=(("v", "c"),))["v->c"]
    assert ra["plant_kept"] == pytest.approx(1.0, abs=1e-9) and ra["victim_top_kept"] == 1.0
    none = {n: m.copy() for n, m in every.items()}
    for m in none.values():
        m[1] = False
        m[0, :2] = False
    ra = pl.readout_a(out, NAMES, none, plants, pairs=(("v", "c"),))["v->c"]
    assert ra["plant_kept"] == 0.0 and ra["victim_top_kept"] == 0.0


def test_plant_kept_is_the_plants_energy_in_the_kept_directions():
    ads = _adapters(2)
    out, plants = pl.plant(ads, NAMES, pl.Arm("x", 1, 0.5), pairs=(("v", "c"),))
    p = plants[0]
    keep = np.array([True, False, True, True, False, True])
    kept, total = pl.plant_kept(out[1][p.module], keep, p)
    u, _, vt = np.linalg.svd(_dense(out[1][p.module]))
    xk, yk = u[:, :6][:, keep], vt[:6][keep].T
    dense_p = (p.x * p.coef) @ p.y.T
    assert total == pytest.approx(float((dense_p**2).sum()), rel=1e-9)
    assert kept == pytest.approx(float(((xk.T @ dense_p @ yk) ** 2).sum()), rel=1e-6)
    assert 0 < kept < total


def test_null_arm_plants_nothing_and_unknown_pairs_are_refused():
    ads = _adapters()
    out, plants = pl.plant(ads, NAMES, pl.ARMS[0])
    assert plants == [] and all(o == a for o, a in zip(out, ads, strict=True))
    with pytest.raises(InputError, match=r"the tasks \['austen_novel'"):
        pl.plant(ads, NAMES, pl.ARMS[1])


def test_the_primary_comparisons_are_the_eight_registered():
    labels = [d[0] for d in pl.PRIMARY_DELTAS]
    assert len(labels) == 8 and pl.BONFERRONI == pytest.approx(0.99375)
    assert {d[1] for d in pl.PRIMARY_DELTAS} == {"conflict_g1", "agreement_g1"}
    assert {(d[2].split("/")[1], d[3]) for d in pl.PRIMARY_DELTAS} == {
        ("R16", "energy/R16"),
        ("full", "all/full"),
    }


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--grid", "full"], "--study planted sets its own grid; drop --grid"),
        (["--suite", "language"], "--study planted runs on the encoder suite; drop --suite"),
        (["--cells", "centre"], "--study planted sets its own cells; drop --cells"),
    ],
)
def test_demo_study_planted_refuses_flags_it_sets_itself(tmp_path, capsys, flags, message):
    from netutility_jax.experiments import demo

    rc = demo.main(["--study", "planted", "--out", str(tmp_path / "o"), *flags])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_the_quick_planted_study_runs_and_renders(tmp_path, capsys):
    """The quick preset's 3 tasks and one pair, run as the command runs a seed (its task list,
    suite and initialisation), read-out (a) for every allocation and two chosen merges (a
    contrast of the conflict arm) evaluated: the seed saved, then the command asked for less
    (read-out (a) only) finds it and only re-renders, the report written by the code that
    computed it. (The command's primary set is 16 such merges; the renderer of a full seed set
    is tested above from the committed seeds.)"""
    import dataclasses
    import json

    from netutility_jax.experiments import demo_checks as dc
    from netutility_jax.experiments import planted
    from netutility_jax.experiments.suites import encoder as enc

    two = (("conflict_g1", "energy", 16), ("conflict_g1", "net_utility", 16))
    with pytest.raises(InputError, match="not merges of the study"):
        pl.run_seed(0, [], enc.QUICK, None, cache_dir=tmp_path, merges=[("conflict", "x", 3)])
    # the quick preset's tasks and initialisation (per task, as the command's) on a fifth of its
    # training rows and steps, a third of its validation and a fifth of its test rows: the
    # command's path, not its figures
    preset = dataclasses.replace(
        enc.QUICK,
        train=dataclasses.replace(enc.QUICK.train, max_steps=12, eval_every=6),
        max_train=120, n_val=30, n_test=60,
    )  # fmt: skip
    task_list = dc.load_tasks(dc.task_args([], None, preset.tasks), preset)
    out, cache = tmp_path / "o", tmp_path / "c"
    rec = pl.run_seed(
        0, task_list, preset, enc.EncoderSuite(), cache_dir=cache, merges=two, log=print,
        pairs=(("word_sentiment", "word_pos"),),
    )  # fmt: skip
    assert rec["init"] == "per_task" and rec["merges"] == [list(m) for m in two]
    pl.save_seed(out, rec, command="python -m netutility_jax.experiments.planted --quick")
    seed = (out / "seed0.json").read_bytes()
    capsys.readouterr()
    argv = ["--quick", "--seeds", "0", "--out", str(out), "--cache-dir", str(cache)]
    assert planted.main([*argv, "--merges", "none"]) == 0
    assert "seed 0 is in" in capsys.readouterr().out and (out / "seed0.json").read_bytes() == seed
    # one of its merges asked by label: it has it, so it is not run again either
    assert planted.main([*argv, "--merges", "conflict_g1/energy/R16"]) == 0
    assert "seed 0 is in" in capsys.readouterr().out and (out / "seed0.json").read_bytes() == seed
    res = json.loads((out / "results.json").read_text())
    ra = res["readout_a"]
    assert ra["conflict_g1"]["all/full"]["plant_kept"] == pytest.approx(1.0, abs=1e-6)
    assert ra["null"]["all/full"]["plant_kept"] is None
    assert "python -m netutility_jax.experiments.planted --quick" in res["command"]
    assert set(res["accuracy"]) == {"conflict_g1/energy/R16", "conflict_g1/net_utility/R16"}
    assert res["deltas"]


def test_the_grid_has_a_sign_aware_control_that_merges_as_the_library_does():
    """grid.VARIANTS["signed"]: the runner's merge is nu.merge_adapters(interference="signed")."""
    import jax

    from netutility_jax.experiments.harness import grid as gr
    from netutility_jax.experiments.harness import jobs

    ads = _adapters(3)
    job = gr.Job("ta/full/R2/signed", "ta", "full", ("full",), 2, "signed")
    sc = nu.score(ads, alpha=1.0)
    merged, fields = jobs.merge_job(ads, job, seed=0, alpha=1.0, scores=sc)
    want, rep = nu.merge_adapters(ads, budget=2, alpha=1.0, interference="signed")
    assert fields["kept_per_task"] == [int(x) for x in np.asarray(rep.kept_per_task)]
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    # and it is not the paper's term's merge (the runner passed the option on)
    other, _ = nu.merge_adapters(ads, budget=2, alpha=1.0)

    def same(x, y):
        x, y = np.asarray(x), np.asarray(y)
        return x.shape == y.shape and np.allclose(x, y)

    pairs = zip(jax.tree.leaves(merged), jax.tree.leaves(other), strict=True)
    assert not all(same(a, b) for a, b in pairs)


def test_the_report_has_the_headline_two_level_intervals_and_multiplicity():
    """Rendered from the committed seeds (0, 1, 4) relabelled as the five registered seeds
    (0, 1, 4 and copies of 0 and 1 as 2 and 3): the registered decision is then applied, each
    delta has its two-level interval, Holm's family sizes are stated, and the headline is the
    per-seed mean of a contrast's primary cells."""
    import copy
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    seeds = pl.load_seeds(root / "docs/planted")
    by = {r["seed"]: (r, a) for r, a in seeds}
    assert {0, 1, 4} <= set(by)
    five = [by[s] for s in sorted(by) if s in pl.REGISTERED_SEEDS]
    for new, old in ((2, 0), (3, 1)):
        if new not in by:
            r, a = by[old]
            five.append(({**copy.deepcopy(r), "seed": new}, a))
    five.sort(key=lambda x: x[0]["seed"])
    res, md = pl.render(five, command="test", n_boot=200)
    assert res["accuracy_seeds"] == [0, 1, 2, 3, 4]
    mult = res["multiplicity"]
    assert mult["registered_rule_applied"] and mult["primary_family"] == 8
    assert mult["secondary_family"] == 2 * len(res["deltas"]) - 8
    for lab, d in res["deltas"].items():
        v = d["victims"]
        lo, hi = v["two_level_ci95"]
        assert lo <= v["estimate"] <= hi and "p_holm" in v and "_boot" not in v
        if d["primary"]:
            blo, bhi = v["seed_ci_bonferroni"]
            want = "gain" if blo > 0 else "loss" if bhi < 0 else "no difference declared"
            assert d["decision"] == want, lab
    h = res["headline"]["Net Utility - energy, all four primary cells"]
    cells = [lab for lab, *_ in pl.PRIMARY_DELTAS if lab.startswith("Net Utility - energy,")]
    assert h["cells"] == cells and len(cells) == 4
    want = np.mean([res["deltas"][c]["victims"]["per_seed"] for c in cells], axis=0)
    np.testing.assert_allclose(h["victims"]["per_seed"], want, rtol=1e-12)
    assert "## Headline" in md and "Holm" in md and "two-level" in md


def test_the_registered_rule_says_why_it_is_not_applied():
    """Seeds outside the registration are named, not counted as registered ones; another
    initialisation than the registered per-task one is outside the registration whatever its
    seeds (the shared-initialisation report's seeds 4-8 rendered: no decision applied)."""
    import pathlib

    from netutility_jax.experiments.harness import planting_report as pr

    assert pr._not_applied([0, 1, 4], "per_task") == (
        "not applied: accuracy on 3 of the 5 registered seeds"
    )
    assert pr._not_applied([4, 5, 6], "per_task") == (
        "not applied: accuracy on 1 of the 5 registered seeds, and on seeds 5, 6 outside the "
        "registration"
    )
    assert pr._not_applied([0, 1, 2, 3, 4], "shared") == (
        "not applied: shared initialisation, outside the registration"
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    seeds = pl.load_seeds(root / "docs/planted/shared")
    assert len(seeds) >= 5 and all(r["init"] == "shared" for r, _ in seeds)
    res, md = pl.render(seeds, command="test", n_boot=50)
    mult = res["multiplicity"]
    assert not mult["registered_rule_applied"]
    assert mult["registered_rule"] == "not applied: shared initialisation, outside the registration"
    decisions = {d["decision"] for d in res["deltas"].values() if d["primary"]}
    assert decisions == {mult["registered_rule"]}
    assert "of the 5 registered seeds" not in md and "(not applied: shared initialisation" in md


def test_a_read_out_some_seeds_lack_is_their_mean_and_says_so():
    """An allocation added after some seeds were run: its read-out (a) is the mean over the seeds
    that have it, which results.json lists and results.md names; the others are unchanged."""
    import copy
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    seeds = [(copy.deepcopy(r), a) for r, a in pl.load_seeds(root / "docs/planted")][:3]
    assert len(seeds) == 3
    arm, merge = "conflict_g1", "signed/R16"
    want = [s[0]["readout_a"][arm][merge]["pairs"] for s in seeds]
    for r, _ in seeds[1:]:  # only the first seed has it
        for a in r["readout_a"].values():
            a.pop(merge, None)
    res, md = pl.render(seeds, command="test", n_boot=50)
    got = res["readout_a"][arm][merge]
    assert got["seeds"] == [seeds[0][0]["seed"]]
    pair = next(iter(want[0]))
    assert got["per_pair"][pair]["plant_kept"] == [want[0][pair]["plant_kept"]]
    assert f"| {merge} (seed {seeds[0][0]['seed']} only) |" in md
    other = res["readout_a"][arm]["energy/R16"]
    assert other["seeds"] == [r["seed"] for r, _ in seeds] and "| energy/R16 |" in md


def test_merge_labels_name_every_merge_of_the_study_and_refuse_others(capsys):
    """Every merge of the study has a label that parses back to it; names parse as names; a
    label that is not a merge is refused naming it, and the command's flag says so."""
    from netutility_jax.experiments import planted

    merges = pl.all_merges()
    assert len({pl.merge_label(m) for m in merges}) == len(merges)
    for m in merges:
        assert pl.parse_merges(pl.merge_label(m)) == (m,)
    two = "conflict_g1/signed_weaker/R16, agreement_g1/all/full,conflict_g1/signed_weaker/R16"
    assert pl.parse_merges(two) == (
        ("conflict_g1", "signed_weaker", 16),
        ("agreement_g1", "all", None),
    )
    names = ("none", "primary", "all", "data_weaker")
    assert [pl.parse_merges(n) for n in names] == list(names)
    for bad in ("conflict_g1/signed/full", "conflict_g1/all/R16", "conflict/energy/R16", ","):
        with pytest.raises(InputError, match="expected none, primary, all, data_weaker or labels"):
            pl.parse_merges(bad)
    with pytest.raises(SystemExit):
        planted.main(["--out", "o", "--merges", "conflict_g1/signed/R64"])
    err = capsys.readouterr().err
    assert "argument --merges: merges ['conflict_g1/signed/R64']" in err


def test_the_data_weaker_follow_up_is_its_registered_merges_and_comparisons():
    """The follow-up registered in docs/experiments.md: 12 merges a seed, each a merge of the
    study, holding both sides of its two primary comparisons (and of its secondary ones); the
    Bonferroni level over the two; the data-aware asymmetric allocations score with the input
    moments and the asymmetric term."""
    todo = pl._todo("data_weaker")
    assert len(todo) == 12 == len(set(todo)) and set(todo) <= set(pl.all_merges())
    labels = {pl.merge_label(m) for m in todo}
    for _, arm, a, b in plants.DATA_WEAKER_DELTAS:
        assert {f"{arm}/{a}", f"{arm}/{b}"} <= labels
    for arm in ("conflict_g1", "agreement_g1"):
        assert {f"{arm}/signed_weaker/R16", f"{arm}/all/full"} <= labels
        assert f"{arm}/signed_weaker_data_pos/full" in labels
    assert {"null/energy/R16", "null/signed_weaker_data/R16"} <= labels
    assert plants.DATA_WEAKER_LEVEL == pytest.approx(0.975)
    for name in ("signed_weaker_data", "signed_weaker_data_pos"):
        spec = pl.ALLOCATIONS[name]
        assert spec["interference"] == "signed_weaker" and spec["data"] is True


def test_a_seed_asked_for_merges_it_lacks_is_run_for_what_it_had_and_what_is_asked():
    """merges_to_run: None when the saved seed has every merge asked; else the union, a name
    when the union is one, the triples in the study's order otherwise (JSON lists accepted)."""
    a = ("conflict_g1", "signed_weaker", 16)
    b = ("agreement_g1", "signed_weaker_pos", None)
    assert pl.merges_to_run("primary", "none") is None
    assert pl.merges_to_run("all", (a, b)) is None
    assert pl.merges_to_run([list(a), list(b)], (b,)) is None
    assert pl.merges_to_run("none", (b, a)) == tuple(m for m in pl.all_merges() if m in (a, b))
    assert pl.merges_to_run([list(a)], "primary") == (*pl.PRIMARY, a)
    assert pl.merges_to_run("primary", "all") == "all"
    assert pl.merges_to_run(list(map(list, pl.PRIMARY[:3])), "primary") == "primary"
    got = pl.merges_to_run("primary", (a,))
    assert set(got) == {*pl.PRIMARY, a} and len(got) == len(pl.PRIMARY) + 1


def test_the_asymmetric_terms_comparisons_are_reported_where_both_merges_were_evaluated():
    """The committed seeds with the symmetric sign-aware merges copied under the asymmetric
    term's labels: each signed_weaker comparison then equals the signed one's (to the bit), its
    delta against signed is zero, and the registered comparisons and their family are as
    before (an exploratory comparison joins the secondary family only)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    seeds = pl.load_seeds(root / "docs/planted")[:3]
    base, _ = pl.render(seeds, command="test", n_boot=100)
    copied = []
    for r, a in seeds:
        recs, arrays = dict(r["records"]), dict(a)
        for arm in ("conflict_g1", "agreement_g1"):
            for src, dst in (("signed/R16", "signed_weaker/R16"),
                             ("signed_pos/full", "signed_weaker_pos/full")):  # fmt: skip
                recs[f"{arm}/{dst}"] = recs[f"{arm}/{src}"]
                arrays[f"c:{arm}/{dst}"] = arrays[f"c:{arm}/{src}"]
        copied.append(({**r, "records": recs}, arrays))
    res, md = pl.render(copied, command="test", n_boot=100)
    d = res["deltas"]

    def by_pair(deltas, a, b):  # (a primary pairing is shown once, under its registered label)
        return next(v for v in deltas.values() if (v["a"], v["b"]) == (a, b))

    for arm in ("conflict_g1", "agreement_g1"):
        for new, old, b in (
            ("signed_weaker/R16", "signed/R16", f"{arm}/energy/R16"),
            ("signed_weaker_pos/full", "signed_pos/full", f"{arm}/all/full"),
            ("signed_weaker/R16", "signed/R16", "null/net_utility/R16"),
        ):
            got = by_pair(d, f"{arm}/{new}", b)
            want = by_pair(base["deltas"], f"{arm}/{old}", b)
            assert got["victims"]["per_seed"] == want["victims"]["per_seed"], (new, b)
            assert got["mean"]["per_seed"] == want["mean"]["per_seed"] and not got["primary"]
        for same in (
            f"signed_weaker - signed, {arm}, R16",
            f"signed_weaker_pos - signed_pos, {arm}",
        ):
            assert d[same]["victims"]["per_seed"] == [0.0] * len(seeds)
    assert res["multiplicity"]["primary_family"] == base["multiplicity"]["primary_family"] == 8
    assert res["multiplicity"]["secondary_family"] > base["multiplicity"]["secondary_family"]
    assert "signed_weaker - signed, conflict_g1, R16" in md


def test_the_data_weaker_follow_up_is_reported_as_its_own_registered_family():
    """The committed asymmetric-term seeds (docs/planted/weaker, the five registered seeds) with
    its merges copied under the follow-up's labels: the two registered comparisons equal the
    copied ones (to the bit), are decided by their own 97.5% t interval (written out here from
    the per-seed deltas), and each family holds what the registration names (2 primary; 5
    secondary comparisons' two outcomes and the primary ones' all-tasks outcome: 12)."""
    import math
    import pathlib

    from scipy import stats as sps

    root = pathlib.Path(__file__).resolve().parents[2]
    seeds = pl.load_seeds(root / "docs/planted/weaker")
    assert sorted(r["seed"] for r, _ in seeds) == [0, 1, 2, 3, 4]
    copied = []
    for r, a in seeds:
        recs, arrays = dict(r["records"]), dict(a)
        for src, dst in (
            *((f"{arm}/signed_weaker/R16", f"{arm}/signed_weaker_data/R16") for arm in
              ("conflict_g1", "agreement_g1", "null")),
            *((f"{arm}/signed_weaker_pos/full", f"{arm}/signed_weaker_data_pos/full") for arm in
              ("conflict_g1", "agreement_g1")),
        ):  # fmt: skip
            recs[dst] = recs[src]
            arrays[f"c:{dst}"] = arrays[f"c:{src}"]
        copied.append(({**r, "records": recs}, arrays))
    res, md = pl.render(copied, command="test", n_boot=100)
    d, mult = res["deltas"], res["multiplicity"]
    # (the study's sign-aware rows are there too: those seeds evaluated their merges)
    assert mult["primary_family"] == sum(v["primary"] for v in d.values()) == 4
    assert mult["data_weaker_family"] == 2
    assert mult["data_weaker_secondary_family"] == 12
    for lab, arm, *_ in plants.DATA_WEAKER_DELTAS:
        got, want = d[lab], d[f"signed_weaker - energy, {arm}, R16"]
        assert got["family"] == "data_weaker" and not got["primary"]
        assert got["victims"]["per_seed"] == want["victims"]["per_seed"]
        per = np.asarray(got["victims"]["per_seed"])
        half = sps.t.ppf(1 - 0.025 / 2, 4) * per.std(ddof=1) / math.sqrt(5)
        np.testing.assert_allclose(
            got["victims"]["seed_ci_bonferroni"], [per.mean() - half, per.mean() + half]
        )
        lo, hi = got["victims"]["seed_ci_bonferroni"]
        assert got["decision"] == ("gain" if lo > 0 else "loss" if hi < 0 else
                                   "no difference declared")  # fmt: skip
    for arm in ("conflict", "agreement"):
        same = d[f"signed_weaker_data - signed_weaker, {arm}, R16"]
        assert same["family"] == "data_weaker_secondary"
        assert same["victims"]["per_seed"] == [0.0] * 5
    assert "97.5%" in md
    assert md.index("signed_weaker_data - energy, conflict, R16") < md.index(
        "signed_weaker - energy, conflict_g1, R16"
    )
