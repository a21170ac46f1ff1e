"""Property/fuzz suite over the public API (issue 12, "Tests that keep it this way").

Every case ends in either a result checked against a float64 numpy computation
(``tests/_reference.py``) or one of the library's documented error types
(``netutility_jax.errors``); any other exception, a NaN where a number is due, or a hang fails.
Each test runs under a hard wall-clock limit (``SIGALRM``, the :func:`_wall_limit` fixture) on
top of Hypothesis' per-example ``deadline``.

The default profile keeps ``max_examples`` small (the file runs in well under 2 minutes); the
``slow``-marked variants run the same properties with more examples: ``pytest -m slow
tests/test_fuzz.py``.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import signal

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
from _reference import assert_scores_match, default_rtol, flat_modules, folder_digest, ref_scores

import netutility_jax as nu
from netutility_jax.errors import InputError, InputTypeError

# a compile of a new shape takes ~1 s on the CI box; an example that takes this long hangs
DEADLINE = datetime.timedelta(seconds=30)
WALL_SECONDS = 120  # hard per-test limit: a hang fails the test instead of the suite
SLOW_WALL_SECONDS = 900
FAST = {"max_examples": 12, "deadline": DEADLINE}  # (the slow profile runs 150)
SLOW = {"max_examples": 150, "deadline": DEADLINE}

# float32 library vs float64 reference, relative to each quantity's largest entry: the scores are
# float32 r x r eigen/SVD work on normalised Grams, ~1e-6 relative; 1e-4 is the margin the other
# score tests use (tests/scoring/test_utility.py RTOL32)
RTOL32 = 1e-4
F32_TINY = 1e-36  # float32 smallest normal is 1.2e-38: a decade of slack for the library's checks
F32_HUGE = 1e36  # float32 largest is 3.4e38


class _Hang(Exception):
    pass


@pytest.fixture(autouse=True)
def _wall_limit(request):
    """Fail (not hang) when a test runs longer than ``WALL_SECONDS`` (``SLOW_WALL_SECONDS`` for
    the slow profile)."""
    if not hasattr(signal, "setitimer"):
        yield
        return
    limit = SLOW_WALL_SECONDS if request.node.get_closest_marker("slow") else WALL_SECONDS

    def on_alarm(signum, frame):
        raise _Hang(f"test still running after {limit} s: a call hangs")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------------------------------------
# Random small adapters
# ---------------------------------------------------------------------------------------------


@st.composite
def adapters_st(draw, *, max_tasks=4, max_modules=3, allow_missing=True, extreme=True):
    """Adapters of M tasks, modules of random ``(d_in, d_out)`` in 2..12, ranks 0..5 per
    task and module (rank 0: factors of shape ``(d, 0)``), some modules ``None`` for some tasks,
    float32 or float64 numpy factors, scales ``10**U(-20, 20)`` (or order one)."""
    m = draw(st.integers(1, max_tasks))
    n_mod = draw(st.integers(1, max_modules))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    ads = [{} for _ in range(m)]
    for mi in range(n_mod):
        d_in = draw(st.integers(2, 12))
        d_out = draw(st.integers(2, 12))
        for j in range(m):
            if allow_missing and m > 1 and j > 0 and draw(st.integers(0, 5)) == 0:
                ads[j][f"m{mi}"] = None
                continue
            r = draw(st.integers(0, 5))
            if extreme:
                log_scale = draw(st.floats(-20, 20))
            else:
                log_scale = draw(st.floats(-1, 1))
            sign = draw(st.sampled_from([1.0, -1.0]))
            scale_kind = draw(st.sampled_from(["float", "np32", "np64", "absent"]))
            mod = {
                "lora_a": rng.normal(size=(d_in, r)).astype(dtype),
                "lora_b": rng.normal(size=(r, d_out)).astype(dtype),
            }
            sc = sign * 10.0**log_scale
            if scale_kind == "float":
                mod["scale"] = sc
            elif scale_kind == "np32":
                mod["scale"] = np.float32(sc)
            elif scale_kind == "np64":
                mod["scale"] = np.float64(sc)
            ads[j][f"m{mi}"] = mod
    # task 0 has every module (a module missing in every task has no shape to score)
    return ads


def _ref_values(ref):
    for name, rm in ref.modules.items():
        for arr in (rm.sigma, rm.benefit, rm.interference):
            yield from np.abs(arr[rm.candidate]).ravel()
        u = ref.utility[name]
        yield from np.abs(u[np.isfinite(u)]).ravel()
    yield abs(ref.lam)


def _representable32(ref) -> bool:
    """Every nonzero reference quantity a normal float32 number (with a decade of slack)."""
    vals = np.asarray(list(_ref_values(ref)), np.float64)
    vals = vals[vals > 0]
    return bool(np.all((vals >= F32_TINY) & (vals <= F32_HUGE)))


def _near_cut(ads) -> bool:
    """A singular value within a factor 4 of the candidate cut ``rtol * s_max`` (float32 round-off
    could put it on either side: such draws are not decided by the reference)."""
    flats = [flat_modules(ad) for ad in ads]
    for name in flats[0]:
        mods = [f[name] for f in flats]
        r_max = max(0 if mm is None else np.asarray(mm["lora_a"]).shape[1] for mm in mods)
        rtol = default_rtol(max(r_max, 1))
        for mm in mods:
            if mm is None or np.asarray(mm["lora_a"]).shape[1] == 0:
                continue
            a = np.asarray(mm["lora_a"], np.float64)
            b = np.asarray(mm["lora_b"], np.float64)
            s = np.linalg.svd(a @ b, compute_uv=False)[: a.shape[1]]  # scale-free ratios
            if s[0] == 0:
                continue
            rel = s / s[0]
            if np.any((rel > rtol / 4) & (rel < rtol * 4)):
                return True
    return False


def _check_scores(ads):
    ref = ref_scores(ads)
    try:
        sc = nu.score(ads)
    except InputError as e:
        # refusal is documented only where a returned quantity is not a normal float32 number
        assert not _representable32(ref), f"refused a representable input: {e}"
        hypothesis.event("refused (outside float32)")
        return
    hypothesis.event("scored")
    for name, ms in sc.modules.items():
        u = np.asarray(ms.utility, np.float64)
        assert not np.any(np.isnan(u)), f"{name}: NaN utility"
        assert not np.any(u == np.inf), f"{name}: +inf utility"
    if _near_cut(ads):
        hypothesis.event("near the candidate cut: not compared")
        return
    assert_scores_match(sc, ref, RTOL32)


def _score_property(ads):
    flats = [flat_modules(ad) for ad in ads]
    if all(
        mm is None or np.asarray(mm["lora_a"]).shape[1] == 0 for f in flats for mm in f.values()
    ):
        # no candidate anywhere: either a well-defined empty result or the documented error
        try:
            sc = nu.score(ads)
        except InputError:
            hypothesis.event("all rank 0: refused")
            return
        for ms in sc.modules.values():
            assert np.all(np.asarray(ms.utility) == -np.inf)
        hypothesis.event("all rank 0: empty scores")
        return
    _check_scores(ads)


# in the slow tier (which CI runs) to keep the default tier near 8 minutes: 13 s; 150 examples there
@pytest.mark.slow
@hypothesis.settings(**FAST)
@hypothesis.given(ads=adapters_st())
def test_score_random_adapters_match_float64(ads):
    _score_property(ads)


@pytest.mark.slow
@hypothesis.settings(**SLOW)
@hypothesis.given(ads=adapters_st())
def test_score_random_adapters_match_float64_slow(ads):
    _score_property(ads)


# ---------------------------------------------------------------------------------------------
# Garbage values: always the documented error, naming the module
# ---------------------------------------------------------------------------------------------

GARBAGE_NAMES = ("layers/0/attn/query", "layers/1/mlp/up")


def _clean_adapters(m, seed):
    rng = np.random.default_rng(seed)
    return [
        {
            "layers": {
                "0": {"attn": {"query": _mod(rng, 6, 2, 5)}},
                "1": {"mlp": {"up": _mod(rng, 4, 3, 7)}},
            }
        }
        for _ in range(m)
    ]


def _mod(rng, d_in, r, d_out):
    return {
        "lora_a": rng.normal(size=(d_in, r)).astype(np.float32),
        "lora_b": rng.normal(size=(r, d_out)).astype(np.float32),
        "scale": 1.5,
    }


def _node(ad, name):
    node = ad
    for p in name.split("/"):
        node = node[p]
    return node


NONFINITE = [np.nan, np.inf, -np.inf]
# (garbage for the scale, error type)
SCALE_GARBAGE = [
    ("1.0", InputTypeError),
    ("", InputTypeError),
    (1 + 2j, InputTypeError),
    (np.complex64(1), InputTypeError),
    (True, InputTypeError),
    (np.bool_(False), InputTypeError),
    (None, InputTypeError),
    ([1.0], InputTypeError),
    ({"x": 1}, InputTypeError),
    (np.nan, InputError),
    (np.inf, InputError),
    (-np.inf, InputError),
    (np.float32(np.nan), InputError),
    (np.ones(2, np.float32), InputError),
    (1e300, InputError),  # finite float64 that is inf in float32 (x64 off)
]
# (garbage for a factor, error type); shapes of the clean factors are (d_in, 2|3) and (2|3, d_out)
FACTOR_GARBAGE = [
    ("x", InputTypeError),
    (None, InputTypeError),
    (3.0, InputTypeError),
    (lambda a: a.astype(np.complex64), InputTypeError),
    (lambda a: a.astype(bool), InputTypeError),
    (lambda a: a.astype(np.int32), InputTypeError),
    ("unchain", InputError),  # one rank slot fewer: the factors do not chain
    (lambda a: a[None], InputError),  # 3-d
    (lambda a: a.ravel(), InputError),  # 1-d
]


@st.composite
def garbage_case_st(draw):
    m = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    ads = _clean_adapters(m, seed)
    name = draw(st.sampled_from(GARBAGE_NAMES))
    task = draw(st.integers(0, m - 1))
    mod = _node(ads[task], name)
    kind = draw(st.sampled_from(["nonfinite_entry", "scale", "factor"]))
    if kind == "nonfinite_entry":
        which = draw(st.sampled_from(["lora_a", "lora_b"]))
        arr = mod[which].copy()
        i = draw(st.integers(0, arr.shape[0] - 1))
        k = draw(st.integers(0, arr.shape[1] - 1))
        arr[i, k] = draw(st.sampled_from(NONFINITE))
        mod[which] = arr
        err = InputError
    elif kind == "scale":
        val, err = draw(st.sampled_from(SCALE_GARBAGE))
        mod["scale"] = val
    else:
        which = draw(st.sampled_from(["lora_a", "lora_b"]))
        val, err = draw(st.sampled_from(FACTOR_GARBAGE))
        if val == "unchain":  # drop the rank axis' last slot of one factor
            val = (lambda a: a[:, :-1]) if which == "lora_a" else (lambda a: a[:-1])
        mod[which] = val(mod[which]) if callable(val) else val
    return ads, name, task, err


def _garbage_property(case):
    ads, name, task, err = case
    with pytest.raises((InputError, InputTypeError)) as info:
        nu.score(ads)
    assert isinstance(info.value, err), (type(info.value), str(info.value))
    msg = str(info.value)
    assert f"'{name}'" in msg, msg
    assert f"task {task}" in msg, msg
    # lora_svd on the same module's factors: the documented error type too
    mod = _node(ads[task], name)
    with pytest.raises((InputError, InputTypeError)):
        nu.lora_svd(mod["lora_a"], mod["lora_b"], mod["scale"])


# in the slow tier (which CI runs) to keep the default tier near 8 minutes: 13 s
@pytest.mark.slow
@hypothesis.settings(**FAST)
@hypothesis.given(case=garbage_case_st())
def test_garbage_values_give_documented_errors_naming_module(case):
    _garbage_property(case)


@pytest.mark.slow
@hypothesis.settings(**SLOW)
@hypothesis.given(case=garbage_case_st())
def test_garbage_values_give_documented_errors_naming_module_slow(case):
    _garbage_property(case)


# ---------------------------------------------------------------------------------------------
# Allocation: random budgets and scopes
# ---------------------------------------------------------------------------------------------

BAD_BUDGETS = [
    (0, InputError),
    (-1, InputError),
    (-(2**63), InputError),
    (1.5, InputTypeError),
    (2.0, InputTypeError),
    ("3", InputTypeError),
    (True, InputTypeError),
    (None, InputTypeError),
    (3 + 0j, InputTypeError),
    (np.float32(2), InputTypeError),
]
BAD_SCOPES = [
    ("everywhere", InputError),
    ("", InputError),
    (None, InputTypeError),
    (1, InputTypeError),
]


def _check_masks(sc, masks, budget, scope, positive_only):
    assert list(masks) == list(sc.modules)
    n_mod = len(sc.modules)
    utils = {n: np.asarray(ms.utility, np.float64) for n, ms in sc.modules.items()}
    sig = {n: np.asarray(ms.sigma, np.float64) for n, ms in sc.modules.items()}
    mk = {n: np.asarray(masks[n]) for n in masks}
    for n in mk:
        assert mk[n].dtype == np.bool_ and mk[n].shape == utils[n].shape
        assert not np.any(mk[n] & ~np.isfinite(utils[n])), f"{n}: a non-candidate kept"
    if scope == "uniform":
        for n, u in utils.items():
            cand = np.isfinite(u)
            assert mk[n].sum() == min(budget, int(cand.sum())), n
            for j in range(u.shape[0]):  # each task keeps a prefix of its largest sigmas
                kept = int(mk[n][j].sum())
                assert mk[n][j, :kept].all(), (n, j)
                if kept:
                    assert np.all(np.diff(sig[n][j, :kept]) <= 0)
        return
    groups = (
        [
            (
                np.concatenate([u.ravel() for u in utils.values()]),
                np.concatenate([mk[n].ravel() for n in utils]),
                budget * n_mod,
            )
        ]
        if scope == "global"
        else [(utils[n].ravel(), mk[n].ravel(), budget) for n in utils]
    )
    for u, k, cap in groups:
        eligible = u > 0 if positive_only else np.isfinite(u)
        assert k.sum() == min(cap, int(eligible.sum())), (k.sum(), cap, eligible.sum())
        assert np.all(eligible[k])
        dropped = eligible & ~k
        if k.any() and dropped.any():
            assert u[k].min() >= u[dropped].max()


@st.composite
def allocate_case_st(draw):
    ads = draw(adapters_st(max_tasks=3, max_modules=3, extreme=False))
    bad = draw(st.integers(0, 3))  # 0: bad budget, 1: bad scope, else valid
    good_budget = st.one_of(
        st.integers(1, 12),
        st.integers(1, 12).map(np.int64),
        st.integers(2**31 - 3, 2**31 + 3),
        st.integers(2**62, 2**63 - 1),
        st.just(2**63 - 1),
    )
    budget = draw(st.sampled_from(BAD_BUDGETS) if bad == 0 else good_budget)
    scope = draw(
        st.sampled_from(BAD_SCOPES) if bad == 1 else st.sampled_from(["global", "local", "uniform"])
    )
    positive_only = draw(st.booleans())
    return ads, budget, scope, positive_only


def _allocate_property(case):
    ads, budget, scope, positive_only = case
    try:
        sc = nu.score(ads)
    except InputError:
        hypothesis.event("score refused (all rank 0)")
        return
    err = None
    if isinstance(budget, tuple):
        budget, err = budget
    if isinstance(scope, tuple):
        scope, err = scope if err is None else (scope[0], err)
    if err is not None:
        with pytest.raises((InputError, InputTypeError)) as info:
            nu.allocate(sc, budget, scope=scope, positive_only=positive_only)
        hypothesis.event("refused")
        assert "nu.allocate" in str(info.value)
        return
    # a valid budget: every scope and both positive_only settings on the same scores (one score
    # compile per draw; the drawn scope only decides the refusals above)
    for scope in ("global", "local", "uniform"):
        for positive_only in (True, False):
            masks = nu.allocate(sc, budget, scope=scope, positive_only=positive_only)
            _check_masks(sc, masks, int(budget), scope, positive_only)
    hypothesis.event("allocated (all scopes)")


# 23 s, and its 150-example profile is in the slow tier too: in the slow tier, which CI runs
@pytest.mark.slow
@hypothesis.settings(**FAST)
@hypothesis.given(case=allocate_case_st())
def test_allocate_random_budgets_and_scopes(case):
    _allocate_property(case)


@pytest.mark.slow
@hypothesis.settings(**SLOW)
@hypothesis.given(case=allocate_case_st())
def test_allocate_random_budgets_and_scopes_slow(case):
    _allocate_property(case)


# ---------------------------------------------------------------------------------------------
# Merge against the dense float64 references (few examples: merge compiles are slow; one shape)
# ---------------------------------------------------------------------------------------------


def _merge_property(seed, ranks, method, coef):
    import _merge_reference as mref

    rng = np.random.default_rng(seed)
    d_in, d_out = 8, 6
    ads = []
    for r in ranks:
        mod = None if r is None else _mod(rng, d_in, r, d_out)
        ads.append({"q": mod})
    mods = [ad["q"] for ad in ads]
    xs = mref.kept_updates(mods, d_in, d_out)
    want = getattr(mref, method)(xs, coef=coef)
    got = nu.merge(ads, method=method, coef=coef)
    got_dense = mref.dense(got["q"])
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got_dense - want).max())
    # float32 QR/SVD of order-one factors: ~1e-6 relative; 1e-4 leaves room for the r x r SVDs
    assert err <= 1e-4 * scale, (err, scale)


@hypothesis.settings(max_examples=6, deadline=DEADLINE)
@hypothesis.given(
    seed=st.integers(0, 2**16),
    ranks=st.tuples(st.integers(1, 2), st.one_of(st.none(), st.integers(1, 2))),
    method=st.sampled_from(["ta", "tsv", "iso_c"]),
    coef=st.sampled_from([1.0, 0.5, -2.0]),
)
def test_merge_random_adapters_match_float64(seed, ranks, method, coef):
    _merge_property(seed, ranks, method, coef)


@pytest.mark.slow
@hypothesis.settings(max_examples=40, deadline=DEADLINE)
@hypothesis.given(
    seed=st.integers(0, 2**16),
    ranks=st.tuples(st.integers(1, 2), st.one_of(st.none(), st.integers(1, 2))),
    method=st.sampled_from(["ta", "tsv", "iso_c"]),
    coef=st.floats(-3, 3).filter(lambda c: abs(c) > 1e-3),
)
def test_merge_random_adapters_match_float64_slow(seed, ranks, method, coef):
    _merge_property(seed, ranks, method, coef)


# ---------------------------------------------------------------------------------------------
# PEFT loader: truncated/garbled safetensors and JSON, hostile configs
# ---------------------------------------------------------------------------------------------

_PEFT_PREFIX = "base_model.model."
_PEFT_NAMES = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj")
_PEFT_SHAPE = (6, 5, 2)  # d_in, d_out, r
_VALID_CONFIG = {
    "r": 2,
    "lora_alpha": 4,
    "target_modules": ["q_proj", "v_proj"],
    "peft_type": "LORA",
}
_HOSTILE = r"(\w|.)+\d"


def _peft_tensors():
    rng = np.random.default_rng(5)
    d_in, d_out, r = _PEFT_SHAPE
    out = {}
    for name in _PEFT_NAMES:
        out[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = rng.normal(size=(r, d_in)).astype(np.float32)
        out[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = rng.normal(size=(d_out, r)).astype(np.float32)
    return out


def _write_peft(d, config_text, weights: bytes):
    import pathlib

    d = pathlib.Path(d)
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(config_text)
    (d / "adapter_model.safetensors").write_bytes(weights)
    return d


def _valid_weights() -> bytes:
    from safetensors.numpy import save

    return save(_peft_tensors())


_CONFIG_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2),
    st.just(_HOSTILE),
    st.just({_HOSTILE: 2}),
    st.just({"q_proj": 0}),
    st.just({"v_proj(": 2}),
)


@st.composite
def peft_case_st(draw):
    weights = _valid_weights()
    config = json.dumps(_VALID_CONFIG)
    kind = draw(
        st.sampled_from(
            ["valid", "truncate", "garble_header", "huge_header", "json_cut", "json_field"]
        )
    )
    exact = kind == "valid"
    if kind == "truncate":
        cut = draw(st.integers(0, len(weights) - 1))
        weights = weights[:cut]
    elif kind == "garble_header":
        n_header = 8 + int.from_bytes(weights[:8], "little")
        pos = draw(st.integers(0, n_header - 1))
        byte = draw(st.integers(0, 255))
        weights = weights[:pos] + bytes([byte]) + weights[pos + 1 :]
    elif kind == "huge_header":
        size = draw(st.sampled_from([2**64 - 1, 2**63, 2**40, len(weights), len(weights) - 7]))
        weights = size.to_bytes(8, "little") + weights[8:]
    elif kind == "json_cut":
        config = config[: draw(st.integers(0, len(config) - 1))]
    elif kind == "json_field":
        field = draw(
            st.sampled_from(
                ["r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "use_rslora"]
            )
        )
        cfg = dict(_VALID_CONFIG)
        cfg[field] = draw(_CONFIG_VALUES)
        config = json.dumps(cfg)  # NaN/Infinity are written as Python's json does
    return kind, exact, config, weights


def _peft_property(tmp_path_factory, case):
    from netutility_jax import peft as nu_peft
    from netutility_jax.errors import NetUtilityError

    kind, exact, config, weights = case
    d = _write_peft(tmp_path_factory.mktemp("peft"), config, weights)
    try:
        ad = nu_peft.load_adapter(d)
    except NetUtilityError as e:
        hypothesis.event(f"{kind}: refused ({type(e).__name__})")
        assert str(e).strip()
        assert kind != "valid", str(e)
        return
    hypothesis.event(f"{kind}: loaded")
    tensors = _peft_tensors()
    if kind in ("truncate", "huge_header", "json_cut"):
        pytest.fail(f"{kind}: a corrupt file loaded: {sorted(ad)}")
    if set(ad) != set(_PEFT_NAMES):
        assert kind == "garble_header", sorted(ad)  # a garbled key byte renames a module
        return
    for name in _PEFT_NAMES:
        a = tensors[f"{_PEFT_PREFIX}{name}.lora_A.weight"]
        b = tensors[f"{_PEFT_PREFIX}{name}.lora_B.weight"]
        np.testing.assert_array_equal(np.asarray(ad[name]["lora_a"]), a.T)
        np.testing.assert_array_equal(np.asarray(ad[name]["lora_b"]), b.T)
        scale = float(np.asarray(ad[name].get("scale", 1.0), np.float64))
        assert math.isfinite(scale), (name, scale)
        if exact:
            assert scale == 2.0


@hypothesis.settings(max_examples=40, deadline=DEADLINE)
@hypothesis.given(case=peft_case_st())
def test_peft_loader_corrupt_files(tmp_path_factory, case):
    _peft_property(tmp_path_factory, case)


@pytest.mark.slow
@hypothesis.settings(max_examples=400, deadline=DEADLINE)
@hypothesis.given(case=peft_case_st())
def test_peft_loader_corrupt_files_slow(tmp_path_factory, case):
    _peft_property(tmp_path_factory, case)


# ---------------------------------------------------------------------------------------------
# CLI: random garbage flag values for `netutility merge`
# ---------------------------------------------------------------------------------------------

_GARBAGE_TEXT = st.one_of(
    st.text(max_size=8),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", "nan", "inf", "-0", "0x10", "1e400", "(1+2j)", "auto", "1e-320", "é"]),
)
_CLI_FLAGS = {  # flag: a valid value (the rest of the time the value is garbage)
    "--budget": "2",
    "--coef": "0.5",
    "--lam": "auto",
    "--alpha": "1",
    "--seed": "3",
    "--density": "0.5",
    "--p": "0.2",
    "--trim-scope": "module",
    "--common-fraction": "0.8",
    "--serving-ranks": "vllm",
    "--chunk-mb": "1",
    "--devices": "all",
    "--min-share": "0.5",
    "--interference": "overlap",
    # one file for two adapters (refused: the count), or garbage (refused: no such file)
    "--input-moments": "none",
    # without --distributed (never drawn: it would wait for other processes) these are refused
    "--coordinator": "localhost:1",
    "--num-processes": "2",
    "--process-id": "0",
    "--distributed-timeout": "5",
    "--heartbeat-timeout": "5",
}


@pytest.fixture(scope="module")
def cli_adapters(tmp_path_factory):
    from safetensors.numpy import save

    root = tmp_path_factory.mktemp("cli_adapters")
    dirs = []
    for i in range(2):
        rng = np.random.default_rng(100 + i)
        d_in, d_out, r = _PEFT_SHAPE
        tensors = {}
        for name in _PEFT_NAMES:
            tensors[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = rng.normal(size=(r, d_in)).astype(
                np.float32
            )
            tensors[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = rng.normal(size=(d_out, r)).astype(
                np.float32
            )
        dirs.append(str(_write_peft(root / f"t{i}", json.dumps(_VALID_CONFIG), save(tensors))))
    return root, dirs


@st.composite
def cli_case_st(draw):
    method = draw(st.sampled_from(["ta", "ties", "dare"]))
    flags = []
    n_garbage = 0
    for flag, good in _CLI_FLAGS.items():
        if flag == "--trim-scope":  # both scopes are valid (model-wide TIES streams too)
            good = draw(st.sampled_from(["module", "model"]))
        if flag == "--interference":  # the paper's term or a sign-aware one
            good = draw(st.sampled_from(["overlap", "signed", "signed_weaker"]))
        if flag == "--budget" or draw(st.booleans()):
            garbage = draw(st.integers(0, 2)) == 0
            n_garbage += garbage
            flags.append(f"{flag}={draw(_GARBAGE_TEXT) if garbage else good}")
    out_kind = draw(st.sampled_from(["new", "new", "empty", "existing_dir", "under_file", "file"]))
    return method, flags, out_kind, n_garbage


def _cli_property(cli_adapters, capsys, case, counter):
    from netutility_jax import cli

    root, dirs = cli_adapters
    method, flags, out_kind, n_garbage = case
    counter[0] += 1
    base = root / f"run{counter[0]}"
    base.mkdir()
    (base / "f").write_text("x")
    out = {
        "new": base / "out",
        "empty": "",
        "existing_dir": base,
        "under_file": base / "f" / "out",
        "file": base / "f",
    }[out_kind]
    if out_kind == "new" and n_garbage == 0:
        hypothesis.event("valid combination: not run here (merges are slow)")
        return
    argv = ["merge", *dirs, "--out", str(out), "--method", method, "--no-plots", "--quiet", *flags]
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code in (0, 2), (argv, code, err)  # never 1 (a bug) and never an escaping exception
    if code == 2:
        lines = err.strip().splitlines()
        assert lines and lines[-1].startswith("netutility merge: error"), err
        assert "Traceback" not in err, err
        assert not (base / "out").exists() or out_kind != "new", "a refused merge wrote output"
        hypothesis.event(f"exit 2 ({out_kind})")
    else:
        # garbage text can be a valid value (e.g. "1"): then the merge must have written its output
        assert out_kind == "new", (argv, err)
        assert (base / "out" / "adapter_model.safetensors").is_file()
        hypothesis.event("exit 0")


@hypothesis.settings(
    max_examples=25,
    deadline=DEADLINE,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(case=cli_case_st())
def test_cli_merge_garbage_flags_exit_2(cli_adapters, capsys, case):
    _cli_property(cli_adapters, capsys, case, _CLI_COUNTER)


@pytest.mark.slow
@hypothesis.settings(
    max_examples=150,
    deadline=DEADLINE,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(case=cli_case_st())
def test_cli_merge_garbage_flags_exit_2_slow(cli_adapters, capsys, case):
    _cli_property(cli_adapters, capsys, case, _CLI_COUNTER)


_CLI_COUNTER = [0]


@pytest.mark.parametrize(
    "flags",
    [
        ["--method", "ta", "--budget", "2", "--coef", "0.5"],
        ["--method", "tsv", "--budget", "3", "--lam", "0.1", "--alpha", "0"],
        ["--method", "ta", "--budget", "3", "--interference", "signed", "--space", "core"],
        # model-wide TIES streamed a module at a time (1 KB chunks)
        [
            "--method",
            "ties",
            "--space",
            "core",
            "--budget",
            "2",
            "--trim-scope",
            "model",
            "--density",
            "0.9",
            "--chunk-mb",
            "0.001",
        ],
    ],
)
def test_cli_merge_valid_combos_exit_0(cli_adapters, capsys, tmp_path, flags):
    from netutility_jax import cli
    from netutility_jax import peft as nu_peft

    _, dirs = cli_adapters
    out = tmp_path / "merged"
    code = cli.main(["merge", *dirs, "--out", str(out), "--no-plots", "--quiet", *flags])
    err = capsys.readouterr().err
    assert code == 0, err
    merged = nu_peft.load_adapter(out)
    assert set(merged) == set(_PEFT_NAMES)
    # the merged updates are finite and not all zero (issue 12: never a zero adapter with exit 0)
    for name, mod in merged.items():
        a = np.asarray(mod["lora_a"], np.float64)
        b = np.asarray(mod["lora_b"], np.float64)
        dk = float(np.asarray(mod.get("scale", 1.0))) * a @ b
        assert np.all(np.isfinite(dk)) and np.any(dk), name


# ------------------------------------------------------------- nu.peft.AdapterWriter's inputs


@hypothesis.settings(**FAST)
@hypothesis.given(
    cuts=st.lists(st.integers(0, 6), max_size=4),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    seed=st.integers(0, 2**16),
)
def test_adapter_writer_any_chunking_is_save_adapter(tmp_path_factory, cuts, dtype, seed):
    """Any split of the modules into chunks (empty chunks too), in any dtype: the file
    save_adapter writes, byte for byte."""
    from netutility_jax import peft

    rng = np.random.default_rng(seed)
    mods = {
        f"model.layers.{i}.q": {
            "lora_a": rng.normal(size=(5, int(r))),
            "lora_b": rng.normal(size=(int(r), 3)),
        }
        for i, r in enumerate(rng.integers(0, 4, size=6))
    }
    d = tmp_path_factory.mktemp("w")
    peft.save_adapter(mods, d / "a", dtype=dtype)
    names = list(mods)
    bounds = [0, *sorted(cuts), len(names)]
    with peft.AdapterWriter(d / "b", dtype=dtype, names=names) as w:
        for lo, hi in itertools.pairwise(bounds):
            w.add({n: mods[n] for n in names[lo:hi]})
    for f in (peft.WEIGHTS_NAME, peft.CONFIG_NAME):
        assert (d / "a" / f).read_bytes() == (d / "b" / f).read_bytes()


@pytest.mark.parametrize(
    "names, error",
    [
        ([], "names=\\[\\] names no module"),
        ("model.layers.0.q", "names is a str"),
        (b"x", "names is a bytes"),
        (3, "names is a int"),
        (["a", ""], "names holds ''"),
        (["a", None], "names holds None"),
        (["a", "b", "a"], "names lists module 'a' more than once"),
    ],
)
def test_adapter_writer_refuses_bad_names(tmp_path, names, error):
    from netutility_jax import errors, peft

    with pytest.raises(errors.NetUtilityError, match=error):
        peft.AdapterWriter(tmp_path / "out", names=names)
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# A model's weights sharded over a mesh (experiments.models.sharding)
# ---------------------------------------------------------------------------------------------
# Mesh sizes are drawn from 1 to this process' devices: one in the default tier; the slow
# variant runs the same properties in a child process with 8 forced CPU devices.

# the slow variant's child runs more examples (NETUTILITY_FUZZ_SHARDING_EXAMPLES)
SHARDING = {
    "max_examples": int(os.environ.get("NETUTILITY_FUZZ_SHARDING_EXAMPLES", "12")),
    "deadline": DEADLINE,
}
_NAMES = ["q_proj", "o_proj", "down_proj", "fc1", "query", "embed_tokens", "norm", "mlp", "x"]
_LEAVES = ["kernel", "lora_a", "lora_b", "embedding", "scale", "bias"]


@st.composite
def _param_st(draw):
    path = (*draw(st.lists(st.sampled_from(_NAMES), max_size=3)), draw(st.sampled_from(_LEAVES)))
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24]), max_size=4)))
    dtype = draw(st.sampled_from([np.float32, np.float16, np.int32]))
    return path, shape, np.dtype(dtype)


def _check_spec(spec, shape, nbytes, n, min_bytes, axis="model"):
    """The rule's invariants: at most one split axis, named ``axis``, of a size the mesh divides,
    only for parameters of at least ``min_bytes`` on several devices; replicated only when no
    axis qualifies."""
    from jax.sharding import PartitionSpec

    assert isinstance(spec, PartitionSpec) and len(spec) <= len(shape)
    split = [i for i, a in enumerate(spec) if a is not None]
    assert len(split) <= 1 and all(spec[i] == axis for i in split)
    if split:
        (d,) = split
        assert n > 1 and nbytes >= min_bytes and shape[d] % n == 0 and shape[d] >= n
        assert spec[-1] == axis  # no trailing None (as jit writes its outputs' specs)
    else:
        assert n <= 1 or nbytes < min_bytes or not any(s >= n and s % n == 0 for s in shape)


@hypothesis.settings(**SHARDING)
@hypothesis.given(
    param=_param_st(),
    n=st.integers(1, 8),
    min_bytes=st.integers(0, 4096),
    axis=st.sampled_from(["model", "x"]),
)
def test_sharding_partition_spec_random_shapes(param, n, min_bytes, axis):
    from netutility_jax.experiments.models import sharding

    path, shape, dtype = param
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    spec = sharding.partition_spec(path, shape, nbytes, n, axis=axis, min_bytes=min_bytes)
    _check_spec(spec, shape, nbytes, n, min_bytes, axis)


@st.composite
def _state_st(draw):
    """A state of 1..4 arrays at random paths (``p<i>/<layer names>/<leaf>``: the rule's
    names among others), shapes and dtypes, a mesh size among this process' devices and a
    ``min_bytes``: ``(state, [(keys, array)], n, min_bytes)``."""
    import jax

    state: dict = {}
    arrays = []
    for i, (path, shape, dtype) in enumerate(draw(st.lists(_param_st(), min_size=1, max_size=4))):
        size = int(np.prod(shape, dtype=np.int64))
        x = (np.arange(size, dtype=np.int64).reshape(shape) % 97).astype(dtype)
        keys = (f"p{i}", *path)
        node = state
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = x
        arrays.append((keys, x))
    n = draw(st.integers(1, len(jax.local_devices())))
    return state, arrays, n, draw(st.integers(0, 2048))


def _shard_state_property(case):
    import jax

    from netutility_jax.experiments.models import sharding

    state, arrays, n, min_bytes = case
    hypothesis.event(f"mesh of {n} of {len(jax.local_devices())} devices")
    mesh = sharding.model_mesh(n)
    assert mesh.size == n and mesh.axis_names == ("model",)
    placed, summary = sharding.shard_state(state, mesh, min_bytes=min_bytes)
    assert jax.tree.structure(placed) == jax.tree.structure(state)
    assert summary.devices == n and summary.sharded + summary.replicated == len(arrays)
    assert summary.bytes_per_device <= summary.total_bytes
    assert summary.total_bytes == sum(x.nbytes for _, x in arrays)
    for keys, x in arrays:
        got = placed
        for k in keys:
            got = got[k]
        np.testing.assert_array_equal(np.asarray(got), x)  # the placed array is the input
        assert got.dtype == x.dtype and len(got.sharding.device_set) == n
        spec = summary.specs["/".join(keys)]
        assert tuple(got.sharding.spec) == tuple(spec)
        assert spec == sharding.partition_spec(keys, x.shape, x.nbytes, n, min_bytes=min_bytes)
        _check_spec(spec, x.shape, x.nbytes, n, min_bytes)
        split = any(a is not None for a in spec)
        for s in got.addressable_shards:  # each device holds its share of the split axis
            assert s.data.nbytes * (n if split else 1) == x.nbytes


@hypothesis.settings(**SHARDING)
@hypothesis.given(case=_state_st())
def test_sharding_shard_state_random_states(case):
    _shard_state_property(case)


_GARBAGE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 20), st.floats(allow_nan=True), st.text(max_size=3),
    st.binary(max_size=3), st.lists(st.integers(-1, 3), max_size=3), st.just([]),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)  # fmt: skip


@hypothesis.settings(**SHARDING)
@hypothesis.given(devices=_GARBAGE, axis=st.one_of(_GARBAGE, st.just("model")))
def test_sharding_model_mesh_garbage_gives_documented_errors(devices, axis):
    """Any ``devices`` and ``axis``: a mesh, or InputError / InputTypeError only."""
    import jax

    from netutility_jax.experiments.models import sharding

    try:
        mesh = sharding.model_mesh(devices, axis=axis)
    except (InputError, InputTypeError) as e:
        assert str(e).startswith("sharding.model_mesh: ")
        hypothesis.event(type(e).__name__)
        return
    assert mesh.axis_names == (axis,) and 1 <= mesh.size <= len(jax.local_devices())


@hypothesis.settings(**SHARDING)
@hypothesis.given(mesh=st.one_of(_GARBAGE, st.just("mesh")), min_bytes=_GARBAGE)
def test_sharding_shard_state_garbage_gives_documented_errors(mesh, min_bytes):
    """A bad ``mesh`` or ``min_bytes`` (a real mesh where ``mesh`` is ``"mesh"``): InputError or
    InputTypeError, naming the function, never another exception."""
    from netutility_jax.experiments.models import sharding

    real = sharding.model_mesh(1)
    state = {"w": np.ones((8, 8), np.float32)}
    try:
        placed, _ = sharding.shard_state(
            state, real if mesh == "mesh" else mesh, min_bytes=min_bytes
        )
    except (InputError, InputTypeError) as e:
        assert str(e).startswith("sharding.shard_state: ")
        hypothesis.event(type(e).__name__)
        return
    assert mesh == "mesh" and isinstance(min_bytes, int) and min_bytes >= 0
    np.testing.assert_array_equal(np.asarray(placed["w"]), state["w"])


@pytest.mark.slow  # (a child process with 8 CPU devices: mesh sizes 1..8)
def test_sharding_properties_on_8_devices():
    """The sharding properties above, run by pytest in a child with 8 forced CPU devices (JAX
    fixes its device count when it starts), with more examples."""
    import pathlib
    import subprocess
    import sys

    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=8"])
    env["NETUTILITY_COMPILE_CACHE"] = "off"
    env["NETUTILITY_FUZZ_SHARDING_EXAMPLES"] = "60"
    here = pathlib.Path(__file__).resolve()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
         str(here), "-k", "test_sharding_ and not on_8_devices", "--hypothesis-show-statistics"],
        cwd=here.parents[1], env=env, capture_output=True, text=True, timeout=SLOW_WALL_SECONDS,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "4 passed" in proc.stdout, proc.stdout[-2000:]
    assert "mesh of 8 of 8 devices" in proc.stdout, proc.stdout[-2000:]


# ---------------------------------------------------------------------------------------------
# netutility demo: --min-bytes values and --seeds-from directories
# ---------------------------------------------------------------------------------------------

_UNIT_BYTES = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30,
               "kb": 10**3, "mb": 10**6, "gb": 10**9}  # fmt: skip


def _min_bytes_reference(text: str) -> int | None:
    """``--min-bytes`` read by hand: ASCII digits, optional blanks, a unit in any case."""
    s = text.strip()
    i = 0
    while i < len(s) and s[i] in "0123456789":
        i += 1
    rest = s[i:].lstrip(" \t")
    if i == 0 or rest.lower() not in _UNIT_BYTES or not rest.isascii():
        return None
    return int(s[:i]) * _UNIT_BYTES[rest.lower()]


_MIN_BYTES_TEXT = st.one_of(
    _GARBAGE_TEXT,
    st.tuples(
        st.integers(0, 2**40).map(str) | st.sampled_from(["", "-1", "1.5", "１２", "٣", "0x10"]),
        st.sampled_from(["", " ", "  ", "\t", "\u00a0"]),
        st.sampled_from([*_UNIT_BYTES, "KIB", "Mb", "gB", "KiB", "TiB", "bytes", "k", "µB"]),
        st.sampled_from(["", " ", "x"]),
    ).map("".join),
)


def _min_bytes_property(text: str) -> None:
    from netutility_jax.experiments import demo

    want = _min_bytes_reference(text)
    try:
        got = demo.min_bytes(text)
    except demo.DemoError as e:
        assert want is None, (text, want)
        assert str(e).startswith(f"--min-bytes {text!r}: expected a whole number of bytes"), e
        assert "\n" not in str(e)
        hypothesis.event("refused")
        return
    assert got == want and isinstance(got, int) and got >= 0, (text, got, want)
    hypothesis.event("read")


@hypothesis.settings(max_examples=200, deadline=DEADLINE)
@hypothesis.given(text=_MIN_BYTES_TEXT)
def test_demo_min_bytes_any_text_is_read_as_written_or_refused(text):
    _min_bytes_property(text)


@pytest.mark.slow
@hypothesis.settings(max_examples=3000, deadline=DEADLINE)
@hypothesis.given(text=_MIN_BYTES_TEXT)
def test_demo_min_bytes_any_text_is_read_as_written_or_refused_slow(text):
    _min_bytes_property(text)


def test_demo_min_bytes_garbage_on_the_command_line_exits_2_before_any_work(tmp_path, capsys):
    """Each refused value through ``netutility demo --suite nli --model-devices 1``: one line,
    exit 2, no output folder and no cache."""
    from netutility_jax.experiments import demo

    for i, text in enumerate(["-1", "1.5", "١٢", "0x10", "1e6", "KiB", "", "12 TiB", "nan"]):
        argv = ["--suite", "nli", "--model-devices", "1", "--min-bytes", text, "--no-progress",
                "--out", str(tmp_path / f"o{i}"), "--cache-dir", str(tmp_path / f"c{i}")]  # fmt: skip
        code = demo.main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.count("\n") == 0 and "--min-bytes" in err, (text, err)
        assert not (tmp_path / f"o{i}").exists() and not (tmp_path / f"c{i}").exists()


_SEED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                         "language_head", "seed0")  # fmt: skip
_JSON_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                               max_size=3),
    max_leaves=6,
)  # fmt: skip


@st.composite
def _seed_dir_case_st(draw):
    """A mutation of a real rendered seed: a JSON value replaced or removed somewhere in
    results.json, or its bytes cut or replaced, or predictions.npz's bytes cut or garbled."""
    kind = draw(st.sampled_from(["replace", "replace", "delete", "json_bytes", "npz_bytes",
                                 "deep", "npy"]))  # fmt: skip
    path = []
    if kind in ("replace", "delete"):
        with open(os.path.join(_SEED_DIR, "results.json")) as f:
            node = json.load(f)
        while True:  # walk down to a random node (at least one step)
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            k = draw(st.sampled_from(keys))
            path.append(k)
            node = node[k]
            if not isinstance(node, dict | list) or draw(st.integers(0, 3)) == 0:
                break
    value = draw(_JSON_VALUE) if kind == "replace" else None
    cut = draw(st.floats(0.0, 1.0))
    garble = draw(st.binary(max_size=16))
    return kind, path, value, cut, garble


def _seed_dir_property(tmp_path_factory, case):
    import copy
    import shutil

    from netutility_jax.experiments.harness import seeds as sds

    kind, path, value, cut, garble = case
    d = tmp_path_factory.mktemp("seeds")
    shutil.copy(os.path.join(_SEED_DIR, "predictions.npz"), d / "predictions.npz")
    with open(os.path.join(_SEED_DIR, "results.json")) as f:
        original = json.load(f)
    results = copy.deepcopy(original)
    if path:
        node = results
        for k in path[:-1]:
            node = node[k]
        if kind == "delete":
            del node[path[-1]]
        else:
            node[path[-1]] = value
    text = json.dumps(results)
    if kind == "json_bytes":
        text = text[: int(cut * len(text))] + garble.decode("latin-1")
    elif kind == "deep":  # nesting deeper than the JSON reader's recursion limit
        text = "[" * 100_000 + "]" * 100_000
    (d / "results.json").write_text(text, encoding="utf-8", errors="surrogatepass")
    if kind == "npz_bytes":
        raw = (d / "predictions.npz").read_bytes()
        (d / "predictions.npz").write_bytes(raw[: int(cut * len(raw))] + garble)
    elif kind == "npy":  # one array where the archive belongs
        with open(d / "predictions.npz", "wb") as f:
            np.save(f, np.frombuffer(garble, np.uint8))
    try:
        sv = sds.load(d, label="--seeds-from")
    except InputError as e:
        assert str(e).startswith(f"--seeds-from {d}: "), e
        hypothesis.event(f"{kind}: refused by load")
        return
    # read: every merge with a record has its test correctness, and the other way round
    assert all(set(s.records) == set(s.correct) for s in sv.seeds)
    # then it is checked against the experiment it came from; a changed field the check
    # compares must be refused there
    exp = {
        "suite": original["suite"], "preset": original["preset"], "grid": original["grid"],
        "train_config": original["train_config"], "tasks": original["tasks"],
        "alpha_arg": "auto", "evaluation": original["evaluation"],
        "jobs": [k for k, v in original["merges"]["0"].items() if not v.get("derived")],
    }  # fmt: skip

    class _Test:
        task, labels, task_names = sv.task, sv.labels, sv.task_names

    compared = {"suite", "preset", "grid", "train_config", "tasks", "evaluation"}
    touched = (
        bool(path) and path[0] in compared and json.dumps(results.get(path[0]), sort_keys=True)
        != json.dumps(original[path[0]], sort_keys=True)
    )  # fmt: skip
    try:
        sv.check(exp, _Test(), original["evaluation"]["val_texts"])
    except InputError as e:
        assert str(e).startswith(f"--seeds-from {d}: "), e
        hypothesis.event(f"{kind}: refused by the check")
        return
    assert not touched, f"a changed {path} passed the check"
    hypothesis.event(f"{kind}: read and passed ({path[:1]})")


@hypothesis.settings(
    max_examples=25, deadline=DEADLINE,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)  # fmt: skip
@hypothesis.given(case=_seed_dir_case_st())
def test_seeds_from_damaged_directories_are_read_or_refused_in_one_error(tmp_path_factory, case):
    _seed_dir_property(tmp_path_factory, case)


@pytest.mark.slow
@hypothesis.settings(
    max_examples=300, deadline=DEADLINE,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)  # fmt: skip
@hypothesis.given(case=_seed_dir_case_st())
def test_seeds_from_damaged_directories_are_read_or_refused_in_one_error_slow(
    tmp_path_factory, case
):
    _seed_dir_property(tmp_path_factory, case)


# ---------------------------------------------------------------------------------------------
# The command line's files (issue 46): config text, a replayed report, input-moments archives
# ---------------------------------------------------------------------------------------------

_CFG_KEYS = ["adapters", "budget", "method", "weights", "alpha", "chunk_mb", "config",
             "netutility_version", "path", "weight", "name", "sha256", "input-moments",
             "serving-ranks", "x", "<<"]  # fmt: skip
_CFG_SCALAR = (
    st.none() | st.booleans() | st.integers(-(10**60), 10**60) | st.floats(allow_nan=False)
    | st.text(max_size=6)
)  # fmt: skip
_CFG_TREE = st.recursive(
    _CFG_SCALAR.map(lambda v: ("scalar", v)),
    lambda inner: st.lists(inner, max_size=4).map(lambda xs: ("list", xs))
    | st.lists(st.tuples(st.sampled_from(_CFG_KEYS) | st.text(max_size=3), inner), max_size=4)
    .map(lambda kv: ("map", kv)),
    max_leaves=12,
)  # fmt: skip


@st.composite
def config_text_st(draw):
    """A config file's text, JSON or YAML (flow style, every scalar written as JSON writes
    it), from a random tree of mappings (keys may repeat), lists and scalars (integers up to 61
    digits), optionally nested inside ``deep`` lists, and in YAML optionally an alias bomb of
    ``fan ** levels`` values; with the violations of the loader's limits it holds, computed
    here from the tree: ``dup``, ``deep``, ``digits``, ``bomb`` (``maybe_bomb``: near the
    limit, either outcome)."""
    from netutility_jax.cli import configfile

    yaml_form = draw(st.booleans())
    top = ("map", draw(st.lists(st.tuples(st.sampled_from(_CFG_KEYS), _CFG_TREE), max_size=3)))
    if draw(st.booleans()):  # a plausible merge config, which the random pairs may spoil
        name = st.text("abc/@.", min_size=1, max_size=6).map(lambda t: ("scalar", t))
        item = name | st.fixed_dictionaries(
            {"path": name}, optional={"weight": _CFG_SCALAR.map(lambda v: ("scalar", v))}
        ).map(lambda d: ("map", list(d.items())))
        plausible = [("adapters", ("list", draw(st.lists(item, min_size=1, max_size=3)))),
                     ("budget", ("scalar", draw(st.integers(1, 9))))]  # fmt: skip
        if draw(st.booleans()):
            plausible.append(("method", ("scalar", draw(st.sampled_from(["ta", "tsv", "x"])))))
        top = ("map", plausible + (top[1] if draw(st.booleans()) else []))
    deep = draw(st.sampled_from([0, 0, 0, configfile.MAX_DEPTH - 2, configfile.MAX_DEPTH - 1, 200]))
    if deep:
        leaf = ("scalar", 1)
        for _ in range(deep):
            leaf = ("list", [leaf])
        top[1].append(("x", leaf))
    levels, fan = (draw(st.integers(1, 9)), draw(st.integers(2, 9))) if yaml_form else (0, 0)
    if yaml_form and draw(st.booleans()):
        levels = 0

    def dump(node):
        kind, v = node
        if kind == "scalar":
            return json.dumps(v)
        if kind == "list":
            return "[" + ", ".join(dump(x) for x in v) + "]"
        return "{" + ", ".join(f"{json.dumps(k)}: {dump(x)}" for k, x in v) + "}"

    def walk(node, depth=0):
        kind, v = node
        if kind == "scalar":
            big = isinstance(v, int) and not isinstance(v, bool) and len(str(abs(v))) > 40
            return {"digits"} if big else set(), depth
        found, d = set(), depth + 1
        keys = [k for k, _ in v] if kind == "map" else []
        if len(set(keys)) < len(keys):
            found.add("dup")
        for x in (x for _, x in v) if kind == "map" else v:
            f, dx = walk(x)
            found |= f
            d = max(d, depth + 1 + dx)
        return found, d - depth

    violations, depth = walk(top)
    if depth > configfile.MAX_DEPTH:
        violations.add("deep")
    lines = [f"{json.dumps(k)}: {dump(x)}" for k, x in top[1]]  # (then the bomb's keys)
    if levels:
        lines.append('"b0": &b0 [' + ", ".join(['"lol"'] * fan) + "]")
        for i in range(1, levels):
            lines.append(f'"b{i}": &b{i} [' + ", ".join([f"*b{i - 1}"] * fan) + "]")
        expanded = fan**levels
        if expanded > 2 * configfile.MAX_NODES:
            violations.add("bomb")
        elif expanded > configfile.MAX_NODES // 4:
            violations.add("maybe_bomb")
    text = "{" + ",\n".join(lines) + "}\n"
    return ("yaml" if yaml_form else "json"), text, violations


_VIOLATION_TEXT = {
    "dup": "is given twice in one mapping",
    "deep": "nested deeper than",
    "digits": "digits; a config's numbers have at most",
    "bomb": "aliases are expanded",
    "maybe_bomb": "aliases are expanded",
}


def _expected_config(data):
    """What the loader should return for the independently parsed ``data`` (a report's
    ``config``), or None where it should refuse."""
    if isinstance(data, dict) and "netutility_version" in data:
        return data["config"] if isinstance(data.get("config"), dict) else None
    if not isinstance(data, dict) or "config" in data:
        return None
    return data


def _config_text_property(tmp_path_factory, case):
    from netutility_jax.cli import configfile
    from netutility_jax.cli.common import UsageError

    form, text, violations = case
    path = tmp_path_factory.mktemp("cfg") / f"c.{form}"
    path.write_text(text)
    try:
        data, _ = configfile.read_config(str(path))
    except UsageError as e:
        msg = str(e)
        assert msg.startswith(f"--config {path}: ") and "\n" not in msg, msg
        hard = violations - {"maybe_bomb"}
        if violations:
            assert any(_VIOLATION_TEXT[v] in msg for v in violations), (violations, msg)
            hypothesis.event(f"{form}: refused ({sorted(violations)})")
            return
        assert not hard
        ref = json.loads(text) if form == "json" else __import__("yaml").safe_load(text)
        assert _expected_config(ref) is None, msg  # (refused only as a report or no mapping)
        hypothesis.event(f"{form}: refused (report rules)")
        return
    assert not violations - {"maybe_bomb"}, f"{sorted(violations)} read: {text[:200]}"
    ref = json.loads(text) if form == "json" else __import__("yaml").safe_load(text)
    assert data == _expected_config(ref)
    hypothesis.event(f"{form}: read")
    _resolve_config(path)


def _resolve_config(path) -> None:
    """``merge --config PATH --dry-run``'s arguments resolved: completed, or refused with one
    of the library's errors on one line (never another exception); nothing reaches the Hub."""
    from netutility_jax import cli
    from netutility_jax.cli import config
    from netutility_jax.errors import NetUtilityError

    argv = ["merge", "--config", str(path), "--dry-run"]
    args = cli.build_parser(demo_options=False).parse_args(argv)
    args.argv = argv
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        config.resolve(args)
    except NetUtilityError as e:
        assert str(e).strip() and "\n" not in str(e), str(e)
        hypothesis.event(f"resolve refused: {type(e).__name__}")
        return
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old
    assert args.adapters and len(args.names) == len(args.adapters)
    hypothesis.event("resolved")


@hypothesis.settings(**FAST)
@hypothesis.given(case=config_text_st())
def test_config_files_are_read_as_the_reference_parser_reads_them_or_refused(
    tmp_path_factory, case
):
    """A config's text is read as json / PyYAML's safe_load read it, or refused with one line
    naming the file and one of the limits the text breaks (a duplicate key, nesting, a long
    integer, an alias bomb); a text that breaks one is never read."""
    pytest.importorskip("yaml")
    _config_text_property(tmp_path_factory, case)


@pytest.mark.slow
@hypothesis.settings(**SLOW)
@hypothesis.given(case=config_text_st())
def test_config_files_are_read_as_the_reference_parser_reads_them_or_refused_slow(
    tmp_path_factory, case
):
    pytest.importorskip("yaml")
    _config_text_property(tmp_path_factory, case)


@pytest.fixture(scope="module")
def merge_report(tmp_path_factory):
    """A real merge of three small PEFT adapters and the text of its report."""
    pytest.importorskip("safetensors")
    from netutility_jax import cli

    root = tmp_path_factory.mktemp("replay")
    rng = np.random.default_rng(0)
    folders = []
    for i in range(3):
        ad = {f"model.layers.0.{m}": _mod(rng, 8, 2, 6) for m in ("q_proj", "v_proj")}
        nu.peft.save_adapter(ad, root / f"t{i}", base_config={"base_model_name_or_path": "m"})
        folders.append(str(root / f"t{i}"))
    out = root / "merged"
    rc = cli.main(["merge", *folders, "--budget", "2", "--no-plots", "--quiet", "--out",
                   str(out), "--no-compile-cache"])  # fmt: skip
    assert rc == 0
    return (out / cli.REPORT_NAME).read_text(), folders


@st.composite
def report_case_st(draw):
    """A mutation of a real report: an adapter's digest or the version changed, a value of its
    config replaced or removed, or its bytes cut; and whether ``--allow-changed`` is given."""
    kind = draw(st.sampled_from(["digest", "version", "replace", "replace", "delete", "cut"]))
    return (kind, draw(st.integers(0, 2)), draw(st.integers(0, 63)),
            draw(_JSON_VALUE), draw(st.integers(0, 10**6)), draw(st.booleans()))  # fmt: skip


def _report_property(tmp_path_factory, merge_report, case):
    from netutility_jax import cli
    from netutility_jax.cli import config
    from netutility_jax.errors import NetUtilityError

    text, _ = merge_report
    kind, task, at, value, pick, allow = case
    rep = json.loads(text)
    cfg = rep["config"]
    if kind == "digest":
        sha = cfg["adapters"][task]["sha256"]
        cfg["adapters"][task]["sha256"] = sha[:at] + "0123456789abcdef"[
            ("0123456789abcdef".index(sha[at]) + 1) % 16] + sha[at + 1:]  # fmt: skip
    elif kind == "version":
        rep["netutility_version"] = str(value) if str(value) != nu.__version__ else "0"
    elif kind in ("replace", "delete"):
        node, key = cfg, None
        while True:  # a random node of the config, at least one step down
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            key = keys[pick % len(keys)]
            pick //= len(keys) + 1
            if not isinstance(node[key], dict | list) or pick % 3 == 0:
                break
            node = node[key]
        if key is not None:
            if kind == "delete":
                del node[key]
            else:
                node[key] = value
    new = json.dumps(rep)
    if kind == "cut":
        new = new[: pick % len(new)]
    path = tmp_path_factory.mktemp("rep") / cli.REPORT_NAME
    path.write_text(new)
    argv = ["merge", "--config", str(path), "--dry-run", *(["--allow-changed"] * allow)]
    args = cli.build_parser(demo_options=False).parse_args(argv)
    args.argv = argv
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # (a value read as a Hub id never reaches the network)
    try:
        config.resolve(args)
    except NetUtilityError as e:
        assert str(e).strip() and "\n" not in str(e), str(e)
        hypothesis.event(f"{kind}: refused")
        if kind in ("digest", "version") and not allow:
            assert "--allow-changed" in str(e), str(e)
        return
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old
    hypothesis.event(f"{kind}: replayed{' (allowed)' if allow else ''}")
    if not allow:  # a replay that goes on is of the inputs the report recorded
        assert kind not in ("digest", "version")
        assert rep.get("netutility_version") == nu.__version__
        for a in rep["config"]["adapters"]:
            if isinstance(a, dict) and a.get("sha256") is not None:
                assert a["sha256"] == folder_digest(a["path"]), a


@hypothesis.settings(
    max_examples=25, deadline=DEADLINE,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)  # fmt: skip
@hypothesis.given(case=report_case_st())
def test_a_replayed_report_runs_only_on_the_inputs_it_recorded(
    tmp_path_factory, merge_report, case
):
    """A report changed anywhere replays or is refused in one line; without --allow-changed a
    replay that goes on has the recorded library version and every adapter's recorded digest
    (computed here), and a changed digest or version is refused naming --allow-changed."""
    _report_property(tmp_path_factory, merge_report, case)


@st.composite
def moments_bytes_case_st(draw):
    """A moments file's bytes mutated: cut, bytes flipped, random bytes spliced in, a lone
    .npy array, or random bytes; ``.npz`` (compressed or not) or ``.safetensors``."""
    suffix = draw(st.sampled_from(["npz", "npz_compressed", "safetensors"]))
    kind = draw(st.sampled_from(["none", "cut", "flip", "flip", "member", "splice", "npy",
                                 "random"]))  # fmt: skip
    return suffix, kind, draw(st.floats(0, 1)), draw(st.binary(min_size=1, max_size=24))


def _moments_bytes_property(tmp_path_factory, case):
    from netutility_jax.errors import NetUtilityError
    from netutility_jax.scoring.moments import load_input_moments

    suffix, kind, where, junk = case
    rng = np.random.default_rng(0)
    x = {n: rng.normal(size=(40, d)) for n, d in (("a.q", 12), ("b.v", 8))}
    s = {n: (v.T @ v / len(v)).astype(np.float32) for n, v in x.items()}
    d = tmp_path_factory.mktemp("moments")
    ext = "safetensors" if suffix == "safetensors" else "npz"
    src = d / f"src.{ext}"
    if suffix == "safetensors":
        from safetensors.numpy import save_file

        save_file(s, str(src))
    else:
        (np.savez_compressed if suffix == "npz_compressed" else np.savez)(src, **s)
    data = bytearray(src.read_bytes())
    at = int(where * (len(data) - 1))
    if kind == "cut":
        data = data[:at]
    elif kind == "flip":
        for i, b in enumerate(junk):
            data[(at + 7 * i) % len(data)] ^= b or 1
    elif kind == "member":  # inside the first tensor's (compressed) bytes, past its header
        start = data.find(b".npy") + 4 + 140 if ext == "npz" else len(data) - 80
        for i, b in enumerate(junk):
            data[min(len(data) - 1, start + int(where * 40) + i)] ^= b or 1
    elif kind == "splice":
        data[at:at] = junk
    elif kind == "npy":
        import io

        buf = io.BytesIO()
        np.save(buf, s["a.q"])
        data = bytearray(buf.getvalue())
    elif kind == "random":
        data = bytearray(junk * 8)
    path = d / f"m.{ext}"
    path.write_bytes(bytes(data))
    try:
        got = load_input_moments(path)
    except NetUtilityError as e:
        assert str(e).startswith(f"nu.moments.load_input_moments({str(path)!r}): "), str(e)
        assert kind != "none", str(e)
        hypothesis.event(f"{suffix} {kind}: refused")
        return
    hypothesis.event(f"{suffix} {kind}: read")
    for m in got.values():
        assert m is None or (np.isfinite(np.asarray(m.factor)).all() and m.factor.ndim == 2)
    if bytes(data) == src.read_bytes():  # unchanged: the second moments come back
        assert set(got) == set(s)
        for n, m in got.items():
            back = np.asarray(m.factor, np.float64).T @ np.asarray(m.factor, np.float64)
            np.testing.assert_allclose(back, s[n], atol=1e-5 * np.abs(s[n]).max(), err_msg=n)


@hypothesis.settings(max_examples=40, deadline=DEADLINE)
@hypothesis.given(case=moments_bytes_case_st())
def test_input_moments_archives_are_read_or_refused_naming_the_file(tmp_path_factory, case):
    """Any bytes in a moments file: read (unchanged bytes give back the second moments, checked
    here) or one library error naming the file; never numpy's, zipfile's or zlib's own."""
    _moments_bytes_property(tmp_path_factory, case)


@pytest.mark.slow
@hypothesis.settings(max_examples=400, deadline=DEADLINE)
@hypothesis.given(case=moments_bytes_case_st())
def test_input_moments_archives_are_read_or_refused_naming_the_file_slow(tmp_path_factory, case):
    _moments_bytes_property(tmp_path_factory, case)
