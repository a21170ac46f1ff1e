"""The ``netutility`` command end to end on temporary PEFT adapter folders."""

from __future__ import annotations

import collections
import contextlib
import copy
import errno
import importlib
import io
import json
import math
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import netutility_jax as nu
from netutility_jax import cli
from netutility_jax.errors import InputError, one_line


def _host_tag() -> str:
    """The host part of the library's temporary names, as its contract states it: the host
    name's letters and digits, at most 32 of them ("host" if none)."""
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


pytest.importorskip("safetensors")

NAMES = [f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")]
D_IN, D_OUT = 24, 16


def _adapter(seed: int, r: int, d_out: int = D_OUT) -> dict:
    rng = np.random.default_rng(seed)
    return {
        n: {
            "lora_a": rng.normal(size=(D_IN, r)).astype(np.float32),
            "lora_b": (rng.normal(size=(r, d_out)) / 4).astype(np.float32),
            "scale": 2.0,
        }
        for n in NAMES
    }


BASE = {"base_model_name_or_path": "tiny-test-model", "task_type": "CAUSAL_LM"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("adapters")
    out = []
    for i, r in enumerate((4, 3, 4)):
        p = root / f"task{i}"
        nu.peft.save_adapter(_adapter(i, r), p, base_config=BASE)
        out.append(str(p))
    return out


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _dense(mod) -> np.ndarray:
    return np.asarray(nu.module_update(mod), np.float64)


def test_merge_writes_peft_adapter_report_and_plots(folders, tmp_path, capsys):
    out = tmp_path / "merged"
    rc, stdout, err = _run(
        capsys, "merge", *folders, "--budget", "3", "--method", "tsv", "--out", str(out), "--quiet"
    )
    assert rc == 0, err
    assert "merged 3 adapters (tsv, full space, net_utility)" in stdout
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
        "netutility_report.json",
        "plots",
    ]
    pngs = sorted(p.name for p in (out / "plots").iterdir())
    assert pngs == [
        "budget_heatmap.png",
        "kept_per_task.png",
        "prefix_retention.png",
        "utility_distribution.png",
    ]
    assert all((out / "plots" / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in pngs)
    # the written adapter reproduces the in-process merge, and carries the base config
    ads = [nu.peft.load_adapter(f) for f in folders]
    want, rep = nu.merge_adapters(ads, budget=3, method="tsv", alpha="auto")
    got = nu.peft.load_adapter(out)
    for n in NAMES:
        np.testing.assert_allclose(_dense(got[n]), _dense(want[n]), atol=1e-5, err_msg=n)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "tiny-test-model"
    report = json.loads((out / "netutility_report.json").read_text())
    assert report["budget"] == 3 and report["method"] == "tsv"
    assert report["budget_spent"] == pytest.approx(rep.budget_spent)
    assert report["kept_per_task"] == [int(k) for k in rep.kept_per_task]
    assert report["adapters"] == folders
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def test_merge_all_directions_ta_is_the_sum_of_updates(folders, tmp_path, capsys):
    """Independent check: TA keeping everything = sum of the tasks' dense updates (numpy)."""
    out = tmp_path / "sum"
    rc, _, err = _run(
        capsys, "merge", *folders, "--budget", "1", "--allocation", "all", "--out", str(out),
        "--no-plots", "--quiet",
    )  # fmt: skip
    assert rc == 0, err
    got = nu.peft.load_adapter(out)
    for n in NAMES:
        want = sum(
            2.0 * _adapter(i, r)[n]["lora_a"].astype(np.float64) @ _adapter(i, r)[n]["lora_b"]
            for i, r in enumerate((4, 3, 4))
        )
        np.testing.assert_allclose(_dense(got[n]), want, atol=1e-4 * np.abs(want).max())
    assert not (out / "plots").exists()


def test_merge_dense_method_needs_rank(folders, tmp_path, capsys):
    out = tmp_path / "ties"
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "4", "--method", "ties",
                      "--out", str(out), "--quiet")  # fmt: skip
    assert rc == 2
    assert err.count("\n") == 1
    assert "gives dense updates" in err and "pass --rank K" in err
    assert not out.exists()
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "4", "--method", "ties",
                      "--rank", "5", "--out", str(out), "--quiet", "--no-plots")  # fmt: skip
    assert rc == 0, err
    assert {m["lora_a"].shape[1] for m in nu.peft.load_adapter(out).values()} == {5}


def test_merge_refuses_existing_output_and_inputs(folders, tmp_path, capsys):
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "keep.txt").write_text("x")
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "2", "--out", str(existing))
    assert rc == 2 and "already exists" in err and err.count("\n") == 1
    assert (existing / "keep.txt").read_text() == "x"
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "2", "--out", folders[0])
    assert rc == 2 and "already exists" in err
    inside = pathlib.Path(folders[1]) / "merged"
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "2", "--out", str(inside))
    assert rc == 2 and "inside input adapter" in err
    assert not inside.exists()


def test_bad_inputs_one_line_and_exit_2(folders, tmp_path, capsys):
    missing = tmp_path / "nope"
    rc, _, err = _run(capsys, "inspect", folders[0], str(missing))
    assert rc == 2 and err.count("\n") == 1 and f"adapter folder {missing} does not exist" in err
    # a different base model: shapes do not match
    other = tmp_path / "other"
    nu.peft.save_adapter(_adapter(9, 4, d_out=8), other, base_config=BASE)
    rc, _, err = _run(capsys, "merge", folders[0], str(other), "--budget", "2",
                      "--out", str(tmp_path / "o"))  # fmt: skip
    assert rc == 2 and err.count("\n") == 1
    assert "model.layers.0.self_attn.q_proj" in err
    # a pickled checkpoint is refused, never unpickled
    pk = tmp_path / "pickled"
    pk.mkdir()
    (pk / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (pk / "adapter_model.bin").write_bytes(b"not really a pickle")
    rc, _, err = _run(capsys, "inspect", str(pk))
    assert rc == 2 and "adapter_model.bin" in err and err.count("\n") == 1
    # option errors, before loading, one line (dare's --p has a default: tests/cli/test_cli_config.py)
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "2", "--density", "0.5",
                      "--out", str(tmp_path / "o2"))  # fmt: skip
    assert rc == 2 and err == (
        "netutility merge: error: --density does not apply to method ta in full space; it takes "
        "--isotropize.\n"
    )
    # argparse errors exit 2 too
    with pytest.raises(SystemExit) as e:
        cli.main(["merge", *folders, "--budget", "0", "--out", str(tmp_path / "o3")])
    assert e.value.code == 2
    assert "expected a positive integer" in capsys.readouterr().err


def test_inspect_matches_library(folders, capsys):
    rc, stdout, err = _run(capsys, "inspect", *folders, "--json")
    assert rc == 0, err
    info = json.loads(stdout)
    ads = [nu.peft.load_adapter(f) for f in folders]
    sc = nu.score(ads, alpha="auto")
    assert info["lam"] == pytest.approx(float(sc.lam), rel=1e-6)
    assert info["heterogeneity"] == pytest.approx(float(nu.heterogeneity(ads)), rel=1e-6)
    assert [t["rank_max"] for t in info["tasks"]] == [4, 3, 4]
    for i, t in enumerate(info["tasks"]):
        pos = sum(int((np.asarray(m.utility[i]) > 0).sum()) for m in sc.modules.values())
        assert t["positive_utility"] == pos
        # energy ||dW_i||_F^2 summed over modules, dense numpy
        want = sum(np.sum((2.0 * m["lora_a"].astype(np.float64) @ m["lora_b"]) ** 2)
                   for m in _adapter(i, (4, 3, 4)[i]).values())  # fmt: skip
        assert t["energy"] == pytest.approx(want, rel=1e-4)
    rc, table, _ = _run(capsys, "inspect", *folders)
    assert rc == 0
    assert "heterogeneity h =" in table and "lambda =" in table
    assert len(table.strip().splitlines()) == 1 + 3 + 1


def test_help_explains_every_option():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in ("merge", "inspect"):
        p = sub.choices[name]
        for action in p._actions:
            if action.dest != "help":
                assert action.help, f"{name}: option {action.dest} has no help"


def test_convert_is_a_command_whose_options_all_have_help():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    p = sub.choices["convert"]
    assert "adapter_model.bin" in p.description and "Exit codes" in p.epilog
    for action in p._actions:
        if action.dest != "help":
            assert action.help, f"convert: option {action.dest} has no help"
    args = parser.parse_args(["convert", "src", "out", "--overwrite"])
    assert (args.src, args.out, args.overwrite, args.no_compile_cache) == ("src", "out", True, True)


def test_chunk_mb_default_is_the_librarys_chunk_size():
    """``--chunk-mb`` states the streamed merge's default (``nu.streaming.CHUNK_BYTES``), which the
    parser writes out as a number so that parsing never imports jax."""
    from netutility_jax.pipeline import streaming

    args = cli.build_parser().parse_args(["merge", "a", "b", "--out", "o", "--budget", "4"])
    assert args.chunk_mb * 2**20 == streaming.CHUNK_BYTES
    assert f"default {streaming.CHUNK_BYTES >> 20})" in next(
        a.help
        for a in cli.build_parser()._subparsers._group_actions[0].choices["merge"]._actions
        if a.dest == "chunk_mb"
    )


def test_console_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "netutility_jax.cli", "merge", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--budget" in proc.stdout and "--allocation" in proc.stdout


# ---------------------------------------------------------------------------------------------
# Exit codes: the library's errors are one line and exit 2; anything else is a bug, exit 1
# ---------------------------------------------------------------------------------------------


def _without_share_warnings(err: str) -> str:
    """``err`` without the warnings about tasks below half their uniform share (these small
    budgets leave a task below it; tests/cli/test_cli_plan.py checks those warnings)."""
    return "".join(line for line in err.splitlines(True) if "of its uniform share" not in line)


def _one_error_line(err: str, start: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(start), err


@pytest.mark.parametrize(
    "exc, code",
    [(InputError, 2), (RuntimeError, 1), (TypeError, 1), (ValueError, 1), (ZeroDivisionError, 1)],
)
def test_only_library_errors_are_user_errors(folders, tmp_path, capsys, monkeypatch, exc, code):
    """An exception deep in the merge (in the allocation kernel's caller) is a user error only if
    it is one of the library's own types; a raw TypeError/ValueError is a bug and says so."""
    allocate = importlib.import_module("netutility_jax.allocate")  # (nu.allocate is the function)

    def boom(*args, **kwargs):
        raise exc("boom deep in the merge")

    monkeypatch.setattr(allocate, "_allocate_impl", boom)
    monkeypatch.setattr(allocate, "allocate_stacked", boom)  # (nu.score's own scores)
    jax.clear_caches()  # (the one-program TA merge calls it while tracing: trace again)
    out = tmp_path / "out"
    # (in memory: the traceback checked below names nu.merge_adapters; streaming, the default,
    # reaches the same allocation through nu.merge_adapters_streaming)
    argv = ["merge", *folders, "--budget", "2", "--out", str(out), "--quiet", "--no-plots",
            "--in-memory"]  # fmt: skip
    rc, stdout, err = _run(capsys, *argv)
    assert rc == code and not stdout
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written, no staging left
    if code == 2:
        _one_error_line(err, "netutility merge: error: boom deep in the merge")
        return
    assert err.startswith("Traceback (most recent call last):")
    assert f"{exc.__name__}: boom deep in the merge" in err
    assert ", in boom\n" in err and ", in merge_adapters\n" in err  # the whole traceback
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "netutility merge: internal error: this is a bug in netutility-jax, not a problem with "
        "your input; please report it with the traceback above, the command line (netutility "
        f"merge {folders[0]} "
    )
    assert f"jax {jax.__version__}" in last and "Python 3." in last


def _patch_writing(monkeypatch, route, fail):
    """Make writing the adapter call ``fail``: the streamed merge writes chunk by chunk
    (``AdapterWriter.add``), ``--in-memory`` at the end (``save_adapter``). Returns the route's
    extra flags."""
    if route == "streamed":
        monkeypatch.setattr(nu.peft.AdapterWriter, "add", lambda self, mods: fail(self.path))
        return []
    monkeypatch.setattr(nu.peft, "save_adapter", lambda adapter, path, **kw: fail(path))
    return ["--in-memory"]


@pytest.mark.parametrize("route", ["streamed", "in_memory"])
def test_interrupt_exits_130_and_removes_the_staging(
    folders, tmp_path, capsys, monkeypatch, route
):  # fmt: skip
    def interrupted(path):
        raise KeyboardInterrupt

    flags = _patch_writing(monkeypatch, route, interrupted)
    out = tmp_path / "out"
    argv = ["merge", *folders, "--budget", "2", "--out", str(out), "--quiet", *flags]
    rc, _, err = _run(capsys, *argv)
    assert rc == 130 and err == "netutility merge: interrupted\n"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("route", ["streamed", "in_memory"])
def test_write_failure_is_one_line(folders, tmp_path, capsys, monkeypatch, route):
    def full(path):
        pathlib.Path(path).mkdir(exist_ok=True)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    flags = _patch_writing(monkeypatch, route, full)
    out = tmp_path / "out"
    argv = ["merge", *folders, "--budget", "2", "--out", str(out), "--quiet", *flags]
    rc, _, err = _run(capsys, *argv)
    assert rc == 2
    _one_error_line(err, f"netutility merge: error: --out {out}: writing the result failed at ")
    assert "(No space left on device); nothing was written." in err
    assert not list(tmp_path.iterdir())


def test_long_messages_are_cut(folders, tmp_path, capsys, monkeypatch):
    text = "module model.layers.0.q_proj, " * 2000  # 60,000 characters
    assert one_line(InputError(text), cli.MAX_MESSAGE) == (
        text[: cli.MAX_MESSAGE] + f"... ({len(text.strip()) - cli.MAX_MESSAGE} more characters)"
    )
    assert one_line(InputError("short\n  message"), cli.MAX_MESSAGE) == "short message"

    def wordy(*args, **kwargs):
        raise InputError(text)

    monkeypatch.setattr(nu.peft, "load_adapters", wordy)
    rc, _, err = _run(capsys, "inspect", *folders)
    assert rc == 2
    _one_error_line(err, "netutility inspect: error: module model.layers.0.q_proj, module")
    assert err.endswith(f"... ({len(text.strip()) - cli.MAX_MESSAGE} more characters)\n")
    assert len(err) < cli.MAX_MESSAGE + 100


# ---------------------------------------------------------------------------------------------
# Numbers: bounded by argparse, with the flag named
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--budget", "0", "expected a positive integer up to 2147483647 (2**31 - 1;"),
        ("--budget", str(2**31), "expected a positive integer up to 2147483647"),
        ("--budget", "1e3", "expected a positive integer up to 2147483647"),
        ("--rank", "-3", "expected a positive integer up to 2147483647"),
        ("--seed", str(2**32), "expected an integer in [0, 2**32) = [0, 4294967295]"),
        ("--seed", "-1", "expected an integer in [0, 2**32)"),
        ("--seed", "9" * 5000, "expected an integer in [0, 2**32)"),
        ("--coef", "nan", "expected a finite nonzero number"),
        ("--coef", "-inf", "expected a finite nonzero number"),
        ("--coef", "0", "expected a finite nonzero number"),
        ("--coef", "1e400", "expected a finite nonzero number"),
        ("--coef", "(1+2j)", "expected a finite nonzero number"),
        ("--density", "0", "expected a finite number in (0, 1] (the kept fraction)"),
        ("--density", "1.5", "expected a finite number in (0, 1]"),
        ("--density", "nan", "expected a finite number in (0, 1]"),
        ("--p", "1", "expected a finite number in [0, 1) (the drop rate)"),
        ("--p", "-0.1", "expected a finite number in [0, 1)"),
        ("--p", "inf", "expected a finite number in [0, 1)"),
        (
            "--lam",
            "-1",
            "expected 'auto' or a number in [0, 1e+30] (the interference weight), got '-1'",
        ),
        (
            "--lam",
            "nan",
            "expected 'auto' or a number in [0, 1e+30] (the interference weight), got 'nan'",
        ),
        (
            "--alpha",
            "inf",
            "expected 'auto' or a number in [0, 16] (the geometry exponent), got 'inf'",
        ),
    ],
)
def test_bad_numbers_name_the_flag(capsys, flag, value, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["merge", "a", "--budget", "2", "--out", "o", f"{flag}={value}"])
    assert e.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"netutility merge: error: argument {flag}: {message}")
    assert len(line) < 300  # a 5000-digit value is shown cut


_BOUNDS = {  # flag: (accepted values, the test of a value argparse returns)
    "--budget": lambda v: isinstance(v, int) and 1 <= v <= 2**31 - 1,
    "--rank": lambda v: isinstance(v, int) and 1 <= v <= 2**31 - 1,
    "--seed": lambda v: isinstance(v, int) and 0 <= v < 2**32,
    "--coef": lambda v: isinstance(v, float) and math.isfinite(v) and v != 0,
    "--density": lambda v: isinstance(v, float) and 0 < v <= 1,
    "--p": lambda v: isinstance(v, float) and 0 <= v < 1,
    "--lam": lambda v: v == "auto" or (isinstance(v, float) and 0 <= v <= 1e30),
    "--alpha": lambda v: v == "auto" or (isinstance(v, float) and 0 <= v <= 16),
    "--weights": lambda v: all(isinstance(w, float) and 1e-30 <= abs(w) <= 1e30 for w in v),
}


@settings(max_examples=60, deadline=None)
@given(
    flag=st.sampled_from(sorted(_BOUNDS)),
    value=st.one_of(
        st.text(max_size=12),
        st.integers(-(2**70), 2**70).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.sampled_from(
            [
                "auto",
                "nan",
                "-0",
                "0x10",
                "1_000",
                " 3 ",
                "1e-320",
                "2147483647",
                "1e308",
                "-1e-31",
                "1e30,-1e-30",
                "-1,0.5,2",
                "17",
                "1e31",
            ]
        ),
    ),
    joined=st.booleans(),
)
def test_number_flags_accept_only_values_in_range(flag, value, joined):
    """Whatever the text, argparse either returns a value in the documented range or exits 2,
    the value given as ``--flag=VALUE`` or as ``--flag VALUE`` (a leading "-" included)."""
    parser = cli.build_parser(demo_options=False)
    sink = io.StringIO()
    given = [f"{flag}={value}"] if joined or value.startswith("--") else [flag, value]
    with contextlib.redirect_stderr(sink):
        try:
            args = parser.parse_args(["merge", "a", "--budget", "1", "--out", "o", *given])
        except SystemExit as e:
            assert e.code == 2
            assert f"argument {flag}: " in sink.getvalue()
            return
    assert _BOUNDS[flag](getattr(args, flag.lstrip("-"))), (flag, value)


# ---------------------------------------------------------------------------------------------
# Paths: one line naming the path and what was expected, before anything is loaded
# ---------------------------------------------------------------------------------------------


def _no_loading(monkeypatch) -> None:
    def fail(*args, **kwargs):
        pytest.fail("the adapters were loaded")

    monkeypatch.setattr(nu.peft, "load_adapters", fail)
    monkeypatch.setattr(nu.peft, "load_adapter", fail)


def _deny(monkeypatch, path: pathlib.Path, mode: int) -> None:
    """Make ``os.access(path, mode)`` answer no, as it does for a normal user on a path without
    that permission: the tests run as root, for whom a 0o555 folder or a 0o000 file is still
    writable and readable, so chmod alone would test nothing."""
    real = os.access

    def access(p, m, *args, **kwargs):
        if pathlib.Path(p) == path and m & mode:
            return False
        return real(p, m, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


def _copy_adapter(src: str, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


EXPECTED = (
    "expected a PEFT adapter folder holding adapter_config.json and adapter_model.safetensors (as "
    "PeftModel.save_pretrained writes)"
)


def test_adapter_paths_are_checked(folders, tmp_path, capsys, monkeypatch):
    _no_loading(monkeypatch)
    weights = pathlib.Path(folders[1]) / "adapter_model.safetensors"
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    cases = {
        str(tmp_path / "nope"): f"adapter folder {tmp_path / 'nope'} does not exist; {EXPECTED}",
        str(weights): f"adapter folder {weights} is a file, not a folder; {EXPECTED}; pass the "
        f"folder that holds it, {folders[1]}",
        str(a_file / "sub"): f"adapter folder {a_file / 'sub'} does not exist ({a_file} is a "
        f"file); {EXPECTED}",
        "": "ADAPTER_DIR is an empty path; give a folder",
    }
    no_config = _copy_adapter(folders[0], tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    cases[str(no_config)] = f"adapter folder {no_config} has no adapter_config.json; {EXPECTED}"
    dir_weights = _copy_adapter(folders[0], tmp_path / "dir_weights")
    (dir_weights / "adapter_model.safetensors").unlink()
    (dir_weights / "adapter_model.safetensors").mkdir()
    cases[str(dir_weights)] = (
        f"{dir_weights / 'adapter_model.safetensors'} is a folder; expected the file "
        f"adapter_model.safetensors of a PEFT adapter folder"
    )
    for command in ("inspect", "merge"):
        for path, message in cases.items():
            extra = ["--budget", "2", "--out", str(tmp_path / "o")] if command == "merge" else []
            rc, _, err = _run(capsys, command, folders[0], path, *extra)
            assert rc == 2, (path, err)
            _one_error_line(err, f"netutility {command}: error: {message}")
    assert not (tmp_path / "o").exists()


def test_unreadable_adapters_are_refused(folders, tmp_path, capsys, monkeypatch):
    _no_loading(monkeypatch)
    locked = _copy_adapter(folders[0], tmp_path / "locked")
    locked.chmod(0o000)
    try:
        _deny(monkeypatch, locked, os.R_OK)
        rc, _, err = _run(capsys, "inspect", folders[1], str(locked))
        assert rc == 2
        _one_error_line(
            err, f"netutility inspect: error: adapter folder {locked} cannot be read (permission "
            f"denied); {EXPECTED}",
        )  # fmt: skip
    finally:
        locked.chmod(0o755)
    cfg = _copy_adapter(folders[0], tmp_path / "cfg") / "adapter_config.json"
    cfg.chmod(0o000)
    try:
        _deny(monkeypatch, cfg, os.R_OK)
        rc, _, err = _run(capsys, "inspect", str(cfg.parent), folders[1])
        assert rc == 2
        _one_error_line(err, f"netutility inspect: error: {cfg} cannot be read (permission denied)")
    finally:
        cfg.chmod(0o644)


# ---------------------------------------------------------------------------------------------
# The output location, checked before anything is loaded
# ---------------------------------------------------------------------------------------------


def test_output_location_is_checked_before_loading(folders, tmp_path, capsys, monkeypatch):
    _no_loading(monkeypatch)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    _deny(monkeypatch, ro, os.W_OK)
    cases = {
        str(a_file / "merged"): f"--out {a_file / 'merged'}: {a_file} is a file, not a folder; "
        "choose a path in a folder.",
        str(a_file / "deeper" / "merged"): f"--out {a_file / 'deeper' / 'merged'}: {a_file} is "
        "a file, not a folder;",
        "": "--out is an empty path; give a folder",
        "  ": "--out is an empty path; give a folder",
        str(ro / "merged"): f"--out {ro / 'merged'}: cannot write in {ro} (permission denied); "
        "choose a writable folder.",
        str(ro / "new" / "merged"): f"--out {ro / 'new' / 'merged'}: cannot write in {ro} "
        "(permission denied)",
    }
    try:
        for out, message in cases.items():
            rc, _, err = _run(capsys, "merge", *folders, "--budget", "2", "--out", out)
            assert rc == 2, (out, err)
            _one_error_line(err, f"netutility merge: error: {message}")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "ro"]
        assert not list(ro.iterdir())
    finally:
        ro.chmod(0o755)


def test_output_needs_room_for_the_estimated_size(folders, tmp_path, capsys, monkeypatch):
    """The estimate, by hand: 4 modules (d_in 24, d_out 16) whose task ranks sum to 4 + 3 + 4 =
    11, so a merge has rank <= 11 there: 11 * (24 + 16) float32 numbers + 512 header bytes per
    module, plus 16 MiB for the report and plots."""
    want = 4 * (11 * (24 + 16) * 4 + 512) + (16 << 20)
    shapes = [nu.peft.weight_shapes(f) for f in folders]
    est = cli.estimate_out_bytes(shapes, rank=None, dtype="float32")
    assert est == (want, 4, 11)
    assert cli.estimate_out_bytes(shapes, rank=14, dtype="bfloat16") == (
        4 * (14 * 40 * 2 + 512) + (16 << 20), 4, 14,
    )  # fmt: skip
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(want + 10**6, 10**6 + 1, want - 1))
    real_load, real_load_one = nu.peft.load_adapters, nu.peft.load_adapter
    _no_loading(monkeypatch)
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "2", "--out", str(tmp_path / "o"))
    assert rc == 2
    _one_error_line(
        err,
        f"netutility merge: error: --out {tmp_path / 'o'}: not enough free space in {tmp_path}: "
        "the merge needs about 16.8 MB (estimated from the inputs: 4 modules at rank up to 11 in "
        "float32, plus the report and plots) but 16.8 MB is free; free some space or choose "
        "another --out.",
    )
    assert not list(tmp_path.iterdir())
    # written as it goes (the default), the tensors are on disk twice for a moment (a side file
    # copied after the header): room for the adapter once more is needed; --in-memory does not
    adapter = want - (16 << 20)
    free = want + adapter - 1
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(free + 10**6, 10**6, free))
    argv = ["merge", *folders, "--budget", "2", "--out", str(tmp_path / "o")]
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and "not enough free space" in err
    monkeypatch.setattr(nu.peft, "load_adapters", real_load)
    monkeypatch.setattr(nu.peft, "load_adapter", real_load_one)
    rc, _, err = _run(capsys, *argv, "--in-memory", "--quiet", "--no-plots")
    assert rc == 0 and _without_share_warnings(err) == ""


def test_size_estimate_bounds_what_is_written(folders, tmp_path, capsys):
    """Keeping every direction gives the largest merge; the estimate must not be below it."""
    out = tmp_path / "all"
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "1", "--allocation", "all",
                      "--out", str(out), "--no-plots", "--quiet")  # fmt: skip
    assert rc == 0, err
    est = cli.estimate_out_bytes(
        [nu.peft.weight_shapes(f) for f in folders], rank=None, dtype="float32"
    )
    written = (out / "adapter_model.safetensors").stat().st_size
    assert {m["lora_a"].shape[1] for m in nu.peft.load_adapter(out).values()} == {11}
    assert 11 * 40 * 4 * 4 < written <= est.bytes - cli.OUT_MARGIN


# ---------------------------------------------------------------------------------------------
# Staging folders of killed merges
# ---------------------------------------------------------------------------------------------


def test_stale_staging_of_a_dead_process_is_removed(folders, tmp_path, capsys):
    # a staging folder made by the real code in a process that has since exited, as a merge
    # killed while writing leaves it
    code = (
        "import pathlib, sys; from netutility_jax import cli; "
        "print(cli.staging_dir(pathlib.Path(sys.argv[1])))"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "killed")],
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    dead = pathlib.Path(proc.stdout.strip())
    assert dead.parent == tmp_path and dead.is_dir()
    (dead / "adapter_model.safetensors").write_bytes(b"half written")
    pid = int(re.fullmatch(r"\.killed\.netutility-staging-\w+-(\d+)-[0-9a-f]{8}", dead.name)[1])
    host = _host_tag()
    keep = [
        tmp_path / f".x.netutility-staging-{host}-{os.getpid()}-0123abcd",  # a live process
        tmp_path / f".x.netutility-staging-{host}x-{pid}-0123abcd",  # another host's
        tmp_path / f".x.netutility-staging-{host}-{pid}-0123abcd.old",  # not the exact pattern
        tmp_path / f".x.netutility-staging-{host}-{pid}-0123abcg",
        tmp_path / f"x.netutility-staging-{host}-{pid}-0123abcd",
        tmp_path / ".x.tmp-1234",  # unrelated hidden folders
        tmp_path / ".git",
    ]
    for k in keep:
        k.mkdir()
        (k / "f").write_text("keep me")
    a_file = tmp_path / f".y.netutility-staging-{host}-{pid}-0123abcd"  # not a folder
    a_file.write_text("keep me")
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "2", "--out", str(tmp_path / "new"),
                      "--quiet", "--no-plots")  # fmt: skip
    assert rc == 0, err
    assert _without_share_warnings(err) == (
        f"netutility merge: note: removed 1 stale staging folder left in {tmp_path} by killed "
        f"merges (their processes are gone): {dead.name}\n"
    )
    assert not dead.exists()
    assert all((k / "f").read_text() == "keep me" for k in keep) and a_file.is_file()
    assert (tmp_path / "new" / "adapter_model.safetensors").is_file()
    # a second run has nothing to remove and says nothing about staging
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "2", "--out", str(tmp_path / "new2"),
                      "--quiet", "--no-plots")  # fmt: skip
    assert rc == 0 and _without_share_warnings(err) == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*(k.name for k in keep), a_file.name, "new", "new2"]
    )


# ---------------------------------------------------------------------------------------------
# netutility demo: the output location and inputs are checked before any training
# ---------------------------------------------------------------------------------------------


def test_demo_checks_before_any_training(tmp_path, capsys, monkeypatch):
    pytest.importorskip("optax")
    from netutility_jax.experiments.data import tasks
    from netutility_jax.experiments.harness import runner
    from netutility_jax.experiments.suites import train

    def fail(*args, **kwargs):
        pytest.fail("the demo started working before checking its arguments")

    monkeypatch.setattr(tasks, "load_tasks", fail)
    monkeypatch.setattr(runner, "run_experiment", fail)
    monkeypatch.setattr(train, "train_task", fail)
    monkeypatch.setattr(train, "train_tasks", fail)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    _deny(monkeypatch, ro, os.W_OK)
    csv_dir = tmp_path / "data.csv"
    csv_dir.mkdir()
    locked = tmp_path / "locked.csv"
    locked.write_text("text,label\na,b\n")
    _deny(monkeypatch, locked, os.R_OK)
    cache = ["--cache-dir", str(tmp_path / "cache")]
    task = ["--tasks", "word_pos,mine"]
    cases = [
        (["--out", str(a_file)], f"--out {a_file} exists and is not a directory; choose a "
         "directory"),
        (["--out", str(a_file / "x")], f"--out {a_file / 'x'}: {a_file} is not a directory"),
        (["--out", ""], "--out is empty; give a directory for the results"),
        (["--out", str(ro / "x")], f"--out {ro / 'x'}: cannot write in {ro} (permission denied)"),
        (["--task", f"mine={csv_dir}", *task], f"--task mine={csv_dir}: {csv_dir} is a folder; "
         "expected a CSV file with columns text,label"),
        (["--task", f"mine={tmp_path / 'no.csv'}", *task], f"--task mine={tmp_path / 'no.csv'}: "
         f"{tmp_path / 'no.csv'} does not exist; expected a CSV file with columns text,label"),
        (["--task", f"mine={locked}", *task], f"--task mine={locked}: {locked} cannot be read "
         "(permission denied)"),
        (["--task", f"mine={a_file / 'x.csv'}", *task], f"--task mine={a_file / 'x.csv'}: "
         f"{a_file / 'x.csv'} does not exist"),
        (["--cache-dir", str(a_file)], f"--cache-dir {a_file} exists and is not a directory"),
        (["--cache-dir", str(a_file / "c")], f"--cache-dir {a_file / 'c'}: {a_file} is not a "
         "directory"),
        (["--cache-dir", str(ro / "c")], f"--cache-dir {ro / 'c'}: cannot write in {ro}"),
    ]  # fmt: skip
    for argv, message in cases:
        if "--out" not in argv:
            argv = [*argv, "--out", str(tmp_path / "results")]
        if "--cache-dir" not in argv:
            argv = [*argv, *cache]
        rc, _, err = _run(capsys, "demo", *argv)
        assert rc == 2, (argv, err)
        _one_error_line(err, f"netutility demo: error: {message}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "data.csv", "locked.csv", "ro"]


# ---------------------------------------------------------------------------------------------
# The largest numbers accepted work
# ---------------------------------------------------------------------------------------------


def test_largest_budget_and_seed_are_accepted(folders, tmp_path, capsys):
    """--budget 2**31 - 1 with uniform allocation (int32 overflow before) keeps everything: the
    TA merge is the sum of the tasks' updates (numpy float64)."""
    out = tmp_path / "uniform"
    rc, _, err = _run(capsys, "merge", *folders, "--budget", str(2**31 - 1), "--allocation",
                      "uniform", "--out", str(out), "--no-plots", "--quiet")  # fmt: skip
    assert rc == 0, err
    got = nu.peft.load_adapter(out)
    for n in NAMES:
        want = sum(
            2.0 * _adapter(i, r)[n]["lora_a"].astype(np.float64) @ _adapter(i, r)[n]["lora_b"]
            for i, r in enumerate((4, 3, 4))
        )
        np.testing.assert_allclose(_dense(got[n]), want, atol=1e-4 * np.abs(want).max())
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "2", "--method", "dare", "--p",
                      "0.5", "--seed", str(2**32 - 1), "--space", "core", "--out",
                      str(tmp_path / "dare"), "--no-plots", "--quiet")  # fmt: skip
    assert rc == 0, err
    report = json.loads((tmp_path / "dare" / cli.REPORT_NAME).read_text())
    assert report["options"]["seed"] == 2**32 - 1


# ---------------------------------------------------------------------------------------------
# Loader flags: --strict-targets, --allow-different-base, --skip-non-lora
# ---------------------------------------------------------------------------------------------


def test_different_targets_are_merged_over_the_union(tmp_path, capsys):
    """Real PEFT adapters on different target modules (q,v / q,k,v / k): merged over the union
    by default, coverage on the terminal and in the report, and PEFT loads the result with each
    module's update the sum of the PEFT updates of the tasks that have it (numpy float64)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.ModuleDict({m: torch.nn.Linear(24, 16) for m in ("q", "k", "v")})
                for _ in range(2)
            )

    torch.manual_seed(0)
    base = Toy()
    targets = [["q", "v"], ["q", "k", "v"], ["k"]]
    dirs, deltas = [], []
    for i, t in enumerate(targets):
        lc = peft.LoraConfig(r=2 + i, lora_alpha=4, target_modules=t)
        pm = peft.get_peft_model(copy.deepcopy(base), lc)
        delta = {}
        with torch.no_grad():
            for name, m in pm.named_modules():
                if hasattr(m, "lora_B") and "default" in m.lora_B:
                    m.lora_B["default"].weight.normal_(0, 0.1)
                    a = m.lora_A["default"].weight.double().numpy()
                    b = m.lora_B["default"].weight.double().numpy()
                    delta[name.removeprefix("base_model.model.")] = m.scaling["default"] * b @ a
        deltas.append(delta)
        pm.save_pretrained(str(tmp_path / f"task{i}"))
        dirs.append(str(tmp_path / f"task{i}"))
    union = {f"layers.{i}.{m}" for i in range(2) for m in ("q", "k", "v")}
    assert set().union(*deltas) == union

    out = tmp_path / "merged"
    rc, _, err = _run(capsys, "merge", *dirs, "--budget", "1", "--allocation", "all",
                      "--out", str(out), "--no-plots", "--quiet")  # fmt: skip
    assert rc == 0, err
    lines = err.splitlines()
    assert lines[0] == (
        "netutility merge: note: the adapters target different modules: merged over the union "
        "of 6 modules, a task contributing nothing where it has no LoRA module (--strict-targets "
        "refuses this)"
    )
    assert len(lines) == 3 and "Traceback" not in err
    assert lines[1].startswith("netutility merge: note: task0 lacks 2 of 6 modules: ")
    assert "layers.0.k" in lines[1] and "layers.1.k" in lines[1]
    assert lines[2].startswith("netutility merge: note: task2 lacks 4 of 6 modules: ")
    assert lines[2].endswith(" and 1 more")
    report = json.loads((out / cli.REPORT_NAME).read_text())
    # the tasks by their folders' names, in the report as on the terminal
    assert report["coverage"] == {
        n: [f"task{i}" for i in range(3) if n in deltas[i]] for n in union
    }

    pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(out))
    seen = set()
    for name, m in pm.named_modules():
        if hasattr(m, "lora_B") and "default" in m.lora_B:
            name = name.removeprefix("base_model.model.")
            a = m.lora_A["default"].weight.detach().double().numpy()
            b = m.lora_B["default"].weight.detach().double().numpy()
            want = sum(d[name] for d in deltas if name in d)
            np.testing.assert_allclose(m.scaling["default"] * b @ a, want, atol=1e-5, err_msg=name)
            seen.add(name)
    assert seen == union

    rc, stdout, _ = _run(capsys, "inspect", *dirs, "--json")
    assert rc == 0
    info = json.loads(stdout)  # (inspect's coverage is by task index)
    names = [pathlib.Path(t["adapter"]).name for t in info["tasks"]]
    by_name = {n: [names[i] for i in t] for n, t in info["coverage"].items()}
    assert by_name == report["coverage"]

    rc, _, err = _run(capsys, "merge", *dirs, "--budget", "1", "--strict-targets",
                      "--out", str(tmp_path / "strict"), "--quiet")  # fmt: skip
    assert rc == 2 and not (tmp_path / "strict").exists()
    _one_error_line(err, "netutility merge: error: --strict-targets: ")
    assert "strict_targets" not in err and "Drop --strict-targets" in err


def test_coverage_summary_stays_short():
    """5000 modules, 30 tasks, task i lacking module j when (i + j) % 3 == 0: a dozen lines."""
    cov = {f"m{j}": tuple(i for i in range(30) if (i + j) % 3) for j in range(5000)}
    lines = cli.coverage_summary(cov, 30)
    assert len(lines) == 1 + 10 + 1 and all(len(line) < 250 for line in lines)
    assert lines[1] == "task 0 lacks 1667 of 5000 modules: m0, m3, m6 and 1664 more"
    assert lines[2] == "task 1 lacks 1666 of 5000 modules: m2, m5, m8 and 1663 more"
    assert lines[-1] == "... and 20 more tasks lacking modules"
    assert cli.coverage_summary({"q": (0, 1), "k": (0, 1)}, 2) == []


def test_different_base_models_are_refused_unless_allowed(tmp_path, capsys):
    dirs = []
    for i, base in enumerate(("org/model-a", "org/model-b")):
        d = tmp_path / f"task{i}"
        nu.peft.save_adapter(_adapter(i, 3), d, base_config={"base_model_name_or_path": base})
        dirs.append(str(d))
    rc, _, err = _run(capsys, "merge", *dirs, "--budget", "2", "--out", str(tmp_path / "o"),
                      "--quiet")  # fmt: skip
    assert rc == 2 and not (tmp_path / "o").exists()
    _one_error_line(err, "netutility merge: error: ")
    assert "org/model-a" in err and "org/model-b" in err and "--allow-different-base" in err
    rc, _, err = _run(capsys, "merge", *dirs, "--budget", "2", "--allow-different-base",
                      "--out", str(tmp_path / "o"), "--no-plots", "--quiet")  # fmt: skip
    assert rc == 0, err
    cfg = json.loads((tmp_path / "o" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "org/model-a"
    report = json.loads((tmp_path / "o" / cli.REPORT_NAME).read_text())
    assert report["options"]["allow_different_base"] is True


def test_skip_non_lora(folders, tmp_path, capsys):
    """A modules_to_save copy is refused by default; --skip-non-lora merges without it, says how
    many tensors were skipped, and gives the merge of the adapters without it."""
    st_numpy = pytest.importorskip("safetensors.numpy")
    extra = tmp_path / "extra"
    shutil.copytree(folders[1], extra)
    f = extra / "adapter_model.safetensors"
    tensors = st_numpy.load_file(str(f))
    key = "base_model.model.score.modules_to_save.default.weight"
    tensors[key] = np.ones((3, 16), np.float32)
    st_numpy.save_file(tensors, str(f))
    dirs = [folders[0], str(extra), folders[2]]
    rc, _, err = _run(capsys, "merge", *dirs, "--budget", "3", "--out", str(tmp_path / "o"),
                      "--quiet")  # fmt: skip
    assert rc == 2 and not (tmp_path / "o").exists()
    _one_error_line(err, "netutility merge: error: ")
    assert "modules_to_save" in err and "--skip-non-lora" in err
    out = tmp_path / "skipped"
    rc, _, err = _run(capsys, "merge", *dirs, "--budget", "3", "--skip-non-lora", "--out",
                      str(out), "--no-plots", "--quiet")  # fmt: skip
    assert rc == 0, err
    assert err == (
        "netutility merge: warning: --skip-non-lora skipped 1 non-LoRA tensor (extra: "
        f"1, e.g. '{key}'); the merged adapter does not carry them.\n"
    )
    want, _ = nu.merge_adapters([nu.peft.load_adapter(d) for d in folders], budget=3, alpha="auto")
    got = nu.peft.load_adapter(out)
    assert set(got) == set(NAMES)
    for n in NAMES:
        np.testing.assert_allclose(_dense(got[n]), _dense(want[n]), atol=1e-5, err_msg=n)


def test_model_wide_ties_from_the_command_line(folders, tmp_path, capsys):
    """--trim-scope model reaches TIES (the budget's --scope is a different option): the written
    adapter is nu.merge_adapters' model-wide TIES, and differs from the per-module one."""
    outs = {}
    for trim in ("model", "module"):
        out = tmp_path / trim
        rc, _, err = _run(
            capsys, "merge", *folders, "--budget", "3", "--method", "ties", "--space", "core",
            "--trim-scope", trim, "--density", "0.3", "--out", str(out), "--no-plots", "--quiet",
        )  # fmt: skip
        assert rc == 0, err
        outs[trim] = nu.peft.load_adapter(out)
        report = json.loads((out / "netutility_report.json").read_text())
        assert report["options"]["trim_scope"] == trim
    loaded = [nu.peft.load_adapter(f) for f in folders]
    want, _ = nu.merge_adapters(
        loaded, budget=3, method="ties", space="core", trim_scope="model", density=0.3
    )
    for n in NAMES:
        np.testing.assert_allclose(
            _dense(outs["model"][n]), _dense(want[n]), atol=1e-5 * np.abs(_dense(want[n])).max()
        )
    assert any(not np.allclose(_dense(outs["model"][n]), _dense(outs["module"][n])) for n in NAMES)


def test_compile_cache_is_used_and_changes_nothing(folders, tmp_path):
    """The persistent compilation cache: filled by a first run, reused by a second with the same
    output; --no-compile-cache leaves it alone and writes the same adapter."""
    cache = tmp_path / "cache"

    def run(out, *extra, env_cache=str(cache)):
        env = {**os.environ, "NETUTILITY_COMPILE_CACHE": env_cache}
        proc = subprocess.run(
            [sys.executable, "-m", "netutility_jax.cli", "merge", *folders, "--budget", "3",
             "--method", "tsv", "--space", "core", "--out", str(tmp_path / out), "--no-plots",
             "--quiet", *extra],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return nu.peft.load_adapter(tmp_path / out)

    first = run("first")
    entries = set(os.listdir(cache))
    assert entries  # compiled kernels were stored
    second = run("second")
    assert set(os.listdir(cache)) == entries  # the same kernels: nothing new to compile
    # --no-compile-cache (in process: nothing here turns the cache on) writes the same adapter
    off_cache = tmp_path / "cache-unused"
    os.environ["NETUTILITY_COMPILE_CACHE"] = str(off_cache)
    try:
        rc = cli.main(["merge", *folders, "--budget", "3", "--method", "tsv", "--space", "core",
                       "--out", str(tmp_path / "off"), "--no-plots", "--quiet",
                       "--no-compile-cache"])  # fmt: skip
    finally:
        os.environ["NETUTILITY_COMPILE_CACHE"] = "off"
    assert rc == 0 and not off_cache.exists()
    off = nu.peft.load_adapter(tmp_path / "off")
    for n in NAMES:
        np.testing.assert_array_equal(_dense(first[n]), _dense(second[n]))
        np.testing.assert_array_equal(_dense(first[n]), _dense(off[n]))


def test_streaming_is_the_default_and_matches_in_memory(folders, tmp_path, capsys, monkeypatch):
    """The default merge streams (nu.merge_adapters is never called) and writes what --in-memory
    writes; dense results (--rank) are truncated per chunk exactly as save_adapter would."""
    import netutility_jax.pipeline.merging as merging_mod

    for method, space, extra in (("tsv", "core", []), ("ties", "full", ["--rank", "3"])):
        outs, reports = {}, {}
        for mode in ("stream", "memory"):
            out = tmp_path / f"{method}-{mode}"
            argv = ["merge", *folders, "--budget", "3", "--method", method, "--space", space,
                    "--out", str(out), "--no-plots", "--quiet", "--chunk-mb", "0.001", *extra]  # fmt: skip
            with monkeypatch.context() as m:
                if mode == "stream":
                    m.setattr(merging_mod, "merge_adapters", lambda *a, **k: pytest.fail("loaded"))
                else:
                    argv.append("--in-memory")
                rc, _, err = _run(capsys, *argv)
            assert rc == 0, err
            outs[mode] = nu.peft.load_adapter(out)
            reports[mode] = json.loads((out / "netutility_report.json").read_text())
        assert reports["stream"]["kept_per_task"] == reports["memory"]["kept_per_task"]
        assert reports["stream"]["options"]["chunk_mb"] == 0.001
        for n in NAMES:
            want = _dense(outs["memory"][n])
            np.testing.assert_allclose(
                _dense(outs["stream"][n]), want, atol=1e-5 * max(np.abs(want).max(), 1e-30)
            )


def test_version_prints_the_installed_version_and_exits_0(capsys):
    import importlib.metadata

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    want = importlib.metadata.version("netutility-jax")
    assert capsys.readouterr().out == f"netutility {want}\n"
    assert want == nu.__version__  # pyproject's version and the package's agree


@pytest.mark.parametrize("allocation", [[], ["--allocation", "all"]], ids=["budget", "all"])
def test_an_all_zero_adapter_is_warned_of_by_name(folders, tmp_path, capsys, allocation):
    """An adapter whose update is zero in every module (its lora_B all zeros, as PEFT saves an
    untrained one) is merged as nothing: one warning naming it and why, instead of silence (or
    a low-share hint about --min-share, which cannot help a task with no directions); the
    others are merged as without it (TA keeping every direction: their sum)."""
    zero = {n: {**m, "lora_b": np.zeros_like(m["lora_b"])} for n, m in _adapter(7, 4).items()}
    zp = tmp_path / "untrained"
    nu.peft.save_adapter(zero, zp, base_config=BASE)
    out = tmp_path / "out"
    rc, _, err = _run(
        capsys, "merge", str(zp), *folders[:2], "--out", str(out), "--alpha", "1",
        "--budget", "4", "--no-plots", "--quiet", *allocation,
    )  # fmt: skip
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if "zero update in every module" in ln]
    assert len(lines) == 1 and "untrained" in lines[0] and "contributes nothing" in lines[0]
    assert not [ln for ln in err.splitlines() if "untrained keeps" in ln]  # (no share hint)
    for other in folders[:2]:
        assert os.path.basename(other) not in " ".join(lines)
    if allocation:  # every direction: the merge is the sum of the two others' updates
        merged = nu.peft.load_adapter(out)
        ads = [nu.peft.load_adapter(p) for p in folders[:2]]
        for n in NAMES:
            want = sum(_dense(a[n]) for a in ads)
            np.testing.assert_allclose(_dense(merged[n]), want, atol=1e-4 * np.abs(want).max())
