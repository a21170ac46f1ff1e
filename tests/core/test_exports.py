"""The export cache (``_core.exports``): a kernel's traced program kept across processes.

A later process is played by forgetting what this one loaded (``exports.clear`` and the
kernels' compiled programs, ``executables.release``) and making ``jax.export.export`` fail, so
that a result can only come from the stored file.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import netutility_jax as nu
from netutility_jax import InputError
from netutility_jax._core import executables, exports
from netutility_jax._core.mesh import Stacked


@pytest.fixture
def folder(tmp_path):
    exports.set_folder(tmp_path / "exports")
    yield tmp_path / "exports"
    exports.set_folder(None)
    executables.release()


def _stored(folder):
    return sorted(folder.glob(f"*{exports.SUFFIX}")) if folder.exists() else []


@executables.kernel(static_argnames=("k",), export=True)
def _affine(s, y, *, k):
    return {"sum": s.a * k + y, "pair": (s.b.sum() * k, s.a.shape[0])}


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    a, b = (rng.normal(size=sh).astype(np.float32) for sh in ((3, 4), (2,)))
    return Stacked(a, b, np.ones(2, np.float32), np.ones(2, np.int32)), np.float32(rng.normal())


def _expected(s, y, k):  # float64, written out
    return s.a.astype(np.float64) * k + float(y), float(s.b.astype(np.float64).sum()) * k


def _later_process(monkeypatch):
    """Forget what this process loaded; returns the list of the kernels ``jax.export.export``
    was then asked for (a failed export falls back to the plain jit: only this list shows it)."""
    exports.clear()
    executables.release()
    asked = []

    def refuse(fun, *a, **kw):
        asked.append(fun)
        raise RuntimeError("traced again: the stored export was not read")

    monkeypatch.setattr(jax.export, "export", refuse)
    return asked


def test_a_kernel_is_exported_once_and_a_later_process_reads_it(folder, monkeypatch):
    s, y = _inputs()
    out = _affine(s, y, k=3)
    (path,) = _stored(folder)
    want, total = _expected(s, y, 3)
    np.testing.assert_allclose(np.asarray(out["sum"]), want, rtol=1e-6)
    np.testing.assert_allclose(float(out["pair"][0]), total, rtol=1e-5)
    asked = _later_process(monkeypatch)
    again = _affine(s, y, k=3)
    assert jax.tree.structure(again) == jax.tree.structure(out)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(out), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    s2, y2 = _inputs(1)  # other values of the same shapes: the same file
    np.testing.assert_allclose(
        np.asarray(_affine(s2, y2, k=3)["sum"]), _expected(s2, y2, 3)[0], rtol=1e-6
    )
    assert _stored(folder) == [path] and asked == []


def test_the_key_changes_with_the_static_arguments_shapes_and_dtypes(folder):
    s, y = _inputs()
    _affine(s, y, k=3)
    _affine(s, y, k=4)
    _affine(s._replace(a=np.zeros((5, 4), np.float32)), y, k=3)
    _affine(s._replace(a=s.a.astype(np.float64) if jax.config.jax_enable_x64 else s.a), y, k=3)
    _affine(s, 2.0, k=3)  # a Python float: weakly typed
    assert len(_stored(folder)) == 4 + bool(jax.config.jax_enable_x64)
    out = _affine(s, y, k=4)
    np.testing.assert_allclose(np.asarray(out["sum"]), _expected(s, y, 4)[0], rtol=1e-6)


def test_a_damaged_file_is_traced_again_and_written_over(folder, monkeypatch):
    s, y = _inputs()
    _affine(s, y, k=2)
    (path,) = _stored(folder)
    path.write_bytes(b"not an export")
    exports.clear()
    executables.release()
    out = _affine(s, y, k=2)
    np.testing.assert_allclose(np.asarray(out["sum"]), _expected(s, y, 2)[0], rtol=1e-6)
    assert path.read_bytes() != b"not an export"
    _later_process(monkeypatch)
    np.testing.assert_allclose(
        np.asarray(_affine(s, y, k=2)["sum"]), _expected(s, y, 2)[0], rtol=1e-6
    )


@executables.kernel(static_argnames=("limit",), export=True)
def _checked(x, *, limit):
    if x.shape[0] > limit:
        raise InputError(f"_checked: {x.shape[0]} rows, at most {limit}")
    return x * 2


def test_an_error_while_tracing_is_the_kernels_own_and_nothing_is_stored(folder):
    with pytest.raises(InputError, match="3 rows, at most 2"):
        _checked(np.ones((3, 2), np.float32), limit=2)
    assert _stored(folder) == []
    np.testing.assert_array_equal(np.asarray(_checked(np.ones((2, 2), np.float32), limit=2)), 2)


def test_inside_a_trace_and_without_a_folder_the_plain_jit_runs(folder):
    s, y = _inputs()
    out = jax.jit(lambda s, y: _affine(s, y, k=3)["sum"])(s, y)
    np.testing.assert_allclose(np.asarray(out), _expected(s, y, 3)[0], rtol=1e-6)
    g = jax.grad(lambda y: _affine(s, y, k=3)["sum"].sum())(jnp.float32(y))
    assert float(g) == pytest.approx(s.a.size)
    assert _stored(folder) == []
    exports.set_folder(None)
    _affine(s, y, k=5)
    assert _stored(folder) == []


def test_a_folder_that_cannot_be_written_changes_nothing_but_the_time(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder should be")
    exports.set_folder(blocker / "exports")
    try:
        s, y = _inputs()
        out = _affine(s, y, k=3)
        np.testing.assert_allclose(np.asarray(out["sum"]), _expected(s, y, 3)[0], rtol=1e-6)
        assert blocker.read_text() == "a file where the folder should be"
        assert [p.name for p in tmp_path.iterdir()] == ["file"]
    finally:
        exports.set_folder(None)
        executables.release()


def _adapters(seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            f"l{i}.{p}": {
                "lora_a": rng.normal(size=(16, 4)).astype(np.float32) / 4,
                "lora_b": rng.normal(size=(4, d)).astype(np.float32),
                "scale": 1.0 + t,
            }
            for i in range(3)
            for p, d in (("q", 16), ("v", 8))
        }
        for t in range(3)
    ]


@pytest.mark.parametrize(
    "options",
    [
        dict(method="ta", space="core"),
        dict(method="ties", space="knots", density=0.3),
        dict(method="ties", space="knots", density=0.3, weights=[1.0, 0.5, 2.0]),
    ],
)
def test_a_merge_through_the_cache_is_the_merge_without_it(folder, monkeypatch, options):
    """TA and TIES: the one program; TIES with task weights (which the one program does not
    take): the scoring kernel (whose outputs are the library's own NamedTuples, registered for
    the export) and the merge program."""
    ads = _adapters()
    exports.set_folder(None)
    want = nu.merge_adapters(ads, budget=6, **options)
    exports.set_folder(folder)
    executables.release()
    first = nu.merge_adapters(ads, budget=6, **options)
    stored = _stored(folder)
    assert len(stored) == (2 if "weights" in options else 1)
    asked = _later_process(monkeypatch)
    later = nu.merge_adapters(ads, budget=6, **options)
    assert asked == [] and _stored(folder) == stored
    for merged, report in (first, later):
        np.testing.assert_array_equal(report.kept_per_task, want[1].kept_per_task)
        assert report.lam == want[1].lam
        for name, mod in want[0].items():
            for f in ("lora_a", "lora_b"):
                np.testing.assert_array_equal(np.asarray(merged[name][f]), np.asarray(mod[f]))


@executables.kernel(static_argnames=("k",), export=True)
def _scaled(x, k):
    return x * k


def test_a_static_argument_given_by_position_takes_the_plain_jit(folder):
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(_scaled(x, 3)), x * 3)
    assert _stored(folder) == []
    np.testing.assert_array_equal(np.asarray(_scaled(x, k=4)), x * 4)  # by keyword: exported
    assert len(_stored(folder)) == 1
