"""Inside ``jax.jit`` the scores, the masks, the report's counts and the merge of a
``nu.stack_adapters`` set stay stacked per bucket: the traced program does not grow with the
modules, and the merge comes back as a mapping of stacked factors (two arrays per bucket)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import netutility_jax as nu

KINDS = {"q": (12, 12), "k": (12, 6), "up": (12, 20)}


def _adapters(layers: int, tasks: int = 3, rank: int = 3, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(tasks):
        ad = {}
        for i in range(layers):
            for kind, (d_in, d_out) in KINDS.items():
                ad[f"layers.{i}.{kind}"] = {
                    "lora_a": jnp.asarray(rng.normal(size=(d_in, rank)), jnp.float32),
                    "lora_b": jnp.asarray(rng.normal(size=(rank, d_out)), jnp.float32),
                    "scale": 2.0,
                }
        out.append(ad)
    return out


@pytest.mark.parametrize("scope", ["global", "local"])
def test_traced_masks_are_stacked_and_equal_the_concrete_ones(scope):
    ads = nu.stack_adapters(_adapters(2))
    want = nu.allocate(nu.score(ads), 2, scope=scope)
    seen = {}

    @jax.jit
    def masks(a):
        got = nu.allocate(nu.score(a), 2, scope=scope)
        seen["leaves"] = [x.shape for x in jax.tree.leaves(got)]
        return dict(got)

    got = masks(ads)
    # the traced masks are one (n, M, r_max) block per bucket, not one array per module
    assert seen["leaves"] == [(len(bk.names), 3, 3) for bk in ads.buckets]
    assert sorted(got) == sorted(want)  # (jit returns a dict's keys sorted)
    for nm in want:
        np.testing.assert_array_equal(np.asarray(got[nm]), np.asarray(want[nm]), err_msg=nm)


def _report_fields_by_hand(masks: dict) -> dict:
    """kept per module and task, per task, the budget spent per module and the fraction of
    (module, task) kept sets that are not a prefix of the spectrum, in numpy."""
    kept = {nm: m.sum(1) for nm, m in masks.items()}
    sets = nonprefix = 0
    for m in masks.values():
        for row in m:
            k = int(row.sum())
            if k:
                sets += 1
                nonprefix += int(not row[:k].all())
    return {
        "kept": kept,
        "kept_per_task": sum(kept.values()),
        "budget_spent": sum(int(k.sum()) for k in kept.values()) / len(masks),
        "non_prefix_fraction": nonprefix / sets if sets else 0.0,
    }


@pytest.mark.parametrize("allocation", ["net_utility", "uniform"])
def test_the_traced_report_counts_equal_the_masks_counted_by_hand(allocation):
    ads = nu.stack_adapters(_adapters(2))
    run = jax.jit(
        lambda a: nu.merge_adapters(a, budget=3, method="ta", space="core", allocation=allocation)
    )
    _, rep = run(ads)
    masks = {nm: np.asarray(m) for nm, m in rep.masks.items()}
    want = _report_fields_by_hand(masks)
    assert sorted(rep.kept) == sorted(masks)
    for nm in masks:
        np.testing.assert_array_equal(np.asarray(rep.kept[nm]), want["kept"][nm])
    np.testing.assert_array_equal(np.asarray(rep.kept_per_task), want["kept_per_task"])
    assert float(rep.budget_spent) == pytest.approx(want["budget_spent"])
    assert float(rep.non_prefix_fraction) == pytest.approx(want["non_prefix_fraction"])
    # and the concrete merge keeps the same directions
    _, ref = nu.merge_adapters(ads, budget=3, method="ta", space="core", allocation=allocation)
    for nm in masks:
        np.testing.assert_array_equal(masks[nm], np.asarray(ref.masks[nm]), err_msg=nm)


def _eqns(layers: int, method: str = "ta", space: str = "core") -> int:
    ads = nu.stack_adapters(_adapters(layers))
    opts = {"p": 0.5, "key": jax.random.key(0)} if method == "dare" else {}
    jaxpr = jax.make_jaxpr(
        lambda a: nu.merge_adapters(a, budget=3, method=method, space=space, **opts)[0]
    )(ads)
    return len(jaxpr.jaxpr.eqns)


@pytest.mark.parametrize(
    "method,space", [("ta", "core"), ("tsv", "core"), ("ties", "knots"), ("dare", "core")]
)
def test_the_traced_merge_of_a_stacked_set_does_not_grow_with_the_modules(method, space):
    # Scores, masks, the report's counts and the merged factors all stay stacked per bucket
    # (the merge returns its factors stacked): one more equation per module (a slice of a result
    # nothing reads, say) would break the equality.
    assert _eqns(2, method, space) == _eqns(4, method, space)


def _merged_stacked(layers: int = 2, **kw):
    ads = nu.stack_adapters(_adapters(layers))
    run = jax.jit(lambda a, c: nu.merge_adapters(a, budget=3, space="core", coef=c, **kw)[0])
    return ads, run


def _update64(mod) -> np.ndarray:
    a = np.asarray(mod["lora_a"], np.float64)
    b = np.asarray(mod["lora_b"], np.float64)
    return float(np.asarray(mod["scale"])) * a @ b


@pytest.mark.parametrize("method", ["ta", "tsv"])
def test_a_jitted_merge_of_a_stacked_set_returns_its_factors_stacked(method):
    ads, run = _merged_stacked(method=method)
    got = run(ads, 0.7)
    assert not isinstance(got, dict) and got.pristine
    leaves = jax.tree.leaves(got)
    assert len(leaves) == 2 * len(ads.buckets)  # two arrays per bucket, not two per module
    assert list(got) == list(ads.names)
    want, _ = nu.merge_adapters(ads, budget=3, method=method, space="core", coef=0.7)
    assert got.ranks() == {nm: int(got[nm]["lora_a"].shape[-1]) for nm in ads.names}
    for nm in ads.names:  # the same updates as the concrete merge (which compacts the ranks)
        w = _update64(want[nm])
        np.testing.assert_allclose(_update64(got[nm]), w, atol=2e-4 * np.abs(w).max(), err_msg=nm)
    # the table is a pytree of its stacked arrays: mapping them gives a table again
    half = jax.tree.map(lambda x: x.astype(jnp.float16), got)
    assert type(half) is type(got) and len(jax.tree.leaves(half)) == len(leaves)
    nm = ads.names[-1]
    assert half[nm]["lora_a"].dtype == jnp.float16
    np.testing.assert_array_equal(
        np.asarray(half[nm]["lora_b"]), np.asarray(got[nm]["lora_b"]).astype(np.float16)
    )


def test_a_merged_table_is_written_and_checkpointed_as_a_dict_is(tmp_path):
    ads, run = _merged_stacked()
    got = run(ads, 1.0)
    nu.peft.save_adapter(got, tmp_path / "peft")
    back = nu.peft.load_adapter(tmp_path / "peft")
    nu.checkpoint.save(tmp_path / "ckpt", got)
    restored = nu.checkpoint.restore(tmp_path / "ckpt")
    assert sorted(back) == sorted(ads.names) and sorted(restored) == sorted(ads.names)
    for nm in ads.names:
        w = _update64(got[nm])
        for other in (back[nm], restored[nm]):
            np.testing.assert_allclose(_update64(other), w, atol=1e-5 * np.abs(w).max(), err_msg=nm)


def test_a_merged_table_read_inside_the_trace_and_after_vmap():
    ads, _ = _merged_stacked()
    nm = ads.names[3]

    @jax.jit
    def update(a, c):  # a module read inside the trace: sliced in the graph
        m = nu.merge_adapters(a, budget=3, space="core", coef=c)[0][nm]
        return m["scale"] * m["lora_a"] @ m["lora_b"]

    want = [_update64(nu.merge_adapters(ads, budget=3, space="core", coef=c)[0][nm]) for c in (0.5, 2.0)]
    np.testing.assert_allclose(np.asarray(update(ads, 0.5)), want[0], rtol=1e-4, atol=1e-5)
    # under vmap the stacked leaves gain a leading axis; a module is still its own row
    cs = jnp.asarray([0.5, 2.0])
    batched = jax.vmap(lambda c: nu.merge_adapters(ads, budget=3, space="core", coef=c)[0])(cs)
    assert not isinstance(batched, dict) and len(jax.tree.leaves(batched)) == 6
    mod = batched[nm]
    assert mod["lora_a"].shape[0] == 2
    for k in range(2):
        u = np.asarray(mod["lora_a"][k], np.float64) @ np.asarray(mod["lora_b"][k], np.float64)
        np.testing.assert_allclose(u, want[k], rtol=1e-4, atol=1e-5 * np.abs(want[k]).max())


def test_a_merged_table_set_by_hand_flattens_as_a_dict_and_retraces_never():
    ads, run = _merged_stacked()
    counted = chex.assert_max_traces(n=1)(lambda a, c: nu.merge_adapters(a, budget=3, coef=c)[0])
    jitted = jax.jit(counted)
    first = jitted(ads, 1.0)
    jitted(ads, 2.0)  # same shapes: no second trace
    table = run(ads, 1.0)
    nm = ads.names[0]
    table[nm] = {"lora_a": jnp.zeros((12, 1)), "lora_b": jnp.zeros((1, 12)), "scale": 1.0}
    assert not table.pristine
    assert len(jax.tree.leaves(table)) == 3 * len(ads.names)  # factors and scale, per module
    out = jax.tree.map(lambda x: x, table)
    assert isinstance(out, dict) and list(out) == list(ads.names)
    assert np.asarray(out[nm]["lora_a"]).shape == (12, 1)
    assert list(first) == list(ads.names)
