"""The grid's allocation variants (``grid.VARIANTS``): the controls that isolate Net Utility's
mechanism, their jobs, their masks and their merges, checked against the library computed
independently."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax.errors import InputError
from netutility_jax.experiments.harness import evaluate as ev
from netutility_jax.experiments.harness import grid as gr
from netutility_jax.experiments.harness import jobs, runner
from netutility_jax.experiments.harness import report_tables as rt
from netutility_jax.experiments.suites import encoder as enc


def _adapters(m=3, seed=0, ranks=(4, 4, 4)):
    rng = np.random.default_rng(seed)
    return [
        {
            f"layers/{i}/q": {
                "lora_a": rng.normal(size=(24, ranks[t])) / 5,
                "lora_b": rng.normal(size=(ranks[t], 16)) / 5,
            }
            for i in range(3)
        }
        for t in range(m)
    ]


def test_every_variant_is_well_formed():
    for name, var in gr.VARIANTS.items():
        assert var.name == name and var.label and var.what
        kinds = (var.library is not None) + (var.masks is not None) + bool(var.choose_from)
        # a merge, a mask control, a choice among other variants' jobs, or the average
        assert kinds == 1 or name == "average", name
        assert var.library in (None, *nu.registry.ALLOCATIONS), name
        assert var.lam_scale is None or var.library == "net_utility"
        assert var.alpha is None or var.library == "net_utility"
        assert all(gr.VARIANTS[c].library for c in var.choose_from), name
    assert gr.VARIANTS["energy"].lam_scale == 0.0
    assert {gr.VARIANTS[f"lam_x{k}"].lam_scale for k in ("0.25", "0.5", "2")} == {0.25, 0.5, 2.0}


def test_grid_jobs_of_controls():
    g = gr.GridConfig(
        rows=(gr.Row("ta", "full"), gr.Row("ties", "core")),
        budgets=(8, 4),
        random_draws=2,
        controls=(("ta", "full", "energy"), ("ties", "core", "random_split")),
        full_capacity=False,
        weight_average=False,
    )
    jobs = {j.key: j for j in gr.grid_jobs(g, full_capacity=12)}
    main = [
        f"{m}/R{r}/{a}" for m in ("ta/full", "ties/core") for r in (8, 4) for a in gr.ALLOCATIONS
    ]
    splits = [f"ties/core/R{r}/random_split{d}" for r in (8, 4) for d in (1, 2)]
    assert set(jobs) == {*main, "ta/full/R8/energy", "ta/full/R4/energy", *splits}
    e = jobs["ta/full/R4/energy"]
    assert (e.allocation, e.budget, e.draw, e.ref) == ("energy", 4, 0, "ta/full/R4/net_utility")
    s = jobs["ties/core/R8/random_split2"]
    assert (s.allocation, s.draw, s.ref) == ("random_split", 2, "ties/core/R8/net_utility")
    order = list(jobs)  # a control runs after the Net Utility job it copies
    assert order.index("ta/full/R4/net_utility") < order.index("ta/full/R4/energy")


@pytest.mark.parametrize("ranks", [(4, 4, 4), (4, 2, 3)])
def test_random_split_keeps_the_count_and_each_tasks_top_directions(ranks):
    ads = _adapters(ranks=ranks)
    sc = nu.score(ads, alpha=1.0)
    ref = nu.allocate(sc, 5)
    seen = set()
    for d in range(40):
        masks = runner.random_split_allocation(ref, sc, seed=(0, d))
        again = runner.random_split_allocation(ref, sc, seed=(0, d))
        for name, m in masks.items():
            m = np.asarray(m)
            np.testing.assert_array_equal(m, np.asarray(again[name]))  # a seed fixes the draw
            assert m.sum() == np.asarray(ref[name]).sum()
            for t, r in enumerate(ranks):
                k = int(m[t].sum())
                assert k <= r and m[t, :k].all() and not m[t, k:].any()  # a prefix
            seen.add(tuple(m.sum(1)))
    assert len(seen) > 3  # the split among tasks varies between draws


def test_random_mean_of_random_does_not_take_random_split():
    seed = type("Seed", (), {})()
    seed.correct = {"a/R4/random1": 1, "a/R4/random2": 2, "a/R4/random_split1": 3}
    sx = rt.Stats.__new__(rt.Stats)  # (the bootstrap is not needed to pick the draws)
    sx.run = type("Run", (), {})()
    sx.run.seeds = [seed]
    got = []
    sx.draws = lambda k: got.append(k)
    sx.random_mean("a/R4/random")
    assert got == ["a/R4/random1", "a/R4/random2"]


@pytest.mark.parametrize("name", ["energy", "lam_x0.25", "lam_x2"])
def test_lambda_controls_merge_with_a_scaled_median_lambda(name):
    ads = _adapters()
    sc = nu.score(ads, alpha=1.0, lam="auto")
    scale = gr.VARIANTS[name].lam_scale
    job = gr.Job(f"ta/full/R5/{name}", "ta", "full", ("full",), 5, name)
    merged, fields = jobs.merge_job(ads, job, seed=0, alpha=1.0, scores=sc)
    assert fields["lam"] == pytest.approx(scale * float(sc.lam), rel=1e-6)
    want, rep = nu.merge_adapters(
        ads, budget=5, method="ta", allocation="net_utility", alpha=1.0, lam=scale * float(sc.lam)
    )
    assert fields["kept_per_task"] == [int(x) for x in np.asarray(rep.kept_per_task)]
    for mod in want:
        for k in want[mod]:
            np.testing.assert_array_equal(np.asarray(merged[mod][k]), np.asarray(want[mod][k]))
    if name == "energy":  # lambda 0: the global top shares of each task's energy, in float64
        share = {}
        for mod in ads[0]:
            for t, ad in enumerate(ads):
                sv = np.linalg.svd(ad[mod]["lora_a"] @ ad[mod]["lora_b"], compute_uv=False)[:4]
                for k, x in enumerate(sv**4 / np.sum(sv**4)):
                    share[(mod, t, k)] = x
        top = set(sorted(share, key=share.get)[-5 * len(ads[0]) :])
        kept = {
            (mod, int(t), int(k))
            for mod, m in rep.masks.items()
            for t, k in zip(*np.nonzero(np.asarray(m)), strict=True)
        }
        assert kept == top


def test_a_mask_control_merges_its_masks():
    """A control job's merge goes through its spec: random_split builds masks from Net
    Utility's own at the same budget and merges them with ``nu.merge``."""
    ads = _adapters()
    sc = nu.score(ads, alpha=1.0)
    job = gr.Job("ta/full/R5/random_split1", "ta", "full", ("full",), 5, "random_split", 1)
    merged, fields = jobs.merge_job(ads, job, seed=3, alpha=1.0, scores=sc)
    masks = runner.random_split_allocation(nu.allocate(sc, 5), sc, seed=(3, 1, 5))
    want = nu.merge(ads, masks, method="ta", space="full")
    for mod in want:
        for k in want[mod]:
            np.testing.assert_array_equal(np.asarray(merged[mod][k]), np.asarray(want[mod][k]))
    assert fields["kept_per_task"] == [int(x) for x in np.asarray(nu.kept_per_task(masks))]
    bad = gr.Job("k", "ta", "full", ("full",), 5, "nope")
    with pytest.raises(ValueError, match="unknown allocation 'nope' in job 'k'"):
        jobs.merge_job(ads, bad, seed=0, alpha=1.0, scores=sc)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_alpha_controls_score_with_their_own_alpha(alpha):
    ads = _adapters()
    sc = nu.score(ads, alpha=0.5, lam="auto")  # the run's own alpha differs from the control's
    name = f"alpha_{int(alpha)}"
    job = gr.Job(f"ta/full/R5/{name}", "ta", "full", ("full",), 5, name)
    merged, fields = jobs.merge_job(ads, job, seed=0, alpha=0.5, scores=sc)
    assert fields["alpha"] == alpha
    want, rep = nu.merge_adapters(ads, budget=5, method="ta", allocation="net_utility", alpha=alpha)
    assert fields["lam"] == pytest.approx(float(rep.lam), rel=1e-6)
    for mod in want:
        for k in want[mod]:
            np.testing.assert_array_equal(np.asarray(merged[mod][k]), np.asarray(want[mod][k]))


def _val_records(vals):
    names = ("energy", "lam_x0.25", "lam_x0.5", "net_utility", "lam_x2")
    recs = {f"ta/full/R8/{n}": {"key": f"ta/full/R8/{n}", "val_normalized": v, "normalized": i}
            for i, (n, v) in enumerate(zip(names, vals, strict=True))}  # fmt: skip
    ok = {k: np.full(3, i, bool) for i, k in enumerate(recs)}
    return recs, ok


def test_lambda_on_validation_takes_the_best_validation_job_and_makes_no_merge():
    grid = gr.GridConfig(
        rows=(gr.Row("ta", "full"),),
        budgets=(8,),
        controls=tuple(
            ("ta", "full", v) for v in ("energy", "lam_x0.25", "lam_x0.5", "lam_x2", "lam_val")
        ),
    )
    keys = [j.key for j in gr.grid_jobs(grid, full_capacity=32)]
    assert "ta/full/R8/lam_val" not in keys and "ta/full/R8/lam_x2" in keys
    recs, ok = _val_records([80.0, 91.0, 95.5, 95.5, 90.0])  # a tie: the first in order wins
    runner._choose_on_validation(grid, recs, ok)
    got = recs["ta/full/R8/lam_val"]
    assert got["chosen"] == "lam_x0.5" and got["normalized"] == 2 and got["derived"]
    assert ok["ta/full/R8/lam_val"] is ok["ta/full/R8/lam_x0.5"]
    # its sources must be in the grid beside it
    bad = dataclasses.replace(grid, controls=(("ta", "full", "energy"), ("ta", "full", "lam_val")))
    with pytest.raises(InputError, match=r"add the controls \['lam_x0.25', 'lam_x0.5', 'lam_x2'\]"):
        gr.grid_jobs(bad, full_capacity=32)


# ------------------------------------------------- options searched on validation (TIES, DARE)


@pytest.mark.parametrize(
    "search, match",
    [
        ((("nope", "density", (0.1,)),), "unknown method 'nope'"),
        ((("ties", "p", (0.1,)),), "'p' is not an option of 'ties'"),
        ((("ties", "density", ()),), "non-empty tuple of distinct values"),
        ((("ties", "density", (0.2, 0.2)),), "non-empty tuple of distinct values"),
        ((("ties", "density", (0.2, 1.5)),), "density"),
        ((("ties", "density", (0.2,)), ("ties", "density", (0.3,))), "searched twice"),
        ((("ties", "density"),), r"expected \(method, option, candidates\)"),
    ],
)
def test_a_bad_search_is_refused_when_the_grid_is_declared(search, match):
    with pytest.raises(InputError, match=match):
        gr.GridConfig(rows=(gr.Row("ties", "full"),), budgets=(8,), search=search)


def _dense(merged):
    def one(m):  # TIES in full space gives dense updates, the others factors
        return m["delta"] if "delta" in m else np.asarray(m["lora_a"]) @ np.asarray(m["lora_b"])

    return np.concatenate([np.ravel(np.asarray(one(m))) for m in merged.values()])


class _FakeEvaluator(ev.MergeSearch):
    """A validation score that depends on the merge (through its dense updates) and on the
    coefficient, unimodal in the coefficient; test 'correctness' = the signs of the scaled
    updates against a fixed threshold. Enough to check what the runner chooses and evaluates."""

    def deltas(self, adapter):
        return _dense(adapter)

    def val_score(self, deltas, coef):
        return float(-((coef * np.linalg.norm(deltas) - 3.0) ** 2) - np.abs(deltas).max())

    def test_of(self, deltas, search):
        ok = deltas * search.coef > 0.01
        acc = {"t": float(ok.mean())}
        norm = ev.Normalized({"t": 100 * acc["t"]}, 100 * acc["t"])
        s = search.scores[search.coef]
        return ev.MergeEval(search.coef, search.scores, s, ok, acc, norm)


class _Suite:
    def timing(self):
        return {"passes": 0}


def _seed_jobs(ads, grid, tmp_path):
    sc = nu.score(ads, alpha=1.0)
    return jobs.SeedJobs(
        0, ads, sc, _FakeEvaluator(), _Suite(), 1.0, jobs.JobCache(tmp_path), {"k": 1},
        grid=grid,
    )  # fmt: skip


def test_a_searched_option_is_chosen_on_validation_and_tested_once(tmp_path):
    """Each candidate's best validation score over the coefficient grid (brute force, on merges
    made directly with the library) decides; the record's test result is that merge's, and a
    grid without the search (density fixed at the chosen value) gives the same test result."""
    ads = _adapters()
    cands = (0.7, 0.1, 0.3)
    grid = gr.GridConfig(
        rows=(gr.Row("ties", "full"),), budgets=(5,), search=(("ties", "density", cands),)
    )
    job = gr.Job("ties/full/R5/uniform", "ties", "full", ("full",), 5, "uniform")
    rec, ok = _seed_jobs(ads, grid, tmp_path / "a").run(job)
    ev = _FakeEvaluator()
    coefs = np.round(np.arange(1, 100) / 10, 1)
    best = {}
    for d in cands:
        merged, _ = nu.merge_adapters(
            ads, budget=5, method="ties", allocation="uniform", density=d, alpha=1.0
        )
        best[d] = max(ev.val_score(_dense(merged), c) for c in coefs)
    chosen = max(cands, key=lambda d: best[d])
    assert chosen != cands[0] and len(set(best.values())) == len(cands)  # not a default win
    assert rec["options"]["density"] == chosen
    assert rec["option_search"]["option"] == "density"
    for d in cands:
        assert rec["option_search"]["validation"][f"{d:g}"] == pytest.approx(best[d], rel=1e-6)
    # the same merge with the option fixed: the same coefficient and test result
    fixed = dataclasses.replace(gr.METHODS["ties"], options=(("density", chosen),))
    saved = gr.METHODS["ties"]
    gr.METHODS["ties"] = fixed
    try:
        plain = gr.GridConfig(rows=(gr.Row("ties", "full"),), budgets=(5,))
        rec2, ok2 = _seed_jobs(ads, plain, tmp_path / "b").run(job)
    finally:
        gr.METHODS["ties"] = saved
    assert rec2["coef"] == rec["coef"] and "option_search" not in rec2
    np.testing.assert_array_equal(ok, ok2)
    # the search is in the job's cache key (a cached fixed-option result is not reused) and a
    # second run is served from the cache
    s = _seed_jobs(ads, grid, tmp_path / "a")
    assert s.job_key(job, 1.0) != _seed_jobs(ads, plain, tmp_path / "a").job_key(job, 1.0)
    again, ok3 = s.run(job)
    assert again["cache_hit"] and again["options"]["density"] == chosen
    np.testing.assert_array_equal(ok, ok3)


def test_only_searched_methods_change_their_cache_keys(tmp_path):
    ads = _adapters()
    searched = gr.GridConfig(
        rows=(gr.Row("ta", "full"),), budgets=(5,), search=(("ties", "density", (0.1, 0.2)),)
    )
    plain = gr.GridConfig(rows=(gr.Row("ta", "full"),), budgets=(5,))
    job = gr.Job("ta/full/R5/uniform", "ta", "full", ("full",), 5, "uniform")
    a = _seed_jobs(ads, searched, tmp_path).job_key(job, 0.3)
    assert a == _seed_jobs(ads, plain, tmp_path).job_key(job, 0.3)
    assert enc.PAPER.grid.searched("ties")[0] == "density"
    assert enc.PAPER.grid.searched("dare")[0] == "p" and enc.FULL.grid.searched("ties") is None


def test_the_report_lists_the_options_chosen_per_seed():
    from netutility_jax.experiments.harness import report_sections as rs

    rec = {"options": {"density": 0.3}, "coef": 1.0, "val_scores": {"1": 2.0},
           "option_search": {"option": "density", "validation": {"0.1": 80.0, "0.3": 81.5}}}  # fmt: skip
    results = {"merges": {"0": {"ties/full/R8/uniform": rec, "ta/full/all": {"coef": 0.3,
               "val_scores": {}}}, "1": {"ties/full/R8/uniform": {**rec, "options": {"density": 0.1}}}}}  # fmt: skip
    lines = rs.options_md(results)
    assert "| ties/full/R8/uniform | density | 0.3 | 0.1 | 0.1: 80.0, 0.3: 81.5 |" in lines
    assert not any("ta/full/all" in x for x in lines)
    assert rs.options_md({"merges": {"0": {"ta/full/all": {"coef": 1.0}}}}) == []
