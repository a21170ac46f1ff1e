"""Cases shared by the merge tests (tests/pipeline/test_merge.py, the pipeline's public merge,
and tests/operators/test_stages.py, the operators' stages and row blocks): small adapters, masks,
the float64 dense references of tests/_merge_reference.py for each method in each space, and the
QR route switch (also tests/operators/test_lapack_order.py's)."""

from __future__ import annotations

import contextlib
import functools

import _merge_reference as ref
import jax
import numpy as np

# one bucket (keeps compiles few), ragged ranks, a module task 1 lacks; SPEC2 adds a second shape
SPEC = (
    ("layers/0/q", 18, 12, (4, 3, 5)),
    ("layers/0/v", 18, 12, (5, 4, 4)),
    ("layers/1/q", 18, 12, (2, None, 5)),
)
SPEC2 = (*SPEC, ("mlp/up", 10, 22, (3, 5, 2)))
M = 3
SHAPES = {name: (d_in, d_out) for name, d_in, d_out, _ in SPEC2}


@contextlib.contextmanager
def qr_route(route: str):
    """Run the block with netutility_jax._core.linalg's QR route: ``"householder"`` (every module
    of these small tests) as it is, or ``"cholesky"`` (CholeskyQR2) forced by setting _SMALL to
    0. Traces read _SMALL, so JAX's caches are cleared on entering and leaving the CholeskyQR2
    route only: the Householder route clears nothing, and the process's later test files keep
    their compiled programs. For module-scoped fixtures, so that pytest groups tests by route."""
    if route == "householder":
        yield
        return
    from netutility_jax._core import linalg as _linalg

    saved = _linalg._SMALL
    _linalg._SMALL = 0
    jax.clear_caches()  # do not reuse the Householder traces
    try:
        yield
    finally:
        _linalg._SMALL = saved
        jax.clear_caches()


@functools.lru_cache
def adapters(seed=0, two_buckets=False):
    return ref.make_adapters(seed, M, SPEC2 if two_buckets else SPEC)


def masks(ads, seed, p=0.65):
    rng = np.random.default_rng(seed)
    out = {}
    for name, _, _, ranks in SPEC2:
        if name not in ads[0]:
            continue
        r_max = max(r for r in ranks if r is not None)
        out[name] = rng.random((M, r_max)) < p
    return out


def kept(ads, name, masks):
    d_in, d_out = SHAPES[name]
    return ref.kept_updates(
        [ad[name] for ad in ads], d_in, d_out, None if masks is None else masks[name]
    )


def check(out, want_fn, ads, masks, atol=1e-9):
    for name in ads[0]:
        got = ref.dense(out[name])
        want = want_fn(name, kept(ads, name, masks))
        scale = max(np.abs(want).max(), 1.0)
        np.testing.assert_allclose(got / scale, want / scale, atol=atol, err_msg=name)


REF_METHODS = {
    "ta": lambda xs: ref.ta(xs, 0.8),
    "tsv": lambda xs: ref.tsv(xs, 0.8),
    "tsv_iso": lambda xs: ref.tsv(xs, 0.8, isotropize=True),
    "ta_iso": lambda xs: ref.iso_c(xs, 0.8),
    "iso_c": lambda xs: ref.iso_c(xs, 0.8),
    "iso_cts": lambda xs: ref.iso_cts(xs, 0.8),
    "ties": lambda xs: ref.ties(xs, 0.8, 0.3),
}


CALL = {
    "ta": ("ta", {}),
    "tsv": ("tsv", {}),
    "tsv_iso": ("tsv", {"isotropize": True}),
    "ta_iso": ("ta", {"isotropize": True}),
    "iso_c": ("iso_c", {}),
    "iso_cts": ("iso_cts", {}),
    "ties": ("ties", {"density": 0.3}),
}


def ref_in_space(space, method_fn, ads):
    def want(name, xs):
        mods = [ad[name] for ad in ads]
        d_in, d_out = SHAPES[name]
        if space == "full":
            return method_fn(xs)
        if space == "core":
            return ref.in_core(lambda c: method_fn(c), mods, xs, d_in, d_out)
        variant = "original" if space == "knots_original" else "core_space"
        return ref.in_knots(lambda c: method_fn(c), xs, variant)

    return want


def peft_prune(x, density):
    """PEFT's magnitude prune of a float64 array (its own function, through torch)."""
    import torch
    from peft.utils.merge_utils import magnitude_based_pruning

    return magnitude_based_pruning(torch.from_numpy(np.array(x, np.float64)), density).numpy()
