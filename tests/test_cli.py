"""The ``netutility`` command end to end on temporary PEFT adapter folders."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import cli

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
    assert rc == 2 and err.count("\n") == 1 and "not a folder" in err
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
    # option errors from the library, one line
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "2", "--method", "ties",
                      "--density", "1.5", "--out", str(tmp_path / "o2"))  # fmt: skip
    assert rc == 2 and "density=1.5" in err and err.count("\n") == 1
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


def test_console_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "netutility_jax.cli", "merge", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--budget" in proc.stdout and "--allocation" in proc.stdout
