"""``netutility merge --config``, the replay of a merge from its report, ``--weights``, a merge
without ``--budget``, DARE's default ``--p``, the model card and the report's provenance."""

from __future__ import annotations

import datetime
import json

import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import cli

pytest.importorskip("safetensors")

NAMES = [f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")]
D_IN, D_OUT = 24, 16
RANKS = (4, 3, 4)
BASE = {"base_model_name_or_path": "tiny-test-model", "task_type": "CAUSAL_LM"}
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def _adapter(seed: int, r: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        n: {
            "lora_a": rng.normal(size=(D_IN, r)).astype(np.float32),
            "lora_b": (rng.normal(size=(r, D_OUT)) / 4).astype(np.float32),
            "scale": 2.0,
        }
        for n in NAMES
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("config")
    out = []
    for i, r in enumerate(RANKS):
        p = root / "adapters" / f"task{i}"
        nu.peft.save_adapter(_adapter(i, r), p, base_config=BASE)
        out.append(str(p))
    return out


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _same_adapter(a, b) -> None:
    for f in ADAPTER_FILES:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


FLAGS = ["--budget", "3", "--alpha", "1", "--coef", "0.5"]


def test_config_and_flags_and_replay_give_the_same_files(folders, tmp_path, capsys):
    """A YAML config (relative paths, one mapping with a weight) and the same flags write the
    same adapter bit for bit; the report records the resolved config, and --config REPORT with
    a new --out replays it bit for bit."""
    pytest.importorskip("yaml")
    root = tmp_path / "cfg"
    root.mkdir()
    (root / "merge.yaml").write_text(
        "adapters:\n"
        f"  - {folders[0]}\n"
        f"  - {{path: {folders[1]}, weight: 0.5}}\n"
        f"  - path: {folders[2]}\n"
        "alpha: 1\ncoef: 0.5\nbudget: 3\nno-plots: true\nout: merged\n"
    )
    rc, _, err = _run(capsys, "merge", "--config", str(root / "merge.yaml"), "--quiet")
    assert rc == 0, err
    by_flags = tmp_path / "flags"
    rc, _, err = _run(capsys, "merge", *folders, *FLAGS, "--weights", "1,0.5,1", "--no-plots",
                      "--out", str(by_flags), "--quiet")  # fmt: skip
    assert rc == 0, err
    _same_adapter(root / "merged", by_flags)
    report = json.loads((by_flags / cli.REPORT_NAME).read_text())
    cfg = report["config"]
    assert [a["weight"] for a in cfg["adapters"]] == [1.0, 0.5, 1.0]
    assert cfg["coef"] == 0.5 and cfg["budget"] == 3 and "out" not in cfg
    replay = tmp_path / "replay"
    rc, _, err = _run(capsys, "merge", "--config", str(by_flags / cli.REPORT_NAME), "--out",
                      str(replay), "--quiet")  # fmt: skip
    assert rc == 0, err
    _same_adapter(by_flags, replay)
    assert json.loads((replay / cli.REPORT_NAME).read_text())["config"] == cfg


def test_command_line_flags_override_the_config(folders, tmp_path, capsys):
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps({"adapters": folders, "budget": 2, "no_plots": True}))
    rc, _, err = _run(capsys, "merge", "--config", str(cfg), "--budget", "3", "--out",
                      str(tmp_path / "o"), "--quiet")  # fmt: skip
    assert rc == 0, err
    rep = json.loads((tmp_path / "o" / cli.REPORT_NAME).read_text())
    assert rep["budget"] == 3 and not (tmp_path / "o" / "plots").exists()


@pytest.mark.parametrize(
    "config, message",
    [
        ({"adapters": ["a"], "budgett": 2}, "unknown key 'budgett'; a config has 'adapters'"),
        ({"adapters": ["a"], "budget": 2.5}, "key 'budget' (--budget): expected a positive"),
        ({"adapters": ["a"], "budget": 2, "method": "nope"}, "key 'method' (--method): 'nope' is"),
        ({"adapters": ["a"], "budget": 2, "quiet": True}, "key 'quiet' cannot be in a config"),
        ({"adapters": ["a"], "budget": 2, "no-plots": "yes"}, "key 'no-plots': expected true"),
        ({"adapters": "a", "budget": 2}, "'adapters' must be a non-empty list"),
        ({"adapters": [{"path": "a", "wieght": 2}]}, "adapters[0] has the unknown key 'wieght'"),
        ({"adapters": [{"path": "a", "weight": 0}]}, "adapters[0] 'weight' is '0'"),
        ([1, 2], "holds a list; expected a mapping"),
    ],
)  # fmt: skip
def test_bad_configs_are_one_line_naming_the_key(tmp_path, capsys, config, message):
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps(config))
    rc, out, err = _run(capsys, "merge", "--config", str(cfg), "--out", str(tmp_path / "o"))
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"netutility merge: error: --config {cfg}: ") and message in err, err
    assert not (tmp_path / "o").exists()


def test_adapters_in_one_place_and_required_arguments(folders, tmp_path, capsys):
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps({"adapters": folders, "budget": 2}))
    rc, _, err = _run(capsys, "merge", folders[0], "--config", str(cfg), "--out", str(tmp_path))
    assert rc == 2 and "adapters are given both in the config and on the command line" in err
    rc, _, err = _run(capsys, "merge", "--config", str(cfg))
    assert rc == 2 and "--out OUT_DIR is required" in err
    with pytest.raises(SystemExit):
        cli.main(["merge", *folders, "--out", str(tmp_path / "o")])
    assert "required: --budget (unless --allocation all)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["merge", "--budget", "2", "--out", str(tmp_path / "o")])
    assert "required: ADAPTER_DIR (or --config FILE)" in capsys.readouterr().err


def test_weights_with_every_direction_and_no_budget(folders, tmp_path, capsys):
    """--weights with --allocation all and TA, and no --budget: the written update of each
    module is sum_i w_i scale A_i B_i (numpy float64); the summary names no budget."""
    w = (2.0, -0.5, 1.0)
    out = tmp_path / "o"
    rc, stdout, err = _run(capsys, "merge", *folders, "--allocation", "all", "--weights",
                           ",".join(map(str, w)), "--out", str(out), "--quiet", "--no-plots")  # fmt: skip
    assert rc == 0, err
    assert "budget" not in stdout and "every direction kept" in stdout
    assert "task0 " in stdout and "lambda" not in stdout
    got = nu.peft.load_adapter(out)
    for n in NAMES:
        want = sum(
            wi * 2.0 * _adapter(i, r)[n]["lora_a"].astype(np.float64) @ _adapter(i, r)[n]["lora_b"]
            for i, (wi, r) in enumerate(zip(w, RANKS, strict=True))
        )
        dk = np.asarray(nu.module_update(got[n]), np.float64)
        np.testing.assert_allclose(dk, want, atol=1e-4 * np.abs(want).max(), err_msg=n)
    rep = json.loads((out / cli.REPORT_NAME).read_text())
    assert rep["budget"] is None and rep["weights"] == list(w)
    assert [t["weight"] for t in rep["tasks"]] == list(w)
    rc, _, err = _run(capsys, "merge", *folders, "--allocation", "all", "--weights", "1,2",
                      "--out", str(tmp_path / "x"))  # fmt: skip
    assert rc == 2 and "--weights has 2 values for 3 adapters" in err


def test_dare_p_defaults_to_peft_s_density(folders, tmp_path):
    """--p defaults to 0.8 (PEFT's guide keeps density 0.2), stated in --help; the options the
    merge receives (and its report records) carry it."""
    parser = cli.build_parser(demo_options=False)
    args = parser.parse_args(["merge", *folders, "--budget", "2", "--method", "dare",
                              "--space", "core", "--out", str(tmp_path / "o")])  # fmt: skip
    assert cli.method_options(args) == {"p": 0.8}
    args = parser.parse_args(["merge", *folders, "--budget", "2", "--method", "dare_ties",
                              "--p", "0.3", "--out", str(tmp_path / "o")])  # fmt: skip
    assert cli.method_options(args) == {"p": 0.3}
    sub = next(a for a in parser._actions if a.dest == "command").choices["merge"]
    helps = {a.dest: a.help for a in sub._actions}
    assert "Default: 0.8" in helps["p"] and "0.2" in helps["density"]


def test_model_card_and_provenance(folders, tmp_path, capsys):
    out = tmp_path / "o"
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "2", "--out", str(out), "--quiet",
                      "--no-plots")  # fmt: skip
    assert rc == 0, err
    card = (out / "README.md").read_text()
    front = card.split("---\n")[1]
    assert "library_name: peft\n" in front and 'base_model: "tiny-test-model"\n' in front
    for i in range(3):
        assert f"| task{i} | `{folders[i]}` | 1 |" in card
    assert f"netutility-jax {nu.__version__}" in card and "allocation `net_utility`" in card
    rep = json.loads((out / cli.REPORT_NAME).read_text())
    assert rep["netutility_version"] == nu.__version__
    made = datetime.datetime.fromisoformat(rep["created_utc"])
    assert made.utcoffset() == datetime.timedelta(0)
    assert before <= made <= datetime.datetime.now(datetime.UTC)


def test_one_adapter_is_a_note_not_an_error(folders, tmp_path, capsys):
    rc, stdout, err = _run(capsys, "merge", folders[0], "--allocation", "all", "--out",
                           str(tmp_path / "o"), "--quiet", "--no-plots")  # fmt: skip
    assert rc == 0, err
    assert err == (
        "netutility merge: note: one adapter given (task0): nothing is merged across tasks; its "
        "own directions are selected and written as one adapter\n"
    )
    assert stdout.startswith("merged 1 adapter (ta, full space, every direction kept)")


def test_strict_targets_refusal_names_the_flag(folders, tmp_path, capsys):
    fewer = tmp_path / "fewer"
    nu.peft.save_adapter(
        {n: m for n, m in _adapter(5, 2).items() if "q_proj" in n}, fewer, base_config=BASE
    )
    rc, _, err = _run(capsys, "merge", folders[0], str(fewer), "--budget", "2",
                      "--strict-targets", "--out", str(tmp_path / "o"), "--quiet")  # fmt: skip
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("netutility merge: error: --strict-targets: the adapters target ")
    assert "in task0 but not in fewer" in err and "strict_targets" not in err
    with pytest.raises(nu.InputError, match=r"strict_targets=True \(CLI: --strict-targets\)"):
        nu.peft.load_adapters([folders[0], fewer], strict_targets=True)


def test_config_keys_are_the_flags_without_dashes(folders, tmp_path):
    """Every spelling of a flag without its dashes names it (knots-variant, knots_variant, the
    dest variant); values go through the flag's own parsing; the command line wins. The
    namespace keeps the flags as parsed: the settings are the one config."""
    from netutility_jax.cli import config

    parser = cli.build_parser(demo_options=False)
    for key in ("knots-variant", "knots_variant", "variant"):
        cfg = tmp_path / f"{key}.json"
        cfg.write_text(json.dumps({
            "adapters": folders, "budget": 2, key: "original", "space": "knots",
            "serving-ranks": [8, 16], "alpha": "auto", "chunk_mb": 1,
        }))  # fmt: skip
        argv = ["merge", "--config", str(cfg), "--alpha", "0", "--dry-run"]
        args = parser.parse_args(argv)
        args.argv = argv
        settings = config.resolve(args)
        assert settings is args.settings
        assert (settings.method_options["variant"], settings.space, settings.serving_ranks) == (
            "original", "knots", (8, 16)
        )  # fmt: skip
        assert settings.alpha == 0.0 and settings.chunk_mb == 1.0
        assert args.names == ["task0", "task1", "task2"] == list(settings.names)
        assert (args.variant, args.space, args.chunk_mb) == (None, "full", 64.0)  # (as parsed)
        rec = settings.to_dict()
        assert rec["knots-variant"] == "original" and rec["serving-ranks"] == [8, 16]


def test_the_merge_job_is_the_resolved_flags_as_one_config(folders, tmp_path):
    """``MergeJob.of`` turns the resolved flags into the merge's ``nu.MergeConfig`` (one field
    per flag; the registry's option flags in its explicit ``method_options``, not attributes)
    and the arguments about this run; nothing can change it afterwards."""
    import dataclasses

    from netutility_jax.cli import config
    from netutility_jax.cli.job import MergeJob
    from netutility_jax.cli.options import option_names

    parser = cli.build_parser(demo_options=False)
    sub = next(a for a in parser._actions if a.dest == "command").choices["merge"]
    # (--allow-changed is spent by config.resolve, which checks a replay's inputs before the
    # job is made; no step after it reads the flag)
    dests = {a.dest for a in sub._actions} - {"help", "allow_changed"}
    run = {f.name for f in dataclasses.fields(MergeJob)} - {"settings", "argv", "names"}
    settings = {f.name for f in dataclasses.fields(nu.MergeConfig)} - {"method_options", "names"}
    assert run | settings | set(option_names()) == dests and not run & settings
    assert not (run | settings) & set(option_names())

    argv = ["merge", *folders, "--budget", "2", "--method", "ties", "--density", "0.4",
            "--out", str(tmp_path / "o")]  # fmt: skip
    args = parser.parse_args(argv)
    args.argv = argv
    config.resolve(args)
    job = MergeJob.of(args)
    assert job.adapters == tuple(folders) and job.names == tuple(args.names)
    assert job.settings.names == tuple(args.names)
    assert job.argv == tuple(argv) and job.settings.method_options == {"density": 0.4}
    assert cli.method_options(args) == {"density": 0.4}
    assert job.settings == nu.MergeConfig(
        method="ties", budget=2, names=tuple(args.names), method_options={"density": 0.4}
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.budget = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.settings.budget = 3  # type: ignore[misc]
    with pytest.raises(AttributeError, match="density"):
        _ = job.density  # (no flag is served as an attribute)


def _resolved(tmp_path, data, *flags):
    """``merge --config FILE FLAGS --dry-run``'s configuration (:func:`config.resolve`) and
    the namespace it completed."""
    from netutility_jax.cli import config

    cfg = tmp_path / "p.json"
    cfg.write_text(json.dumps(data))
    argv = ["merge", "--config", str(cfg), *flags, "--dry-run"]
    args = cli.build_parser(demo_options=False).parse_args(argv)
    args.argv = argv
    return config.resolve(args), args


def test_precedence_is_the_flag_given_then_the_file_then_the_default(folders, tmp_path):
    """Setting by setting: a flag given on the command line (however spelled, even at its
    default value), else the config's key, else the flag's default; the adapters' weights
    likewise under --weights; and that one config is the job's."""
    from netutility_jax.cli.job import MergeJob

    data = {"adapters": folders, "budget": 2, "method": "ties", "density": 0.3, "coef": 0.5,
            "chunk-mb": 8, "no-plots": True, "seed": 7, "out": "o"}  # fmt: skip
    cfg, args = _resolved(tmp_path, data)
    assert (cfg.method, cfg.budget, cfg.coef, cfg.chunk_mb, cfg.no_plots, cfg.seed) == (
        "ties", 2, 0.5, 8.0, True, 7
    )  # fmt: skip
    assert cfg.method_options == {"density": 0.3} and args.out == str(tmp_path / "o")
    assert (cfg.dtype, cfg.alpha, cfg.space) == ("float32", "auto", "full")  # the defaults
    assert MergeJob.of(args).settings is cfg
    cfg, args = _resolved(
        tmp_path, data, "--method", "ties", "--coef", "1", "--bud", "3", "--chunk-mb=16",
        "--dtype", "bfloat16", "--density", "0.6", "--out", str(tmp_path / "flag"),
    )  # fmt: skip
    assert (cfg.coef, cfg.budget, cfg.chunk_mb, cfg.dtype) == (1.0, 3, 16.0, "bfloat16")
    assert cfg.method_options == {"density": 0.6} and args.out == str(tmp_path / "flag")
    assert cfg.seed == 7 and cfg.no_plots  # (the file's, where no flag was given)
    cfg, _ = _resolved(tmp_path, {**data, "density": None}, "--method", "ta")  # (the default)
    assert cfg.method == "ta" and cfg.method_options == {}
    weighted = {"adapters": [folders[0], {"path": folders[1], "weight": 0.5}, folders[2]],
                "budget": 2}  # fmt: skip
    assert _resolved(tmp_path, weighted)[0].weights == (1.0, 0.5, 1.0)
    assert _resolved(tmp_path, weighted, "--weights", "2,2,-1")[0].weights == (2.0, 2.0, -1.0)
    assert _resolved(tmp_path, {**weighted, "adapters": folders})[0].weights is None


def test_the_merge_call_receives_the_resolved_config(folders, tmp_path, capsys, monkeypatch):
    """``nu.merge_folders`` gets the one config: the file's settings with the flags over them."""
    from netutility_jax.cli import merge as merge_cmd

    got = []

    def merge_folders(paths, out, config, **kwargs):
        got.append((paths, out, config))
        raise nu.InputError("stopped here")

    monkeypatch.setattr(merge_cmd, "merge_folders", merge_folders)
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps({"adapters": folders, "budget": 2, "coef": 0.5, "seed": 3}))
    rc, _, err = _run(capsys, "merge", "--config", str(cfg), "--seed", "4", "--out",
                      str(tmp_path / "o"), "--quiet", "--no-plots")  # fmt: skip
    assert rc == 2 and "stopped here" in err
    ((paths, out, config),) = got
    assert paths == tuple(folders) and out == str(tmp_path / "o")
    assert config == nu.MergeConfig(budget=2, coef=0.5, seed=4, no_plots=True,
                                    names=("task0", "task1", "task2"))  # fmt: skip


def test_a_setting_merge_config_refuses_names_the_file_and_the_key(
    folders, tmp_path, capsys, monkeypatch
):
    """An option the method does not take is refused by ``nu.MergeConfig``; the command says so
    first, in its terms: the file and its key where the file gave it, the flag where a flag
    did (also when the method that does not take it came from the command line)."""
    data = {"adapters": folders, "budget": 2, "density": 0.3}
    with pytest.raises(nu.InputError, match=r"does not take 'density'"):
        nu.MergeConfig.from_dict({k: v for k, v in data.items() if k != "adapters"})
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps(data))
    out = str(tmp_path / "o")
    rc, stdout, err = _run(capsys, "merge", "--config", str(cfg), "--out", out)
    assert rc == 2 and stdout == "" and err.count("\n") == 1, err
    assert err == (
        f"netutility merge: error: --config {cfg}: key 'density' (--density) does not apply to "
        "method ta in full space; it takes --isotropize.\n"
    )
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "2", "--density", "0.3", "--out", out)
    assert rc == 2 and err.startswith("netutility merge: error: --density does not apply to ")
    cfg.write_text(json.dumps({**data, "method": "ties"}))
    rc, _, err = _run(capsys, "merge", "--config", str(cfg), "--method", "dare", "--out", out)
    assert rc == 2 and f"--config {cfg}: key 'density' (--density) does not apply to method " \
        "dare in full space; it takes --p." in err  # fmt: skip
    # whatever else nu.MergeConfig refuses is one line naming the file and the key
    from netutility_jax.cli import config

    def refused(values, **kwargs):
        return nu.MergeConfig.from_dict({"budget": 2, "chunk_mb": 0.0})

    monkeypatch.setattr(config, "settings_from", refused)
    cfg.write_text(json.dumps({**data, "density": None, "chunk-mb": 1}))
    rc, _, err = _run(capsys, "merge", "--config", str(cfg), "--out", out)
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"netutility merge: error: --config {cfg}: key 'chunk-mb': "
                          "MergeConfig: chunk_mb=0.0; expected")  # fmt: skip
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--weights", "1,nan,1"], "--weights"),
        (["--weights", "1,inf,1"], "--weights"),
        (["--weights", ""], "--weights"),
        (["--weights", "1,1"], "--weights"),  # two weights for three adapters
        (["--weights", "a,b,c"], "--weights"),
        (["--min-share", "-0.1"], "--min-share"),
        (["--min-share", "2"], "--min-share"),
        (["--min-share", "nan"], "--min-share"),
        (["--min-share", "0.5", "--allocation", "uniform"], "min"),
        (["--config", "/no/such/merge.yaml"], "--config"),
    ],
)
def test_hostile_weights_min_share_and_config_paths_are_one_line(
    folders, tmp_path, capsys, flags, message
):
    """Every bad value of the new flags: exit 2, one line naming the flag, nothing written."""
    out = tmp_path / "out"
    try:
        rc, _, err = _run(capsys, "merge", *folders, "--budget", "2", "--out", str(out), *flags)
    except SystemExit as e:  # (argparse's refusals of a flag's value)
        rc, err = e.code, capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln]
    assert rc == 2 and len(lines) == 1, err
    assert message in lines[0], lines[0]
    assert not out.exists()
