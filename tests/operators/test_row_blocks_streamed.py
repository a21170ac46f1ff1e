"""TIES and DARE a block of rows at a time in a streamed merge: when one module's dense work
exceeds the working-memory budget (``_plan.DENSE_BYTES``, set tiny here), the operators merge a
few of its rows at a time (``_rows.row_blocks``, watched), chunk by chunk from PEFT folders, and
the result is the in-memory merge's: the same masks and ranks, updates to float32 rounding."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import peft
from netutility_jax.operators import _plan, _rows

SHAPES = {"self_attn.q_proj": (16, 16), "mlp.up_proj": (16, 24)}
LACKING = "model.layers.1.mlp.up_proj"  # task 2 lacks it
TINY = 4096  # chunk_bytes: one or two modules per chunk


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> list[str]:
    """Three PEFT folders of two layers: ragged ranks (4, 2, 3) and a module task 2 lacks."""
    root = tmp_path_factory.mktemp("row_blocks")
    rng = np.random.default_rng(0)
    out = []
    for task, r in enumerate((4, 2, 3)):
        ad = {}
        for layer in range(2):
            for mod, (d_in, d_out) in SHAPES.items():
                name = f"model.layers.{layer}.{mod}"
                if task == 2 and name == LACKING:
                    continue
                a = rng.normal(size=(d_in, r)) / np.sqrt(d_in)
                b = rng.normal(size=(r, d_out)) * 0.6 ** np.arange(r)[:, None] * (1 + task / 3)
                ad[name] = {"lora_a": a, "lora_b": b, "scale": 1.0}
        peft.save_adapter(ad, root / f"task{task}", base_model_name_or_path="org/base")
        out.append(str(root / f"task{task}"))
    return out


def _blocked(monkeypatch) -> list[int]:
    """The row counts of every row-block merge run from now on, the working memory 2 KiB."""
    monkeypatch.setattr(_plan, "DENSE_BYTES", 2048)
    calls: list[int] = []
    real = _rows.row_blocks  # (where the row-block merges call it)
    monkeypatch.setattr(
        _rows, "row_blocks", lambda a, b, rows: calls.append(rows) or real(a, b, rows)
    )
    return calls


def _assert_same(streamed, in_memory) -> None:
    (got, rep), (want, want_rep) = streamed, in_memory
    assert list(got) == list(want) and rep.ranks == want_rep.ranks
    for n in want:
        np.testing.assert_array_equal(np.asarray(rep.masks[n]), np.asarray(want_rep.masks[n]))
        du, ru = np.asarray(nu.module_update(got[n])), np.asarray(nu.module_update(want[n]))
        np.testing.assert_allclose(du, ru, rtol=2e-5, atol=2e-5 * np.abs(ru).max() + 1e-30)


@pytest.mark.parametrize(
    "scope, space",
    [
        ("module", "knots"),
        ("model", "knots"),
        pytest.param("model", "full", marks=pytest.mark.slow),
    ],
)
def test_ties_by_row_blocks_streamed_is_the_in_memory_merge(paths, monkeypatch, scope, space):
    blocked = _blocked(monkeypatch)
    kw = {"budget": 3, "method": "ties", "space": space, "trim_scope": scope, "density": 0.3}
    streamed = nu.merge_adapters_streaming(peft.open_adapters(paths), chunk_bytes=TINY, **kw)
    in_memory = nu.merge_adapters(peft.load_adapters(paths).adapters, **kw)
    assert blocked
    _assert_same(streamed, in_memory)


def test_dare_by_row_blocks_streamed_is_the_in_memory_whole_module_merge(paths, monkeypatch):
    """Each block draws its rows of the module's mask (keyed by the module's place in the whole
    model), so the streamed row-blocked merge is the in-memory merge of whole modules."""
    kw = {"budget": 3, "method": "dare_ties", "space": "knots", "p": 0.4, "key": jax.random.key(3)}
    in_memory = nu.merge_adapters(peft.load_adapters(paths).adapters, **kw)
    calls = _blocked(monkeypatch)
    streamed = nu.merge_adapters_streaming(peft.open_adapters(paths), chunk_bytes=TINY, **kw)
    assert calls
    _assert_same(streamed, in_memory)
