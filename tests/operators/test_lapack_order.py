"""No two LAPACK calls of a merge may run at once (see netutility_jax._core.linalg).

jaxlib's CPU LAPACK kernels split large batches over the intra-op thread pool and block on it, so
two independent calls deadlock a 2-thread pool; small test inputs never show it. These tests check
the traced pipeline instead: the operations that reach LAPACK must be totally ordered by data
dependencies, in the graph XLA runs (jitted calls inlined; control-flow bodies each on their own).
"""

from __future__ import annotations

import functools
import itertools

import _merge_reference as ref
import jax
import jax.extend.core
import jax.numpy as jnp
import pytest
from _merge_cases import qr_route

import netutility_jax as nu
from netutility_jax import registry
from netutility_jax.operators import _plan, _stages

LAPACK = {
    "eigh",
    "svd",
    "qr",
    "geqrf",
    "geqp3",
    "householder_product",
    "cholesky",
    "triangular_solve",
    "lu",
    "eig",
    "schur",
    "tridiagonal",
}


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


@functools.cache
def _uses_lapack(jaxpr) -> bool:
    return any(
        e.primitive.name in LAPACK or any(_uses_lapack(j) for j in _subjaxprs(e))
        for e in jaxpr.eqns
    )


# call-like primitives that XLA inlines: their operations are ordered only by their own data
# dependencies, not as one block (a QR of one operand of a jitted stage can start before the
# stage's other operands exist). Control flow (cond, while, scan) does run as one block.
INLINED = {
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "remat",
    "checkpoint",
}


def _call_body(eqn):
    for k in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(k)
        if sub is not None:
            return sub.jaxpr if isinstance(sub, jax.extend.core.ClosedJaxpr) else sub
    raise KeyError(f"no body in {eqn.primitive.name}")


def _check_ordered(jaxpr, path="top"):
    """Every pair of LAPACK-using operations of ``jaxpr`` is ordered by data dependencies, with
    the call-like primitives inlined as XLA inlines them; control-flow bodies recursively."""
    users: list[tuple[int, str]] = []
    ids = itertools.count()
    var = jax.extend.core.Var

    def walk(jx, env):  # env: variable -> the LAPACK users it depends on
        for e in jx.eqns:
            deps = frozenset().union(
                *(env.get(v, frozenset()) for v in e.invars if isinstance(v, var))
            )
            if e.primitive.name in INLINED:
                body = _call_body(e)
                sub = {
                    sv: env.get(v, frozenset()) if isinstance(v, var) else frozenset()
                    for sv, v in zip(body.invars, e.invars, strict=True)
                }
                walk(body, sub)
                for ov, sv in zip(e.outvars, body.outvars, strict=True):
                    env[ov] = sub.get(sv, frozenset()) if isinstance(sv, var) else frozenset()
                continue
            out = deps
            if e.primitive.name in LAPACK or any(_uses_lapack(j) for j in _subjaxprs(e)):
                uid = next(ids)
                for u, name in users:
                    assert u in deps, (
                        f"{path}: LAPACK-using '{name}' and '{e.primitive.name}' are "
                        "independent: they may run at once"
                    )
                users.append((uid, e.primitive.name))
                out = deps | {uid}
                for j, sub_jaxpr in enumerate(_subjaxprs(e)):
                    _check_ordered(sub_jaxpr, f"{path}/{e.primitive.name}[{j}]")
            for v in e.outvars:
                env[v] = out

    walk(jaxpr, {})


CASES = [
    (m, s)
    for s in ("full", "core", "knots")
    for m in ("ta", "tsv", "iso_c", "iso_cts", "ties", "dare")
    if not (s == "full" and m in ("ties", "dare"))
]


@pytest.fixture(scope="module", params=["householder", "cholesky"])
def route(request):
    """The QR route (_merge_cases.qr_route), module-scoped so that pytest runs the tests route by
    route and the caches are cleared around the CholeskyQR2 group only."""
    with qr_route(request.param):
        yield request.param


@pytest.mark.parametrize(("method", "space"), CASES)
def test_bucket_merge_lapack_calls_are_ordered(method, space, route):
    d_in, d_out, r = 37, 53, 3
    ads = ref.make_adapters(0, 4, (("m", d_in, d_out, (3, 3, 3, 3)),))
    _names, buckets, m_tasks = nu._core.tree.collect(ads, fn="t")
    res = registry.resolve_options("t", method, space, {"p": 0.2} if method == "dare" else {})
    cfg = _plan.bucket_config(res, buckets[0], m_tasks, jnp.float32, chunk=1)
    nums = {k: jnp.asarray(v, jnp.float32) for k, v in _plan.numeric_options(res).items()}
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(1))
    jaxpr = jax.make_jaxpr(functools.partial(_stages.bucket_merge, cfg=cfg))(
        nu._core.buckets.bucket_arrays(buckets[0]),
        jnp.ones((1, m_tasks, r), bool),
        jnp.asarray(1.0),
        keys,
        nums,
        _stages.count_input(cfg, res.kernel_options, m_tasks),
    )
    assert _uses_lapack(jaxpr.jaxpr)
    _check_ordered(jaxpr.jaxpr)


def test_checker_catches_independent_calls():
    def two(x, y):
        return jnp.linalg.eigh(x)[0], jnp.linalg.svd(y)[1]

    x = jnp.eye(3)
    jaxpr = jax.make_jaxpr(two)(x, x)
    with pytest.raises(AssertionError, match="independent"):
        _check_ordered(jaxpr.jaxpr)


def test_checker_sees_into_inlined_calls():
    # the outer eigh waits on the call's first output only; the call's svd reads y alone, so
    # XLA (which inlines the call) may run the two at once
    inner = jax.jit(lambda x, y: (x + 1, jnp.linalg.svd(y)[1]))

    def two(x, y):
        a, sv = inner(x, y)
        return jnp.linalg.eigh(a)[0], sv

    x = jnp.eye(3)
    with pytest.raises(AssertionError, match="independent"):
        _check_ordered(jax.make_jaxpr(two)(x, x).jaxpr)


@pytest.mark.parametrize("form", ["list", "stacked"])
@pytest.mark.parametrize(
    ("method", "space"),
    [("ta", "core"), ("tsv", "core"), ("iso_c", "knots"), ("ties", "knots"), ("dare", "core")],
)
def test_a_jitted_merge_adapters_orders_every_lapack_call(method, space, form):
    """Scoring, allocation and merge traced as one program: the merge's stages must wait for
    the scoring's LAPACK calls, and each bucket for the last (a jitted TSV merge of a stacked
    set hung on 2 cores when a bucket's output-side QR ran beside the scoring's eigh)."""
    spec = (("m", 37, 53, (3, 3, 3)), ("n", 37, 29, (3, 2, 3)), ("o", 37, 53, (3, 3, 3)))
    ads = ref.make_adapters(3, 3, spec)
    ads = nu.stack_adapters(ads) if form == "stacked" else ads
    opts = {"p": 0.3, "key": jax.random.key(0)} if method == "dare" else {}
    jaxpr = jax.make_jaxpr(
        lambda a: nu.merge_adapters(a, budget=2, method=method, space=space, **opts)
    )(ads)
    assert _uses_lapack(jaxpr.jaxpr)
    _check_ordered(jaxpr.jaxpr)


def test_full_space_elementwise_module_lapack_calls_are_ordered(route):
    d_in, d_out, r = 37, 53, 3
    ads = ref.make_adapters(1, 3, (("m", d_in, d_out, (3, 2, 3)),))
    _names, buckets, _m_tasks = nu._core.tree.collect(ads, fn="t")
    bk = buckets[0]
    a, b, s, rk = _stages.stage_stack(
        nu._core.buckets.bucket_arrays(bk), cfg=_stages.StackConfig(d_in, d_out, r, jnp.float32)
    )
    jaxpr = jax.make_jaxpr(functools.partial(_stages.module_dense, method="ties", r_max=r))(
        a[0],
        b[0],
        s[0],
        rk[0],
        jnp.ones((3, r), bool),
        jnp.asarray(1.0),
        jnp.zeros((), jnp.uint32),
        {"density": jnp.asarray(0.3)},
        jnp.asarray(10, jnp.int32),
    )
    assert _uses_lapack(jaxpr.jaxpr)
    _check_ordered(jaxpr.jaxpr)


@pytest.mark.parametrize(
    ("method", "space"), [("tsv", "core"), ("ties", "knots"), ("iso_c", "full")]
)
def test_one_program_over_buckets_orders_their_lapack_calls(method, space):
    """:func:`engine.program.merge_program` traces every bucket's stages in one program: the
    buckets' LAPACK calls must still be totally ordered (each bucket after the previous one's
    result), pieces of a bucket included (``lax.map``); independent ones deadlocked a streamed
    SmolLM2-shaped merge on 2 cores."""
    from netutility_jax.operators import program

    spec = (("m", 37, 53, (3, 3, 3)), ("n", 37, 29, (3, 2, 3)), ("o", 37, 53, (3, 3, 3)))
    ads = ref.make_adapters(2, 3, spec)
    opts = {"density": 0.4} if method == "ties" else {}
    plan = _plan.plan_merge(
        "t", ads, None, method=method, space=space, coef=1.0, key=None, options=opts
    )
    groups = program._groups(plan)
    assert len(groups) == 2  # (two buckets: m and o share one)
    inputs = tuple(program._inputs(jobs, plan.dtype) for _, jobs in groups)
    masks = tuple(
        jnp.ones((sum(len(j.bucket.names) for j in jobs), 3, 3), bool) for _, jobs in groups
    )
    index = tuple(jnp.asarray([i for j in jobs for i in j.index], jnp.int32) for _, jobs in groups)
    nums = {k: jnp.asarray(v, jnp.float32) for k, v in plan.numeric.items()}
    counts = tuple(_stages.count_input(g.cfg, plan.resolved.kernel_options, 3) for g, _ in groups)
    jaxpr = jax.make_jaxpr(
        functools.partial(program.merge_program.__wrapped__, groups=tuple(g for g, _ in groups))
    )(inputs, masks, None, index, jnp.asarray(1.0), nums, counts)
    assert _uses_lapack(jaxpr.jaxpr)
    _check_ordered(jaxpr.jaxpr)
