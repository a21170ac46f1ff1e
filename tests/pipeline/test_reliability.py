"""Results that must never be silently wrong: underflowing coefficients and written dtypes, config
fields that move weights, merges that drop everything, unreadable dtypes, failed writes and the
command's messages. Each test pins a refusal (exit 2, one line) or a result checked against a
float64 reference."""

from __future__ import annotations

import collections
import json
import math
import os
import pathlib
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import warnings

import jax
import ml_dtypes
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import cli
from netutility_jax.errors import InputError
from netutility_jax.pipeline import merging as merging_mod


def _host_tag() -> str:
    """The host part of the library's temporary names, as its contract states it: the host
    name's letters and digits, at most 32 of them ("host" if none)."""
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


safetensors_numpy = pytest.importorskip("safetensors.numpy")

NAMES = [f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")]
D, R = 32, 4
BASE = {"base_model_name_or_path": "tiny-test-model", "task_type": "CAUSAL_LM"}
P = nu.peft.PREFIX


def _adapter(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        n: {
            "lora_a": rng.normal(size=(D, R)).astype(np.float32),
            "lora_b": rng.normal(size=(R, D)).astype(np.float32),
            "scale": 2.0,
        }
        for n in NAMES
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("adapters")
    out = []
    for i in range(3):
        p = root / f"task{i}"
        nu.peft.save_adapter(_adapter(i), p, base_config=BASE)
        out.append(str(p))
    return out


@pytest.fixture(scope="module")
def loaded(folders):
    return nu.peft.load_adapters(folders).adapters


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _update(mod) -> np.ndarray:
    """A module's update in float64, from its stored factors (never through float32)."""
    if "delta" in mod:
        return np.asarray(mod["delta"], np.float64)
    a = np.asarray(mod["lora_a"], np.float64)
    b = np.asarray(mod["lora_b"], np.float64)
    return float(mod.get("scale", 1.0)) * a @ b


def _one_line(err: str, start: str) -> None:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(start), err


# ---------------------------------------------------------------------------------------------
# 1. a coefficient below the dtype's normal range
# ---------------------------------------------------------------------------------------------


def _merged_or_refused(fn, want_unit: dict, coef: float):
    """``fn()`` either refuses with an InputError naming the coefficient and the underflow, or
    returns an adapter whose update is ``coef`` times ``want_unit`` (the merge at coef=1)."""
    try:
        merged = fn()
    except InputError as e:
        assert re.search(r"coef=[-+0-9.e]+", str(e)) and "underflow" in str(e), str(e)
        return None
    for n, want1 in want_unit.items():
        got = _update(merged[n])
        assert np.abs(got).max() > 0, n
        want = coef * want1
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    return merged


@pytest.mark.parametrize("coef", [1e-39, 1e-45, 1e-320])
def test_tiny_coef_is_merged_exactly_or_refused_in_python(loaded, coef):
    unit, _ = nu.merge_adapters(loaded, budget=4)
    want = {n: _update(m) for n, m in unit.items()}
    rep_first = _merged_or_refused(lambda: nu.merge_adapters(loaded, budget=4, coef=coef)[0],
                                   want, coef)  # fmt: skip
    # nu.merge with the same masks: the same answer
    _, rep = nu.merge_adapters(loaded, budget=4)
    got = _merged_or_refused(lambda: nu.merge(loaded, rep.masks, coef=coef), want, coef)
    assert (got is None) == (rep_first is None)
    # the largest entry, 2e-38 * coef / 1e-39, decides: representable at 1e-39, not below
    assert (got is None) == (coef < 1e-40)


_TSV_CORE = ["--method", "tsv", "--space", "core"]


@pytest.mark.parametrize(
    "coef, route",
    [
        ("1e-39", []),
        ("1e-45", []),
        ("1e-320", []),
        ("1e-39", ["--in-memory"]),
        ("1e-39", _TSV_CORE),
        *(
            pytest.param(c, r, marks=pytest.mark.slow)
            for c in ("1e-45", "1e-320")
            for r in (["--in-memory"], _TSV_CORE)
        ),
    ],
)
def test_tiny_coef_is_never_written_as_zeros(folders, loaded, tmp_path, capsys, coef, route):
    out = tmp_path / "o"
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "4", "--coef", coef, "--out",
                      str(out), "--quiet", "--no-plots", *route)  # fmt: skip
    if rc == 2:
        _one_line(err, "netutility merge: error: nu.merge")
        assert f"coef={float(coef)!r}" in err and "underflow" in err
        assert not out.exists()
        return
    assert rc == 0 and err == "", err
    method = route[1] if route[:1] == ["--method"] else "ta"
    space = route[3] if route[:1] == ["--method"] else "full"
    unit, _ = nu.merge_adapters(loaded, budget=4, method=method, space=space)
    back = nu.peft.load_adapter(out)
    for n in NAMES:
        want = float(coef) * _update(unit[n])
        got = _update(back[n])
        assert np.abs(got).max() > 0
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("route", [[], ["--in-memory"]])
def test_huge_coef_is_refused_without_numpy_warnings(folders, tmp_path, capsys, route):
    with warnings.catch_warnings():  # (numpy's overflow warnings would be errors here)
        warnings.simplefilter("error")
        rc, _, err = _run(capsys, "merge", *folders, "--budget", "4", "--coef", "1e308",
                          "--out", str(tmp_path / "o"), "--quiet", "--no-plots", *route)  # fmt: skip
    assert rc == 2, err
    _one_line(err, "netutility merge: error: nu.merge")
    assert "coef=1e+308" in err and "overflow" in err and "Warning" not in err


def test_huge_coef_in_python_is_an_input_error(loaded):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputError, match=r"coef=1e\+308 .*overflow"):
            nu.merge_adapters(loaded, budget=4, coef=1e308)


# ---------------------------------------------------------------------------------------------
# 2. the written dtype's range: a power of two moves between the factors, or a refusal
# ---------------------------------------------------------------------------------------------

_SAVE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _finfo(name):
    return ml_dtypes.finfo(_SAVE[name]) if name == "bfloat16" else np.finfo(_SAVE[name])


@pytest.mark.parametrize("dtype", list(_SAVE))
def test_written_dtype_keeps_the_update_or_refuses(tmp_path, dtype):
    """Across the written dtype's whole range and beyond: the update PEFT reads back (float64
    product of the stored factors) is the merged one to the dtype's precision, or save_adapter
    refuses naming the module and the dtype; never zeros, never inf. Wherever a balanced split
    of the update's size fits the dtype's normal range, it must be written."""
    fi = _finfo(dtype)
    rng = np.random.default_rng(0)
    a = rng.normal(size=(D, R))
    b = rng.normal(size=(R, D))
    tiny, big, eps = float(fi.tiny), float(fi.max), float(fi.eps)
    written = refused = 0
    for k, lg in enumerate(range(-300, 301, 10)):
        scale = 10.0**lg
        mod = {"lora_a": a, "lora_b": b, "scale": scale}
        path = tmp_path / f"o{k}"
        want = _update(mod)
        peak = np.abs(want).max()
        try:
            nu.peft.save_adapter({"m.q": mod}, path, dtype=dtype)
        except InputError as e:
            refused += 1
            assert "'m.q'" in str(e) and dtype in str(e), str(e)
            # refused only where no split of the update into two factors can fit
            assert not (tiny * 64 < math.sqrt(peak) < big / 64), (scale, str(e))
            continue
        written += 1
        got = _update(nu.peft.load_adapter(path)["m.q"])
        assert np.all(np.isfinite(got)) and np.abs(got).max() > 0, scale
        # each factor entry is rounded to eps/2 of the factor's largest entry (a normal number)
        atol = 2 * R * eps * np.abs(a).max() * np.abs(b).max() * scale
        np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=str(scale))
    assert written and refused


def test_float16_coef_1e_9_is_written_or_refused_not_zeroed(folders, tmp_path, capsys):
    out32, out16 = tmp_path / "f32", tmp_path / "f16"
    common = ["--budget", "4", "--coef", "1e-9", "--quiet", "--no-plots"]
    rc, _, err = _run(capsys, "merge", *folders, *common, "--out", str(out32))
    assert rc == 0, err
    rc, _, err = _run(capsys, "merge", *folders, *common, "--out", str(out16), "--dtype",
                      "float16")  # fmt: skip
    ref = nu.peft.load_adapter(out32)
    if rc == 2:
        _one_line(err, "netutility merge: error: ")
        assert "float16" in err and "underflow" in err
        return
    back = nu.peft.load_adapter(out16)
    for n in NAMES:
        want = _update(ref[n])
        np.testing.assert_allclose(_update(back[n]), want, atol=2e-2 * np.abs(want).max())


# ---------------------------------------------------------------------------------------------
# 3. config fields that move weights, checked on every adapter
# ---------------------------------------------------------------------------------------------


def _with_config(src: str, dst: pathlib.Path, **fields) -> str:
    dst.mkdir()
    cfg = json.loads((pathlib.Path(src) / "adapter_config.json").read_text())
    cfg.update(fields)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    (dst / "adapter_model.safetensors").write_bytes(
        (pathlib.Path(src) / "adapter_model.safetensors").read_bytes()
    )
    return str(dst)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"layer_replication": [[0, 2], [1, 2]]}, r"layer_replication"),
        ({"target_modules": ["k_proj"]}, r"target_modules"),
        ({"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [0]},
         r"layers_to_transform"),
    ],
)  # fmt: skip
def test_placement_fields_are_checked_on_every_adapter(folders, tmp_path, capsys, fields, match):
    odd = _with_config(folders[1], tmp_path / "odd", **fields)
    paths = [folders[0], odd, folders[2]]
    for load in (nu.peft.load_adapters, nu.peft.open_adapters):
        with pytest.raises(InputError, match=match) as e:
            load(paths)
        assert "odd" in str(e.value)
    for extra in ([], ["--in-memory"], ["--strict-targets"]):
        rc, _, err = _run(capsys, "merge", *paths, "--budget", "4", "--out",
                          str(tmp_path / "o"), "--quiet", "--no-plots", *extra)  # fmt: skip
        assert rc == 2
        _one_line(err, "netutility merge: error: nu.peft.")
        assert re.search(match, err) and "odd" in err


def test_same_layer_replication_everywhere_is_carried(folders, tmp_path):
    rep = [[0, 2], [1, 2]]
    paths = [_with_config(f, tmp_path / f"r{i}", layer_replication=rep)
             for i, f in enumerate(folders)]  # fmt: skip
    assert nu.peft.load_adapters(paths).config["layer_replication"] == rep


# ---------------------------------------------------------------------------------------------
# 7. a merge whose method drops everything
# ---------------------------------------------------------------------------------------------


_TIES0 = ["--method", "ties", "--space", "core", "--density", "1e-300"]
_DARE0 = ["--method", "dare", "--space", "core", "--p", "0.999999"]


@pytest.mark.parametrize(
    "flags, route",
    [
        (_TIES0, []),
        (_DARE0, ["--in-memory"]),
        pytest.param(_TIES0, ["--in-memory"], marks=pytest.mark.slow),
        pytest.param(_DARE0, [], marks=pytest.mark.slow),
    ],
)
def test_all_zero_merges_are_reported(folders, loaded, tmp_path, capsys, flags, route):
    out = tmp_path / "o"
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "4", "--out", str(out),
                      "--quiet", "--no-plots", *flags, *route)  # fmt: skip
    assert rc == 0
    _one_line(err, "netutility merge: warning: ")
    assert "model.layers.0.self_attn.q_proj" in err and "4 modules" in err
    report = json.loads((out / "netutility_report.json").read_text())
    assert report["zeroed"] == NAMES
    # Python: a warning of its own category, and the report
    opts = {"density": 1e-300} if "ties" in flags else {"p": 0.999999}
    with pytest.warns(merging_mod.ZeroUpdateWarning, match=r"model\.layers\.0\.self_attn"):
        _, rep = nu.merge_adapters(loaded, budget=4, method=flags[1], space="core",
                                   key=jax.random.key(0), **opts)  # fmt: skip
    assert rep.zeroed == tuple(NAMES)
    src = nu.peft.open_adapters(folders)
    with pytest.warns(merging_mod.ZeroUpdateWarning):
        _, rep = nu.merge_adapters_streaming(src, budget=4, method=flags[1], space="core",
                                             key=jax.random.key(0), chunk_bytes=1, **opts)  # fmt: skip
    assert rep.zeroed == tuple(NAMES)


def test_ordinary_merges_report_nothing_zeroed(loaded):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, rep = nu.merge_adapters(loaded, budget=4, method="ties", space="core", density=0.3)
    assert rep.zeroed == ()


# ---------------------------------------------------------------------------------------------
# 9. float8 and float4 safetensors factors
# ---------------------------------------------------------------------------------------------


def _raw_safetensors(path: pathlib.Path, tensors: dict) -> None:
    """A safetensors file written byte by byte: ``{name: (dtype code, shape, bytes)}``."""
    header, blobs, off = {}, [], 0
    for k, (code, shape, data) in tensors.items():
        header[k] = {"dtype": code, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def _f8_folder(d: pathlib.Path, code: str, dtype, seed: int = 0):
    d.mkdir()
    rng = np.random.default_rng(seed)
    cfg = {"r": R, "lora_alpha": R, "target_modules": ["q_proj"], **BASE}
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    name = "model.layers.0.self_attn.q_proj"
    a = rng.normal(size=(R, D)).astype(dtype)
    b = rng.normal(size=(D, R)).astype(dtype)
    _raw_safetensors(
        d / "adapter_model.safetensors",
        {f"{P}{name}.lora_A.weight": (code, a.shape, a.tobytes()),
         f"{P}{name}.lora_B.weight": (code, b.shape, b.tobytes())},
    )  # fmt: skip
    return name, a.astype(np.float32), b.astype(np.float32)


@pytest.mark.parametrize(
    "code, dtype", [("F8_E4M3", ml_dtypes.float8_e4m3fn), ("F8_E5M2", ml_dtypes.float8_e5m2)]
)
def test_float8_factors_are_read_and_upcast(tmp_path, code, dtype):
    name, a, b = _f8_folder(tmp_path / "f8", code, dtype)
    got = nu.peft.load_adapter(tmp_path / "f8")[name]
    assert got["lora_a"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(got["lora_a"]), a.T)
    np.testing.assert_array_equal(np.asarray(got["lora_b"]), b.T)
    s = nu.peft.open_adapters([tmp_path / "f8"])
    assert s.stored_dtypes == (code,)
    np.testing.assert_array_equal(np.asarray(s.read([name])[0][name]["lora_b"]), b.T)


def test_float4_factors_are_refused_before_reading(tmp_path):
    d = tmp_path / "f4"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": R, "lora_alpha": R}))
    name = "model.layers.0.self_attn.q_proj"
    _raw_safetensors(
        d / "adapter_model.safetensors",
        {f"{P}{name}.lora_A.weight": ("F4", (R, D), bytes(R * D // 2)),
         f"{P}{name}.lora_B.weight": ("F4", (D, R), bytes(R * D // 2))},
    )  # fmt: skip
    for load in (nu.peft.load_adapter, lambda p: nu.peft.open_adapters([p])):
        with pytest.raises(InputError, match=r"lora_A\.weight.* F4") as e:
            load(d)
        assert "adapter_model.safetensors" in str(e.value)


# ---------------------------------------------------------------------------------------------
# 10. failed writes, the size estimate, stale temporaries
# ---------------------------------------------------------------------------------------------

_FSIZE = (
    "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (200 * 1024, "
    "resource.getrlimit(resource.RLIMIT_FSIZE)[1])); sys.argv = ['netutility', *sys.argv[1:]]; "
    "runpy.run_module('netutility_jax.cli', run_name='__main__')"
)


@pytest.mark.parametrize("route", [["--in-memory"], pytest.param([], marks=pytest.mark.slow)])
def test_a_failed_write_is_one_line_exit_2(folders, tmp_path, route):
    """A file-size limit (as a full disk) under the real command: exit 2, one line naming the
    output and the system's error, nothing left behind."""
    out = tmp_path / "o"
    proc = subprocess.run(
        [sys.executable, "-c", _FSIZE, "merge", *folders, "--budget", "4", "--out", str(out),
         "--quiet", "--no-plots", "--serving-ranks", "512", *route],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    _one_line(proc.stderr, f"netutility merge: error: --out {out}: writing the result failed")
    assert "File too large" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_save_adapter_failed_write_is_an_os_error(tmp_path):
    code = (
        "import resource, sys, numpy as np, netutility_jax as nu\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        "m = {'m.q': {'lora_a': np.ones((512, 8)), 'lora_b': np.ones((8, 512))}}\n"
        "try:\n    nu.peft.save_adapter(m, sys.argv[1])\n"
        "except OSError as e:\n    print(type(e).__name__, e.errno, e.filename)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "sa")], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    kind, errno_, filename = proc.stdout.split()
    assert (
        kind == "OSError" and int(errno_) == 27 and filename.endswith("adapter_model.safetensors")
    )
    assert not list(tmp_path.iterdir())


def test_size_estimate_counts_serving_rank_padding(folders, tmp_path, capsys, monkeypatch):
    out = tmp_path / "o"
    argv = ["merge", *folders, "--budget", "4", "--quiet", "--no-plots", "--serving-ranks", "512"]
    rc, _, err = _run(capsys, *argv, "--out", str(out))
    assert rc == 0, err
    written = (out / "adapter_model.safetensors").stat().st_size
    est = cli.estimate_out_bytes([nu.peft.weight_shapes(f) for f in folders], rank=None,
                                 dtype="float32", serving_ranks=(1, 512))  # fmt: skip
    assert written <= est.bytes - cli.OUT_MARGIN < 2 * written
    usage = collections.namedtuple("usage", "total used free")
    free = written + cli.OUT_MARGIN - 1
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(2 * free, free, free))
    for extra in ([], ["--in-memory"]):
        rc, _, err = _run(capsys, *argv, "--out", str(tmp_path / "o2"), *extra)
        assert rc == 2 and "not enough free space" in err and "rank up to 512" in err


def test_stale_save_temporaries_are_removed_by_the_next_write(tmp_path):
    """save_adapter killed with -9 while writing leaves its staging folder; the next write into
    that folder removes it (and only such leftovers of dead processes)."""
    code = (
        "import sys, time, numpy as np, netutility_jax as nu, safetensors.numpy as sn\n"
        "def hang(*a, **k):\n    print('writing', flush=True); time.sleep(600)\n"
        "sn.save_file = hang\n"
        "m = {'m.q': {'lora_a': np.ones((8, 2)), 'lora_b': np.ones((2, 8))}}\n"
        "nu.peft.save_adapter(m, sys.argv[1])\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "sa")], stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout.readline().strip() == "writing"
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".sa.tmp-"), left
    keep = [tmp_path / ".sa.tmp-unrelated", tmp_path / ".other"]
    for k in keep:
        k.mkdir()
    mine = tmp_path / f".x.tmp-{_host_tag()}-{os.getpid()}-abcd1234"  # a live process's
    mine.mkdir()
    m = {"m.q": {"lora_a": np.ones((8, 2)), "lora_b": np.ones((2, 8))}}
    nu.peft.save_adapter(m, tmp_path / "next")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*(k.name for k in keep), mine.name, "next"]
    )


# ---------------------------------------------------------------------------------------------
# 14. messages: --rank, argparse errors; the rank cap of the size estimate
# ---------------------------------------------------------------------------------------------


def test_rank_zero_names_rank_not_the_budget(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["merge", "a", "--budget", "2", "--out", "o", "--rank", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("netutility merge: error: argument --rank: ")
    assert "budget" not in err and "rank" in err.split("argument --rank: ", 1)[1]


@pytest.mark.parametrize(
    "argv, start",
    [
        (["merge", "a", "--budget", "0", "--out", "o"], "netutility merge: error: argument --budget"),
        (["merge", "a", "--out", "o"], "netutility merge: error: the following arguments"),
        (["merge", "a", "--budget", "2", "--out", "o", "--frobnicate"],
         "netutility merge: error: unrecognized arguments: --frobnicate"),
        (["inspect"], "netutility inspect: error: the following arguments"),
        (["frobnicate"], "netutility: error: argument COMMAND: invalid choice"),
    ],
)  # fmt: skip
def test_argparse_errors_are_one_line(capsys, argv, start):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    _one_line(err, start)
    assert "--help" in err


def test_huge_rank_is_capped_by_what_the_result_can_have(folders, tmp_path, capsys):
    est = cli.estimate_out_bytes([nu.peft.weight_shapes(f) for f in folders], rank=2**31 - 1,
                                 dtype="float32")  # fmt: skip
    assert est.rank == D and est.bytes - cli.OUT_MARGIN == 4 * (D * 2 * D * 4 + 512)
    rc, _, err = _run(capsys, "merge", *folders, "--budget", "4", "--method", "ties",
                      "--rank", str(2**31 - 1), "--out", str(tmp_path / "o"), "--quiet",
                      "--no-plots")  # fmt: skip
    assert rc == 0, err


# ---------------------------------------------------------------------------------------------
# 14. streamed against in-memory: the bound the README states
# ---------------------------------------------------------------------------------------------


def _readme_bound() -> float:
    text = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    section = text.split("## Errors and guarantees", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"streamed merge .*? within ([0-9.]+e-[0-9]+) of the largest entry", section,
                  re.S)  # fmt: skip
    assert m, "the README's 'Errors and guarantees' states the streamed merge's bound"
    return float(m[1])


@pytest.mark.parametrize(
    "method, space, opts",
    [("ties", "core", {"density": 0.5}), ("tsv", "knots", {}),
     pytest.param("ta", "full", {}, marks=pytest.mark.slow),
     pytest.param("dare", "core", {"p": 0.5}, marks=pytest.mark.slow)],
)  # fmt: skip
def test_streamed_one_module_per_chunk_is_within_the_stated_bound(
    folders, loaded, method, space, opts
):  # fmt: skip
    bound = _readme_bound()
    kw = {"budget": 4, "method": method, "space": space, "key": jax.random.key(0), **opts}
    mem, rm = nu.merge_adapters(loaded, **kw)
    st, rs = nu.merge_adapters_streaming(nu.peft.open_adapters(folders), chunk_bytes=1, **kw)
    for n in NAMES:
        np.testing.assert_array_equal(np.asarray(rm.masks[n]), np.asarray(rs.masks[n]))
        want = _update(mem[n])
        assert np.abs(_update(st[n]) - want).max() <= bound * np.abs(want).max()
