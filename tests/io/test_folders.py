"""``nu.merge_folders`` and ``nu.MergeConfig``: the one library call behind ``netutility
merge``. From Python it writes what the command writes for the same settings (adapter bytes,
report, model card); the configuration's plain-data form is what a report records and what
``--config`` reads, and it round-trips; bad settings are refused naming the field."""

from __future__ import annotations

import dataclasses
import datetime
import json
import warnings

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import cli
from netutility_jax.errors import InputError, InputTypeError, PathExistsError

pytest.importorskip("safetensors")

NAMES = [f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")]
BASE = {"base_model_name_or_path": "tiny-test-model", "task_type": "CAUSAL_LM"}
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
DEADLINE = datetime.timedelta(seconds=30)


def _adapter(seed: int, r: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        n: {
            "lora_a": rng.normal(size=(24, r)).astype(np.float32),
            "lora_b": (rng.normal(size=(r, 16)) / 4).astype(np.float32),
            "scale": 2.0,
        }
        for n in NAMES
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("folders")
    out = []
    for i, r in enumerate((4, 3, 4)):
        p = root / f"task{i}"
        nu.peft.save_adapter(_adapter(i, r), p, base_config=BASE)
        out.append(str(p))
    return out


def _report(folder) -> dict:
    rep = json.loads((folder / cli.REPORT_NAME).read_text())
    rep.pop("created_utc")
    return rep


def _same_output(a, b, *, defaults=()) -> None:
    """The same adapter files, report (but its time; ``defaults``: method options that one
    report's ``options`` states at their defaults and the other leaves out) and model card."""
    for f in ADAPTER_FILES:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    ra, rb = _report(a), _report(b)
    for k in defaults:
        ra["options"].pop(k, None)
        rb["options"].pop(k, None)
    assert ra == rb
    card = (a / "README.md").read_text()
    assert card == (b / "README.md").read_text().replace(str(b), str(a))


@pytest.mark.parametrize(
    ("flags", "config"),
    [
        (["--budget", "3", "--alpha", "1", "--coef", "0.5", "--weights", "1,0.5,1"],
         nu.MergeConfig(budget=3, alpha=1.0, coef=0.5, weights=(1.0, 0.5, 1.0))),
        pytest.param(["--budget", "2", "--method", "ties", "--space", "core", "--density", "0.5",
          "--in-memory"],
         nu.MergeConfig(budget=2, method="ties", space="core", in_memory=True,
                        method_options={"density": 0.5}),
         marks=pytest.mark.slow),
    ],
    ids=["streamed-weighted", "ties-in-memory"],
)  # fmt: skip
def test_merge_folders_writes_what_the_command_writes(folders, tmp_path, flags, config):
    """The same settings from Python and from the command: the same adapter bytes, the same
    report (but its time) and model card."""
    by_cli = tmp_path / "cli"
    rc = cli.main(["merge", *folders, *flags, "--no-plots", "--quiet", "--out", str(by_cli),
                   "--no-compile-cache"])  # fmt: skip
    assert rc == 0
    by_py = tmp_path / "py"
    cfg = dataclasses.replace(config, no_plots=True)
    report = nu.merge_folders(folders, by_py, cfg)
    assert isinstance(report, nu.Report)
    _same_output(by_cli, by_py)
    # the report's recorded configuration reads back as the configuration that ran
    rep = _report(by_py)
    back = nu.MergeConfig.from_dict(rep["config"])
    assert back == dataclasses.replace(
        cfg, weights=cfg.weights or (1.0,) * 3, names=("task0", "task1", "task2"),
        method_options=cfg.resolved_options(),
    )  # fmt: skip
    assert nu.MergeConfig.from_dict(rep) == back  # (the report itself reads as its config)
    settings = {k: v for k, v in rep["config"].items() if k != "adapters"}
    assert settings == dataclasses.replace(back, weights=None, names=None).to_dict()


@pytest.mark.slow
def test_a_report_replays_through_the_config(folders, tmp_path):
    """``MergeConfig.from_dict`` of a command's report, given to ``merge_folders`` with the
    same folders, writes the same adapter as the command's replay of that report."""
    first = tmp_path / "first"
    assert cli.main(["merge", *folders, "--budget", "3", "--no-plots", "--quiet", "--out",
                     str(first), "--no-compile-cache"]) == 0  # fmt: skip
    rep = json.loads((first / cli.REPORT_NAME).read_text())
    replayed = tmp_path / "replayed"
    assert cli.main(["merge", "--config", str(first / cli.REPORT_NAME), "--quiet", "--out",
                     str(replayed), "--no-compile-cache"]) == 0  # fmt: skip
    by_py = tmp_path / "py"
    paths = [a["path"] for a in rep["config"]["adapters"]]
    cfg = nu.MergeConfig.from_dict(rep["config"])
    nu.merge_folders(paths, by_py, cfg)
    # (the command's replay gives a bool option at its default, False, as not given)
    _same_output(replayed, by_py, defaults=[k for k, v in cfg.method_options.items() if v is False])


def test_a_yaml_config_is_the_merge_config(folders, tmp_path):
    """``netutility merge --config FILE``'s settings are ``MergeConfig.from_dict`` of the
    file's mapping (its adapters and ``out`` apart)."""
    yaml = pytest.importorskip("yaml")
    from netutility_jax.cli import config
    from netutility_jax.cli.job import MergeJob

    data = {
        "adapters": [folders[0], {"path": folders[1], "weight": 0.5, "name": "second"},
                     folders[2]],
        "method": "ties", "space": "knots", "budget": 2, "density": 0.3,
        "knots-variant": "original", "chunk_mb": 1, "no-plots": True, "serving-ranks": "8,16",
    }  # fmt: skip
    path = tmp_path / "merge.yaml"
    path.write_text(yaml.safe_dump(data))
    argv = ["merge", "--config", str(path), "--dry-run"]
    args = cli.build_parser(demo_options=False).parse_args(argv)
    args.argv = argv
    config.resolve(args)
    job = MergeJob.of(args)
    want = nu.MergeConfig.from_dict(data)
    assert job.settings == dataclasses.replace(want, names=("task0", "second", "task2"))
    assert want.weights == (1.0, 0.5, 1.0) and want.names == (None, "second", None)
    assert want.serving_ranks == (8, 16)
    # a null is the field's default; 'none' a task without moments data, as in a --config file
    assert nu.MergeConfig.from_dict({"budget": 2, "dtype": None}).dtype == "float32"
    assert nu.MergeConfig.from_dict(
        {"budget": 2, "input-moments": ["m.npz", "none"]}
    ).input_moments == ("m.npz", None)
    assert want.method_options == {"density": 0.3, "variant": "original"}


# ------------------------------------------------------------------------ bad configurations


@pytest.mark.parametrize(
    ("data", "error", "names"),
    [
        ({"budget": 2, "bugdet": 3}, InputError, "'bugdet'"),
        ({"budget": 2, "out": "x"}, InputError, "'out'"),
        ({"budget": "2"}, InputTypeError, "budget="),
        ({"budget": 2, "chunk-mb": "big"}, InputTypeError, "chunk_mb="),
        ({"budget": 2, "in_memory": 1}, InputTypeError, "in_memory="),
        ({"budget": 2, "weights": "1,x"}, InputError, "weights="),
        ({"budget": 2, "weights": {"a": 1}}, InputTypeError, "weights="),
        ({"budget": 2, "density": 0.5}, InputError, "method_options['density']"),
        ({"budget": 2, "method": "ties", "density": 2.0}, InputError, "density"),
        ({"budget": 2, "method": "ties", "method_options": {"p": 0.5}}, InputError, "'p'"),
        ({"budget": 2, "method": "dare"}, InputError, "p"),
        ({"budget": 2, "method": "nope"}, InputError, "method="),
        ({"budget": 2, "budget_": 2}, InputError, "'budget_'"),
        ({"budget": 2, "chunk-mb": 1, "chunk_mb": 2}, InputError, "twice"),
        ({"method": "ta"}, InputError, "budget=None"),
        ({"budget": 0}, InputError, "budget=0"),
        ({"budget": 2, "adapters": [{"path": "a", "wieght": 2}]}, InputError, "'wieght'"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(data, error, names):
    with pytest.raises(error) as info:
        nu.MergeConfig.from_dict(data)
    assert names in str(info.value) and "\n" not in str(info.value)


def test_the_config_is_frozen_and_takes_no_unknown_field():
    cfg = nu.MergeConfig(budget=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.budget = 5  # type: ignore[misc]
    with pytest.raises(TypeError, match="bugdet"):
        nu.MergeConfig(bugdet=4)  # type: ignore[call-arg]
    with pytest.raises(InputTypeError, match="method_options"):
        nu.MergeConfig(budget=4, method_options=[("density", 0.2)])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cfg.method_options["density"] = 0.2  # type: ignore[index]  # (read-only)
    assert nu.MergeConfig(allocation="all", budget=4).budget is None  # (no budget to keep)


def test_merge_folders_refuses_bad_calls(folders, tmp_path):
    cfg = nu.MergeConfig(budget=2, no_plots=True)
    with pytest.raises(InputTypeError, match="MergeConfig"):
        nu.merge_folders(folders, tmp_path / "a", {"budget": 2})  # type: ignore[arg-type]
    with pytest.raises(InputTypeError, match="paths"):
        nu.merge_folders(folders[0], tmp_path / "b", cfg)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="weights has 2 entries for 3 adapters"):
        nu.merge_folders(folders, tmp_path / "c", dataclasses.replace(cfg, weights=(1.0, 2.0)))
    with pytest.raises(InputError, match="rank K"):
        nu.merge_folders(folders, tmp_path / "d", nu.MergeConfig(budget=2, method="ties"))
    (tmp_path / "there").mkdir()
    with pytest.raises(PathExistsError, match="out"):
        nu.merge_folders(folders, tmp_path / "there", cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"]  # nothing else written


def test_refusals_and_notes_name_the_settings_in_python_terms(folders, tmp_path):
    """A Python caller reads the config's field names where the command reads its flags; the
    notes come as UserWarnings from the caller's line, or to ``say``."""
    lacking = tmp_path / "lacking"
    nu.peft.save_adapter(
        {n: m for n, m in _adapter(7, 2).items() if "q_proj" in n}, lacking, base_config=BASE
    )
    paths = [folders[0], str(lacking)]
    with pytest.raises(InputError, match=r"^strict_targets: the adapters target different"):
        nu.merge_folders(paths, tmp_path / "s", nu.MergeConfig(budget=2, strict_targets=True))
    with pytest.raises(nu.errors.MissingFileError, match=r"^input_moments .*none.npz: no such"):
        nu.merge_folders(paths, tmp_path / "m", nu.MergeConfig(
            budget=2, no_plots=True, input_moments=(str(tmp_path / "none.npz"), None)),
            say=lambda *a: None)  # fmt: skip
    said = []
    cfg = nu.MergeConfig(budget=2, no_plots=True, allocation="uniform")
    nu.merge_folders(paths, tmp_path / "said", cfg, say=lambda *a: said.append(a))
    assert said[0][0] == "note" and "(strict_targets refuses this)" in said[0][1]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        nu.merge_folders(paths, tmp_path / "warned", cfg)
    assert [r.category for r in rec] == [UserWarning] * 2
    assert "lacking lacks 2 of 4 modules" in str(rec[1].message)
    assert {r.filename for r in rec} == {__file__}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lacking", "said", "warned"]


# ---------------------------------------------------------------- the plain form round-trips

_METHOD_OPTIONS = {
    ("ta", "full"): st.fixed_dictionaries({}, optional={"isotropize": st.booleans()}),
    ("ties", "core"): st.fixed_dictionaries(
        {},
        optional={
            "density": st.floats(0.05, 1.0),
            "trim_scope": st.sampled_from(["module", "model"]),
        },
    ),
    ("dare", "full"): st.fixed_dictionaries({"p": st.floats(0.0, 0.95)}),
    ("tsv", "knots"): st.fixed_dictionaries(
        {}, optional={"variant": st.sampled_from(["core_space", "original"])}
    ),
}


def _maybe(strategy):
    return st.none() | strategy


@st.composite
def configs(draw) -> nu.MergeConfig:
    method, space = draw(st.sampled_from(sorted(_METHOD_OPTIONS)))
    m = draw(st.integers(1, 3))
    allocation = draw(st.sampled_from(["net_utility", "uniform", "all"]))
    kwargs = dict(
        method=method, space=space, allocation=allocation,
        budget=draw(st.integers(1, 2**31 - 1)),
        scope=draw(st.sampled_from([None, "global", "local"])),
        alpha=draw(st.just("auto") | st.floats(0, 16)),
        lam=draw(st.just("auto") | st.floats(0, 1e30)),
        interference=draw(st.sampled_from(["overlap", "signed"])),
        keep_nonpositive=draw(st.booleans()),
        coef=draw(st.floats(-1e6, 1e6).filter(lambda x: x != 0)),
        seed=draw(st.integers(0, 2**32 - 1)),
        weights=draw(_maybe(st.tuples(*[st.floats(0.01, 100)] * m))),
        names=draw(_maybe(st.tuples(*[st.sampled_from([None, "a", "b", "c"])] * m).filter(
            lambda t: len([n for n in t if n]) == len({n for n in t if n})))),
        min_share=draw(_maybe(st.floats(0, 1))),
        method_options=draw(_METHOD_OPTIONS[(method, space)]),
        rank=draw(_maybe(st.integers(1, 2**31 - 1))),
        dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        serving_ranks=draw(_maybe(st.just("vllm") | st.lists(st.integers(1, 512), min_size=1,
                                                             max_size=4).map(tuple))),
        in_memory=draw(st.booleans()), chunk_mb=draw(st.floats(1e-3, 2**20)),
        devices=draw(st.just("all") | st.integers(1, 8)), no_plots=draw(st.booleans()),
        strict_targets=draw(st.booleans()), allow_different_base=draw(st.booleans()),
        skip_non_lora=draw(st.booleans()),
    )  # fmt: skip
    if allocation == "net_utility" and draw(st.booleans()):
        pinned = nu.folders.MomentsFile("f.npz", "0" * 64)
        entry = st.sampled_from(["s.safetensors", None, pinned])
        kwargs["input_moments"] = (*(draw(entry) for _ in range(m - 1)), "last.npz")
    return nu.MergeConfig(**kwargs)


def _round_trip(cfg: nu.MergeConfig, form: str) -> None:
    plain = cfg.to_dict()
    if form == "json":
        plain = json.loads(json.dumps(plain))
    elif form == "yaml":
        yaml = pytest.importorskip("yaml")
        plain = yaml.safe_load(yaml.safe_dump(plain))
    back = nu.MergeConfig.from_dict(plain)
    assert back == cfg and hash(back) == hash(cfg)
    assert back.to_dict() == cfg.to_dict()


@hypothesis.settings(max_examples=40, deadline=DEADLINE)
@hypothesis.given(cfg=configs(), form=st.sampled_from(["dict", "json", "yaml"]))
def test_the_config_round_trips_through_its_plain_form(cfg, form):
    """``from_dict(to_dict(c)) == c`` for any valid config, also through JSON and YAML text
    (as a report records it and as ``--config`` reads it)."""
    _round_trip(cfg, form)


@pytest.mark.slow
@hypothesis.settings(max_examples=400, deadline=DEADLINE)
@hypothesis.given(cfg=configs(), form=st.sampled_from(["dict", "json", "yaml"]))
def test_the_config_round_trips_through_its_plain_form_slow(cfg, form):
    _round_trip(cfg, form)


@pytest.mark.parametrize("module", ["_config", "_load", "_run"])
def test_docstring_examples(module):
    import doctest
    import importlib

    mod = importlib.import_module(f"netutility_jax.folders.{module}")
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0
