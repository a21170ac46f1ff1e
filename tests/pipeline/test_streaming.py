"""Streaming merges from disk (``netutility_jax.streaming``, ``nu.peft.open_adapters``).

The streamed merge is checked against the in-memory one on the same PEFT folders
(``nu.merge_adapters(nu.peft.load_adapters(paths).adapters, ...)``): identical masks and reports,
merged updates to float32 rounding. Its memory bound is checked as an invariant of the reads: with
a small ``chunk_bytes`` no read asks for more than one chunk, and each pass reads every module
exactly once.
"""

from __future__ import annotations

import gc
import json
import math
import os
import struct
import weakref

import jax
import numpy as np
import pytest
import safetensors.numpy

import netutility_jax as nu
from netutility_jax import peft
from netutility_jax.errors import InputError, InputTypeError
from netutility_jax.pipeline.streaming import merge_adapters_streaming, plan_chunks

SHAPES = {"self_attn.q_proj": (16, 16), "mlp.up_proj": (16, 24)}
LAYERS = 3
TASK_SCALES = (1.0, 1.6, 0.8, 1.2)  # h = Var log-energy: away from the alpha='auto' threshold
LACKING = "model.layers.1.mlp.up_proj"  # task 3 lacks it
TINY = 4096  # chunk_bytes: one or two modules per chunk


def _adapter(rng: np.random.Generator, task: int) -> dict:
    ad = {}
    for layer in range(LAYERS):
        for mod, (d_in, d_out) in SHAPES.items():
            name = f"model.layers.{layer}.{mod}"
            if task == 3 and name == LACKING:
                continue
            # ragged ranks: task 1 is rank 2, task 2 rank 3 on q_proj (a rank_pattern), else 4
            r = 2 if task == 1 else 3 if task == 2 and "q_proj" in mod else 4
            decay = 0.6 ** np.arange(r)
            a = rng.normal(size=(d_in, r)) / np.sqrt(d_in)
            b = rng.normal(size=(r, d_out)) * decay[:, None] * TASK_SCALES[task]
            ad[name] = {"lora_a": a, "lora_b": b, "scale": 1.0}
    return ad


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> list[str]:
    """Four PEFT folders: ragged ranks, a module one task lacks, a bf16 task, an rsLoRA task."""
    root = tmp_path_factory.mktemp("streaming")
    rng = np.random.default_rng(0)
    out = []
    for i in range(4):
        p = root / f"task{i}"
        peft.save_adapter(
            _adapter(rng, i), p, dtype="bfloat16" if i == 2 else "float32",
            base_model_name_or_path="org/base",
        )  # fmt: skip
        if i == 1:  # rsLoRA: PEFT's scale becomes lora_alpha / sqrt(r)
            cfg = json.loads((p / peft.CONFIG_NAME).read_text())
            cfg["use_rslora"] = True
            (p / peft.CONFIG_NAME).write_text(json.dumps(cfg))
        out.append(str(p))
    return out


@pytest.fixture(scope="module")
def loaded(paths):
    return peft.load_adapters(paths)


class _Spy:
    """An AdapterSet whose reads are recorded."""

    def __init__(self, source):
        self._source = source
        self.calls: list[tuple[str, ...]] = []

    def __getattr__(self, name):
        return getattr(self._source, name)

    def read(self, names, **kw):
        self.calls.append(tuple(names))
        return self._source.read(names, **kw)


class _Released(_Spy):
    """A :class:`_Spy` that checks, at each read, that every factor of the chunks read before
    is gone: the merge holds one chunk at a time (the previous one is dropped before the next
    is read, not when its loop variable is next rebound)."""

    def __init__(self, source):
        super().__init__(source)
        self.alive: list[weakref.ref] = []
        self.lingering = 0

    def read(self, names, **kw):
        # An array kept only by a reference cycle goes at the next collection, which the timing
        # of a test run decides (a loop variable holding the chunk is no cycle): collect before
        # counting, but only when something is alive (a full collection in a worker that has run
        # many tests costs seconds, at every read).
        if any(r() is not None for r in self.alive):
            gc.collect()
        self.lingering += sum(r() is not None for r in self.alive)
        out = super().read(names, **kw)
        self.alive = [
            weakref.ref(m[f]) for ad in out for m in ad.values() if m for f in ("lora_a", "lora_b")
        ]
        return out


# ------------------------------------------------------------------------------ open_adapters


def test_read_all_equals_load_adapters(paths, loaded):
    s = peft.open_adapters(paths)
    assert s.paths == tuple(paths)
    assert list(s.names) == list(loaded.adapters[0])
    assert s.config == loaded.config
    assert s.coverage == loaded.coverage
    assert s.coverage[LACKING] == (0, 1, 2)
    got = s.read(s.names)
    assert len(got) == len(loaded.adapters)
    _assert_read_is_loaded(got, loaded)
    # rsLoRA (task 1, r = 2, lora_alpha = r): scale sqrt(2); the others lora_alpha / r = 1
    assert got[1]["model.layers.0.self_attn.q_proj"]["scale"] == pytest.approx(math.sqrt(2))
    for n, (d_in, d_out, r_max) in s.shapes.items():
        mods = [ad[n] for ad in loaded.adapters if ad[n] is not None]
        assert (d_in, d_out) == mods[0]["lora_a"].shape[:1] + mods[0]["lora_b"].shape[1:]
        assert r_max == max(m["lora_a"].shape[1] for m in mods)


def test_read_host_equals_device_read(paths, loaded):
    # host=True: numpy arrays (no device copy), the same values and layout as load_adapters
    s = peft.open_adapters(paths)
    _assert_read_is_loaded(s.read(s.names, host=True), loaded, host=True)


def _assert_read_is_loaded(got, loaded, *, host=False):
    """``AdapterSet.read``'s modules are ``load_adapters``' (numpy arrays with ``host``)."""
    for mine, ref in zip(got, loaded.adapters, strict=True):
        assert list(mine) == list(ref)
        for n in ref:
            if ref[n] is None:
                assert mine[n] is None
                continue
            assert mine[n]["scale"] == ref[n]["scale"]
            for k in ("lora_a", "lora_b"):
                if host:
                    assert isinstance(mine[n][k], np.ndarray), type(mine[n][k])
                assert mine[n][k].dtype == ref[n][k].dtype
                assert mine[n][k].shape == ref[n][k].shape
                np.testing.assert_array_equal(np.asarray(mine[n][k]), np.asarray(ref[n][k]))


def test_read_subset_and_nbytes(paths, loaded):
    s = peft.open_adapters(paths)
    part = [s.names[4], s.names[1], LACKING]
    got = s.read(part)
    assert [list(ad) for ad in got] == [part] * 4
    assert got[3][LACKING] is None
    np.testing.assert_array_equal(
        np.asarray(got[2][s.names[4]]["lora_a"]),
        np.asarray(loaded.adapters[2][s.names[4]]["lora_a"]),
    )
    # the files hold only the factors: their bytes are the file size less the header
    total = 0
    for p in paths:
        f = os.path.join(p, peft.WEIGHTS_NAME)
        with open(f, "rb") as fh:
            (header,) = struct.unpack("<Q", fh.read(8))
        total += os.path.getsize(f) - 8 - header
    assert s.nbytes == total
    assert s.stored_dtypes == ("BF16", "F32")
    with pytest.raises(InputError, match="not among the adapters' modules"):
        s.read(["model.nope"])
    with pytest.raises(InputError, match="repeated"):
        s.read([s.names[0], s.names[0]])


def _write(d, tensors, cfg):
    d.mkdir()
    safetensors.numpy.save_file(tensors, str(d / peft.WEIGHTS_NAME))
    (d / peft.CONFIG_NAME).write_text(json.dumps(cfg))
    return str(d)


def _lora(d_in, d_out, r=2, dtype=np.float32, name="model.q"):
    return {
        f"base_model.model.{name}.lora_A.weight": np.ones((r, d_in), dtype),
        f"base_model.model.{name}.lora_B.weight": np.ones((d_out, r), dtype),
    }


@pytest.mark.parametrize(
    "case", ["shapes", "base", "targets", "non_lora", "int_factors", "rank", "empty"]
)
def test_open_refuses_what_load_refuses(tmp_path, case):
    cfg = {"r": 2, "lora_alpha": 2, "base_model_name_or_path": "org/base"}
    a = _write(tmp_path / "a", _lora(8, 4), cfg)
    kw = {}
    if case == "shapes":
        b = _write(tmp_path / "b", _lora(8, 6), cfg)
    elif case == "base":
        b = _write(tmp_path / "b", _lora(8, 4), {**cfg, "base_model_name_or_path": "org/other"})
    elif case == "targets":
        b = _write(tmp_path / "b", _lora(8, 4, name="model.k"), cfg)
        kw = {"strict_targets": True}
    elif case == "non_lora":
        b = _write(tmp_path / "b", {**_lora(8, 4), "base_model.model.head.weight": np.ones(3)}, cfg)
    elif case == "int_factors":
        b = _write(tmp_path / "b", _lora(8, 4, dtype=np.int32), cfg)
    elif case == "rank":
        b = _write(tmp_path / "b", _lora(8, 4, r=3), cfg)
    else:
        b = None
    ps = [] if b is None else [a, b]
    with pytest.raises((InputError, InputTypeError)) as ref:
        peft.load_adapters(ps, **kw)
    with pytest.raises(type(ref.value)) as got:
        peft.open_adapters(ps, **kw)

    def body(e):
        return str(e.value).split(": ", 1)[1]

    if case == "empty":
        assert "non-empty list of adapter directories" in str(got.value)
    else:
        assert body(got) == body(ref)


# ------------------------------------------------------------------------------ plan_chunks


def test_plan_chunks_partition_shapes_and_sizes():
    shapes = {f"m{i}": ((8, 8, 2) if i % 3 else (8, 4, 2)) for i in range(12)}
    per = 3 * 2 * (8 + 8) * 4  # M r (d_in + d_out) bytes: 384
    chunks = plan_chunks(shapes, 3, chunk_bytes=3 * per, itemsize=4)
    assert sorted(n for c in chunks for n in c) == sorted(shapes)
    for c in chunks:
        assert len({shapes[n] for n in c}) == 1
        order = [n for n in shapes if n in c]
        assert list(c) == order
    big = [c for c in chunks if shapes[c[0]] == (8, 8, 2)]
    assert [len(c) for c in big] == [2, 2, 2, 2]  # 8 modules, at most 3 fit: runs of 2
    assert plan_chunks(shapes, 3, chunk_bytes=1, itemsize=4) == [(n,) for n in _grouped(shapes)]


def test_plan_chunks_packs_whole_small_groups_together():
    """Groups that fit whole share a chunk while their sum fits (a small set is one chunk: one
    scoring and one merge program per pass, not one per shape); a group too large is cut as
    before and never shares; every module once, in group order; no chunk over the limit."""
    shapes = {
        "a0": (8, 8, 2), "b0": (8, 4, 2), "a1": (8, 8, 2), "d0": (8, 4, 1), "c0": (16, 16, 4),
    }  # fmt: skip
    size = {s: 3 * s[2] * (s[0] + s[1]) * 4 for s in set(shapes.values())}
    assert plan_chunks(shapes, 3, chunk_bytes=10**6, itemsize=4) == [("a0", "a1", "b0", "d0", "c0")]
    # room for the a and b groups together, not for d's as well; c's alone is too large
    limit = 2 * size[(8, 8, 2)] + size[(8, 4, 2)]
    chunks = plan_chunks(shapes, 3, chunk_bytes=limit, itemsize=4)
    assert chunks == [("a0", "a1", "b0"), ("d0",), ("c0",)]
    # a group cut into runs is on its own (a0, a1); the next groups that fit are packed
    limit = size[(8, 4, 2)] + size[(8, 4, 1)]
    assert plan_chunks(shapes, 3, chunk_bytes=limit, itemsize=4) == [
        ("a0",), ("a1",), ("b0", "d0"), ("c0",)
    ]  # fmt: skip
    for c in chunks:  # (a single module larger than the limit is a chunk of its own)
        assert (
            len(c) == 1 or sum(size[shapes[n]] for n in c) <= 2 * size[(8, 8, 2)] + size[(8, 4, 2)]
        )


def _grouped(shapes):
    return [n for s in dict.fromkeys(shapes.values()) for n in shapes if shapes[n] == s]


# ------------------------------------------------------------------------------ merges


def _assert_same(streamed, in_memory, *, exact_masks=True):
    (got, rep), (ref, ref_rep) = streamed, in_memory
    assert list(got) == list(ref)
    for n in ref:
        assert set(got[n]) == set(ref[n])
        du, ru = np.asarray(nu.module_update(got[n])), np.asarray(nu.module_update(ref[n]))
        np.testing.assert_allclose(du, ru, rtol=2e-5, atol=2e-5 * np.abs(ru).max() + 1e-30)
    for f in ("budget", "budget_spent", "non_prefix_fraction", "ranks", "method", "space"):
        assert getattr(rep, f) == getattr(ref_rep, f), f
    assert (rep.allocation, rep.scope) == (ref_rep.allocation, ref_rep.scope)
    assert rep.kept.keys() == ref_rep.kept.keys()
    for n in rep.kept:
        np.testing.assert_array_equal(rep.kept[n], ref_rep.kept[n])
        np.testing.assert_array_equal(np.asarray(rep.masks[n]), np.asarray(ref_rep.masks[n]))
    np.testing.assert_array_equal(rep.kept_per_task, ref_rep.kept_per_task)
    np.testing.assert_allclose(rep.heterogeneity, ref_rep.heterogeneity, rtol=1e-5)
    if ref_rep.scores is None:
        assert rep.scores is None and rep.lam is None and rep.alpha is None
        return
    assert rep.alpha == ref_rep.alpha
    np.testing.assert_allclose(rep.lam, ref_rep.lam, rtol=1e-6)
    assert list(rep.scores.modules) == list(ref_rep.scores.modules)
    for n, ms in rep.scores.modules.items():
        for f, x in ms._asdict().items():
            y = np.asarray(getattr(ref_rep.scores.modules[n], f))
            np.testing.assert_allclose(np.asarray(x), y, rtol=1e-5, atol=1e-7, err_msg=f"{n} {f}")


def _both(paths, loaded, **kw):
    source = _Spy(peft.open_adapters(paths))
    streamed = merge_adapters_streaming(source, chunk_bytes=TINY, **kw)
    in_memory = nu.merge_adapters(loaded.adapters, **kw)
    return streamed, in_memory, source


@pytest.mark.parametrize(
    "allocation, alpha, lam",
    [
        pytest.param("net_utility", "auto", "auto", marks=pytest.mark.slow),  # 16 s
        pytest.param("net_utility", 0.0, "auto", marks=pytest.mark.slow),
        pytest.param("net_utility", 1.0, 0.3, marks=pytest.mark.slow),  # 14 s
        pytest.param("net_utility", "auto", 0.3, marks=pytest.mark.slow),
        pytest.param("uniform", "auto", "auto", marks=pytest.mark.slow),
        ("uniform", 0.0, 0.3),
        pytest.param("all", 1.0, "auto", marks=pytest.mark.slow),
    ],
)
def test_scoring_and_allocation_match_in_memory(paths, loaded, allocation, alpha, lam):
    """(The combinations marked slow run with ``pytest -m slow``; the default suite keeps one of
    each path: alpha auto / fixed, lam auto / fixed, net utility / uniform.)"""
    streamed, in_memory, _ = _both(
        paths, loaded, budget=3, method="ta", space="core", allocation=allocation, alpha=alpha,
        lam=lam,
    )  # fmt: skip
    _assert_same(streamed, in_memory)


def test_alpha_auto_picks_what_in_memory_picks(loaded):
    h = float(nu.heterogeneity(loaded.adapters))
    assert abs(h - 1.0) > 0.05  # the fixture keeps the rule away from its threshold
    rep = nu.merge_adapters(loaded.adapters, budget=3, alpha="auto")[1]
    assert rep.alpha == (0.0 if h > 1.0 else 1.0)


def _scaled_set(root, scales, seed=3):
    """The fixture's four tasks with each task's ``lora_b`` times ``scales[i]``."""
    rng = np.random.default_rng(seed)
    out = []
    for i, c in enumerate(scales):
        ad = {n: {**m, "lora_b": m["lora_b"] * c} for n, m in _adapter(rng, i).items()}
        peft.save_adapter(ad, root / f"task{i}", base_model_name_or_path="org/base")
        out.append(str(root / f"task{i}"))
    return out


def test_alpha_auto_above_the_threshold_is_the_in_memory_merge(tmp_path):
    """Tasks of very different sizes (h > 1): the pass that scores both geometries at once picks
    alpha = 0 from the energies it summed on the way, as the in-memory merge does, and reads
    every chunk twice in all (scores, merge), not three times."""
    ps = _scaled_set(tmp_path, (1.0, 20.0, 0.05, 5.0))
    loaded = peft.load_adapters(ps)
    assert float(nu.heterogeneity(loaded.adapters)) > 1.5
    streamed, in_memory, source = _both(
        ps, loaded, budget=3, method="ta", space="core", alpha="auto"
    )
    assert streamed[1].alpha == 0.0
    _assert_same(streamed, in_memory)
    chunks = plan_chunks(source.shapes, 4, chunk_bytes=TINY, itemsize=4)
    assert len(source.calls) == 2 * len(chunks)


def test_unrepresentable_scores_streamed_fail_as_in_memory(tmp_path):
    """One task 1e25 times larger: its interference (about 1e50) is beyond float32. The both-
    geometries pass defers that check until h has picked alpha; then it raises nu.score's error,
    word for word the in-memory one."""
    ps = _scaled_set(tmp_path, (1.0, 1e25, 1.0, 1.0))
    with pytest.raises(InputError, match="interference") as ref:
        nu.merge_adapters(peft.load_adapters(ps).adapters, budget=3, alpha="auto")
    with pytest.raises(InputError, match="interference") as got:
        merge_adapters_streaming(peft.open_adapters(ps), budget=3, alpha="auto", chunk_bytes=TINY)
    assert str(got.value) == str(ref.value)


@pytest.mark.parametrize(
    "method, space, options",
    [
        pytest.param("ta", "full", {}, marks=pytest.mark.slow),
        pytest.param("ta", "knots", {}, marks=pytest.mark.slow),
        pytest.param("tsv", "full", {}, marks=pytest.mark.slow),
        ("tsv", "core", {}),
        pytest.param("tsv", "knots", {}, marks=pytest.mark.slow),
        ("ties", "core", {"density": 0.4}),
        pytest.param("dare", "core", {"p": 0.3}, marks=pytest.mark.slow),
        pytest.param("dare", "full", {"p": 0.3}, marks=pytest.mark.slow),
    ],
)
def test_methods_match_in_memory(paths, loaded, method, space, options):
    key = jax.random.key(7) if method == "dare" else None
    streamed, in_memory, _ = _both(
        paths, loaded, budget=4, method=method, space=space, key=key, **options
    )
    _assert_same(streamed, in_memory)


@pytest.mark.parametrize(
    "allocation, alpha, passes",
    [
        ("net_utility", "auto", 2),  # alpha's energies come with the scores: no third read
        pytest.param("uniform", 1.0, 2, marks=pytest.mark.slow),
        pytest.param("all", 1.0, 1, marks=pytest.mark.slow),
    ],
)
def test_reads_one_chunk_at_a_time_each_module_once_per_pass(
    paths, loaded, allocation, alpha, passes
):
    source = _Released(peft.open_adapters(paths))
    merge_adapters_streaming(
        source, budget=3, method="ta", space="core", allocation=allocation, alpha=alpha,
        chunk_bytes=TINY,
    )  # fmt: skip
    assert source.lingering == 0  # each chunk dropped before the next read
    names = list(source.names)
    chunks = plan_chunks(source.shapes, 4, chunk_bytes=TINY, itemsize=4)
    assert len(chunks) > len(set(source.shapes.values()))  # the budget really cuts buckets
    for call in source.calls:
        assert call in chunks  # never more than one chunk's modules at once
        d_in, d_out, r_max = source.shapes[call[0]]
        assert len(call) == 1 or len(call) * 4 * r_max * (d_in + d_out) * 4 <= TINY
    assert len(source.calls) == passes * len(chunks)
    for p in range(passes):
        read = [n for call in source.calls[p * len(chunks) : (p + 1) * len(chunks)] for n in call]
        assert sorted(read) == sorted(names)  # every module once per pass


@pytest.mark.parametrize(
    "space, allocation",
    [
        pytest.param("full", "net_utility", marks=pytest.mark.slow),
        ("core", "net_utility"),
        pytest.param("knots", "net_utility", marks=pytest.mark.slow),
        pytest.param("knots", "all", marks=pytest.mark.slow),  # 10 s
        pytest.param("full", "all", marks=pytest.mark.slow),
    ],
)
def test_model_wide_ties_streamed_is_the_in_memory_merge(paths, loaded, space, allocation):
    """One threshold per task over every entry of every module, found chunk by chunk from disk:
    the in-memory merge's masks, ranks and updates; reads: the scores (and energies for
    alpha='auto'), then four of every chunk (common unit, two radix passes, merge), one chunk at
    a time."""
    kw = {"budget": 3, "method": "ties", "space": space, "trim_scope": "model", "density": 0.3}
    streamed, in_memory, source = _both(paths, loaded, allocation=allocation, **kw)
    _assert_same(streamed, in_memory)
    if space == "full":  # the same entries, kept at the same thresholds: exactly equal
        for n, m in in_memory[0].items():
            np.testing.assert_array_equal(
                np.asarray(streamed[0][n]["delta"]), np.asarray(m["delta"])
            )
    chunks = plan_chunks(source.shapes, 4, chunk_bytes=TINY, itemsize=4)
    assert all(call in chunks for call in source.calls)
    before = 0 if allocation == "all" else 1  # the scores (alpha=1: no energies pass)
    assert len(source.calls) == (before + 4) * len(chunks)
    # and it differs from TIES per module, so the global threshold really is used
    per_module = nu.merge_adapters(
        loaded.adapters, allocation=allocation, **{**kw, "trim_scope": "module"}
    )
    assert any(
        not np.allclose(nu.module_update(streamed[0][n]), nu.module_update(per_module[0][n]))
        for n in per_module[0]
    )


def test_model_wide_ties_ties_at_the_threshold_are_kept_in_flat_order(tmp_path):
    """Factors of small integers: many equal magnitudes at each task's threshold, more than fit,
    so which of them are kept depends on the flat module order carried across chunks."""
    rng = np.random.default_rng(3)
    folders = []
    for t in range(3):
        ad = {
            f"model.layers.{layer}.self_attn.q_proj": {
                "lora_a": rng.integers(-1, 2, size=(8, 2)).astype(np.float64),
                "lora_b": rng.integers(-1, 2, size=(2, 8)).astype(np.float64),
                "scale": 1.0,
            }
            for layer in range(6)
        }
        folders.append(str(tmp_path / f"t{t}"))
        peft.save_adapter(ad, folders[-1])
    kw = {"budget": 2, "method": "ties", "space": "full", "trim_scope": "model", "density": 0.37}
    kw["allocation"] = "all"
    ref, _ = nu.merge_adapters(peft.load_adapters(folders).adapters, **kw)
    got, _ = merge_adapters_streaming(peft.open_adapters(folders), chunk_bytes=600, **kw)
    assert len(plan_chunks(peft.open_adapters(folders).shapes, 3, chunk_bytes=600, itemsize=4)) > 1
    for n in ref:
        np.testing.assert_array_equal(np.asarray(got[n]["delta"]), np.asarray(ref[n]["delta"]))
    assert any(np.asarray(ref[n]["delta"]).any() for n in ref)


def test_one_chunk_of_everything_is_the_in_memory_merge(paths, loaded):
    kw = {"budget": 3, "method": "tsv", "space": "core", "alpha": 1.0}
    got, rep = merge_adapters_streaming(peft.open_adapters(paths), chunk_bytes=1 << 30, **kw)
    ref, ref_rep = nu.merge_adapters(loaded.adapters, **kw)
    for n in ref:
        np.testing.assert_allclose(
            np.asarray(nu.module_update(got[n])), np.asarray(nu.module_update(ref[n])), rtol=2e-5,
            atol=1e-6,
        )  # fmt: skip
    assert rep.ranks == ref_rep.ranks


def test_on_chunk_sees_each_chunk_and_its_result_is_kept(paths, loaded):
    seen = []

    def truncate(mods):
        seen.append(tuple(mods))
        return {n: nu.to_lora(m, 1) for n, m in mods.items()}

    source = peft.open_adapters(paths)
    got, rep = merge_adapters_streaming(
        source, budget=3, method="ties", space="full", density=0.5, chunk_bytes=TINY,
        on_chunk=truncate,
    )  # fmt: skip
    assert seen == plan_chunks(source.shapes, 4, chunk_bytes=TINY, itemsize=4)
    assert set(rep.ranks.values()) == {1}
    ref, _ = nu.merge_adapters(loaded.adapters, budget=3, method="ties", space="full", density=0.5)
    n = source.names[0]
    np.testing.assert_allclose(
        np.asarray(nu.module_update(got[n])),
        np.asarray(nu.module_update(nu.to_lora(ref[n], 1))),
        rtol=1e-4,
        atol=1e-6,
    )


def test_refusals(paths, monkeypatch):
    source = peft.open_adapters(paths)
    # model-wide TIES streams in one process only: refused before any exchange, so every process
    # of a distributed run raises the same error and none waits for the others
    from netutility_jax.pipeline import _exchange, streaming

    monkeypatch.setattr(streaming._exchange, "current", lambda fn, d: _exchange.Exchange(1, 2))
    with pytest.raises(InputError, match=r"trim_scope='model'.* not split between 2 processes"):
        merge_adapters_streaming(source, budget=3, method="ties", trim_scope="model")
    monkeypatch.undo()
    with pytest.raises(InputTypeError, match="AdapterSet"):
        merge_adapters_streaming([{}], budget=3)
    with pytest.raises(InputError, match="chunk_bytes=0"):
        merge_adapters_streaming(source, budget=3, chunk_bytes=0)
    with pytest.raises(InputTypeError, match="chunk_bytes"):
        merge_adapters_streaming(source, budget=3, chunk_bytes=1.5)
    # merge_adapters' own checks, under this function's name
    with pytest.raises(InputError, match=r"nu\.merge_adapters_streaming: budget=0"):
        merge_adapters_streaming(source, budget=0)
    with pytest.raises(InputError, match=r"nu\.merge_adapters_streaming: .*key"):
        merge_adapters_streaming(source, budget=3, method="dare", p=0.5)  # no key


@pytest.mark.slow
def test_bad_inputs_fail_as_in_memory(tmp_path):
    """A NaN factor and an all-zero task: the same errors (and NaN h) as in memory."""
    cfg = {"r": 2, "lora_alpha": 2}
    rng = np.random.default_rng(1)
    ps = []
    for i in range(3):
        t = {}
        for layer in range(2):
            a, b = rng.normal(size=(2, 8)), rng.normal(size=(4, 2))
            if i == 1 and layer == 1:
                b[0, 0] = np.nan
            if i == 2:
                b[:] = 0
            t[f"base_model.model.model.layers.{layer}.q.lora_A.weight"] = a.astype(np.float32)
            t[f"base_model.model.model.layers.{layer}.q.lora_B.weight"] = b.astype(np.float32)
        ps.append(_write(tmp_path / f"t{i}", t, cfg))
    for chosen, kw, what in (
        ([0, 1], {}, "non-finite"),
        ([0, 1], {"allocation": "all"}, "non-finite"),
        ([0, 2], {"alpha": "auto"}, "zero update in every module"),
    ):
        sub = [ps[i] for i in chosen]
        with pytest.raises(InputError, match=what) as ref:
            nu.merge_adapters(peft.load_adapters(sub).adapters, budget=2, **kw)
        with pytest.raises(InputError, match=what) as got:
            merge_adapters_streaming(peft.open_adapters(sub), budget=2, chunk_bytes=1, **kw)
        assert str(got.value).split(": ", 1)[1] == str(ref.value).split(": ", 1)[1]
    sub = [ps[0], ps[2]]
    rep = merge_adapters_streaming(peft.open_adapters(sub), budget=2, chunk_bytes=1)[1]
    ref_rep = nu.merge_adapters(peft.load_adapters(sub).adapters, budget=2)[1]
    assert np.isnan(rep.heterogeneity) and np.isnan(ref_rep.heterogeneity)
    with pytest.raises(InputError, match="on_chunk returned dict"):
        merge_adapters_streaming(
            peft.open_adapters(sub), budget=2, chunk_bytes=1, on_chunk=lambda mods: {}
        )


@pytest.mark.slow
def test_each_chunk_is_released_before_the_next_read_ties_knots(paths):
    # (TA: test_reads_one_chunk_at_a_time_each_module_once_per_pass; not model-wide TIES, whose
    # radix passes still hold a unit of the previous chunk during the next read)
    source = _Released(peft.open_adapters(paths))
    merge_adapters_streaming(source, budget=3, method="ties", space="knots", chunk_bytes=TINY)
    assert len(source.calls) > 2
    assert source.lingering == 0


# --------------------------------------------------------------------------- the process heap


def test_the_streamed_merge_leaves_the_allocator_alone(paths, monkeypatch):
    # a library does not change glibc's thresholds of the process it runs in: only
    # `netutility merge` (and a caller who opts in) calls bound_heap, which sets them for good
    import ctypes

    calls = []
    libc = ctypes.CDLL(None)

    class _Libc:
        def __getattr__(self, name):
            if name == "mallopt":
                calls.append(name)
            return getattr(libc, name)

    from netutility_jax.pipeline import streaming

    streaming.bound_heap.cache_clear()
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: _Libc())
    merge_adapters_streaming(peft.open_adapters(paths), budget=4, method="ta", space="core")
    assert calls == []
    streaming.bound_heap()  # the opt-in does reach mallopt (so the spy above can see a call)
    assert calls == ["mallopt"]
    streaming.bound_heap.cache_clear()


def test_the_command_bounds_the_heap_before_it_streams(paths, tmp_path, monkeypatch):
    from netutility_jax.cli.entry import main
    from netutility_jax.pipeline import streaming

    calls = []
    monkeypatch.setattr(streaming, "bound_heap", lambda: calls.append("bound"))
    rc = main(["merge", *paths, "--out", str(tmp_path / "out"), "--budget", "4", "--no-plots"])
    assert rc in (0, None) and calls == ["bound"]


def test_the_energies_h_is_computed_once():
    """A streamed merge's h (the scoring pass's, for alpha='auto', and the report's) is one
    value computed once: after every kernel's programs are dropped (as the merge pass drops
    them), asking again compiles nothing and gives the same bits, which are nu.heterogeneity's
    of the same adapters in memory."""
    from jax._src import monitoring

    from netutility_jax._core import executables
    from netutility_jax.pipeline import _chunks

    rng = np.random.default_rng(5)
    ads = [_adapter(rng, i) for i in range(3)]
    energies = _chunks.Energies()
    energies.add(0, ads, "t", strict=True)
    h = energies.heterogeneity(np.float32, "t", strict=True)
    compiled = []

    def listen(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiled.append(kw.get("fun_name"))

    executables.release()
    monitoring.register_event_duration_secs_listener(listen)
    try:
        again = energies.heterogeneity(np.float32, "t", strict=False)
    finally:
        monitoring.unregister_event_duration_listener(listen)
    assert again == h and compiled == []
    assert h == float(nu.heterogeneity(ads))
