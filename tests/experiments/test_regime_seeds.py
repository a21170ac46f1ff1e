"""experiments/regime_seeds.py: seeds pooled across regime-study runs, from the committed
study.json files (no run)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from netutility_jax.experiments import regime_seeds as rs

ROOT = pathlib.Path(__file__).resolve().parents[2]


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


def _ci_study(seeds, nu_u, nu_e, d_u, d_nu, half):
    """A study.json whose deltas carry per-seed bootstrap intervals of half-width ``half``."""

    def entry(v):
        return {"per_seed": v, "per_seed_bootstrap_ci": [[x - half, x + half] for x in v]}

    a = {
        "net_utility_minus_uniform": entry(nu_u),
        "net_utility_minus_energy": entry(nu_e),
        "net_utility_data_minus_uniform": entry(d_u),
        "net_utility_data_minus_net_utility": entry(d_nu),
    }
    cells = [
        {"cell": c, "seeds": seeds, "allocation": {"16": a, "32": a}, "seconds": {}}
        for c in ("centre", "init=per_task")
    ]
    return {"cells": cells, "commit": None, "command": "x"}


def test_text_standard_errors_two_level_interval_and_holm():
    study = _ci_study([0, 1, 2, 3], [1.0, 2.0, 0.5, 1.5], [0.2, 0.1, 0.3, 0.0],
                      [1.0, 1.0, 2.0, 0.0], [0.0, -1.0, 1.5, -1.5], half=1.959964 * 0.1)  # fmt: skip
    se = rs.per_seed_se(study)["centre"]["16"][0]
    # saved deltas: their own standard error; derived ones: the sum of the parts' (a bound)
    assert se["net_utility - uniform"] == pytest.approx(0.1)
    assert se["energy - uniform"] == pytest.approx(0.2)
    assert se["data - energy"] == pytest.approx(0.2)
    res = rs.pool([("a", study)])
    iv = res["cells"]["centre"]["16"]["energy - uniform"]
    assert iv["estimate"] == pytest.approx(np.mean([0.8, 1.9, 0.2, 1.5]))
    lo, hi = iv["two_level_ci95"]
    blo, bhi = iv["two_level_rho1_ci95"]
    assert lo < iv["estimate"] < hi and blo <= lo and bhi >= hi  # rho = 1 is the wider
    # the grid headline is the per-seed mean of the two (here equal) cells
    g = res["grid"]["16"]["energy - uniform"]
    assert g["per_seed"] == iv["per_seed"] and g["seed_ci95"] == pytest.approx(iv["seed_ci95"])
    # Holm over every delta of the tables: 5 comparisons x 2 budgets x (2 cells + grid)
    assert res["multiplicity"]["family"] == 30
    assert all("p_holm" in v for v in res["cells"]["centre"]["32"].values())
    md = rs.markdown({"command": "c", "commit": None, **res})
    assert "## Headline" in md and "Holm" in md and "{" in md


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
    # the committed study.json files keep each seed's bootstrap interval: a two-level interval
    g = res["grid"]["16"]["energy - uniform"]
    assert g["n"] == 4 and g["two_level_ci95"] is not None
