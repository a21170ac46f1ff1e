"""A streamed merge whose set is one chunk (``netutility_jax/pipeline/_stream_merge.py``,
``merge_one_chunk``): read once and merged by the one program of the in-memory merge (TA's, or
every other method's), the same masks, merge and report as the chunked passes and as
``nu.merge_adapters``; the passes where that program does not take the merge or a flag sends it
back."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import safetensors.numpy

import netutility_jax as nu
from netutility_jax import InputError, peft
from netutility_jax.pipeline import _fused, _fused_stages
from netutility_jax.pipeline.streaming import merge_adapters_streaming

SHAPES = {"q_proj": (16, 16), "up_proj": (16, 24)}
TINY = 4096  # chunk_bytes: a module or two a chunk
LACKING = "model.layers.1.up_proj"  # task 2 lacks it


def _write(root, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(3):
        ad = {}
        for layer in range(3):
            for kind, (d_in, d_out) in SHAPES.items():
                name = f"model.layers.{layer}.{kind}"
                if i == 2 and name == LACKING:
                    continue
                r = 2 if i == 1 else 4  # ragged ranks
                b = rng.normal(size=(r, d_out)) * (0.6 ** np.arange(r))[:, None] * (1 + 0.4 * i)
                ad[name] = {"lora_a": rng.normal(size=(d_in, r)) / 4, "lora_b": b}
        p = root / f"task{i}"
        peft.save_adapter(ad, p)
        out.append(str(p))
    return out


class _Reads:
    """An AdapterSet whose reads are counted."""

    def __init__(self, source):
        self._source, self.calls = source, []

    def __getattr__(self, name):
        return getattr(self._source, name)

    def read(self, names, **kw):
        self.calls.append(tuple(names))
        return self._source.read(names, **kw)


@pytest.fixture
def took(monkeypatch):
    """The results of the one-program routes (TA's and the other methods') in this test."""
    seen = []

    def spy(real):
        def call(*args, **kwargs):
            seen.append(real(*args, **kwargs))
            return seen[-1]

        return call

    monkeypatch.setattr(_fused, "fused_ta", spy(_fused.fused_ta))
    monkeypatch.setattr(_fused_stages, "fused_merge", spy(_fused_stages.fused_merge))
    return seen


def _update(mod):
    return np.asarray(nu.module_update(mod), np.float64)


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"alpha": "auto", "space": "core"},
        {"lam": 0.0},
        {"method": "tsv", "space": "core"},
        {"method": "ties", "space": "knots", "density": 0.3, "alpha": "auto"},
        {"method": "dare_ties", "space": "core", "p": 0.3, "seed": 3},
        {"method": "iso_cts", "space": "full", "scope": "local"},
    ],
)
def test_one_chunk_is_read_once_and_merged_as_the_chunked_passes_merge_it(tmp_path, took, opts):
    paths = _write(tmp_path)
    opts = dict(opts)
    if "seed" in opts:
        opts["key"] = jax.random.key(opts.pop("seed"))
    kw = {"budget": 3, "method": "ta", **opts}
    source = _Reads(peft.open_adapters(paths))
    seen, steps = [], []
    got, rep = merge_adapters_streaming(
        source, on_chunk=lambda mods: seen.append(list(mods)) or mods,
        progress=lambda done, total: steps.append((done, total)), **kw,
    )  # fmt: skip
    assert len(took) == 1 and took[0] is not None  # the one program ran
    assert source.calls == [tuple(source.names)]  # one read of every module
    assert seen == [list(source.names)] and list(got) == list(source.names)
    assert steps == [(0, 2), (2, 2)]  # two reads announced, one made
    chunked, crep = merge_adapters_streaming(peft.open_adapters(paths), chunk_bytes=TINY, **kw)
    assert len(took) == 1  # (several chunks: the passes)
    ref, rref = nu.merge_adapters(peft.load_adapters(paths).adapters, **kw)
    for other, orep in ((chunked, crep), (ref, rref)):
        assert rep.ranks == orep.ranks and rep.alpha == orep.alpha
        assert rep.lam == pytest.approx(orep.lam, rel=1e-6)
        assert rep.heterogeneity == pytest.approx(orep.heterogeneity, rel=1e-5)
        for n in source.names:
            np.testing.assert_array_equal(rep.masks[n], orep.masks[n], err_msg=n)
            want = _update(other[n])
            np.testing.assert_allclose(_update(got[n]), want, atol=1e-5 * np.abs(want).max())
    assert rep.ranks[LACKING] > 0


@pytest.mark.parametrize(
    "kw",
    [
        {"method": "ties", "space": "full"},
        {"weights": [1.0, 0.5, 2.0]},
        {"allocation": "all"},
        {"min_share": 0.5},
    ],
    ids=["ties_full", "weights", "all", "min_share"],
)
def test_what_the_program_does_not_take_runs_the_passes(tmp_path, took, kw):
    paths = _write(tmp_path)
    source = _Reads(peft.open_adapters(paths))
    merge_adapters_streaming(source, **{"budget": 3, **kw})
    assert took == []  # never asked: nothing read for it
    assert len(source.calls) == (1 if kw.get("allocation") == "all" else 2)


def test_a_flag_sends_the_chunk_back_to_the_passes_and_their_error(tmp_path, took):
    paths = _write(tmp_path)
    f = f"{paths[1]}/adapter_model.safetensors"  # a NaN written into task 1's file
    tensors = safetensors.numpy.load_file(f)
    key = next(k for k in tensors if "layers.2.q_proj.lora_B" in k)
    tensors[key][0, 0] = np.nan
    safetensors.numpy.save_file(tensors, f)
    with pytest.raises(InputError, match=r"model\.layers\.2\.q_proj") as one:
        merge_adapters_streaming(peft.open_adapters(paths), budget=3)
    assert took == [None]
    with pytest.raises(InputError) as chunked:
        merge_adapters_streaming(peft.open_adapters(paths), budget=3, chunk_bytes=TINY)
    assert str(one.value) == str(chunked.value)


def test_factors_beyond_the_raw_grams_range_take_the_passes_exact_route(tmp_path, took):
    """Entries beyond 2^+-40 (a module's A scaled down and B up by 2^45, the same update):
    the program's raw Grams are refused, the passes score on normalised factors."""
    paths = _write(tmp_path / "plain")
    scaled = _write(tmp_path / "scaled")
    f = f"{scaled[0]}/adapter_model.safetensors"
    tensors = safetensors.numpy.load_file(f)
    for k in tensors:
        if "layers.0.q_proj" in k:
            tensors[k] *= np.float32(2.0**-45 if "lora_A" in k else 2.0**45)
    safetensors.numpy.save_file(tensors, f)
    got, rep = merge_adapters_streaming(peft.open_adapters(scaled), budget=3)
    assert took == [None]
    want, wrep = merge_adapters_streaming(peft.open_adapters(paths), budget=3)
    assert took[1] is not None
    for n in want:
        np.testing.assert_array_equal(rep.masks[n], wrep.masks[n])
        ref = _update(want[n])
        np.testing.assert_allclose(_update(got[n]), ref, atol=1e-5 * np.abs(ref).max())
