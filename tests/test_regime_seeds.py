"""experiments/regime_seeds.py: seeds pooled across regime-study runs, from the committed
study.json files (no run)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from netutility_jax.experiments import regime_seeds as rs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _study(seeds, nu_u, nu_e, d_u):
    a = {
        "net_utility_minus_uniform": {"per_seed": nu_u},
        "net_utility_minus_energy": {"per_seed": nu_e},
        "net_utility_data_minus_uniform": {"per_seed": d_u},
    }
    cells = [
        {"cell": c, "seeds": seeds, "allocation": {"16": a, "32": a}, "seconds": {}}
        for c in ("centre", "init=per_task", "h=4x")
    ]
    return {"cells": cells, "commit": None, "command": "x"}


def test_energy_minus_uniform_is_derived_per_seed_and_pooled():
    res = rs.pool([("a", _study([0, 1], [1.0, 2.0], [0.5, -1.0], [0.0, 1.0])),
                   ("b", _study([2], [0.0], [1.0], [2.0]))])  # fmt: skip
    e = res["cells"]["centre"]["16"]["energy - uniform"]
    assert e["per_seed"] == {"0": 0.5, "1": 3.0, "2": -1.0} and e["n"] == 3
    assert e["estimate"] == pytest.approx(2.5 / 3) and e["positive_seeds"] == 2
    de = res["cells"]["init=per_task"]["32"]["data - energy"]["per_seed"]
    assert de == {"0": -0.5, "1": -2.0, "2": 3.0}
    assert "h=4x" not in res["cells"]
    assert res["grid"]["16"]["energy - uniform"]["per_seed"] == {"0": 0.5, "1": 3.0, "2": -1.0}


def test_a_seed_in_two_sources_is_refused():
    with pytest.raises(SystemExit, match="seed 1 is in both a and b"):
        rs.pool([("a", _study([0, 1], [1, 1], [0, 0], [0, 0])), ("b", _study([1], [1], [0], [0]))])


def test_the_committed_seeds_read_back():
    sources = [
        (str(p), json.loads(p.read_text()))
        for p in (ROOT / "docs/regime/study.json", ROOT / "docs/regime/seed3/study.json")
    ]
    res = rs.pool(sources)
    e = res["cells"]["centre"]["16"]["energy - uniform"]["per_seed"]
    assert sorted(e) == ["0", "1", "2", "3"] and all(np.isfinite(list(e.values())))
    assert "R = 16" in rs.markdown({"command": "c", "commit": None, **res})
