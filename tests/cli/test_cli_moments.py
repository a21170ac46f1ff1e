"""``netutility merge --input-moments``: the data-aware merge from moments files (one per
adapter), bit for bit the Python API's with the same moments (streamed and in memory, with
``--dry-run`` and ``--config``); the files' format (``nu.moments.save_input_moments`` /
``load_input_moments``, ``.safetensors`` or ``.npz`` without pickles, factors or second
moments); the report's ``data_aware`` and digests; bad files as one line naming the flag, the
file, the module and the shapes, exit 2, nothing written."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np
import pytest
from test_cli_config import D_IN, NAMES, _adapter  # the same small adapters

import netutility_jax as nu
from netutility_jax import cli
from netutility_jax.scoring.moments import (
    input_moments_dense,
    load_input_moments,
    save_input_moments,
)

pytest.importorskip("safetensors")

RANKS = (4, 3, 4)
BASE = {"base_model_name_or_path": "tiny-test-model", "task_type": "CAUSAL_LM"}
FLAGS = ["--budget", "3", "--alpha", "1", "--no-plots", "--quiet"]
API = {"budget": 3, "alpha": 1.0}


def _activations(seed: int, n: int) -> dict[str, np.ndarray]:
    """Strongly anisotropic inputs (scales 1e-2 to 10 along random axes), so that the
    data-aware score differs from the data-free one."""
    rng = np.random.default_rng(100 + seed)
    out = {}
    for name in NAMES:
        q, _ = np.linalg.qr(rng.normal(size=(D_IN, D_IN)))
        scales = np.geomspace(10, 1e-2, D_IN)
        out[name] = ((rng.normal(size=(n, D_IN)) * scales) @ q.T).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Three adapter folders; task 0's moments from 40 samples (a (40, d_in) factor, saved as
    factors in .safetensors), task 1's as formed second moments written by a plain np.savez
    (no header: any program's file), task 2 without data."""
    root = tmp_path_factory.mktemp("moments")
    folders = []
    for i, r in enumerate(RANKS):
        p = root / f"task{i}"
        nu.peft.save_adapter(_adapter(i, r), p, base_config=BASE)
        folders.append(str(p))
    m0 = nu.input_moments(_activations(0, 40))
    f0 = root / "task0.safetensors"
    save_input_moments(m0, f0)
    acts1 = _activations(1, 500)
    s1 = {n: (x.astype(np.float64).T @ x.astype(np.float64)) / len(x) for n, x in acts1.items()}
    f1 = root / "task1.npz"
    np.savez(f1, **s1)
    return {
        "root": root, "folders": folders, "files": [str(f0), str(f1), "none"],
        "moments": [m0, input_moments_dense(s1), None], "s1": s1,
    }  # fmt: skip


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _tensors(folder) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(pathlib.Path(folder) / "adapter_model.safetensors"))


def _api_tensors(merged, tmp: pathlib.Path, folders) -> dict[str, np.ndarray]:
    """The API's merged adapter written as the command writes it (its base config)."""
    loaded = nu.peft.load_adapters(folders)
    nu.peft.save_adapter(merged, tmp, base_config=loaded.config)
    return _tensors(tmp)


def _assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_file_round_trip(tmp_path):
    """Factors come back bit for bit from both formats; the second-moment form and a plain
    file of S give S (to float64 rounding); data-free modules come back None."""
    m = nu.input_moments({"a/q": np.random.default_rng(0).normal(size=(7, 5)), "k": None})
    for suffix in ("safetensors", "npz"):
        path = tmp_path / f"m.{suffix}"
        save_input_moments(m, path)
        back = load_input_moments(path)
        assert back.keys() == m.keys() and back["k"] is None
        f = np.asarray(back["a/q"].factor)
        assert f.dtype == np.asarray(m["a/q"].factor).dtype
        assert np.array_equal(f, np.asarray(m["a/q"].factor))
        save_input_moments(m, path, form="second_moment")
        s = load_input_moments(path)["a/q"].second_moment()
        np.testing.assert_allclose(s, m["a/q"].second_moment(), rtol=1e-5, atol=1e-6)
    with pytest.raises(nu.errors.InputError, match=r"neither a \.safetensors nor an \.npz"):
        save_input_moments(m, tmp_path / "m.pt")


@pytest.mark.parametrize("in_memory", [True, False], ids=["in_memory", "streamed"])
def test_cli_merge_equals_the_api_with_the_same_moments(world, tmp_path, capsys, in_memory):
    folders, files = world["folders"], world["files"]
    mode = ["--in-memory"] if in_memory else []
    out = tmp_path / "cli"
    rc, _, err = _run(capsys, "merge", *folders, *FLAGS, *mode, "--out", str(out),
                      "--input-moments", *files)  # fmt: skip
    assert rc == 0, err
    if in_memory:
        merged, report = nu.merge_adapters(
            nu.peft.load_adapters(folders).adapters, **API, input_moments=world["moments"]
        )
    else:
        merged, report = nu.merge_adapters_streaming(
            nu.peft.open_adapters(folders), **API, input_moments=world["moments"]
        )
        # the moments matter here: the data-free merge is another adapter
        free, _ = nu.merge_adapters_streaming(nu.peft.open_adapters(folders), **API)
        other = _api_tensors(free, tmp_path / "free", folders)
        assert any(
            a.shape != other[k].shape or not np.array_equal(a, other[k])
            for k, a in _tensors(out).items()
        )
    assert report.data_aware
    _assert_identical(_tensors(out), _api_tensors(merged, tmp_path / "api", folders))
    rep = json.loads((out / cli.REPORT_NAME).read_text())
    assert rep["data_aware"] is True
    assert rep["config"]["input-moments"] == [
        {"path": os.path.abspath(f), "sha256": hashlib.sha256(pathlib.Path(f).read_bytes())
         .hexdigest()} for f in files[:2]
    ] + [None]  # fmt: skip
    assert list(rep["kept_per_task"]) == [int(k) for k in report.kept_per_task]


def test_replay_dry_run_and_config(world, tmp_path, capsys):
    """The report replays the data-aware merge bit for bit; --dry-run plans the same masks as
    nu.plan with the moments; a config's input_moments (relative paths, null for a task
    without data) is the flag."""
    folders, files = world["folders"], world["files"]
    out = tmp_path / "cli"
    rc, _, err = _run(capsys, "merge", *folders, *FLAGS, "--out", str(out), "--input-moments",
                      *files)  # fmt: skip
    assert rc == 0, err
    replay = tmp_path / "replay"
    rc, _, err = _run(capsys, "merge", "--config", str(out / cli.REPORT_NAME), "--out",
                      str(replay), "--quiet")  # fmt: skip
    assert rc == 0, err
    _assert_identical(_tensors(out), _tensors(replay))
    rep = json.loads((replay / cli.REPORT_NAME).read_text())
    assert rep["data_aware"] is True

    from netutility_jax.pipeline.planning import plan

    p = plan(nu.peft.open_adapters(folders), **API, input_moments=world["moments"])
    rc, text, err = _run(capsys, "merge", *folders, "--budget", "3", "--alpha", "1",
                         "--dry-run", "--input-moments", *files)  # fmt: skip
    assert rc == 0, err
    assert str(p).splitlines()[2:5] == text.splitlines()[2:5]  # the per-task table
    assert list(rep["kept_per_task"]) == list(p.kept_per_task)

    cfg = world["root"] / "merge.json"
    cfg.write_text(json.dumps({
        "adapters": folders, "budget": 3, "alpha": 1, "no-plots": True,
        "input_moments": ["task0.safetensors", "task1.npz", None], "out": str(tmp_path / "cfg"),
    }))  # fmt: skip
    rc, _, err = _run(capsys, "merge", "--config", str(cfg), "--quiet")
    assert rc == 0, err
    _assert_identical(_tensors(out), _tensors(tmp_path / "cfg"))


def _bad(world, tmp_path, name, arrays, suffix="npz") -> str:
    path = tmp_path / f"{name}.{suffix}"
    if suffix == "npz":
        np.savez(path, **arrays)
    else:
        path.write_bytes(arrays)
    return str(path)


def _s1(world, **change) -> dict:
    s = {k: v.copy() for k, v in world["s1"].items()}
    s.update(change)
    return {k: v for k, v in s.items() if v is not None}


CASES = {
    "count": lambda w, t: ([w["files"][0], w["files"][1]],
                           "--input-moments has 2 files for 3 adapters"),
    "missing module": lambda w, t: (
        [w["files"][0], _bad(w, t, "m", _s1(w, **{NAMES[3]: None})), "none"],
        f"m.npz: has no entry for module '{NAMES[3]}' of adapter task1"),
    "wrong shape": lambda w, t: (
        [w["files"][0], _bad(w, t, "m", _s1(w, **{NAMES[0]: np.eye(20)})), "none"],
        f"m.npz: module '{NAMES[0]}' has inputs of width 20"),
    "not square": lambda w, t: (
        [w["files"][0], _bad(w, t, "m", _s1(w, **{NAMES[0]: np.ones((24, 3))})), "none"],
        f"m.npz: the second moment of module '{NAMES[0]}' has shape (24, 3)"),
    "non-finite": lambda w, t: (
        [w["files"][0], _bad(w, t, "m", _s1(w, **{NAMES[1]: np.full((24, 24), np.nan)})), "none"],
        f"the second moment of module '{NAMES[1]}' (24 x 24) has 576 non-finite"),
    "not psd": lambda w, t: (
        [w["files"][0], _bad(w, t, "m", _s1(w, **{NAMES[2]: -np.eye(24)})), "none"],
        f"module '{NAMES[2]}' (24 x 24) is not positive semidefinite"),
    "foreign module": lambda w, t: (
        [w["files"][0], _bad(w, t, "m", _s1(w, **{"model.layers.9.mlp": np.eye(24)})), "none"],
        "m.npz: names module 'model.layers.9.mlp', which adapter task1 (task 2) does not have"),
    "suffix": lambda w, t: ([w["files"][0], _bad(w, t, "m", b"x", "txt"), "none"],
                            "m.txt: expected a .safetensors or .npz file"),
    "no file": lambda w, t: ([w["files"][0], str(t / "absent.npz"), "none"],
                             "absent.npz: no such file"),
    "pickle": lambda w, t: (
        [w["files"][0], _bad(w, t, "m", {NAMES[0]: np.array([object()], dtype=object)}), "none"],
        "m.npz: cannot be read as .npz without pickles"),
    "garbage safetensors": lambda w, t: (
        [_bad(w, t, "m", b"\xff" * 16, "safetensors"), w["files"][1], "none"],
        "m.safetensors: not a safetensors file"),
    "all none": lambda w, t: (["none", "none", "none"], "every entry is 'none'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_bad_moments_are_one_line_and_write_nothing(world, tmp_path, capsys, case):
    files, message = CASES[case](world, tmp_path)
    out = tmp_path / "out"
    before = sorted(os.listdir(tmp_path))
    rc, o, err = _run(capsys, "merge", *world["folders"], *FLAGS, "--out", str(out),
                      "--input-moments", *files)  # fmt: skip
    assert rc == 2 and o == "" and err.count("\n") == 1, err
    assert err.startswith("netutility merge: error: --input-moments"), err
    assert message in err, err
    assert sorted(os.listdir(tmp_path)) == before  # no --out, no staging folder


def test_moments_need_net_utility(world, tmp_path, capsys):
    rc, _, err = _run(capsys, "merge", *world["folders"], *FLAGS, "--allocation", "uniform",
                      "--out", str(tmp_path / "o"), "--input-moments", *world["files"])  # fmt: skip
    assert rc == 2 and err.count("\n") == 1 and "applies to --allocation net_utility" in err, err
    assert not (tmp_path / "o").exists()


def test_a_changed_file_does_not_replay(world, tmp_path, capsys):
    """The report's digest pins each file: a replay after the file changed is refused."""
    f = tmp_path / "t0.safetensors"
    f.write_bytes(pathlib.Path(world["files"][0]).read_bytes())
    out = tmp_path / "o"
    rc, _, err = _run(capsys, "merge", *world["folders"], *FLAGS, "--out", str(out),
                      "--input-moments", str(f), "none", "none")  # fmt: skip
    assert rc == 0, err
    save_input_moments(nu.input_moments(_activations(5, 30)), f)
    rc, _, err = _run(capsys, "merge", "--config", str(out / cli.REPORT_NAME), "--out",
                      str(tmp_path / "again"))  # fmt: skip
    assert rc == 2 and err.count("\n") == 1 and "the file changed since that merge" in err, err
    assert not (tmp_path / "again").exists()
