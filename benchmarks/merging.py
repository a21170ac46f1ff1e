"""Merge benchmark on Qwen3-4B-shaped adapters: every method x space, plus a dense baseline.

Case table: 36 layers of q (2560->4096), k, v (2560->1024), o (4096->2560); M = 6 tasks, r = 16,
budget R = 16 (net-utility masks: global scope for TA/TSV/Iso, local for TIES/DARE, as the paper).

Each case runs in its own subprocess so that its peak RSS is its own: the adapters and masks are
built, the peak-RSS counter is reset (``/proc/self/clear_refs``), then one warm-up call (compile +
run) and ``--repeat`` steady calls are timed with ``block_until_ready``. Reported per case: compile
time (first call minus steady median), steady median, peak RSS during the merges and its increase
over the pre-merge RSS, both also as multiples of the adapters' own size. That peak includes XLA's
compilation and the irreducible reference (which stacks every factor at once), so the library's
own memory is measured apart: after the timings, free heap memory is returned to the OS
(``malloc_trim``), the counter is reset and one more steady merge runs; its peak increase over the
RSS just before it (``steady_peak_increase_mb``, ``steady_increase_over_adapters``) is the
working memory of a merge, results included.

In the same process and interleaved with the merges, the irreducible work of a factored merge is
timed: per bucket, the Grams of the task-stacked factors ``[a_1 .. a_M]`` and ``[b_1^T .. b_M^T]``
(one pass over every factor; any orthogonalisation of the kept directions needs at least that).

Full-space TIES/DARE (dense modules) and the dense baseline (the reference codebases' route: dense
updates, per-module dense SVDs) run on a few modules and are scaled to the whole model by module
count; the JSON says so (``"scaled_from"``).

Timing, memory counters, machine and code info, the JSON writer and the subprocess per case come
from ``_harness.py`` (shared with ``scoring.py``).

Usage:
  python benchmarks/merging.py [--quick] [--out benchmarks/results/merging.json] [--repeat 3]
      [--only tsv:full,ta:core] [--timeout 900]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# This checkout's library, not whichever one is installed (a second worktree measures its own code).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _harness as h
import numpy as np

__all__ = ["cases", "dense_baseline", "main", "make_adapters", "merge_case", "run_case"]

SHAPES = {"q": (2560, 4096), "k": (2560, 1024), "v": (2560, 1024), "o": (4096, 2560)}
M, R, BUDGET = 6, 16, 16

LOW_RANK = [("ta", {}), ("tsv", {}), ("iso_c", {}), ("tsv", {"isotropize": True}), ("iso_cts", {})]
ELEMENTWISE = [
    ("ties", {"density": 0.2}),
    ("ties", {"density": 0.2, "trim_scope": "model"}),
    ("dare", {"p": 0.5}),
    ("dare_ties", {"p": 0.5}),
]
SPACES = ["full", "core", "knots"]


def make_adapters(layers: int, seed: int = 0):
    """Random LoRA factors with a decaying spectrum, float32 numpy (lora_b scaled like training)."""
    rng = np.random.default_rng(seed)
    decay = (0.85 ** np.arange(R)).astype(np.float32)
    ads = []
    for _ in range(M):
        ad = {}
        for layer in range(layers):
            for mod, (d_in, d_out) in SHAPES.items():
                a = rng.standard_normal((d_in, R), dtype=np.float32) / np.sqrt(d_in)
                b = rng.standard_normal((R, d_out), dtype=np.float32) * decay[:, None] * 0.01
                ad[f"model.layers.{layer}.self_attn.{mod}_proj"] = {
                    "lora_a": a,
                    "lora_b": b,
                    "scale": 2.0,
                }
        ads.append(ad)
    return ads


def _irreducible(ads):
    """Per bucket, the Grams of the task-stacked factors, from the per-module arrays (jitted)."""
    import jax
    import jax.numpy as jnp

    hi = jax.lax.Precision.HIGHEST
    groups: dict = {}
    for name, m in ads[0].items():
        groups.setdefault((m["lora_a"].shape[0], m["lora_b"].shape[1]), []).append(name)
    leaves = [
        (
            [[ad[n]["lora_a"] for ad in ads] for n in names],
            [[ad[n]["lora_b"] for ad in ads] for n in names],
        )
        for names in groups.values()
    ]

    @jax.jit
    def grams(leaves):
        out = []
        for a_l, b_l in leaves:
            a = jnp.stack([jnp.concatenate(row, 1) for row in a_l])  # (n, d_in, M r)
            b = jnp.stack([jnp.concatenate(row, 0) for row in b_l])  # (n, M r, d_out)
            out.append(jnp.einsum("ndk,ndl->nkl", a, a, precision=hi))
            out.append(jnp.einsum("nkd,nld->nkl", b, b, precision=hi))
        return out

    return lambda: grams(leaves)


def _timings(m: h.Measurement) -> dict:
    """The JSON fields of one measured merge (and of its irreducible reference, if timed)."""
    steady = m.main.median_s
    out = {
        "first_s": m.main.first_s,
        "steady_s": steady,
        "compile_s": max(m.main.compile_s, 0.0),
        "steady_all_s": m.main.all_s,
    }
    if "irreducible" in m.refs:
        irr = m.refs["irreducible"]
        out["irreducible_s"] = irr.median_s
        out["irreducible_first_s"] = irr.first_s
        out["steady_over_irreducible"] = steady / irr.median_s
    return out


def merge_case(spec: dict) -> dict:
    """One method x space: score + allocate, timed merges, then the working memory of one merge."""
    import jax
    import jax.numpy as jnp

    import netutility_jax as nu

    ads = [
        {k: {kk: jnp.asarray(vv) for kk, vv in m.items()} for k, m in ad.items()}
        for ad in make_adapters(spec["layers"])
    ]
    size = h.adapter_bytes(ads)
    method, space, opts = spec["method"], spec["space"], spec["options"]
    scope = nu.registry.METHODS[method].budget_scope
    masks, sw = h.timed(lambda: nu.allocate(nu.score(ads), BUDGET, scope=scope))
    out = {"score_allocate_s": sw.total}
    sub = spec.get("subset")
    if sub:  # dense full-space methods: a few modules, scaled by module count
        names = [
            n for n in ads[0] if any(n.endswith(f"{m}_proj") for m in sub) and ".layers.0." in n
        ]
        ads = [{n: ad[n] for n in names} for ad in ads]
        masks = {n: masks[n] for n in names}
    key = jax.random.key(0)
    base = h.rss_mb()
    reset = h.reset_peak()

    def call():
        return nu.merge(ads, masks, method=method, space=space, key=key, **opts)

    refs = None if sub else (lambda: {"irreducible": _irreducible(ads)})
    out.update(_timings(h.measure(call, repeats=spec["repeat"], references=refs)))
    peak_all = h.hwm_mb()
    res, inc = h.working_memory(call)
    if inc is not None:
        out["steady_peak_increase_mb"] = inc
        out["steady_increase_over_adapters"] = inc * 2**20 / size
    ranks = [m["lora_a"].shape[1] for m in res.values() if "lora_a" in m]
    out["mean_rank"] = float(np.mean(ranks)) if ranks else None
    out["dense_modules"] = sum("delta" in m for m in res.values())
    peak = max(h.hwm_mb(), peak_all)  # the larger of the two windows (timed calls, steady call)
    out["rss_before_mb"] = base
    out["peak_rss_mb"] = peak
    out["peak_increase_mb"] = peak - base if reset else None
    out["adapter_mb"] = size / 2**20
    out["peak_over_adapters"] = peak * 2**20 / size
    out["increase_over_adapters"] = (peak - base) * 2**20 / size if reset else None
    return out


def run_case(spec: dict) -> dict:
    """The record of one case (a merge, or the dense baseline), in this process."""
    if spec["kind"] == "merge":
        return {**spec, **merge_case(spec)}
    out = {**spec, **dense_baseline(spec)}  # one module per distinct shape, reference route
    out["rss_before_mb"] = h.rss_mb()
    out["peak_rss_mb"] = h.hwm_mb()
    out["peak_increase_mb"] = None
    return out


def dense_baseline(spec: dict) -> dict:
    """The references' route on one module per shape: dense dW_i, dense SVDs (float32, jitted)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    res = {}
    hi = jax.lax.Precision.HIGHEST

    def dense(a, b):
        return 2.0 * jnp.einsum("mir,mro->mio", a, b, precision=hi)

    @jax.jit
    def ta(a, b):
        return dense(a, b).sum(0)

    @jax.jit
    def iso_c(a, b):
        u, s, vt = jnp.linalg.svd(dense(a, b).sum(0), full_matrices=False)
        nz = s > s[0] * 1e-6
        return (u * jnp.where(nz, (s * nz).sum() / nz.sum(), 0)) @ vt

    @jax.jit
    def tsv(a, b):
        x = dense(a, b)
        u, s, vt = jnp.linalg.svd(x, full_matrices=False)  # per task, full dense SVD
        u, s, vt = u[..., :R], s[..., :R], vt[..., :R, :]
        uc = jnp.moveaxis(u, 0, 1).reshape(u.shape[1], -1)
        vc = jnp.moveaxis(vt, 0, 1).reshape(-1, vt.shape[-1])
        pu, _, qu = jnp.linalg.svd(uc, full_matrices=False)
        pv, _, qv = jnp.linalg.svd(vc, full_matrices=False)
        return ((pu @ qu) * s.reshape(-1)) @ (pv @ qv)

    @jax.jit
    def knots(a, b):  # SVD of the task concatenation [dW_1 .. dW_M] (d_out, M d_in)
        x = dense(a, b)
        return jnp.linalg.svd(x.reshape(-1, x.shape[2]).T, full_matrices=False)

    counts = {"q": 72, "k": 72}  # q and o have transposed shapes; k and v equal
    for shape_key, (d_in, d_out) in (("q", SHAPES["q"]), ("k", SHAPES["k"])):
        a = jnp.asarray(rng.standard_normal((M, d_in, R), dtype=np.float32))
        b = jnp.asarray(rng.standard_normal((M, R, d_out), dtype=np.float32))
        for name, fn in (("ta", ta), ("iso_c", iso_c), ("tsv", tsv), ("knots_basis", knots)):
            reps = 1 if (shape_key == "q" and name in ("tsv", "knots_basis")) else spec["repeat"]
            t = h.measure(lambda fn=fn, a=a, b=b: fn(a, b), repeats=reps)
            res[f"{name}_{shape_key}_steady_s"] = t.main.median_s
    for name in ("ta", "iso_c", "tsv", "knots_basis"):
        res[f"{name}_model_s_scaled"] = sum(
            res[f"{name}_{k}_steady_s"] * c for k, c in counts.items()
        )
    res["scaled_from"] = "one module per shape x module count (72 q/o-shaped, 72 k/v-shaped)"
    return res


def cases(args) -> list[dict]:
    layers = 4 if args.quick else 36
    out = []
    for space in SPACES:
        for method, opts in LOW_RANK + ELEMENTWISE:
            spec = {
                "kind": "merge",
                "method": method,
                "space": space,
                "options": opts,
                "layers": layers,
                "repeat": args.repeat,
            }
            if space == "full" and method in ("ties", "dare", "dare_ties"):
                spec["subset"] = ["q", "k"]
                spec["repeat"] = 1
                spec["scaled_from"] = "layer 0 q and k modules; model time = 72 x q + 72 x k"
            out.append(spec)
    out.append({"kind": "dense_baseline", "layers": layers, "repeat": args.repeat})
    return out


def _tag(spec: dict) -> str:
    """The case's name as printed and as ``--only`` takes it (``method:space[+iso][+model]``)."""
    tag = f"{spec.get('method', spec['kind'])}:{spec.get('space', '-')}"
    if spec.get("options", {}).get("isotropize"):
        tag += "+iso"
    opts = spec.get("options", {})
    if opts.get("trim_scope", opts.get("scope")) == "model":  # "scope" in older results
        tag += "+model"
    return tag


def run_isolated(spec: dict, tag: str, timeout: float) -> dict:
    """One case in a fresh interpreter (its own peak RSS, cold caches); failures as records."""
    load = h.load_average()
    w = h.run_worker(
        __file__, ["--case", json.dumps(spec)], record_flag="--record", timeout=timeout
    )
    if w.timed_out:
        print(f"{tag}: TIMEOUT after {timeout} s", file=sys.stderr)
        return {**spec, "tag": tag, "error": f"timeout after {timeout} s"}
    if w.record is None:
        print(f"{tag}: FAILED\n{w.stderr[-2000:]}", file=sys.stderr)
        return {**spec, "tag": tag, "error": w.stderr[-2000:]}
    r = w.record
    r["tag"] = tag
    r["load_average_at_start"] = load
    if r.get("subset"):  # one q and one k module measured: 72 q/o- and 72 k/v-shaped modules
        r["model_steady_s_scaled"] = 72 * r["steady_s"]
    show = {
        k: (round(v, 3) if isinstance(v, float) else v)
        for k, v in r.items()
        if k.endswith(("_s", "_mb", "scaled", "_adapters")) or k.startswith("peak")
    }
    print(tag, json.dumps(show), flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4 layers instead of 36")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/merging.json")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per case")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--record", help=argparse.SUPPRESS)  # with --case: write its record there
    ap.add_argument("--only", help="comma list of method:space to run")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    if args.case:
        rec = run_case(json.loads(args.case))
        if args.record:
            h.write_json(args.record, rec)
        else:
            print(json.dumps(rec))
        return
    results = []
    only = set(args.only.split(",")) if args.only else None
    for spec in cases(args):
        tag = _tag(spec)
        if only and tag not in only:
            continue
        results.append(run_isolated(spec, tag, args.timeout))
        code = h.code_info()
        doc = {  # machine: the fields this benchmark wrote before the harness, then the rest
            "machine": {"cpus": os.cpu_count(), "git_head": code["git_head"], **h.machine_info()},
            "code": code,
            "shapes": SHAPES,
            "tasks": M,
            "rank": R,
            "budget": BUDGET,
            "layers": 4 if args.quick else 36,
            "results": results,
        }
        h.write_json(args.out, doc)  # after every case: partial results survive a timeout


if __name__ == "__main__":
    main()
