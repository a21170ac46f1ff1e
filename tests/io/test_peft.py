"""nu.peft: load PEFT LoRA checkpoints and save merges PEFT loads, against real PEFT and numpy.

The pure-numpy tests write checkpoints by hand with ``safetensors.numpy`` and need no torch. The
round-trip tests build tiny random ``transformers`` models from a config (no download), train
nothing: they set random LoRA factors, save them with PEFT, load them here, merge, save, and
compare PEFT's forward pass with the base model whose weights get the merged update computed in
numpy float64.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import pathlib
import re
import signal
import stat
import time

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import netutility_jax as nu
from netutility_jax import peft as nu_peft
from netutility_jax.errors import FileAccessError, InputError, InputTypeError, MissingFileError
from netutility_jax.peft._common import natural_key
from netutility_jax.peft._config import is_targeted, untargeted
from netutility_jax.peft._regex import Regexes, plain_full_match, plain_pattern, plain_suffix_match

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="nu.peft needs safetensors")

# transformers' PreTrainedModel.is_gradient_checkpointing, which PEFT calls when wrapping a model,
# emits this deprecation in transformers 5.x; it is not ours to fix.
HF_WARNINGS = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)
P = nu_peft.PREFIX


def _write(d: pathlib.Path, config: dict | None, tensors: dict[str, np.ndarray]) -> pathlib.Path:
    d.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (d / "adapter_config.json").write_text(json.dumps(config))
    safetensors_numpy.save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


def _lora_tensors(rng, modules: dict[str, tuple[int, int, int]], dtype=np.float32) -> dict:
    """PEFT-layout factors: lora_A (r, d_in), lora_B (d_out, r) for {name: (d_in, d_out, r)}."""
    out = {}
    for name, (d_in, d_out, r) in modules.items():
        out[f"{P}{name}.lora_A.weight"] = rng.normal(size=(r, d_in)).astype(dtype)
        out[f"{P}{name}.lora_B.weight"] = rng.normal(size=(d_out, r)).astype(dtype)
    return out


def _dense(mod) -> np.ndarray:
    """float64 kernel-layout update of a loaded / merged module."""
    if "delta" in mod:
        return np.asarray(mod["delta"], np.float64)
    a = np.asarray(mod["lora_a"], np.float64)
    b = np.asarray(mod["lora_b"], np.float64)
    return float(mod.get("scale", 1.0)) * a @ b


def _assert_close(got, want, rtol, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.abs(got - want).max() if got.size else 0.0
    assert err <= rtol * max(np.abs(want).max(), 1e-30), (what, err, np.abs(want).max())


# ---------------------------------------------------------------------------------------------
# Loading (pure numpy)
# ---------------------------------------------------------------------------------------------


def test_load_layout_scale_and_order(tmp_path):
    rng = np.random.default_rng(0)
    mods = {
        "model.layers.10.self_attn.q_proj": (8, 6, 4),
        "model.layers.2.self_attn.q_proj": (8, 6, 4),
    }
    t = _lora_tensors(rng, mods)
    _write(tmp_path, {"peft_type": "LORA", "r": 4, "lora_alpha": 8}, t)
    ad = nu_peft.load_adapter(tmp_path)
    assert list(ad) == ["model.layers.2.self_attn.q_proj", "model.layers.10.self_attn.q_proj"]
    for name in mods:
        m = ad[name]
        assert m["lora_a"].shape == (8, 4) and m["lora_b"].shape == (4, 6)
        assert m["lora_a"].dtype == jnp.float32 and m["scale"] == 2.0
        A, B = t[f"{P}{name}.lora_A.weight"], t[f"{P}{name}.lora_B.weight"]
        want = 2.0 * (B.astype(np.float64) @ A).T
        _assert_close(nu.module_update(m), want, 1e-6, name)


def test_load_rslora_and_patterns(tmp_path):
    rng = np.random.default_rng(1)
    mods = {
        "model.layers.0.self_attn.q_proj": (8, 6, 2),  # rank_pattern "q_proj"
        "model.layers.1.self_attn.q_proj": (8, 6, 5),  # the more specific key comes first
        "model.layers.0.self_attn.v_proj": (8, 6, 3),  # regex key
        "model.layers.1.self_attn.v_proj": (8, 6, 4),  # default r
    }
    cfg = {
        "r": 4,
        "lora_alpha": 16,
        "use_rslora": True,
        "rank_pattern": {"layers.1.self_attn.q_proj": 5, "q_proj": 2, r"layers\.0\..*v_proj": 3},
        "alpha_pattern": {"v_proj": 9, "model.layers.0.self_attn.q_proj": 3},
    }
    _write(tmp_path, cfg, _lora_tensors(rng, mods))
    ad = nu_peft.load_adapter(tmp_path)
    want = {
        "model.layers.0.self_attn.q_proj": 3 / math.sqrt(2),
        "model.layers.1.self_attn.q_proj": 16 / math.sqrt(5),
        "model.layers.0.self_attn.v_proj": 9 / math.sqrt(3),
        "model.layers.1.self_attn.v_proj": 9 / math.sqrt(4),
    }
    for name, scale in want.items():
        assert ad[name]["lora_a"].shape[1] == mods[name][2]
        assert ad[name]["scale"] == pytest.approx(scale, rel=1e-12), name


def test_pattern_key_rule():
    keys = ["k_proj", "layers.1.self_attn.q_proj", "q_proj", r"layers\.[01]\.mlp\.up_proj"]
    pk = nu_peft.pattern_key
    assert pk(keys, "model.layers.1.self_attn.q_proj") == "layers.1.self_attn.q_proj"
    assert pk(keys, "model.layers.0.self_attn.q_proj") == "q_proj"
    assert pk(keys, "model.layers.0.mlp.up_proj") == r"layers\.[01]\.mlp\.up_proj"
    assert pk(keys, "model.layers.2.mlp.up_proj") is None
    assert pk(["proj"], "model.layers.0.self_attn.q_proj") is None  # only after a dot
    assert pk(["q_proj"], "q_proj") == "q_proj"  # the whole name
    with pytest.raises(ValueError, match=r"pattern key '\(q' is not a valid regular expression"):
        pk(["(q"], "model.q")


def test_load_accepts_adapter_name_in_keys(tmp_path):
    rng = np.random.default_rng(2)
    A, B = rng.normal(size=(2, 5)), rng.normal(size=(3, 2))
    t = {f"{P}m.lora_A.default.weight": A, f"{P}m.lora_B.default.weight": B}
    _write(tmp_path, {"r": 2, "lora_alpha": 2}, t)
    ad = nu_peft.load_adapter(tmp_path)
    _assert_close(nu.module_update(ad["m"]), (B @ A).T, 1e-6)


def test_load_bf16_upcasts(tmp_path):
    import ml_dtypes

    rng = np.random.default_rng(3)
    A = rng.normal(size=(4, 16)).astype(ml_dtypes.bfloat16)
    B = rng.normal(size=(12, 4)).astype(ml_dtypes.bfloat16)
    _write(
        tmp_path,
        {"r": 4, "lora_alpha": 4},
        {f"{P}q.lora_A.weight": A, f"{P}q.lora_B.weight": B},
    )
    ad = nu_peft.load_adapter(tmp_path)
    assert ad["q"]["lora_a"].dtype == jnp.float32 and ad["q"]["lora_b"].dtype == jnp.float32
    # the upcast is exact
    np.testing.assert_array_equal(np.asarray(ad["q"]["lora_a"]), A.astype(np.float32).T)
    np.testing.assert_array_equal(np.asarray(ad["q"]["lora_b"]), B.astype(np.float32).T)


def test_load_adapters_and_config(tmp_path):
    rng = np.random.default_rng(4)
    cfg = {
        "r": 2,
        "lora_alpha": 4,
        "base_model_name_or_path": "org/base",
        "task_type": "CAUSAL_LM",
        "target_modules": ["q", "v"],
        "modules_to_save": None,
        "lora_dropout": 0.1,
    }
    d0 = _write(tmp_path / "a", cfg, _lora_tensors(rng, {"l.q": (8, 6, 2), "l.v": (8, 6, 2)}))
    d1 = _write(
        tmp_path / "b",
        {**cfg, "r": 3, "lora_alpha": 3},
        _lora_tensors(rng, {"l.q": (8, 6, 3), "l.v": (8, 6, 3)}),
    )
    ads, base = nu_peft.load_adapters([d0, d1])
    assert [list(a) for a in ads] == [["l.q", "l.v"]] * 2
    assert ads[1]["l.q"]["scale"] == 1.0
    assert base == {
        "base_model_name_or_path": "org/base",
        "task_type": "CAUSAL_LM",
        "target_modules": ["q", "v"],
    }
    assert nu_peft.load_config(d0) == cfg


# ---------------------------------------------------------------------------------------------
# Refusals on load (pure numpy)
# ---------------------------------------------------------------------------------------------


def _one(tmp_path, config=None, **extra):
    rng = np.random.default_rng(5)
    t = _lora_tensors(rng, {"m.q": (8, 6, 2)})
    t.update(extra)
    return _write(tmp_path, {"r": 2, "lora_alpha": 2} if config is None else config, t)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"r": 2, "use_dora": True}, r"use_dora=true: a DoRA adapter"),
        ({"r": 2, "lora_bias": True}, r"lora_bias=true"),
        ({"r": 2, "peft_type": "LOHA"}, r"peft_type='LOHA'; only LoRA adapters"),
        ({"r": 2, "target_parameters": ["experts.w"]}, r"target_parameters=\['experts.w'\]"),
        ({"r": 2, "init_lora_weights": "pissa"}, r"path_initial_model_for_weight_conversion"),
        ({"r": 2, "use_qalora": True}, r"use_qalora=true"),
        ({"r": 4}, r"module 'm.q' has lora_A \(2, 8\) and lora_B \(6, 2\) .* gives it r=4"),
        ({"r": 4, "rank_pattern": {"q": 3}}, r"gives it r=3 \(r / rank_pattern\)"),
        ({"r": 2, "rank_pattern": ["q"]}, r"rank_pattern is a list"),
        ({"r": 2, "lora_alpha": math.nan}, r"gives module 'm\.q' lora_alpha=nan \(lora_alpha\); "),
        ({"r": 2, "lora_alpha": math.inf}, r"lora_alpha=inf \(lora_alpha\); expected a finite"),
        (
            {"r": 2, "alpha_pattern": {"q": -math.inf}},
            r"lora_alpha=-inf \(alpha_pattern\['q'\]\); expected a finite number",
        ),
        ({"r": 2, "lora_alpha": 10**400}, r"lora_alpha=1000000.*\(lora_alpha\); expected a finite"),
        ({"r": 0}, r"adapter_config\.json' gives module 'm\.q' r=0 \(r\); expected a positive"),
        ({"r": 2, "rank_pattern": {"q": -2}}, r"r=-2 \(rank_pattern\['q'\]\); expected a positive"),
        ({"r": 2, "rank_pattern": {"m.q": 2.0}}, r"r=2\.0 \(rank_pattern\['m\.q'\]\)"),
        ({"r": 2, "use_rslora": "false"}, r"use_rslora is 'false'; expected true or false"),
    ],
)
def test_load_refuses_config(tmp_path, config, match):
    d = _one(tmp_path, config)
    with pytest.raises(ValueError, match=match):
        nu_peft.load_adapter(d)


def test_load_refuses_tensors(tmp_path):
    z = np.zeros
    cases = [
        ({f"{P}m.q.lora_magnitude_vector.weight": z(6, np.float32)}, r"DoRA magnitude"),
        ({f"{P}m.q.lora_B.bias": z(6, np.float32)}, r"bias .*lora_bias=true"),
        ({f"{P}emb.lora_embedding_A": z((2, 10), np.float32)}, r"embedding layer \('emb'\)"),
        (
            {f"{P}m.k.lora_A.weight": z((2, 8), np.float32)},
            r"has '.*m\.k\.lora_A\.weight' \(2, 8\) but no lora_B for module 'm\.k'",
        ),
        ({f"{P}m.k.lora_B.weight": z((6, 2), np.float32)}, r"but no lora_A for module 'm\.k'"),
        (
            {f"{P}m.k.lora_A.weight": z((2, 8)), f"{P}m.k.lora_B.weight": z((6, 3))},
            r"lora_A \(2, 8\) = \(r, d_in\) but lora_B \(6, 3\) = \(d_out, r\) with a different r",
        ),
        (
            {f"{P}c.lora_A.weight": z((2, 3, 1, 1)), f"{P}c.lora_B.weight": z((4, 2, 1, 1))},
            r"only 2-D factors",
        ),
        (
            {
                f"{P}m.k.lora_A.other.weight": z((2, 8)),
                f"{P}m.k.lora_B.other.weight": z((6, 2)),
                f"{P}m.v.lora_A.default.weight": z((2, 8)),
                f"{P}m.v.lora_B.default.weight": z((6, 2)),
            },
            r"several adapters \(\['default', 'other'\]\)",
        ),
        (
            {f"{P}m.k.lora_A.weight": z((2, 8), np.int32), f"{P}m.k.lora_B.weight": z((6, 2))},
            r"dtype int32",
        ),
    ]
    for i, (extra, match) in enumerate(cases):
        d = _one(tmp_path / str(i), **extra)
        err = TypeError if "int32" in match else ValueError
        with pytest.raises(err, match=match):
            nu_peft.load_adapter(d)


def test_load_non_lora_tensors_strict_and_skip(tmp_path):
    d = _one(tmp_path, **{f"{P}score.weight": np.zeros((3, 8), np.float32)})
    with pytest.raises(
        InputError,
        match=r"holds 'base_model\.model\.score\.weight' \(3, 8\), which is not a LoRA factor.*"
        r"pass strict=False \(CLI: --skip-non-lora\) to skip such tensors",
    ):
        nu_peft.load_adapter(d)
    assert list(nu_peft.load_adapter(d, strict=False)) == ["m.q"]
    with pytest.raises(InputTypeError, match=r"load_adapter: strict='no'; expected True or False"):
        nu_peft.load_adapter(d, strict="no")


def test_load_refuses_no_factors(tmp_path):
    _write(tmp_path, {"r": 2}, {f"{P}score.weight": np.zeros((3, 8), np.float32)})
    with pytest.raises(ValueError, match=r"holds no LoRA factors"):
        nu_peft.load_adapter(tmp_path, strict=False)


def test_load_refuses_files(tmp_path):
    with pytest.raises(MissingFileError, match=r"no such directory .*snapshot_download"):
        nu_peft.load_adapter(tmp_path / "nope")
    d = _one(tmp_path / "ok")
    for call in (nu_peft.load_adapter, nu_peft.load_config):
        with pytest.raises(
            MissingFileError,
            match=r"adapter_model\.safetensors' is a file, expected an adapter folder containing "
            r"adapter_config\.json and adapter_model\.safetensors; pass its folder \(here: '.*ok'\)",
        ):
            call(d / "adapter_model.safetensors")
    # a folder where a file is expected
    for fname, what in (
        ("adapter_model.safetensors", "the safetensors file"),
        ("adapter_config.json", "the JSON file adapter_config.json"),
    ):
        bad = _one(tmp_path / f"folder-{fname}")
        (bad / fname).unlink()
        (bad / fname).mkdir()
        with pytest.raises(
            MissingFileError, match=rf"{re.escape(fname)}' is a folder, expected {what}"
        ):
            nu_peft.load_adapter(bad)

    pk = tmp_path / "pickled"
    pk.mkdir()
    (pk / "adapter_config.json").write_text('{"r": 2}')
    (pk / "adapter_model.bin").write_bytes(b"\x80\x04not unpickled")
    with pytest.raises(
        ValueError, match=r"only the pickled adapter_model\.bin.*safe_serialization=True"
    ):
        nu_peft.load_adapter(pk)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MissingFileError, match=r"adapter_model\.safetensors' does not exist"):
        nu_peft.load_adapter(empty)

    nocfg = tmp_path / "nocfg"
    _write(nocfg, None, _lora_tensors(np.random.default_rng(0), {"q": (4, 4, 2)}))
    with pytest.raises(MissingFileError, match=r"adapter_config\.json' does not exist"):
        nu_peft.load_adapter(nocfg)

    badjson = _one(tmp_path / "badjson")
    (badjson / "adapter_config.json").write_text('{"r": 2,')
    with pytest.raises(ValueError, match=r"adapter_config\.json' is not valid JSON"):
        nu_peft.load_adapter(badjson)
    (badjson / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"holds a JSON list, expected an object"):
        nu_peft.load_adapter(badjson)

    trunc = _one(tmp_path / "trunc")
    f = trunc / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(
        ValueError, match=r"is not a readable safetensors file .*corrupt or truncated"
    ):
        nu_peft.load_adapter(trunc)
    f.write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"is not a readable safetensors file"):
        nu_peft.load_adapter(trunc)


def test_load_adapters_refuses_mismatch(tmp_path):
    rng = np.random.default_rng(6)
    cfg = {"r": 2, "lora_alpha": 2}
    d0 = _write(tmp_path / "a", cfg, _lora_tensors(rng, {"l.q": (8, 6, 2), "l.v": (8, 6, 2)}))
    d1 = _write(tmp_path / "b", cfg, _lora_tensors(rng, {"l.q": (8, 6, 2), "l.v": (8, 5, 2)}))
    d2 = _write(tmp_path / "c", cfg, _lora_tensors(rng, {"l.q": (8, 6, 2)}))
    with pytest.raises(
        ValueError,
        match=r"module 'l\.v' has update shape \(d_in, d_out\) = \(8, 6\) in '.*a' but \(8, 5\) "
        r"in '.*b'; the adapters were trained on different base models",
    ):
        nu_peft.load_adapters([d0, d1])
    with pytest.raises(
        InputError,
        match=r"module 'l\.v' is in '.*a' but not in '.*c': the adapters target different modules, "
        r"which strict_targets=True \(CLI: --strict-targets\) refuses\. Pass strict_targets=False",
    ):
        nu_peft.load_adapters([d0, d2], strict_targets=True)
    ads, _ = nu_peft.load_adapters([d0, d2])  # the union, None where a task lacks a module
    assert list(ads[1]) == ["l.q", "l.v"] and ads[1]["l.v"] is None
    # shapes must agree wherever two tasks have a module, even when task 0 lacks it
    with pytest.raises(
        InputError,
        match=r"module 'l\.v' has update shape \(d_in, d_out\) = \(8, 6\) in '.*a' but \(8, 5\) in "
        r"'.*b'",
    ):
        nu_peft.load_adapters([d2, d0, d1])
    with pytest.raises(InputTypeError, match=r"strict_targets=1; expected True or False"):
        nu_peft.load_adapters([d0, d2], strict_targets=1)
    with pytest.raises(ValueError, match=r"expected a non-empty list of adapter directories"):
        nu_peft.load_adapters(str(d0))


# ---------------------------------------------------------------------------------------------
# Saving (pure numpy)
# ---------------------------------------------------------------------------------------------


def test_save_round_trip_ranks_rank0_dense(tmp_path):
    rng = np.random.default_rng(7)
    delta = rng.normal(size=(8, 6))
    merged = {
        "model.layers.0.q": {
            "lora_a": rng.normal(size=(8, 3)),
            "lora_b": rng.normal(size=(3, 6)),
            "scale": 0.7,
        },
        "model.layers.1.q": {
            "lora_a": rng.normal(size=(8, 3)),
            "lora_b": rng.normal(size=(3, 6)),
            "scale": 1.0,
        },
        "model.layers.0.v": {"lora_a": rng.normal(size=(8, 5)), "lora_b": rng.normal(size=(5, 6))},
        "model.layers.1.v": {"lora_a": np.zeros((8, 0)), "lora_b": np.zeros((0, 6)), "scale": 1.0},
        "model.layers.1.o": {"delta": delta},
    }
    out = tmp_path / "out"
    cfg = nu_peft.save_adapter(merged, out, rank=2, base_model_name_or_path="org/base")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dir left behind
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert cfg == json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == cfg["lora_alpha"] == 3 and cfg["use_rslora"] is False
    assert (
        cfg["rank_pattern"]
        == cfg["alpha_pattern"]
        == {
            r"^model\.layers\.0\.v": 5,
            r"^model\.layers\.1\.o": 2,
            r"^model\.layers\.1\.v": 1,
        }
    )
    assert cfg["target_modules"] == sorted(merged, key=natural_key)
    assert cfg["base_model_name_or_path"] == "org/base"

    back = nu_peft.load_adapter(out)
    assert {n: int(m["lora_a"].shape[1]) for n, m in back.items()} == {
        "model.layers.0.q": 3,
        "model.layers.0.v": 5,
        "model.layers.1.q": 3,
        "model.layers.1.v": 1,
        "model.layers.1.o": 2,
    }
    for name, mod in merged.items():
        if "delta" in mod:
            u, s, vt = np.linalg.svd(delta, full_matrices=False)
            want = (u[:, :2] * s[:2]) @ vt[:2]
        else:
            want = _dense(mod)
        assert back[name]["scale"] == 1.0
        _assert_close(_dense(back[name]), want, 1e-6, name)
    assert not np.any(np.asarray(back["model.layers.1.v"]["lora_a"]))


def _writer_modules(rng):
    return {
        "model.layers.0.q": {"lora_a": rng.normal(size=(8, 3)), "lora_b": rng.normal(size=(3, 6)),
                             "scale": 0.7},
        "model.layers.1.q": {"lora_a": rng.normal(size=(8, 2)), "lora_b": rng.normal(size=(2, 6))},
        "model.layers.0.v": {"lora_a": rng.normal(size=(8, 5)), "lora_b": rng.normal(size=(5, 6))},
        "model.layers.1.v": {"lora_a": np.zeros((8, 0)), "lora_b": np.zeros((0, 6)), "scale": 1.0},
        "model.layers.1.o": {"delta": rng.normal(size=(8, 6))},
        "model.layers.10.o": {"lora_a": rng.normal(size=(8, 1)), "lora_b": rng.normal(size=(1, 6))},
    }  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_adapter_writer_writes_what_save_adapter_writes(tmp_path, dtype):
    """Chunks in any order (one nested): the same tensors, dtypes and config as save_adapter,
    read back by the safetensors package (header, metadata) and load_adapter."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    merged = _writer_modules(np.random.default_rng(3))
    kw = {"rank": 2, "dtype": dtype, "base_model_name_or_path": "org/base"}
    want_cfg = nu_peft.save_adapter(merged, tmp_path / "a", **kw)
    names = list(merged)
    chunks = [
        {n: merged[n] for n in names[3:]},
        {"model": {"layers": {"0": {"v": merged["model.layers.0.v"]}}}},  # nested, as PEFT trees
        {n: merged[n] for n in names[:3] if n != "model.layers.0.v"},
    ]
    with nu_peft.AdapterWriter(tmp_path / "b", names=names, **kw) as w:
        ranks = {}
        for c in chunks:
            ranks.update(w.add(c))
    assert ranks == w.ranks and ranks["model.layers.1.v"] == 1 and ranks["model.layers.1.o"] == 2
    assert w.config == want_cfg == json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no staging left
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    fa, fb = (str(tmp_path / d / "adapter_model.safetensors") for d in "ab")
    # byte for byte the safetensors package's file (layers 0, 1, 10: name order, not natural)
    assert pathlib.Path(fa).read_bytes() == pathlib.Path(fb).read_bytes()
    ta, tb = load_file(fa), load_file(fb)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        np.testing.assert_array_equal(ta[k].view(np.uint8), tb[k].view(np.uint8), err_msg=k)
    with safe_open(fb, framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
    back = nu_peft.load_adapter(tmp_path / "b")
    for n, m in nu_peft.load_adapter(tmp_path / "a").items():
        np.testing.assert_array_equal(_dense(back[n]), _dense(m), err_msg=n)


def test_adapter_writer_leaves_nothing_when_it_fails(tmp_path):
    merged = _writer_modules(np.random.default_rng(4))
    names = list(merged)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="stop"):
        with nu_peft.AdapterWriter(out, rank=2) as w:
            w.add({names[0]: merged[names[0]]})
            raise RuntimeError("stop")
    assert not list(tmp_path.iterdir())
    # a module never added, when the names were given: an error at the end, nothing written
    with pytest.raises(InputError, match=r"1 of the 6 modules named were never added"):
        with nu_peft.AdapterWriter(out, rank=2, names=names) as w:
            w.add({n: merged[n] for n in names[1:]})
    assert not list(tmp_path.iterdir())
    with pytest.raises(InputError, match=r"'model.layers.0.q' was already written"):
        with nu_peft.AdapterWriter(out, rank=2) as w:
            w.add({names[0]: merged[names[0]]})
            w.add({names[0]: merged[names[0]]})
    with pytest.raises(InputError, match=r"'model.layers.0.q' is not among the names"):
        with nu_peft.AdapterWriter(out, rank=2, names=names[1:]) as w:
            w.add({names[0]: merged[names[0]]})
    with pytest.raises(InputError, match=r"model.layers.1.o.* is dense"):
        with nu_peft.AdapterWriter(out) as w:  # no rank for a dense module
            w.add({"model.layers.1.o": merged["model.layers.1.o"]})
    with pytest.raises(InputError, match="no module was added"):
        with nu_peft.AdapterWriter(out):
            pass
    assert not list(tmp_path.iterdir())
    with pytest.raises(InputError, match=r"inside the writer's `with` block"):
        nu_peft.AdapterWriter(out).add({names[0]: merged[names[0]]})
    # refused before anything is written: a non-empty folder, a target list that misses a module
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(FileExistsError, match="not empty"):
        nu_peft.AdapterWriter(tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "keep"
    with pytest.raises(InputError, match=r"model\.layers\.1"):
        nu_peft.AdapterWriter(out, names=names, target_modules=["model.layers.0.q"])


def test_adapter_writer_a_failing_chunk_writes_nothing_of_it(tmp_path):
    """A chunk whose conversion fails (lora_B overflows float16) adds none of its tensors, even
    those converted before the failure: the writer can go on, and the file is consistent."""
    from safetensors.numpy import load_file

    merged = _writer_modules(np.random.default_rng(5))
    q0, q1 = merged["model.layers.0.q"], merged["model.layers.1.q"]
    # (1e12: beyond float16 even split between the factors, sqrt(2e12) > 65504)
    big = {"lora_a": np.ones((8, 2)), "lora_b": np.full((2, 6), 1e12)}
    with nu_peft.AdapterWriter(tmp_path / "out", dtype="float16") as w:
        w.add({"model.layers.0.q": q0})
        with pytest.raises(InputError, match=r"'model.layers.0.v'.*overflows float16"):
            w.add({"model.layers.0.v": big, "model.layers.1.q": q1})
        w.add({"model.layers.1.q": q1})
    assert sorted(w.ranks) == ["model.layers.0.q", "model.layers.1.q"]
    keys = sorted(load_file(str(tmp_path / "out" / "adapter_model.safetensors")))
    assert keys == [
        f"{nu_peft.PREFIX}model.layers.{i}.q.lora_{p}.weight" for i in (0, 1) for p in "AB"
    ]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_adapter_writer_full_disk_on_close_keeps_the_error_and_cleans_up(tmp_path):
    """The block fails and closing the tensors' file fails too (a full disk): the block's error
    is the one raised, and the staging folder is gone."""
    merged = _writer_modules(np.random.default_rng(6))
    with pytest.raises(RuntimeError, match="the block's own error"):
        with nu_peft.AdapterWriter(tmp_path / "out") as w:
            w._data.close()
            w._data = open("/dev/full", "wb")
            w.add({"model.layers.0.q": merged["model.layers.0.q"]})  # buffered, not yet flushed
            raise RuntimeError("the block's own error")
    assert not list(tmp_path.iterdir())


def test_save_pattern_keys_with_suffix_clash(tmp_path):
    # "x.a.q" ends with "." + "a.q": an unanchored key "a.q" would also match "x.a.q"
    rng = np.random.default_rng(8)

    def mod(r):
        return {"lora_a": rng.normal(size=(4, r)), "lora_b": rng.normal(size=(r, 4))}

    merged = {"a.q": mod(3), "x.a.q": mod(2), "b.q": mod(2), "y.x.a.q": mod(2)}
    cfg = nu_peft.save_adapter(merged, tmp_path / "o")
    assert cfg["r"] == 2 and list(cfg["rank_pattern"]) == [r"^a\.q"]
    for keys in (cfg["rank_pattern"], sorted(cfg["rank_pattern"], reverse=True)):  # any order
        for name, m in merged.items():
            key = nu_peft.pattern_key(keys, name)
            r = cfg["rank_pattern"][key] if key else cfg["r"]
            assert r == m["lora_a"].shape[1], name
    back = nu_peft.load_adapter(tmp_path / "o")  # checks every module's r against the config
    for name, m in merged.items():
        _assert_close(_dense(back[name]), _dense(m), 1e-6, name)


def test_save_bf16_and_base_config_carry(tmp_path):
    rng = np.random.default_rng(9)
    merged = {"l.q": {"lora_a": rng.normal(size=(8, 2)), "lora_b": rng.normal(size=(2, 6))}}
    src = _write(
        tmp_path / "src",
        {
            "r": 2,
            "lora_alpha": 2,
            "task_type": "SEQ_CLS",
            "modules_to_save": ["score"],
            "target_modules": ["q"],
            "fan_in_fan_out": True,
            "lora_dropout": 0.1,
        },
        _lora_tensors(rng, {"l.q": (8, 6, 2)}),
    )
    cfg = nu_peft.save_adapter(
        merged, tmp_path / "o", base_config=src, dtype="bfloat16", task_type="CAUSAL_LM"
    )
    assert cfg["target_modules"] == ["q"] and cfg["fan_in_fan_out"] is True
    assert cfg["task_type"] == "CAUSAL_LM" and cfg["modules_to_save"] is None
    assert cfg["lora_dropout"] == 0.0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "o" / "adapter_model.safetensors"), framework="flax") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    back = nu_peft.load_adapter(tmp_path / "o")
    assert back["l.q"]["lora_a"].dtype == jnp.float32
    _assert_close(_dense(back["l.q"]), _dense(merged["l.q"]), 2e-2)


def test_save_refusals(tmp_path):
    rng = np.random.default_rng(10)
    lo = {"lora_a": rng.normal(size=(8, 2)), "lora_b": rng.normal(size=(2, 6))}
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "x").write_text("x")
    with pytest.raises(FileExistsError, match=r"occupied' exists and is not empty; refusing"):
        nu_peft.save_adapter({"m.q": lo}, occupied)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(FileExistsError, match=r"afile' is a file"):
        nu_peft.save_adapter({"m.q": lo}, afile)
    with pytest.raises(
        ValueError,
        match=r"module 'm\.o' is dense \(\{'delta': \(8, 6\)\}.*Pass rank=k .*nu\.to_lora",
    ):
        nu_peft.save_adapter({"m.q": lo, "m.o": {"delta": np.ones((8, 6))}}, tmp_path / "d")
    with pytest.raises(ValueError, match=r"unknown config field foo=; accepted: "):
        nu_peft.save_adapter({"m.q": lo}, tmp_path / "d", foo=1)
    with pytest.raises(ValueError, match=r"r= is computed by save_adapter"):
        nu_peft.save_adapter({"m.q": lo}, tmp_path / "d", r=4)
    with pytest.raises(ValueError, match=r"module name 'layers/0/q' is not a PEFT module name"):
        nu_peft.save_adapter({"layers": {"0": {"q": lo}}, "layers/0/q": lo}, tmp_path / "d")
    with pytest.raises(ValueError, match=r"PEFT would not adapt module 'm\.q'"):
        nu_peft.save_adapter({"m.q": lo}, tmp_path / "d", target_modules=["k"])
    with pytest.raises(ValueError, match=r"rank=0; expected a positive integer"):
        nu_peft.save_adapter({"m.q": lo}, tmp_path / "d", rank=0)
    with pytest.raises(ValueError, match=r"factors of module 'm\.q' do not chain"):
        nu_peft.save_adapter({"m.q": {**lo, "lora_b": np.ones((3, 6))}}, tmp_path / "d")
    with pytest.raises(ValueError, match=r"lora_a of module 'm\.q' \(8, 2\) has non-finite"):
        nu_peft.save_adapter({"m.q": {**lo, "lora_a": np.full((8, 2), np.nan)}}, tmp_path / "d")
    with pytest.raises(ValueError, match=r"module 'm\.q''s lora_B overflows float16 \(largest"):
        nu_peft.save_adapter({"m.q": {**lo, "scale": 1e12}}, tmp_path / "d", dtype="float16")
    with pytest.raises(ValueError, match=r"dtype='int8'; expected one of"):
        nu_peft.save_adapter({"m.q": lo}, tmp_path / "d", dtype="int8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "occupied"]  # nothing left
    # an existing empty directory is fine
    empty = tmp_path / "empty"
    empty.mkdir()
    nu_peft.save_adapter({"m.q": lo}, empty)
    assert (empty / "adapter_model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------
# Against real PEFT (torch, transformers, peft)
# ---------------------------------------------------------------------------------------------

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
ZERO_MODULE = "model.layers.1.self_attn.o_proj"  # B = 0 in every task: the merge keeps nothing
IDS = [[1, 5, 7, 42, 3, 99, 0, 12]]


def _torch_stack():
    torch = pytest.importorskip("torch", reason="round trips against PEFT need torch")
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    peft = pytest.importorskip("peft", reason="needs peft")
    return torch, transformers, peft


def _lora_layers(pm):
    """{module name in the base model: PEFT LoRA layer} of a PeftModel."""
    out = {}
    for name, m in pm.named_modules():
        if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {}):
            out[name.removeprefix("base_model.model.")] = m
    return out


def _peft_delta(layer) -> np.ndarray:
    """PEFT's own update scaling * B @ A in float64, in kernel layout (d_in, d_out)."""
    A = layer.lora_A["default"].weight.detach().double().numpy()
    B = layer.lora_B["default"].weight.detach().double().numpy()
    return (layer.scaling["default"] * B @ A).T


def _randomize(torch, pm, seed, zero=()):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, layer in _lora_layers(pm).items():
            A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            A.copy_(torch.randn(A.shape, generator=g) / math.sqrt(A.shape[1]))
            B.copy_(0.0 if name in zero else 0.02 * torch.randn(B.shape, generator=g))


def _logits(torch, model, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.double().numpy()


def _reference_logits(torch, base, updates, *, conv1d=False) -> np.ndarray:
    """Logits of the base model with W + dK (numpy float64, cast once to the weight dtype)."""
    ref = copy.deepcopy(base)
    with torch.no_grad():
        for name, dk in updates.items():
            w = ref.get_submodule(name).weight
            new = w.detach().double().numpy() + (dk if conv1d else dk.T)
            w.copy_(torch.from_numpy(new))
    return _logits(torch, ref)


def _assert_logits(got, want, base):
    err = np.abs(got - want).max()
    moved = np.abs(base - want).max()
    assert err <= 2e-5 * np.abs(want).max(), (err, np.abs(want).max())
    assert moved > 1e3 * err, (moved, err)  # the update is large enough to be checked


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch, transformers, peft = _torch_stack()
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,  # k/v_proj 64x64 like q/o: one merge bucket, one compile
        vocab_size=100,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).eval()
    root = tmp_path_factory.mktemp("llama")
    configs = [
        dict(r=4, lora_alpha=8),
        dict(r=8, lora_alpha=16, use_rslora=True),
        dict(
            r=6,
            lora_alpha=12,
            rank_pattern={"q_proj": 2, "layers.1.self_attn.v_proj": 3},
            alpha_pattern={"k_proj": 5},
        ),
    ]
    dirs, deltas = [], []
    for i, c in enumerate(configs):
        lc = peft.LoraConfig(target_modules=LLAMA_TARGETS, task_type="CAUSAL_LM", **c)
        pm = peft.get_peft_model(copy.deepcopy(base), lc)
        _randomize(torch, pm, seed=i, zero=(ZERO_MODULE,))
        deltas.append({n: _peft_delta(layer) for n, layer in _lora_layers(pm).items()})
        pm.save_pretrained(str(root / f"task{i}"))
        dirs.append(root / f"task{i}")
    return torch, peft, base, dirs, deltas


@HF_WARNINGS
def test_peft_load_matches_peft_delta(llama):
    _, _, _, dirs, deltas = llama
    ads, base_cfg = nu_peft.load_adapters(dirs)
    assert base_cfg["task_type"] == "CAUSAL_LM"
    assert sorted(base_cfg["target_modules"]) == sorted(LLAMA_TARGETS)
    assert len(ads[0]) == 8
    assert ads[2]["model.layers.0.self_attn.q_proj"]["lora_a"].shape == (64, 2)
    assert ads[2]["model.layers.1.self_attn.v_proj"]["lora_a"].shape == (64, 3)
    assert ads[2]["model.layers.1.self_attn.k_proj"]["scale"] == 5 / 6
    assert ads[1]["model.layers.0.self_attn.k_proj"]["scale"] == pytest.approx(16 / math.sqrt(8))
    for ad, want in zip(ads, deltas, strict=True):
        assert set(ad) == set(want)
        for name, dk in want.items():
            _assert_close(_dense(ad[name]), dk, 1e-6, name)


@HF_WARNINGS
@pytest.mark.parametrize("method", ["ta", "tsv"])
def test_peft_merge_save_load_forward(llama, tmp_path, method):
    torch, peft, base, dirs, _ = llama
    ads, base_cfg = nu_peft.load_adapters(dirs)
    merged, report = nu.merge_adapters(ads, budget=3, method=method)
    assert report.ranks[ZERO_MODULE] == 0
    assert max(report.ranks.values()) > 1
    out = tmp_path / "merged"
    cfg = nu_peft.save_adapter(merged, out, base_config=base_cfg)
    assert cfg["rank_pattern"].get("^" + re.escape(ZERO_MODULE)) == 1 or cfg["r"] == 1

    pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(out)).eval()
    layers = _lora_layers(pm)
    assert set(layers) == set(merged)
    updates = {n: _dense(m) for n, m in merged.items()}  # numpy float64 from the merged factors
    for name, layer in layers.items():
        _assert_close(_peft_delta(layer), updates[name], 1e-6, name)
    assert not np.any(updates[ZERO_MODULE])
    got = _logits(torch, pm)
    _assert_logits(got, _reference_logits(torch, base, updates), _logits(torch, base))


@HF_WARNINGS
def test_peft_loads_a_streamed_merge_written_chunk_by_chunk(llama, tmp_path):
    """merge_adapters_streaming writing each chunk with AdapterWriter (what `netutility merge`
    does): PEFT's layers hold exactly the merged updates."""
    _, peft, base, dirs, _ = llama
    source = nu_peft.open_adapters(dirs)
    updates = {}

    def write(chunk):
        updates.update({n: _dense(m) for n, m in chunk.items()})
        w.add(chunk)
        return chunk

    out = tmp_path / "merged"
    with nu_peft.AdapterWriter(out, base_config=source.config, names=source.names) as w:
        nu.merge_adapters_streaming(source, budget=3, chunk_bytes=4096, on_chunk=write)
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(out)).eval()
    layers = _lora_layers(pm)
    assert set(layers) == set(updates) == set(source.names)
    for name, layer in layers.items():
        _assert_close(_peft_delta(layer), updates[name], 1e-6, name)


@HF_WARNINGS
def test_peft_dense_ties_saved_with_rank(llama, tmp_path):
    torch, peft, base, dirs, _ = llama
    ads, base_cfg = nu_peft.load_adapters(dirs)
    merged, _ = nu.merge_adapters(ads, budget=4, method="ties", density=0.5)
    assert all("delta" in m for m in merged.values())
    with pytest.raises(ValueError, match=r"is dense .*Pass rank=k"):
        nu_peft.save_adapter(merged, tmp_path / "refused", base_config=base_cfg)
    k = 3
    cfg = nu_peft.save_adapter(merged, tmp_path / "ties", rank=k, base_config=base_cfg)
    assert cfg["r"] == k and cfg["rank_pattern"] == {}
    updates = {}
    for name, m in merged.items():
        u, s, vt = np.linalg.svd(np.asarray(m["delta"], np.float64), full_matrices=False)
        updates[name] = (u[:, :k] * s[:k]) @ vt[:k]
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "ties")).eval()
    for name, layer in _lora_layers(pm).items():
        _assert_close(_peft_delta(layer), updates[name], 1e-5, name)
    _assert_logits(
        _logits(torch, pm), _reference_logits(torch, base, updates), _logits(torch, base)
    )


@HF_WARNINGS
def test_peft_serving_export_uniform_rank(llama, tmp_path):
    """serving_ranks: one rank for every module (vLLM's smallest allowed one at least the
    largest merged rank), no patterns, PEFT's scale 1, and PEFT applies exactly the merge."""
    _torch, peft, base, dirs, _ = llama
    ads, base_cfg = nu_peft.load_adapters(dirs)
    merged, report = nu.merge_adapters(ads, budget=3, method="tsv")
    top = max(report.ranks.values())
    want_r = min(r for r in nu_peft.VLLM_RANKS if r >= top)
    cfg = nu_peft.save_adapter(merged, tmp_path / "srv", base_config=base_cfg, serving_ranks="vllm")
    assert cfg["r"] == cfg["lora_alpha"] == want_r
    assert cfg["rank_pattern"] == {} and cfg["alpha_pattern"] == {}
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "srv")).eval()
    layers = _lora_layers(pm)
    assert set(layers) == set(merged)
    for name, layer in layers.items():
        assert layer.r["default"] == want_r and layer.scaling["default"] == 1.0
        _assert_close(_peft_delta(layer), _dense(merged[name]), 1e-6, name)
    # a rank list that cannot hold the largest module is refused, naming it
    with pytest.raises(InputError, match=rf"has rank {top}, above every allowed serving rank"):
        nu_peft.save_adapter(merged, tmp_path / "no", serving_ranks=[top - 1])
    assert not (tmp_path / "no").exists()
    for bad in ("sglang", [], [0, 8], [True], 8):
        with pytest.raises(InputError, match=r"serving_ranks="):
            nu_peft.save_adapter(merged, tmp_path / "no", serving_ranks=bad)


@HF_WARNINGS
def test_peft_gpt2_fan_in_fan_out_round_trip(tmp_path):
    torch, transformers, peft = _torch_stack()
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=32)
    torch.manual_seed(1)
    base = transformers.GPT2LMHeadModel(cfg).eval()
    lc = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
    pm = peft.get_peft_model(copy.deepcopy(base), lc)
    _randomize(torch, pm, seed=3)
    pm.save_pretrained(str(tmp_path / "gpt2"))
    ad = nu_peft.load_adapter(tmp_path / "gpt2")
    assert set(ad) == {"transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"}
    for name, layer in _lora_layers(pm).items():
        # Conv1D stores its weight (d_in, d_out): PEFT's delta is already in kernel layout
        assert layer.fan_in_fan_out
        want = layer.get_delta_weight("default").detach().double().numpy()
        assert ad[name]["lora_a"].shape == (32, 4) and ad[name]["lora_b"].shape == (4, 96)
        _assert_close(nu.module_update(ad[name]), want, 1e-6, name)

    # base_config as a peft.LoraConfig object (sets and enums become JSON lists and strings)
    cfg_out = nu_peft.save_adapter(ad, tmp_path / "out", base_config=lc)
    assert cfg_out["target_modules"] == ["c_attn"]
    assert cfg_out["fan_in_fan_out"] is True
    pm2 = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "out")).eval()
    updates = {n: _dense(m) for n, m in ad.items()}
    _assert_logits(
        _logits(torch, pm2),
        _reference_logits(torch, base, updates, conv1d=True),
        _logits(torch, base),
    )


def test_pattern_key_matches_peft():
    _torch_stack()
    from peft.utils.other import get_pattern_key

    keys = [
        r"^model\.layers\.0\.self_attn\.k_proj",
        "k_proj",
        "layers.1.self_attn.q_proj",
        "q_proj",
        r"layers\.[01]\..*v_proj",
        r"^a\.q",
        "a.q",
    ]
    names = [
        "model.layers.1.self_attn.q_proj",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.2.self_attn.v_proj",
        "model.layers.0.self_attn.k_proj",
        "x.a.q",
        "a.q",
        "xa.q",
        "model.layers.0.mlp.up_proj",
    ]
    for name in names:
        want = get_pattern_key(keys, name)
        got = nu_peft.pattern_key(keys, name)
        assert (got if got is not None else name) == want, name


def test_target_rule_matches_peft():
    # save_adapter checks a carried target_modules covers every module with PEFT's own rule
    _torch_stack()
    from types import SimpleNamespace

    from peft.tuners.tuners_utils import check_target_module_exists

    configs = [
        {"target_modules": ["q_proj", "v_proj"]},
        {"target_modules": ["model.layers.0.self_attn.q_proj"]},
        {"target_modules": r".*layers\.1\..*_proj"},
        {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1]},
        {"target_modules": ["q_proj"], "layers_to_transform": 0, "layers_pattern": "layers"},
        {"target_modules": ["q_proj", "v_proj"], "exclude_modules": ["layers.1.self_attn.v_proj"]},
        {"target_modules": ["proj"]},
    ]
    names = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
        "model.layers.0.mlp.up_proj",
    ]
    fields = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")
    for cfg in configs:
        ns = SimpleNamespace(
            **{k: cfg.get(k) for k in fields}, modules_to_save=None, target_parameters=None
        )
        for name in names:
            want = bool(check_target_module_exists(ns, name))
            assert is_targeted(cfg, name) == want, (cfg, name)


def test_save_refuses_config_missing_modules(tmp_path):
    rng = np.random.default_rng(11)
    lo = {"lora_a": rng.normal(size=(8, 2)), "lora_b": rng.normal(size=(2, 6))}
    ad = {"model.layers.0.self_attn.q_proj": lo, "model.layers.1.self_attn.q_proj": lo}
    with pytest.raises(
        ValueError,
        match=r"with target_modules=\['q_proj'\], layers_to_transform=\[1\] PEFT would not adapt "
        r"module 'model\.layers\.0\.self_attn\.q_proj', so its weights",
    ):
        nu_peft.save_adapter(
            ad,
            tmp_path / "o",
            base_config={"target_modules": ["q_proj"], "layers_to_transform": [1]},
        )
    cfg = nu_peft.save_adapter(ad, tmp_path / "o", base_config={"target_modules": ["q_proj"]})
    assert cfg["target_modules"] == ["q_proj"]


# ---------------------------------------------------------------------------------------------
# Regular expressions from the config: PEFT's rule, at bounded cost
# ---------------------------------------------------------------------------------------------

# "any module whose name ends in a digit": Python's re backtracks exponentially on a module name
# that does not (2^31 paths for model.layers.0.self_attn.q_proj), so PEFT hangs on it
HOSTILE = r"(\w|.)+\d"
LLAMA_NAMES = [f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")]


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds):
    """Fail (do not hang) if the body runs longer than ``seconds``: re checks signals."""
    if not hasattr(signal, "setitimer"):
        pytest.skip("needs SIGALRM to bound the test's own run time")

    def on_alarm(signum, frame):
        raise _Hang(f"still running after {seconds} s: the call hangs")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _llama_like(d, config):
    rng = np.random.default_rng(12)
    return _write(d, config, _lora_tensors(rng, {n: (8, 6, 2) for n in LLAMA_NAMES}))


def _refused_fast(call, match):
    with _time_limit(10):
        t0 = time.perf_counter()
        with pytest.raises(InputError, match=match):
            call()
        took = time.perf_counter() - t0
    assert took < 1.0, took  # the pattern's 0.25 s limit plus starting one helper process


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_hostile_pattern_key_is_refused_fast(tmp_path, field):
    d = _llama_like(tmp_path, {"r": 2, "lora_alpha": 2, field: {"k_proj": 2, HOSTILE: 2}})
    _refused_fast(
        lambda: nu_peft.load_adapter(d),
        rf"adapter_config\.json': {field} key {re.escape(repr(HOSTILE))} did not finish matching "
        r"module 'model\.layers\.0\.self_attn\.q_proj' within 0\.25 s: the regex backtracks "
        r"catastrophically .*PEFT, .*would hang on it too",
    )


def test_hostile_target_patterns_are_refused_fast(tmp_path):
    cfg = {"r": 2, "lora_alpha": 2, "target_modules": HOSTILE}
    d = _llama_like(tmp_path / "a", cfg)
    assert list(nu_peft.load_adapter(d)) == LLAMA_NAMES  # load_adapter does not use targets
    # load_adapters checks that the carried target fields cover the modules
    _refused_fast(
        lambda: nu_peft.load_adapters([d]),
        rf"load_adapters: '.*a/adapter_config\.json': target_modules pattern "
        rf"{re.escape(repr(HOSTILE))} did not finish matching module 'model\.layers\.0\.",
    )
    ad = nu_peft.load_adapter(d)
    for base_config, label in (
        ({"target_modules": HOSTILE}, "target_modules pattern"),
        ({"target_modules": ["q_proj", "v_proj"], "exclude_modules": HOSTILE}, "exclude_"),
    ):
        _refused_fast(
            lambda bc=base_config: nu_peft.save_adapter(ad, tmp_path / "o", base_config=bc),
            rf"save_adapter: {label}.* did not finish matching module",
        )
    assert not (tmp_path / "o").exists()


def test_invalid_pattern_names_key_pattern_and_module(tmp_path):
    d = _llama_like(tmp_path, {"r": 2, "rank_pattern": {"q_proj": 2, "v_proj(": 2}})
    # PEFT's first-match rule: "v_proj(" is reached only by modules "q_proj" does not match
    with pytest.raises(
        InputError,
        match=r"adapter_config\.json': rank_pattern key 'v_proj\(' is not a valid regular "
        r"expression \(missing \), unterminated subpattern.*; matched against module "
        r"'model\.layers\.0\.self_attn\.v_proj'\)",
    ):
        nu_peft.load_adapter(d)


def test_real_regex_keys_still_follow_peft(tmp_path):
    # keys that need the regex engine (character classes, alternation, repetition)
    cfg = {
        "r": 2,
        "lora_alpha": 2,
        "rank_pattern": {r"layers\.[1-9]\..*q_proj": 2},
        "alpha_pattern": {r"(q|k)_proj": 6, r"layers\.1\..+": 10, "v_proj": 4},
    }
    d = _llama_like(tmp_path, cfg)
    scales = {n: m["scale"] for n, m in nu_peft.load_adapter(d).items()}
    assert scales == {
        "model.layers.0.self_attn.q_proj": 3.0,
        "model.layers.0.self_attn.v_proj": 2.0,
        "model.layers.1.self_attn.q_proj": 3.0,
        "model.layers.1.self_attn.v_proj": 5.0,
    }


_GLOB_TOKENS = ["a", "b", "_", "-", ".", r"\.", r"\-", r"\_", "é"]
_NAME_CHARS = "ab_-.é\n"


@settings(max_examples=400, deadline=None)
@given(
    anchor=st.booleans(),
    tokens=st.lists(st.sampled_from(_GLOB_TOKENS), max_size=4),
    name=st.text(alphabet=_NAME_CHARS, max_size=8),
)
def test_plain_patterns_match_exactly_like_re(anchor, tokens, name):
    # the direct matcher of plain patterns against re itself, on the rules PEFT applies
    key = ("^" if anchor else "") + "".join(tokens)
    g = plain_pattern(key)
    assert g is not None, key
    assert plain_suffix_match(g, name) == bool(re.match(rf"(.*\.)?({key})$", name)), (key, name)
    assert plain_full_match(g, name) == bool(re.fullmatch(key, name)), (key, name)


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(
        st.tuples(st.booleans(), st.lists(st.sampled_from(_GLOB_TOKENS), max_size=3)), max_size=6
    ),
    names=st.lists(st.text(alphabet=_NAME_CHARS, max_size=8), min_size=1, max_size=4),
)
def test_first_plain_key_follows_peft_rule(keys, names):
    # literal keys are looked up, wildcard keys scanned: the first key in order still wins
    ks = [("^" if anchor else "") + "".join(tokens) for anchor, tokens in keys]
    got = Regexes("test").first_keys("key", ks, names)
    for name, j in zip(names, got, strict=True):
        want = next((i for i, k in enumerate(ks) if re.match(rf"(.*\.)?({k})$", name)), -1)
        assert j == want, (ks, name)


def test_real_regexes_are_not_taken_for_plain_patterns():
    for key in (HOSTILE, "q*", "[qk]_proj", r"\d", "a|b", "(a)", "a{2}", "a$", "a?", "a+", "x^"):
        assert plain_pattern(key) is None, key


# ---------------------------------------------------------------------------------------------
# Files: missing, folder for file, unreadable
# ---------------------------------------------------------------------------------------------


def test_unreadable_files_are_access_errors(tmp_path, monkeypatch):
    for fname in ("adapter_model.safetensors", "adapter_config.json"):
        d = _one(tmp_path / fname)
        f = d / fname
        f.chmod(0)
        try:
            if os.access(f, os.R_OK):
                # root reads anything: make the reader refuse this file as chmod does for others
                real_open = open

                def fake_open(path, *args, _f=f, _open=real_open, **kwargs):
                    if pathlib.Path(path) == _f:
                        raise PermissionError(13, "Permission denied", str(path))
                    return _open(path, *args, **kwargs)

                monkeypatch.setattr(nu_peft._read, "open", fake_open, raising=False)
            with pytest.raises(
                FileAccessError,
                match=rf"{re.escape(fname)}' exists but cannot be read \(permission denied\); make "
                r"it readable",
            ) as info:
                nu_peft.load_adapter(d)
            assert isinstance(info.value, PermissionError)
        finally:
            f.chmod(0o644)
            monkeypatch.undo()
        nu_peft.load_adapter(d)  # readable again


# ---------------------------------------------------------------------------------------------
# Adapters from different sources: base models, target modules
# ---------------------------------------------------------------------------------------------


def test_load_adapters_refuses_different_base_models(tmp_path):
    rng = np.random.default_rng(13)
    t = _lora_tensors(rng, {"l.q": (8, 6, 2)})
    d0 = _write(tmp_path / "a", {"r": 2, "base_model_name_or_path": "org/llama-7b"}, t)
    d1 = _write(tmp_path / "b", {"r": 2, "base_model_name_or_path": "org/mistral-7b"}, t)
    d_none = _write(tmp_path / "c", {"r": 2, "base_model_name_or_path": None}, t)
    d_absent = _write(tmp_path / "d", {"r": 2}, t)
    match = (
        r"load_adapters: the adapters were trained on different base models: '.*a' on "
        r"'org/llama-7b' but '.*b' on 'org/mistral-7b' \(base_model_name_or_path\).*pass "
        r"allow_different_base=True \(CLI: --allow-different-base\)"
    )
    with pytest.raises(InputError, match=match):
        nu_peft.load_adapters([d0, d1])
    # an unknown base model is never refused, and does not hide a difference between known ones
    with pytest.raises(InputError, match=match):
        nu_peft.load_adapters([d_none, d0, d_absent, d1])
    loaded = nu_peft.load_adapters([d_none, d0, d_absent])
    assert loaded.config == {}  # the first config names no base model
    loaded = nu_peft.load_adapters([d0, d1], allow_different_base=True)
    assert loaded.config["base_model_name_or_path"] == "org/llama-7b"
    # refused before any weights are read
    (d1 / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(InputError, match=match):
        nu_peft.load_adapters([d0, d1])


def _task_update(d, name, scale):
    """float64 kernel-layout update of module ``name`` read from ``d``'s safetensors file."""
    t = safetensors_numpy.load_file(str(d / "adapter_model.safetensors"))
    A = t[f"{P}{name}.lora_A.weight"].astype(np.float64)
    B = t[f"{P}{name}.lora_B.weight"].astype(np.float64)
    return scale * (B @ A).T


def test_load_adapters_merges_the_union_of_modules(tmp_path):
    rng = np.random.default_rng(14)
    base = {"base_model_name_or_path": "org/base", "task_type": "CAUSAL_LM"}

    def mods(layers, kinds, r):
        return {f"m.layers.{i}.{k}": (8, 6, r) for i in layers for k in kinds}

    specs = [  # (config, modules, scale)
        (
            {**base, "r": 2, "lora_alpha": 4, "target_modules": ["q", "v"]},
            mods([2, 10], "qv", 2),
            2,
        ),
        (
            {**base, "r": 3, "lora_alpha": 3, "target_modules": ["k", "o"]},
            mods([2, 10], "ko", 3),
            1,
        ),
        ({**base, "r": 1, "lora_alpha": 5, "target_modules": ["v", "o"]}, mods([10], "vo", 1), 5),
    ]
    dirs = [
        _write(tmp_path / f"t{i}", cfg, _lora_tensors(rng, m))
        for i, (cfg, m, _) in enumerate(specs)
    ]
    loaded = nu_peft.load_adapters(dirs)
    adapters, config = loaded  # still a pair
    names = [f"m.layers.{i}.{k}" for i in (2, 10) for k in "koqv"]  # natural order
    assert [list(ad) for ad in adapters] == [names] * 3
    for ad, (_, m, _) in zip(adapters, specs, strict=True):
        assert {n for n in names if ad[n] is not None} == set(m)
    assert loaded.coverage == {
        "m.layers.2.k": (1,),
        "m.layers.2.o": (1,),
        "m.layers.2.q": (0,),
        "m.layers.2.v": (0,),
        "m.layers.10.k": (1,),
        "m.layers.10.o": (1, 2),
        "m.layers.10.q": (0,),
        "m.layers.10.v": (0, 2),
    }
    assert config == {**base, "target_modules": ["k", "o", "q", "v"]}  # covers the union

    for ad, (_, m, scale), d in zip(adapters, specs, dirs, strict=True):
        for name in m:
            _assert_close(_dense(ad[name]), _task_update(d, name, scale), 1e-6, name)
    # the carried config lets save_adapter write an adapter over the union (the merge itself is
    # checked against PEFT in test_peft_union_merge_save_load_forward)
    union = {n: next(ad[n] for ad in adapters if ad[n] is not None) for n in names}
    cfg = nu_peft.save_adapter(union, tmp_path / "union", base_config=config)
    assert cfg["target_modules"] == ["k", "o", "q", "v"]
    back = nu_peft.load_adapter(tmp_path / "union")
    for name in names:
        _assert_close(_dense(back[name]), _dense(union[name]), 1e-6, name)

    with pytest.raises(
        InputError,
        match=r"modules 'm\.layers\.2\.q', 'm\.layers\.2\.v', 'm\.layers\.10\.q' and 1 more are in "
        r"'.*t0' but not in '.*t1'.*CLI: --strict-targets",
    ):
        nu_peft.load_adapters(dirs, strict_targets=True)


def test_union_config_falls_back_to_exact_names(tmp_path):
    # target fields that cannot be joined into one list (a regex, layers_to_transform): the
    # carried config leaves them out and save_adapter writes the exact module names
    rng = np.random.default_rng(15)
    t0 = _lora_tensors(rng, {"m.layers.0.q": (8, 6, 2), "m.layers.1.q": (8, 6, 2)})
    t1 = _lora_tensors(rng, {"m.layers.1.k": (8, 6, 2)})
    names = ["m.layers.0.q", "m.layers.1.k", "m.layers.1.q"]
    for i, (target, extra) in enumerate(
        [(r"m\.layers\.[0-9]+\.q", {}), (["q"], {"layers_to_transform": [0, 1]})]
    ):
        cfg0 = {"r": 2, "target_modules": target, "fan_in_fan_out": False, **extra}
        d0 = _write(tmp_path / f"{i}a", cfg0, t0)
        d1 = _write(tmp_path / f"{i}b", {"r": 2, "target_modules": ["k"]}, t1)
        assert nu_peft.load_adapters([d0]).config == _jsonable_config(cfg0)  # covers: kept
        loaded = nu_peft.load_adapters([d0, d1])
        assert loaded.config == {"fan_in_fan_out": False}
        union = {n: next(ad[n] for ad in loaded.adapters if ad[n] is not None) for n in names}
        cfg = nu_peft.save_adapter(union, tmp_path / f"{i}out", base_config=loaded.config)
        assert cfg["target_modules"] == names


def _jsonable_config(cfg):
    return {k: v for k, v in cfg.items() if k in nu_peft.CARRIED_FIELDS}


def test_check_compatible_skips_missing_modules():
    a = {"q": {"lora_a": np.ones((8, 2)), "lora_b": np.ones((2, 4))}, "k": None}
    b = {"q": None, "k": {"lora_a": np.ones((8, 1)), "lora_b": np.ones((1, 5))}}
    c = {"q": {"lora_a": np.ones((8, 3)), "lora_b": np.ones((3, 5))}, "k": None}
    nu_peft.check_compatible([a, b], strict_targets=False)
    with pytest.raises(InputError, match=r"module 'q' is in adapter 0 but not in adapter 1"):
        nu_peft.check_compatible([a, b])
    with pytest.raises(
        InputError,
        match=r"module 'q' has update shape \(d_in, d_out\) = \(8, 4\) in adapter 0 but \(8, 5\) "
        r"in adapter 2",
    ):
        nu_peft.check_compatible([a, b, c], strict_targets=False)


# ---------------------------------------------------------------------------------------------
# Messages stay short, whatever the number of modules
# ---------------------------------------------------------------------------------------------


def test_messages_about_many_modules_stay_short(tmp_path):
    n = 2000
    names = [f"model.layers.{i}.mlp.proj_{j}" for i in range(n // 4) for j in range(4)]
    rng = np.random.default_rng(16)
    t_big = _lora_tensors(rng, {name: (2, 2, 1) for name in names})
    big = _write(tmp_path / "big", {"r": 1, "target_modules": names}, t_big)
    small = _write(tmp_path / "small", {"r": 1}, _lora_tensors(rng, {names[0]: (2, 2, 1)}))
    wide = _write(tmp_path / "wide", {"r": 1}, _lora_tensors(rng, {names[0]: (2, 3, 1)}))
    messages = []
    for call in (
        lambda: nu_peft.load_adapters([big, small], strict_targets=True),
        lambda: nu_peft.load_adapters([small, big], strict_targets=True),
        lambda: nu_peft.load_adapters([big, wide]),
    ):
        with pytest.raises(InputError) as info:
            call()
        messages.append(str(info.value))
    ad = nu_peft.load_adapter(big)
    other = {f"{name}_x": m for name, m in ad.items()}
    with pytest.raises(InputError) as info:
        nu_peft.save_adapter(other, tmp_path / "o", base_config=big)  # a list of 2000 names
    messages.append(str(info.value))
    assert "and 1996 more are in" in messages[0] and "and 1997 more" in messages[3]
    for msg in messages:
        assert len(msg) < 1000, (len(msg), msg[:300])


def test_rank_zero_and_extreme_alpha(tmp_path):
    z = np.zeros
    d = _write(
        tmp_path / "r0",
        {"r": 2},
        {f"{P}m.q.lora_A.weight": z((0, 8), np.float32), f"{P}m.q.lora_B.weight": z((6, 0))},
    )
    with pytest.raises(
        InputError,
        match=r"adapter_model\.safetensors' holds rank-0 factors for module 'm\.q' "
        r"\('base_model\.model\.m\.q\.lora_A\.weight' \(0, 8\), .*PEFT adapters have r >= 1",
    ):
        nu_peft.load_adapter(d)
    # a finite extreme alpha loads as given (the scoring handles the scale)
    d = _one(tmp_path / "big", {"r": 2, "lora_alpha": 1e30})
    assert nu_peft.load_adapter(d)["m.q"]["scale"] == 5e29


# ---------------------------------------------------------------------------------------------
# Adapters with different target modules, against real PEFT
# ---------------------------------------------------------------------------------------------

# (LoraConfig kwargs, {module kind: scale PEFT applies}) per task; the union of their modules is
# every q/k/v/o projection, which no single task covers. Every rank is 4, so that all modules form
# one merge bucket (one compile).
MIXED_TASKS = [
    (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), {"q_proj": 2.0, "v_proj": 2.0}),
    (
        dict(r=4, lora_alpha=6, target_modules=["k_proj", "o_proj"], alpha_pattern={"o_proj": 2}),
        {"k_proj": 1.5, "o_proj": 0.5},
    ),
    (
        dict(r=4, lora_alpha=3, use_rslora=True, target_modules=["v_proj", "o_proj"]),
        {"v_proj": 1.5, "o_proj": 1.5},
    ),
]


@HF_WARNINGS
@pytest.mark.parametrize("layers", [None, [1]], ids=["lists", "layers_to_transform"])
def test_peft_union_merge_save_load_forward(llama, tmp_path, layers):
    torch, peft, base, _, _ = llama
    dirs, own = [], []  # own: {module: scale} of each task
    for i, (kwargs, scales) in enumerate(MIXED_TASKS):
        extra = {"layers_to_transform": layers} if layers and i == 2 else {}
        lc = peft.LoraConfig(task_type="CAUSAL_LM", **kwargs, **extra)
        pm = peft.get_peft_model(copy.deepcopy(base), lc)
        _randomize(torch, pm, seed=10 + i)
        own.append({n: scales[n.rsplit(".", 1)[1]] for n in _lora_layers(pm)})
        pm.save_pretrained(str(tmp_path / f"task{i}"))
        dirs.append(tmp_path / f"task{i}")
    union = sorted(set().union(*own), key=natural_key)
    assert len(union) == 8 and all(len(o) < 8 for o in own)

    loaded = nu_peft.load_adapters(dirs)
    assert [list(ad) for ad in loaded.adapters] == [union] * 3
    assert loaded.coverage == {n: tuple(i for i, o in enumerate(own) if n in o) for n in union}
    merged, _ = nu.merge_adapters(loaded.adapters, budget=2, allocation="all", method="ta")
    # each task's own update, float64 from its safetensors file; a task lacking a module adds 0
    want = {
        n: sum(_task_update(d, n, o[n]) for d, o in zip(dirs, own, strict=True) if n in o)
        for n in union
    }
    for name in union:
        _assert_close(_dense(merged[name]), want[name], 1e-5, name)

    out = tmp_path / "merged"
    cfg = nu_peft.save_adapter(merged, out, base_config=loaded.config)
    # plain lists join into one list; layers_to_transform cannot, so exact names are written
    assert cfg["target_modules"] == (LLAMA_TARGETS_SORTED if layers is None else union)
    assert cfg["task_type"] == "CAUSAL_LM"
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(out)).eval()
    layers_back = _lora_layers(pm)
    assert set(layers_back) == set(union)
    for name, layer in layers_back.items():
        _assert_close(_peft_delta(layer), want[name], 1e-5, name)
    _assert_logits(_logits(torch, pm), _reference_logits(torch, base, want), _logits(torch, base))


LLAMA_TARGETS_SORTED = sorted(LLAMA_TARGETS)


def test_target_rule_with_patterns_matches_peft():
    # string patterns (plain ones matched directly, real regexes by the helper) and layer rules
    _torch_stack()
    from types import SimpleNamespace

    from peft.tuners.tuners_utils import check_target_module_exists

    configs = [
        {"target_modules": "model.layers.0.self_attn.q_proj"},
        {"target_modules": "model.layers.1.self_attn..._proj"},
        {"target_modules": r"^model\.layers\.0\.self_attn\.q_proj"},
        {"target_modules": r".*\.(q|v)_proj", "exclude_modules": r".*layers\.1\.self_attn\.v_proj"},
        {"target_modules": ["q_proj"], "exclude_modules": "model.layers.0.self_attn.q_proj"},
        {"target_modules": ["q_proj", "up_proj"], "layers_to_transform": 0},
        {
            "target_modules": ["q_proj", "v_proj"],
            "layers_to_transform": [1],
            "layers_pattern": "layers",
        },
        {
            "target_modules": ["q_proj"],
            "layers_to_transform": [0],
            "layers_pattern": ["h", "layers"],
        },
        {"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": "la.ers"},
        {"target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": ""},
        {"target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": []},
        {"target_modules": ["q_proj", "v_proj"], "exclude_modules": ["layers.1.self_attn.v_proj"]},
        {"target_modules": ["model.layers.1.self_attn.q_proj"], "layers_to_transform": [0]},
    ]
    names = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
        "model.layers.0.mlp.up_proj",
    ]
    fields = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")
    for cfg in configs:
        ns = SimpleNamespace(
            **{k: cfg.get(k) for k in fields}, modules_to_save=None, target_parameters=None
        )
        want = sorted((n for n in names if not check_target_module_exists(ns, n)), key=natural_key)
        got = untargeted(cfg, names, Regexes("test"), fn="test")
        assert got == want, cfg


def test_save_refuses_malformed_target_fields(tmp_path):
    lo = {"lora_a": np.ones((8, 2)), "lora_b": np.ones((2, 6))}
    for bad, match in (
        ({"target_modules": ["q", 3]}, r"target_modules is \['q', 3\]; expected a regex string"),
        ({"target_modules": ["q"], "layers_to_transform": [True]}, r"layers_to_transform is"),
        ({"target_modules": ["q"], "exclude_modules": 7}, r"exclude_modules is 7; expected"),
    ):
        with pytest.raises(InputError, match=match):
            nu_peft.save_adapter({"m.q": lo}, tmp_path / "o", base_config=bad)


def test_save_gives_files_the_users_umask_modes(tmp_path):
    # safetensors writes 0600 and mkdtemp makes a private folder; a saved adapter must be as
    # readable as any file the user writes (0644 / 0755 under the usual umask 022)
    old = os.umask(0o022)
    try:
        ad = {"q": {"lora_a": np.ones((4, 2), np.float32), "lora_b": np.ones((2, 3), np.float32)}}
        nu_peft.save_adapter(ad, tmp_path / "out")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        assert stat.S_IMODE((tmp_path / "out" / f).stat().st_mode) == 0o644, f
