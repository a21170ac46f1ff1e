"""The per-task floor of the allocation (``min_share``) against a pure-Python reference, and
its use in the in-memory and streamed merges."""

from __future__ import annotations

import numpy as np
import pytest
from _reference import CLI_MODULES
from _reference import cli_adapters as _adapters

import netutility_jax as nu
from netutility_jax.allocation import _min_share
from netutility_jax.errors import InputError, InputTypeError

MODULES = CLI_MODULES


def _reference_floor(utils: dict, budget: int, scope: str, positive_only: bool, f: float):
    """The floor allocation written out with Python lists: each task's int(f * share) best
    admissible directions first, then the best of the rest up to the budget."""
    names = list(utils)
    m = utils[names[0]].shape[0]

    def select(entries, k, shares):
        # entries: (utility, flat index, task, (name, j, slot)); best first, lower index first
        entries = sorted(entries, key=lambda e: (-e[0], e[1]))
        ok = [e for e in entries if (e[0] > 0 if positive_only else e[0] > -np.inf)]
        floors = [min(int(f * shares[j]), sum(1 for e in ok if e[2] == j)) for j in range(m)]
        kept, taken = set(), [0] * m
        for e in ok:
            if taken[e[2]] < floors[e[2]]:
                kept.add(e[3])
                taken[e[2]] += 1
        for e in ok:
            if len(kept) >= k:
                break
            kept.add(e[3])
        return kept

    def entries_of(ns):
        out, off = [], 0
        for n in ns:
            u = utils[n]
            for j in range(m):
                for s in range(u.shape[1]):
                    out.append((float(u[j, s]), off + j * u.shape[1] + s, j, (n, j, s)))
            off += u.size
        return out

    def cand(n, j):
        return int(np.sum(utils[n][j] > -np.inf))

    kept = set()
    if scope == "global":
        shares = [min(budget * len(names) / m, sum(cand(n, j) for n in names)) for j in range(m)]
        kept = select(entries_of(names), budget * len(names), shares)
    else:
        for n in names:
            shares = [min(budget / m, cand(n, j)) for j in range(m)]
            kept |= select(entries_of([n]), budget, shares)
    return {
        n: np.array([[(n, j, s) in kept for s in range(utils[n].shape[1])] for j in range(m)])
        for n in names
    }


@pytest.mark.parametrize("scope", ["global", "local"])
@pytest.mark.parametrize("positive_only", [True, False])
def test_min_share_matches_a_pure_python_reference(scope, positive_only):
    """Task 0 scaled 30x interferes most and starves; the floor gives it its share back."""
    ads = nu.merging.weight_adapters(_adapters(), [30.0, 1.0, 1.0])
    sc = nu.score(ads)
    utils = {n: np.asarray(ms.utility, np.float64) for n, ms in sc.modules.items()}
    for f in (0.0, 0.25, 0.5, 1.0):
        got = _min_share.allocate_min_share(
            sc, 3, scope=scope, positive_only=positive_only, min_share=f
        )
        want = _reference_floor(utils, 3, scope, positive_only, f)
        for n in MODULES:
            np.testing.assert_array_equal(np.asarray(got[n]), want[n], err_msg=f"{n} f={f}")
    if not positive_only:  # the floor binds: task 0 keeps nothing without it, its share with it
        plain = nu.allocate(sc, 3, scope=scope, positive_only=False)
        full = _min_share.allocate_min_share(sc, 3, scope=scope, positive_only=False, min_share=1)
        assert sum(int(np.asarray(plain[n])[0].sum()) for n in MODULES) < 4
        assert sum(int(np.asarray(full[n])[0].sum()) for n in MODULES) == 4


@pytest.mark.parametrize("scope", ["global", "local"])
def test_a_floor_that_does_not_bind_is_allocate(scope):
    sc = nu.score(_adapters())
    for positive_only in (True, False):
        want = nu.allocate(sc, 2, scope=scope, positive_only=positive_only)
        got = _min_share.allocate_min_share(
            sc, 2, scope=scope, positive_only=positive_only, min_share=0.0
        )
        for n in MODULES:
            np.testing.assert_array_equal(np.asarray(got[n]), np.asarray(want[n]))


def test_min_share_in_merge_and_streamed_merge(tmp_path):
    ads = nu.merging.weight_adapters(_adapters(), [30.0, 1.0, 1.0])  # task 0 starves
    _, rep = nu.merge_adapters(ads, budget=3, positive_only=False, min_share=1.0)
    shares = _min_share.uniform_shares(_min_share.candidates(rep.scores), 3, scope="global")
    assert list(shares) == [4.0, 4.0, 4.0]  # 3 x 4 modules / 3 tasks, under every candidate count
    assert all(int(k) >= 4 for k in rep.kept_per_task) and rep.min_share == 1.0
    # a floor every task already meets changes nothing
    _, a = nu.merge_adapters(_adapters(), budget=3)
    _, b = nu.merge_adapters(_adapters(), budget=3, min_share=0.25)  # a floor of int(1.0) = 1
    assert list(a.kept_per_task) == list(b.kept_per_task) and min(a.kept_per_task) >= 1
    paths = []
    for i, ad in enumerate(ads):
        nu.peft.save_adapter(ad, tmp_path / f"t{i}")
        paths.append(tmp_path / f"t{i}")
    _, srep = nu.merge_adapters_streaming(
        nu.peft.open_adapters(paths), budget=3, positive_only=False, min_share=1.0
    )
    assert list(srep.kept_per_task) == list(rep.kept_per_task)


def test_min_share_is_checked():
    ads = _adapters()
    with pytest.raises(InputError, match=r"min_share=1\.5.*\[0, 1\]"):
        nu.merge_adapters(ads, budget=2, min_share=1.5)
    with pytest.raises(InputError, match="applies to allocation='net_utility'"):
        nu.merge_adapters(ads, budget=2, allocation="uniform", min_share=0.5)
    with pytest.raises(InputTypeError, match="min_share"):
        nu.merge_adapters(ads, budget=2, min_share="half")
