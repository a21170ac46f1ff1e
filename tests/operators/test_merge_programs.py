"""The merge pass's programs: how many, that they are the previous computation bit for bit, and
that the library's kernels can drop their compiled programs (``netutility_jax._core.executables``).

Shapes here (``d_in = 41``, ``d_out`` 29 and 13, ``r = 5``, ``M = 3``) are used by no other test,
so that every program of a merge below is compiled (or loaded) where it is counted.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import monitoring

import netutility_jax as nu
from netutility_jax._core import executables as _executables
from netutility_jax._core import mesh as _mesh
from netutility_jax._core.executables import kernel
from netutility_jax.operators import _reduce, _stages, program

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
    """Programs compiled (or loaded from JAX's cache) while the context is open."""

    def __enter__(self):
        self.counts: collections.Counter = collections.Counter()
        monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def _listen(self, name, secs, **kw):
        self.counts[name] += 1

    def __exit__(self, *exc):
        monitoring.unregister_event_duration_listener(self._listen)

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
    bk = nu._core.tree.Bucket(
        tuple(names), D_IN, OUTS["q"], R,
        tuple(tuple(nu._core.tree.Module(ad[n]["lora_a"], ad[n]["lora_b"], ad[n]["scale"])
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


# ------------------------------------------------------------------------- kernels


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
        mp.setattr(_executables, "release", lambda: None)
        held_programs, held, held_rep = run()
    programs, out, rep = run()
    assert rep.ranks == held_rep.ranks
    for n in held:
        for k in ("lora_a", "lora_b"):
            np.testing.assert_array_equal(np.asarray(out[n][k]), np.asarray(held[n][k]))
    # (a program used by both shapes, e.g. of the scores' scalars, may compile once more)
    assert held_programs <= programs <= held_programs + 2 * len(OUTS), (programs, held_programs)
    # (h, from the summed energies, is computed once: where the report is the first to need
    # it, after the last chunk, its small program may be held)
    held_now = [k._name for k in _executables._KERNELS if k._cache_size()]
    h = "netutility_jax.scoring._run.log_energy_variance"
    assert not [n for n in held_now if n.startswith("netutility_jax.") and n != h], held_now


# ------------------------------------------------------------- every bucket in one program

_ONE_PROGRAM = [  # (the default tier keeps one merge per kind: SVD, TIES, DARE)
    ("tsv", "core", {}),
    pytest.param("iso_c", "knots", {}, marks=pytest.mark.slow),
    pytest.param("iso_cts", "full", {}, marks=pytest.mark.slow),
    ("ties", "knots", {"density": 0.4}),
    ("dare", "core", {"p": 0.5}),
    pytest.param("dare_ties", "knots", {"p": 0.3}, marks=pytest.mark.slow),
]


def _dense_of(out: dict) -> dict:
    return {
        n: np.asarray(m["lora_a"], np.float64) @ np.asarray(m["lora_b"], np.float64) * m["scale"]
        for n, m in out.items()
    }


_KEY = jax.random.key(3)  # (made once: a key's creation is a program of its own)


def _merge_with(ads, masks, method, space, opts):
    key = _KEY if method.startswith("dare") else None
    return nu.merge(ads, masks, method=method, space=space, key=key, **opts)


@pytest.mark.parametrize("method,space,opts", _ONE_PROGRAM, ids=lambda x: str(x))
def test_in_memory_merge_is_one_program_and_never_traced_again(method, space, opts):
    """Every bucket of a merge (two shapes here) in one compiled program, the keys of DARE's
    modules folded inside it; a second call with other values of the same shapes compiles
    nothing (the per-bucket route compiled 5-7 programs per bucket)."""
    ads = _adapters(20 + len(method) + len(space))
    jax.clear_caches()
    with _Programs() as first:
        jax.block_until_ready(_merge_with(ads, _masks(ads), method, space, opts))
    other = _adapters(60 + len(method))
    with _Programs() as again:
        jax.block_until_ready(_merge_with(other, _masks(other, 7), method, space, opts))
    assert first.programs == 1, first.counts
    assert again.programs == 0, again.counts


@pytest.mark.parametrize("method,space,opts", _ONE_PROGRAM, ids=lambda x: str(x))
def test_one_program_is_the_per_bucket_route(method, space, opts, monkeypatch):
    """The one-program merge is the per-bucket route's arithmetic (the same stages traced
    together): each merged update within float32 rounding of the route's (1e-5 of the module's
    largest entry; XLA may contract a multiply-add differently across the former program
    boundaries), DARE drawing the same masks."""
    from netutility_jax.operators import program

    ads = _adapters(30 + len(method))
    masks = _masks(ads, 2)
    got = _dense_of(_merge_with(ads, masks, method, space, opts))
    monkeypatch.setattr(program, "applies", lambda plan: False)
    want = _dense_of(_merge_with(ads, masks, method, space, opts))
    for n, w in want.items():
        np.testing.assert_allclose(got[n], w, rtol=0, atol=1e-5 * np.abs(w).max(), err_msg=n)


def test_pieces_of_a_bucket_go_through_one_mapped_program(monkeypatch):
    """A bucket larger than a piece (``_plan.PIECE_BYTES``) is merged a piece at a time inside
    the one program (``lax.map``: one piece's working memory, one compiled body whatever the
    number of pieces): the same merge as the bucket whole, in one program."""
    from netutility_jax.operators import _plan

    ads = [{n: m for n, m in ad.items() if n.endswith(".q")} for ad in _adapters(50)]
    masks = _masks(ads, 4)
    whole = _dense_of(nu.merge(ads, masks, method="tsv", space="core"))
    per_module = M * R * (D_IN + OUTS["q"]) * 4
    monkeypatch.setattr(_plan, "PIECE_BYTES", per_module)  # two pieces of one module
    plan = _plan.plan_merge(
        "t", ads, masks, method="tsv", space="core", coef=1.0, key=None, options={}
    )
    assert [len(j.bucket.names) for j in plan.jobs] == [1, 1]
    jax.clear_caches()
    with _Programs() as p:
        pieces = _dense_of(nu.merge(ads, masks, method="tsv", space="core"))
    assert p.programs == 1, p.counts
    for n, w in whole.items():
        np.testing.assert_allclose(pieces[n], w, rtol=0, atol=1e-5 * np.abs(w).max(), err_msg=n)


def test_host_plain_is_the_programs_own_choice_of_reduction():
    """``_stages.host_plain`` decides on the host what the reduction decides in the program
    (every entry finite, each factor's largest entry within 2**+-24): where it says plain, the
    program's own test says so too, for largest entries on both sides of the boundary,
    subnormal ones and non-finite ones."""
    rng = np.random.default_rng(7)
    exps = (-126, -30, -26, -25, -24, -1, 0, 23, 24, 25, 40)  # largest entry 2**e: frexp's e + 1
    cases = [(e, bad) for e in exps for bad in "0n"]
    cases += [("sub", "0")]
    for e, bad in cases:
        a = rng.standard_normal((2, M, 6, 3)).astype(np.float32)
        b = rng.standard_normal((2, M, 3, 4)).astype(np.float32)
        s = np.full((2, M), 1.5, np.float32)
        if e == "sub":
            a[1, 2] = np.float32(1e-40) * rng.random((6, 3), dtype=np.float32)
        else:
            a[1, 2] *= np.float32(2.0**e) / np.abs(a[1, 2]).max()
        if bad == "n":
            b[0, 1, 0, 0] = np.nan
        st = _mesh.Stacked(a, b, s, np.full((2, M), 3, np.int32))
        ts, _, flags = _stages.stage_scales(a, b, s)
        lim = _stages.MODERATE_EXP
        device = bool(
            ((np.abs(ts.a_exp) <= lim) & (np.abs(ts.b_exp) <= lim)).all() and not flags.any()
        )
        host = _stages.host_plain(st)
        assert host <= device, (e, bad)  # (never plain where the program would scale)
        want = bad == "0" and e != "sub" and -25 <= e <= 23
        assert host == want, (e, bad)
    dev = _mesh.Stacked(*(jnp.asarray(x) for x in st))
    assert not _stages.host_plain(dev)  # (device factors: the program decides)


def test_a_program_of_moderate_factors_holds_the_plain_reduction_only(monkeypatch):
    """The in-memory merge's program, given moderate factors stacked on the host, is traced with
    the plain reduction only (the other branch was half of its reduction's compiling); factors
    of extreme size still take the scaled one, inside the program, with the same merge as the
    per-bucket route."""
    traced = []
    scaled = _reduce._scaled

    def spy(*args, **kw):
        traced.append("scaled")
        return scaled(*args, **kw)

    monkeypatch.setattr(_reduce, "_scaled", spy)
    ads = _adapters(11, scale=1.25)
    masks = _masks(ads, 3)
    jax.clear_caches()
    nu.merge(ads, masks, method="tsv", space="core")
    assert traced == []
    big = [
        {n: {**m, "lora_a": m["lora_a"] * np.float32(2.0**30)} for n, m in ad.items()} for ad in ads
    ]
    got = nu.merge(big, masks, method="tsv", space="core")
    assert traced  # (the program's choice: the scaled branch is there)
    monkeypatch.setattr(program, "applies", lambda plan: False)  # (the per-bucket route)
    want = nu.merge(big, masks, method="tsv", space="core")
    for n in want:
        w = np.asarray(want[n]["lora_a"] @ want[n]["lora_b"], np.float64)
        g = np.asarray(got[n]["lora_a"] @ got[n]["lora_b"], np.float64)
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4 * np.abs(w).max(), err_msg=n)
