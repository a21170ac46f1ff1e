"""``scripts/check_baseline.py``: the quick demo's estimates against the stored baseline."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_baseline", ROOT / "scripts/check_baseline.py")
cb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cb)


def _cell(x):
    return {"estimate": x, "bootstrap_ci": [x - 1, x + 1], "per_seed": [x]}


RESULTS = {
    "command": "netutility demo --quick",
    "table": [
        {"space": "all", "key": "ta", "cells": {"16": {"uniform": _cell(80.0), "ours": _cell(81.5),
                                                       "delta": _cell(1.5)}}},
        {"space": "Full", "key": "tsv", "cells": {"16": {"uniform": _cell(70.0),
                                                         "ours": _cell(float("nan"))}}},
    ],
    "controls": {"zero_shot": _cell(60.0), "rows": {"ta/full": {"no_budget": _cell(85.0)}}},
    "other": {"ignored": _cell(1.0)},
}  # fmt: skip


def test_estimates_are_every_table_and_control_estimate_by_path():
    assert cb.estimates(RESULTS) == {
        "table/all:ta/cells/16/uniform": 80.0,
        "table/all:ta/cells/16/ours": 81.5,
        "table/all:ta/cells/16/delta": 1.5,
        "table/Full:tsv/cells/16/uniform": 70.0,
        "table/Full:tsv/cells/16/ours": None,  # (NaN: not finite)
        "controls/zero_shot": 60.0,
        "controls/rows/ta/full/no_budget": 85.0,
    }
    with pytest.raises(SystemExit, match="controls"):
        cb.estimates({"table": []})


def test_compare_fails_on_a_lost_cell_a_large_move_and_a_new_nan():
    base = cb.estimates(RESULTS)
    now = dict(base)
    assert cb.compare(now, base, warn=2, fail=10) == ([], [])
    now["table/all:ta/cells/16/ours"] = 81.5 + 3  # over warn, under fail
    now["controls/zero_shot"] = 60.0 - 10.5  # over fail
    now["table/all:ta/cells/16/uniform"] = None  # finite before
    del now["table/all:ta/cells/16/delta"]
    now["table/all:ta/cells/32/ours"] = 1.0
    failures, warnings = cb.compare(now, base, warn=2, fail=10)
    assert len(warnings) == 1 and "(+3.00)" in warnings[0]
    assert len(failures) == 4
    assert any("not in the results" in f and "16/delta" in f for f in failures)
    assert any("not in the baseline" in f and "32/ours" in f for f in failures)
    assert any("zero_shot" in f and "(-10.50)" in f for f in failures)
    assert any("16/uniform" in f and "now None" in f for f in failures)


def test_write_then_check_round_trips_and_a_broken_merge_fails(tmp_path, capsys):
    res, base = tmp_path / "results.json", tmp_path / "baseline.json"
    res.write_text(json.dumps(RESULTS))
    assert cb.main([str(res), str(base), "--write"]) == 0
    stored = json.loads(base.read_text())
    assert stored["command"] == "netutility demo --quick"
    assert stored["estimates"] == cb.estimates(RESULTS)
    assert cb.main([str(res), str(base)]) == 0
    broken = copy.deepcopy(RESULTS)
    broken["table"][0]["cells"]["16"]["ours"]["estimate"] = 60.0  # a merge that broke
    res.write_text(json.dumps(broken))
    capsys.readouterr()
    assert cb.main([str(res), str(base)]) == 1
    err = capsys.readouterr().err
    assert "FAILED: table/all:ta/cells/16/ours: baseline 81.50, now 60.00 (-21.50)" in err
    with pytest.raises(SystemExit):
        cb.main([str(res), str(base), "--warn", "5", "--fail", "1"])


def test_the_stored_quick_baseline_is_well_formed():
    doc = json.loads((ROOT / "tests/experiments/quick_baseline.json").read_text())
    est = doc["estimates"]
    assert "demo --quick" in doc["command"]
    assert len(est) >= 10 and any(k.startswith("controls/") for k in est)
    assert all(v is None or isinstance(v, float) for v in est.values())
