"""The SVD of batches above 32 x 32 on a GPU (netutility_jax/_core/linalg.py, ``svd``): one
batched ``eigh`` of ``[[0, x], [x^T, 0]]`` where cuSOLVER's SVD would run once per matrix.
Checked against float64 numpy SVDs, through the merges of every spectral method against the
LAPACK route, and in the program that JAX lowers for CUDA (no GPU needed to lower)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import netutility_jax as nu
from netutility_jax._core import linalg as L


def _graded(rng, m, k, low):
    """``m x k`` with singular values spread from 1 to ``low`` (float64)."""
    c = min(m, k)
    qa, _ = np.linalg.qr(rng.normal(size=(m, c)))
    qb, _ = np.linalg.qr(rng.normal(size=(k, c)))
    return (qa * np.logspace(0, np.log10(low), c)) @ qb.T


def _cases():
    rng = np.random.default_rng(0)
    return {
        "square": rng.normal(size=(3, 40, 40)),
        "tall": rng.normal(size=(2, 48, 36)),
        "wide": rng.normal(size=(2, 36, 48)),
        "rank_10": rng.normal(size=(2, 40, 10)) @ rng.normal(size=(2, 10, 40)),
        "graded": np.stack([_graded(rng, 40, 40, 1e-5), _graded(rng, 40, 40, 1e-3)]),
        "repeated": np.stack([_graded(rng, 40, 40, 1.0)] * 2),  # every singular value 1
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_svd_by_eigh_is_the_float64_svd_above_the_rank_cut(name):
    x = _cases()[name]
    u, s, vt = map(np.asarray, L._svd_by_eigh(jnp.asarray(x, jnp.float32)))
    m, k = x.shape[-2:]
    want = np.linalg.svd(x, compute_uv=False)
    smax = want[..., :1]
    eps = np.finfo(np.float32).eps
    np.testing.assert_allclose(s, want, rtol=0, atol=float(8 * eps * smax.max()))
    assert np.all(np.diff(s, axis=-1) <= 0)  # descending
    # x = U S V^T, and the columns every caller keeps (s > max(m, k) eps s_max) orthonormal
    recon = np.einsum("...ik,...k,...kj->...ij", u, s, vt)
    np.testing.assert_allclose(recon, x, rtol=0, atol=float(2e-6 * np.abs(x).max()))
    kept = s > max(m, k) * eps * s[..., :1]
    for side in (u, np.swapaxes(vt, -1, -2)):
        gram = np.swapaxes(side, -1, -2) @ side
        eye = kept[..., :, None] & kept[..., None, :] & np.eye(s.shape[-1], dtype=bool)
        mask = kept[..., :, None] & kept[..., None, :]
        np.testing.assert_allclose(np.where(mask, gram, 0), eye.astype(float), atol=2e-6)
    # the pairing: x v_i = s_i u_i for each kept direction
    xv = x @ np.swapaxes(vt, -1, -2)
    err = np.abs(xv - u * s[..., None, :]).max()
    assert err <= 2e-6 * smax.max(), err


def test_a_vanishing_direction_gives_zero_columns():
    """A zero matrix and a zero block: where +s and -s (and the zeros) mix, no half-vector is
    made into a direction; its columns are zero and its s 0."""
    x = np.zeros((2, 36, 36), np.float32)
    x[1, :3, :3] = np.diag([3.0, 2.0, 1.0])
    u, s, vt = map(np.asarray, L._svd_by_eigh(jnp.asarray(x)))
    np.testing.assert_array_equal(s[0], 0)
    np.testing.assert_allclose(s[1, :3], [3, 2, 1], atol=1e-6)
    assert np.abs(s[1, 3:]).max() <= 1e-6
    dead = s == 0
    assert np.all(np.abs(u)[np.broadcast_to(dead[:, None, :], u.shape)] == 0)
    assert np.all(np.abs(vt)[np.broadcast_to(dead[:, :, None], vt.shape)] == 0)


@pytest.fixture
def eigh_route():
    """Every ``svd`` of the library takes the GPU route here (on this CPU too)."""
    L.FORCE_EIGH_SVD = True
    jax.clear_caches()  # no trace of the LAPACK route reused
    try:
        yield
    finally:
        L.FORCE_EIGH_SVD = False
        jax.clear_caches()


def _adapters(seed=0):
    """4 tasks, rank 12: cores of 48 x 48 (above the batched kernel's 32), two buckets."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(4):
        ad = {}
        for layer in range(2):
            for kind, (d_in, d_out) in {"q": (40, 40), "up": (40, 56)}.items():
                ad[f"l{layer}.{kind}"] = {
                    "lora_a": rng.normal(size=(d_in, 12)).astype(np.float32) / np.sqrt(d_in),
                    "lora_b": rng.normal(size=(12, d_out)).astype(np.float32) * (1 + i),
                    "scale": 0.5 + i,
                }
        out.append(ad)
    return out


_SLOW = pytest.mark.slow  # (the default tier keeps a spectral and an elementwise merge)
OPTS = [
    {"method": "tsv", "space": "core"},
    pytest.param({"method": "tsv", "space": "full"}, marks=_SLOW),
    pytest.param({"method": "iso_c", "space": "core"}, marks=_SLOW),
    pytest.param({"method": "iso_cts", "space": "knots"}, marks=_SLOW),
    {"method": "ties", "space": "knots", "density": 0.3},
    pytest.param({"method": "ta", "space": "knots"}, marks=_SLOW),
]


def _merged(opts):
    out, rep = nu.merge_adapters(_adapters(), budget=6, **opts)
    return {n: np.asarray(nu.module_update(m), np.float64) for n, m in out.items()}, rep


@pytest.mark.parametrize(
    "opts",
    OPTS,
    ids=["tsv-core", "tsv-full", "iso_c-core", "iso_cts-knots", "ties-knots", "ta-knots"],
)
def test_the_gpu_route_merges_as_the_lapack_route(opts, request):
    want, wrep = _merged(opts)
    request.getfixturevalue("eigh_route")
    got, rep = _merged(opts)
    assert rep.ranks == wrep.ranks
    for nm in want:
        np.testing.assert_array_equal(rep.masks[nm], wrep.masks[nm])
        scale = np.abs(want[nm]).max()
        np.testing.assert_allclose(got[nm], want[nm], rtol=0, atol=1e-4 * scale, err_msg=nm)


def _solver_calls(fn, *args, platform):
    """``(target, operand shape)`` of every solver custom call of ``fn`` lowered for
    ``platform`` (the first operand's shape, e.g. ``(8, 48, 48)``)."""
    text = export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()
    calls = []
    for m in re.finditer(r"custom_call @(\w+)\([^)]*\)[^\n]*?: \(tensor<([0-9x]+)x\w+>", text):
        calls.append((m.group(1), tuple(int(d) for d in m.group(2).split("x"))))
    return calls


@pytest.mark.parametrize("method, space", [("tsv", "core"), ("ties", "knots")])
def test_a_merge_lowered_for_cuda_decomposes_no_large_matrix_one_at_a_time(method, space):
    """cuSOLVER's gesvdj loops over a batch whose matrices exceed 32 x 32, its syevd does not
    (jaxlib's solver kernels); the CPU lowering of the same merge keeps LAPACK's SVD."""
    stacked = nu.stack_adapters(_adapters())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), stacked)

    def merged(a):
        return nu.merge_adapters(a, budget=6, method=method, space=space)[0]

    cuda = _solver_calls(merged, abstract, platform="cuda")
    svds = [shape for target, shape in cuda if "gesvd" in target]
    assert all(max(shape[-2:]) <= 32 for shape in svds), svds
    assert any(t == "cusolver_syevd_ffi" and shape[-1] == 96 for t, shape in cuda), cuda
    cpu = _solver_calls(merged, abstract, platform="cpu")
    assert any("gesdd" in t and max(shape[-2:]) == 48 for t, shape in cpu), cpu
    assert not any("syevd" in t and shape[-1] == 96 for t, shape in cpu), cpu
