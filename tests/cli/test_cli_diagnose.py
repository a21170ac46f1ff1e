"""``netutility inspect --diagnose``: the command line's diagnostics equal ``nu.diagnose``'s, and
its refusals are one line with exit status 2."""

from __future__ import annotations

import json
import math

import pytest
from test_cli import BASE, _adapter, _run  # the same small adapters (this folder's helpers)

import netutility_jax as nu

M, R = 3, 4


@pytest.fixture(scope="module")
def peft_folders(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("diag_adapters")
    out = []
    for i in range(M):
        p = root / f"task{i}"
        nu.peft.save_adapter(_adapter(i, R), p, base_config=BASE)
        out.append(str(p))
    return out


def test_cli_inspect_diagnose(peft_folders, capsys):
    rc, out, err = _run(capsys, "inspect", *peft_folders, "--diagnose", "--budget", "4")
    assert rc == 0, err
    assert "overlap vs chance" in out and "random-rotation control" in out
    assert "heterogeneity h =" in out  # the usual table comes first
    rc, out, err = _run(capsys, "inspect", *peft_folders, "--diagnose", "--budget", "4", "--json")
    assert rc == 0, err
    info = json.loads(out)
    diag = info["diagnostics"]
    assert diag["budget"] == 4 and [t["name"] for t in diag["tasks"]] == peft_folders
    ads = [nu.peft.load_adapter(f) for f in peft_folders]
    want = nu.diagnose(ads, budget=4, names=peft_folders).to_dict()
    assert diag["kept"] == want["kept"]
    assert diag["overlap_vs_chance"] == pytest.approx(want["overlap_vs_chance"], rel=1e-6)
    assert not math.isnan(diag["overlap_vs_chance"])
    # the recommendation and the difference from energy alone, spelt as flags
    assert diag["energy_changed"] == want["energy_changed"]
    rec = diag["recommendation"]
    assert rec["energy_only"] == want["recommendation"]["energy_only"]
    flags = "--lam 0" if rec["energy_only"] else "--interference signed"
    assert flags in rec["text"] and flags.replace("--", "").replace(" ", "=") not in rec["text"]
    rc, out, err = _run(capsys, "inspect", *peft_folders, "--diagnose", "--budget", "4")
    assert out.splitlines()[-1] == f"recommendation: {rec['text']}"


def test_cli_diagnose_scores_with_the_interference_flag(peft_folders, capsys):
    rc, out, err = _run(capsys, "inspect", *peft_folders, "--diagnose", "--budget", "4",
                        "--interference", "signed", "--json")  # fmt: skip
    assert rc == 0, err
    diag = json.loads(out)["diagnostics"]
    ads = [nu.peft.load_adapter(f) for f in peft_folders]
    want = nu.diagnose(ads, budget=4, interference="signed").to_dict()
    assert diag["interference"] == "signed"
    assert diag["lam"] == pytest.approx(want["lam"], rel=1e-6)
    assert (diag["kept"], diag["lambda_changes"]) == (want["kept"], want["lambda_changes"])


def test_cli_diagnose_needs_budget(peft_folders, capsys):
    rc, out, err = _run(capsys, "inspect", *peft_folders, "--diagnose")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1
    assert err.startswith("netutility inspect: error: --diagnose needs --budget N")
    rc, _, err = _run(capsys, "inspect", *peft_folders, "--budget", "4")
    assert rc == 2 and err.count("\n") == 1 and "--budget applies only with --diagnose" in err


@pytest.mark.parametrize("budget", ["0", "-3", "abc", "1.5", "", "nan", "9" * 40])
def test_cli_hostile_budgets_exit_2_without_a_traceback(peft_folders, capsys, budget):
    with pytest.raises(SystemExit) as e:  # argparse refuses it, before any work
        _run(capsys, "inspect", *peft_folders, "--diagnose", "--budget", budget)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == "", (budget, out)
    assert "Traceback" not in err and "argument --budget: expected a positive integer" in err


def test_cli_a_budget_beyond_every_direction_keeps_at_most_every_direction(peft_folders, capsys):
    rc, out, err = _run(capsys, "inspect", *peft_folders, "--diagnose", "--budget", "10000000",
                        "--json")  # fmt: skip
    assert rc == 0, err
    diag = json.loads(out)["diagnostics"]
    ads = [nu.peft.load_adapter(f) for f in peft_folders]
    assert diag["kept"] == nu.diagnose(ads, budget=10_000_000).to_dict()["kept"]
