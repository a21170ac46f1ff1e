"""The merge pass's programs: how many, that they are the previous computation bit for bit, and
the kept executables (``netutility_jax._executables``) that spare a fresh process tracing and
lowering them.

Shapes here (``d_in = 41``, ``d_out`` 29 and 13, ``r = 5``, ``M = 3``) are used by no other test,
so that every program of a merge below is compiled (or loaded) where it is counted.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import monitoring

import netutility_jax as nu
from netutility_jax import _executables, _mesh, _stages, registry
from netutility_jax._executables import kernel

D_IN, R, M = 41, 5, 3
OUTS = {"q": 29, "v": 13}  # two buckets
LAYERS = 2
COMPILE = "/jax/core/compile/backend_compile_duration"


def _adapters(seed: int = 0, scale: float = 1.5) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            f"l{layer}.{mod}": {
                "lora_a": rng.standard_normal((D_IN, R)).astype(np.float32),
                "lora_b": (rng.standard_normal((R, d_out)) * 0.1).astype(np.float32),
                "scale": scale * (1 + i),
            }
            for layer in range(LAYERS)
            for mod, d_out in OUTS.items()
        }
        for i in range(M)
    ]


def _masks(ads: list[dict], seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {n: rng.random((M, R)) < 0.6 for n in ads[0]}


class _Programs:
    """Programs compiled (or loaded from JAX's cache) while the context is open, and the kept
    executables compiled."""

    def __enter__(self):
        self.counts: collections.Counter = collections.Counter()
        self.kept = _executables.stats()["compiles"]
        monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def _listen(self, name, secs, **kw):
        self.counts[name] += 1

    def __exit__(self, *exc):
        monitoring.unregister_event_duration_listener(self._listen)
        self.kept = _executables.stats()["compiles"] - self.kept

    @property
    def programs(self) -> int:
        return self.counts[COMPILE]


def _one_device_mesh():
    return nu.module_mesh(jax.local_devices()[:1])


@pytest.mark.parametrize(
    "method,space,most", [("ta", "full", 6), ("tsv", "core", 6), ("ties", "knots", 7)]
)
def test_streamed_merge_pass_programs_per_bucket(method, space, most):
    """The merge pass of a streamed merge (factors stacked on the host, one device) compiles at
    most ``most`` programs per bucket: the scales, the reduction's branch taken, coordinates,
    the method, decode, map back (elementwise methods: the split and the elementwise kernel of
    one chunk shape, and ``_select``'s count table). Eager operations on the host side (a mask
    stack, the live counts' sum and slice, a concatenation of statuses) are each a program of
    their own, traced and loaded in every process: a regression adds programs here."""
    ads = _adapters(10 + len(method) + len(space))
    opts = {"density": 0.4} if method == "ties" else {}
    with _Programs() as p:
        jax.block_until_ready(
            nu.merge(ads, _masks(ads), method=method, space=space, mesh=_one_device_mesh(), **opts)
        )
    # (ties in knots space also compiles one count table per bucket in _select; listed apart)
    assert p.programs <= most * len(OUTS), p.counts


@pytest.mark.parametrize("extreme", [False, True], ids=["plain", "scaled"])
def test_reduce_bucket_is_the_one_program_reduction_bit_for_bit(extreme):
    """:func:`_stages.reduce_bucket` (scales first, then the branch they call for, two
    programs) returns exactly what the one-program :func:`_stages.stage_reduce` (both branches
    under a ``lax.cond``) returns, for moderate factors and for factors far from 1 (the scaled
    branch)."""
    ads = _adapters(3)
    if extreme:
        for ad in ads:
            for mod in ad.values():
                mod["lora_a"] = mod["lora_a"] * np.float32(2.0**40)
    names = [n for n in ads[0] if n.endswith(".q")]
    bk = nu._tree.Bucket(
        tuple(names), D_IN, OUTS["q"], R,
        tuple(tuple(nu._tree.Module(ad[n]["lora_a"], ad[n]["lora_b"], ad[n]["scale"])
                    for ad in ads) for n in names),
    )  # fmt: skip
    st = _mesh.host_stack(bk, np.float32, len(names))
    cfg = _stages.ReduceConfig(D_IN, OUTS["q"], R, np.float32, M)
    new = _stages.reduce_bucket(st, cfg=cfg)
    old = _stages.stage_reduce(st, cfg=cfg)
    a_exp = np.asarray(new[1].a_exp)
    assert (np.abs(a_exp).max() > 24) == extreme  # the branch meant
    for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_streamed_path_ta_equals_float64_reference():
    """TA on the stacked (streamed) path: the merged update of each module is the sum of the
    kept directions of each task's SVD, computed here in float64 numpy."""
    ads = _adapters(4)
    masks = _masks(ads, 5)
    out = nu.merge(ads, masks, method="ta", space="full", mesh=_one_device_mesh())
    for n in ads[0]:
        want = np.zeros((D_IN, OUTS[n.split(".")[1]]))
        for i, ad in enumerate(ads):
            a = ad[n]["lora_a"].astype(np.float64)
            b = ad[n]["lora_b"].astype(np.float64)
            u, s, vt = np.linalg.svd(ad[n]["scale"] * a @ b, full_matrices=False)
            keep = masks[n][i] & (s[:R] > 0)
            want += (u[:, :R] * (s[:R] * keep)) @ vt[:R]
        got = np.asarray(out[n]["lora_a"], np.float64) @ np.asarray(out[n]["lora_b"], np.float64)
        np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())


# ------------------------------------------------------------------------- kept executables


@pytest.fixture
def kept(tmp_path):
    """The kept executables on, in a fresh folder; off again afterwards."""
    _executables.enable(tmp_path / "exe")
    try:
        yield tmp_path / "exe"
    finally:
        _executables.enable(None)


def _fresh_kernel(**kw):
    """A new kernel (nothing loaded in memory) and the list its traces append to."""
    traces: list = []

    def poly(x, y, *, k: int):
        traces.append(k)
        return jnp.sin(x) * y + k, {"sum": jnp.sum(x * y)}

    poly.__module__ = __name__  # (its key: this module's name)
    return kernel(poly, static_argnames=("k",)), traces


def test_kernel_is_jit_when_off():
    f, traces = _fresh_kernel()
    x = np.linspace(0, 1, 7, dtype=np.float32)
    assert _executables.folder() is None
    before = _executables.stats()
    out = f(x, np.float32(2), k=3)
    assert _executables.stats() == before and traces == [3]
    ref = jax.jit(lambda x, y: (jnp.sin(x) * y + 3, {"sum": jnp.sum(x * y)}))(x, np.float32(2))
    jax.tree.map(np.testing.assert_array_equal, out, ref)


def test_kernel_kept_then_loaded_without_tracing(kept):
    x = np.linspace(0, 1, 7, dtype=np.float32)
    f, traces = _fresh_kernel()
    s0 = _executables.stats()
    first = f(x, np.float32(2), k=3)
    again = f(x, np.float32(2), k=3)
    s1 = _executables.stats()
    assert (s1["compiles"] - s0["compiles"], s1["hits"] - s0["hits"]) == (1, 1)
    assert traces == [3] and len(list(kept.iterdir())) == 1
    # a new kernel object (as a fresh process has): loaded from the folder, never traced
    g, traces_g = _fresh_kernel()
    loaded = g(x, np.float32(2), k=3)
    assert traces_g == [] and _executables.stats()["loads"] == s1["loads"] + 1
    ref = jax.jit(lambda x, y: (jnp.sin(x) * y + 3, {"sum": jnp.sum(x * y)}))(x, np.float32(2))
    for out in (first, again, loaded):
        jax.tree.map(np.testing.assert_array_equal, out, ref)


def test_kernel_keys_static_args_shapes_and_config(kept):
    f, traces = _fresh_kernel()
    x = np.ones(4, np.float32)
    f(x, np.float32(1), k=1)
    f(x, np.float32(1), k=2)  # another static value
    f(np.ones(5, np.float32), np.float32(1), k=1)  # another shape
    f(x, 1.0, k=1)  # a weak-typed scalar
    with jax.numpy_dtype_promotion("standard"):  # (the suite runs strict): another config
        f(x, np.float32(1), k=1)
    assert traces == [1, 2, 1, 1, 1]
    assert len(list(kept.iterdir())) == 5


def test_kernel_inside_a_trace_is_plain_jit(kept):
    f, _ = _fresh_kernel()
    before = _executables.stats()["bypassed"]
    out = jax.jit(lambda x: f(x, x, k=2)[0])(np.ones(3, np.float32))
    assert _executables.stats()["bypassed"] == before + 1 and not list(kept.glob("*.exe"))
    np.testing.assert_allclose(np.asarray(out), np.sin(1.0) + 2, rtol=1e-6)


def test_kernel_replaces_a_corrupt_file(kept):
    f, _ = _fresh_kernel()
    x = np.ones(3, np.float32)
    f(x, np.float32(1), k=1)
    (path,) = kept.iterdir()
    path.write_bytes(b"not an executable")
    g, traces = _fresh_kernel()
    out = g(x, np.float32(1), k=1)
    assert traces == [1] and path.read_bytes() != b"not an executable"
    np.testing.assert_allclose(np.asarray(out[0]), np.sin(1.0) + 1, rtol=1e-6)


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")
@pytest.mark.parametrize("where", ["file", "folder"])
def test_kernel_never_reads_a_file_others_can_write(kept, where):
    """Loading unpickles and runs native code: a kept file (or its folder) that another user
    could have written is not read, it is compiled again in this process and left alone."""
    f, _ = _fresh_kernel()
    x = np.ones(3, np.float32)
    f(x, np.float32(1), k=1)
    (path,) = kept.iterdir()
    assert path.stat().st_mode & 0o077 == 0 and kept.stat().st_mode & 0o077 == 0
    path.write_bytes(b"planted")  # what a pickle that runs a command would be, had it been read
    target = path if where == "file" else kept
    target.chmod(target.stat().st_mode | 0o020)
    g, traces = _fresh_kernel()
    before = _executables.stats()
    out = g(x, np.float32(1), k=1)
    after = _executables.stats()
    assert traces == [1] and after["loads"] == before["loads"]
    assert after["compiles"] == before["compiles"] + 1
    assert path.read_bytes() == b"planted"  # left alone, not replaced
    np.testing.assert_allclose(np.asarray(out[0]), np.sin(1.0) + 1, rtol=1e-6)


def test_kernel_bypassed_while_a_foreign_method_is_registered(kept, monkeypatch):
    """A method whose kernel is not the library's (its code is not in the key): every kernel
    goes to jax.jit while it is registered."""
    spec = registry.METHODS["ta"]

    def mine(a, b, *, coef, rtol, is_svd):
        return spec.kernel(a, b, coef=coef, rtol=rtol, is_svd=is_svd)

    monkeypatch.setitem(
        registry.METHODS, "mine", dataclasses.replace(spec, name="mine", kernel=mine)
    )
    f, traces = _fresh_kernel()
    f(np.ones(3, np.float32), np.float32(1), k=1)
    assert traces == [1] and not list(kept.glob("*.exe"))


_RUN = textwrap.dedent(
    """
    import collections, json, sys
    import numpy as np
    from jax._src import monitoring
    import netutility_jax as nu
    from netutility_jax import _executables
    traced = []
    def listen(name, secs, fun_name=None, **kw):
        if name == "/jax/core/compile/jaxpr_trace_duration":
            traced.append(fun_name)
    monitoring.register_event_duration_secs_listener(listen)
    if sys.argv[1] != "off":
        _executables.enable(sys.argv[1])
    paths = sys.argv[4:]
    out, rep = nu.merge_adapters_streaming(nu.peft.open_adapters(paths), budget=3,
                                           method=sys.argv[2], space="core")
    np.savez(sys.argv[3], **{n + "/" + k: np.asarray(v) for n, m in out.items()
                             for k, v in m.items()})
    print(json.dumps({"stats": _executables.stats(), "traced": traced}))
    """
)


@pytest.mark.slow  # (three processes, the first compiling every kernel)
def test_a_second_process_loads_the_merge_pass_and_merges_the_same(tmp_path):
    """Two processes merging the same streamed adapters with the kept executables on: the
    first compiles and keeps the merge pass's kernels, the second loads every one of them
    (none traced again) and writes the same bits as a process with them off."""
    paths = []
    for i, ad in enumerate(_adapters(7)):
        paths.append(str(tmp_path / f"task{i}"))
        nu.peft.save_adapter(ad, paths[-1])
    env = {**os.environ, "NETUTILITY_COMPILE_CACHE": "off"}

    def run(folder, bits):
        proc = subprocess.run(
            [sys.executable, "-c", _RUN, folder, "tsv", str(tmp_path / bits), *paths],
            capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    exe = str(tmp_path / "exe")
    first, second = run(exe, "first.npz"), run(exe, "second.npz")
    # (a kernel the streamed merge dropped after a chunk shape's last chunk, needed again later
    # in the run, is loaded from the folder this process wrote: a load, not a compile)
    assert first["stats"]["compiles"] > 0
    assert second["stats"]["compiles"] == 0
    assert second["stats"]["loads"] == first["stats"]["compiles"] + first["stats"]["loads"]
    merge_pass = {"stage_scales", "_plain", "stage_coords", "stage_low_rank", "stage_decode",
                  "stage_map_back", "_utility", "lam_auto", "log2", "add", "multiply", "var"}  # fmt: skip
    assert {"stage_scales", "_plain", "stage_coords", "stage_map_back"} <= set(first["traced"])
    assert not merge_pass & set(second["traced"]), second["traced"]  # (left: the scoring pass)
    run("off", "off.npz")
    off = np.load(tmp_path / "off.npz")
    for bits in ("first.npz", "second.npz"):
        kept_bits = np.load(tmp_path / bits)
        assert sorted(kept_bits) == sorted(off)
        for k in off:
            np.testing.assert_array_equal(kept_bits[k], off[k])


_LAPACK = textwrap.dedent(
    """
    import sys
    import jax.numpy as jnp, numpy as np
    from netutility_jax import _executables
    _executables.enable(sys.argv[1])

    def qr_r(x):
        return jnp.linalg.qr(x)[1]

    qr_r.__module__ = "netutility_jax.test_kept_lapack"
    k = _executables.kernel(qr_r)
    x = np.arange(12, dtype=np.float32).reshape(4, 3) + np.eye(4, 3, dtype=np.float32)
    print(np.abs(np.asarray(k(x))).sum(), _executables.stats()["loads"])
    """
)


def test_a_loaded_executable_runs_lapack_in_a_fresh_process(tmp_path):
    """An executable loaded in a process that has lowered nothing (so jaxlib's CPU LAPACK
    handlers were never set up by a lowering) runs its LAPACK calls: the second process loads
    the kept QR and gets the first's result (it crashed before the handlers were set up)."""
    env = {**os.environ, "NETUTILITY_COMPILE_CACHE": "off"}
    outs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _LAPACK, str(tmp_path / "exe")],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(proc.stdout.split())
    assert outs[0][1] == "0" and outs[1][1] == "1"
    assert outs[0][0] == outs[1][0]


def test_release_drops_every_kernels_executables():
    """``_executables.release()``: every library kernel's compiled programs are dropped (a
    streamed merge calls it once a chunk shape is done with), and a later call compiles again
    and gives the same result."""

    @kernel
    def double(x):
        return 2 * x

    x = jnp.arange(D_IN, dtype=jnp.float32)
    want = np.asarray(double(x))
    assert double._cache_size() == 1
    _executables.release()
    assert double._cache_size() == 0
    np.testing.assert_array_equal(np.asarray(double(x)), want)


@pytest.mark.slow  # (two cold streamed merges: about 10 s)
def test_a_streamed_merge_drops_a_shapes_programs_after_its_last_chunk(tmp_path, monkeypatch):
    """Chunks of one shape are read one after another, so the programs of a shape are dropped
    after its last chunk (pass by pass) without compiling anything again within the pass: the
    same programs, counted from a cold start, as a merge that holds them to the end, the same
    result, and no library kernel holding executables afterwards."""
    from netutility_jax import streaming

    ads = _adapters(41)
    paths = [tmp_path / f"t{i}" for i in range(M)]
    for ad, p in zip(ads, paths, strict=True):
        nu.peft.save_adapter({f"model.{n}": m for n, m in ad.items()}, p)
    per_module = M * R * (D_IN + max(OUTS.values())) * 4

    def run():
        jax.clear_caches()
        with _Programs() as p:
            out, rep = nu.merge_adapters_streaming(
                nu.peft.open_adapters(paths), budget=3, space="core", chunk_bytes=per_module
            )  # a module a chunk: two chunks of each shape
        return p.programs, out, rep

    held_programs, held, held_rep = None, None, None
    with monkeypatch.context() as mp:
        mp.setattr(streaming, "release", lambda: None)
        held_programs, held, held_rep = run()
    programs, out, rep = run()
    assert rep.ranks == held_rep.ranks
    for n in held:
        for k in ("lora_a", "lora_b"):
            np.testing.assert_array_equal(np.asarray(out[n][k]), np.asarray(held[n][k]))
    # (a program used by both shapes, e.g. of the scores' scalars, may compile once more)
    assert held_programs <= programs <= held_programs + 2 * len(OUTS), (programs, held_programs)
    # (what runs after the last chunk, h from the summed energies, holds its small programs)
    held_now = [k._name for k in _executables._KERNELS if k._cache_size()]
    assert not [n for n in held_now if n.startswith("netutility_jax.")], held_now
