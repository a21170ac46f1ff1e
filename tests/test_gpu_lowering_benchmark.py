"""benchmarks/gpu_lowering.py: the launch rules, the count through functions and cond branches
(a hand-written program whose launches are known), and the script's counts on a small set
(constant in depth with the GPU SVD route, growing without it). Counts only, no timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax import export

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_lowering  # noqa: E402


def test_launch_rules_follow_jaxlibs_kernels():
    L = gpu_lowering.launches
    assert L("cusolver_gesvdj_ffi", (6, 16, 16)) == 1  # batched Jacobi
    assert L("cusolver_gesvdj_ffi", (6, 40, 40)) == 6  # one matrix at a time
    assert L("cusolver_gesvdj_ffi", (2, 3, 40, 8)) == 6
    assert L("cusolver_orgqr_ffi", (6, 128, 16)) == 1
    assert L("cusolver_orgqr_ffi", (6, 4096, 16)) == 6
    assert L("cusolver_syevd_ffi", (6, 256, 256)) == 1
    assert L("cusolver_geqrf_ffi", (6, 4096, 16)) == 1


def test_a_solver_call_in_a_loop_is_found():
    def f(x):
        return jax.lax.fori_loop(0, 3, lambda i, y: jnp.linalg.qr(y)[1] + y, x)

    x = jax.ShapeDtypeStruct((5, 40, 40), jnp.float32)
    text = export.export(jax.jit(f), platforms=["cuda"])(x).mlir_module()
    assert gpu_lowering.solver_calls_in_loops(text) == 1
    g = export.export(jax.jit(lambda y: jnp.linalg.qr(y)[1]), platforms=["cuda"])(x)
    assert gpu_lowering.solver_calls_in_loops(g.mlir_module()) == 0


def test_a_cond_counts_its_cheapest_and_dearest_branch_and_a_twice_called_function_twice():
    def svd40(x):
        return jnp.linalg.svd(x, full_matrices=False)[1]

    @jax.jit
    def inner(x):  # an outlined function, called twice below
        return jnp.linalg.eigh(x[..., :8, :8] @ jnp.swapaxes(x[..., :8, :8], -1, -2))[0]

    def f(x, p):
        s = jax.lax.cond(p, svd40, lambda y: jnp.linalg.qr(y)[1][..., 0, :], x)  # 5 or 1 (R only)
        return s.sum() + inner(x).sum() + inner(2 * x).sum()  # 2 eighs

    x = jax.ShapeDtypeStruct((5, 40, 40), jnp.float32)
    p = jax.ShapeDtypeStruct((), bool)
    text = export.export(jax.jit(f), platforms=["cuda"])(x, p).mlir_module()
    lo, hi, calls = gpu_lowering.launch_range(text)
    assert dict(hi) == {"gesvdj": 5, "syevd": 2}
    assert dict(lo) == {"geqrf": 1, "syevd": 2}
    assert sorted(calls) == [
        "cusolver_geqrf_ffi 5x40x40",
        "cusolver_gesvdj_ffi 5x40x40",
        "cusolver_syevd_ffi 5x8x8",
    ]


# ~1 minute: four lowerings of a 2- and 4-layer set; the slow tier runs in CI
@pytest.mark.slow
def test_the_launches_stay_constant_in_depth_with_the_route_and_grow_without(tmp_path):
    rows = {}
    for flag in ("", "--lapack-svd"):
        out = tmp_path / f"gl{flag}.json"
        proc = subprocess.run(
            [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_lowering.py"),
             "--depths", "2,4", "--out", str(out), *([flag] if flag else [])],
            capture_output=True, text=True, timeout=900, cwd=ROOT,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        for r in json.loads(out.read_text())["rows"]:
            rows[(flag, r["method"], r["space"], r["layers"])] = r
    for method, space in gpu_lowering.CASES:
        now = [rows[("", method, space, n)] for n in (2, 4)]
        before = [rows[("--lapack-svd", method, space, n)] for n in (2, 4)]
        assert now[0]["launches"] == now[1]["launches"]
        assert now[0]["solver_calls_in_loops"] == now[1]["solver_calls_in_loops"] == 0
        svds = [c.split()[1] for c in now[1]["calls"] if "gesvdj" in c]
        assert all(max(int(d) for d in c.split("x")[-2:]) <= 32 for c in svds), svds
        if method != "ta":  # TA needs no SVD: the route changes nothing
            assert before[1]["launches"] > before[0]["launches"] > now[0]["launches"]
        else:
            assert before[1]["launches"] == now[1]["launches"]
