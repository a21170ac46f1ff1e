"""A merge's programs follow its size and method (netutility_jax/pipeline/_request.py
``sized_merge``): a small low-rank merge compiles them for speed of compiling on the CPU, a large
one or an elementwise method's with XLA's defaults; the merged modules agree."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax._core import executables as ex
from netutility_jax.pipeline import _fused

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU compile options")


def _adapters(d=24, r=4, m_tasks=3):
    rng = np.random.default_rng(0)
    return [
        {
            f"l{i}": {
                "lora_a": rng.normal(size=(d, r)).astype(np.float32),
                "lora_b": rng.normal(size=(r, d)).astype(np.float32),
                "scale": 1.0,
            }
            for i in range(3)
        }
        for _ in range(m_tasks)
    ]


def _close(x, y):
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.fixture
def chosen(monkeypatch):
    """``[(kernel name, fast?)]`` of every kernel call from here on (a spy on the kernels'
    choice of jitted function)."""
    calls = []
    pick = ex.Kernel._jit.fget

    def spy(self):
        jitted = pick(self)
        calls.append((self._name.rsplit(".", 1)[-1], jitted is self._fast))
        return jitted

    monkeypatch.setattr(ex.Kernel, "_jit", property(spy))
    return calls


def _fast(calls, name):
    picks = {fast for n, fast in calls if n == name}
    assert picks, f"{name} was not called"
    return picks


@pytest.mark.parametrize("small", [True, False])
def test_a_low_rank_merges_programs_follow_its_size(monkeypatch, chosen, small):
    """nu.merge_adapters (TA) of a small set runs its one program (scores, allocation and
    merge: pipeline/_fused.py) compiled for speed of compiling, of a set over SMALL_BYTES with
    XLA's defaults; the merged modules agree either way."""
    ads = _adapters()
    if not small:
        monkeypatch.setattr(ex, "SMALL_BYTES", ex.factor_bytes(ads) - 1)
    merged, _ = nu.merge_adapters(ads, budget=2, method="ta", space="full")
    assert _fast(chosen, "fused_program") == {small}
    chosen.clear()
    monkeypatch.setattr(ex, "SMALL_BYTES", ex.factor_bytes(ads) - 1 if small else 1 << 40)
    other, _ = nu.merge_adapters(ads, budget=2, method="ta", space="full")
    assert _fast(chosen, "fused_program") == {not small}
    _close(merged, other)


@pytest.mark.parametrize("small", [True, False])
def test_the_stages_programs_follow_the_size_too(monkeypatch, chosen, small):
    """Where the one program declines (here forced), the stages: the TA program follows the
    size, the scoring program is compiled for speed of compiling whatever the size."""
    monkeypatch.setattr(_fused, "fused_ta", lambda *a, **k: None)
    ads = _adapters()
    if not small:
        monkeypatch.setattr(ex, "SMALL_BYTES", ex.factor_bytes(ads) - 1)
    merged, _ = nu.merge_adapters(ads, budget=2, method="ta", space="full")
    assert _fast(chosen, "ta_program") == {small}
    assert _fast(chosen, "score_impl") == {True}
    chosen.clear()
    monkeypatch.setattr(ex, "SMALL_BYTES", ex.factor_bytes(ads) - 1 if small else 1 << 40)
    other, _ = nu.merge_adapters(ads, budget=2, method="ta", space="full")
    assert _fast(chosen, "ta_program") == {not small}
    _close(merged, other)


@pytest.mark.parametrize(
    "method, space, options",
    [("ties", "knots", {"density": 0.5}), ("tsv", "core", {})],
)
def test_other_methods_keep_xlas_defaults_however_small(chosen, method, space, options):
    """TIES's dense coordinates and TSV's spectral steps ran several times slower at LLVM's
    level 0: their programs keep the defaults even for a tiny set (the scoring's does not)."""
    nu.merge_adapters(_adapters(), budget=2, method=method, space=space, **options)
    assert _fast(chosen, "merge_program") == {False}
    assert _fast(chosen, "score_impl") == {True}
