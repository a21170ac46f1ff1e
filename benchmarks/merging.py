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

Usage:
  python benchmarks/merging.py [--quick] [--out benchmarks/results/merging.json] [--repeat 3]
      [--only tsv:full,ta:core] [--timeout 900]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

SHAPES = {"q": (2560, 4096), "k": (2560, 1024), "v": (2560, 1024), "o": (4096, 2560)}
M, R, BUDGET = 6, 16, 16

LOW_RANK = [("ta", {}), ("tsv", {}), ("iso_c", {}), ("tsv", {"isotropize": True}), ("iso_cts", {})]
ELEMENTWISE = [
    ("ties", {"density": 0.2}),
    ("ties", {"density": 0.2, "scope": "model"}),
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


def adapter_bytes(ads) -> int:
    return sum(m["lora_a"].nbytes + m["lora_b"].nbytes for ad in ads for m in ad.values())


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trim_heap() -> None:
    """Return freed heap memory to the OS (glibc), so that RSS counts live memory only."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _block(tree):
    import jax

    for x in jax.tree.leaves(tree):
        if hasattr(x, "block_until_ready"):
            x.block_until_ready()


def _timed(fn, repeat: int, floor=None) -> dict:
    """First call, then ``repeat`` steady calls; ``floor`` (irreducible work) interleaved."""
    t0 = time.perf_counter()
    _block(fn())
    first = time.perf_counter() - t0
    if floor is not None:
        _block(floor())  # compile it outside the timings
    times, floors = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        _block(fn())
        times.append(time.perf_counter() - t0)
        if floor is not None:
            t0 = time.perf_counter()
            _block(floor())
            floors.append(time.perf_counter() - t0)
    steady = float(np.median(times))
    out = {
        "first_s": first,
        "steady_s": steady,
        "compile_s": max(first - steady, 0.0),
        "steady_all_s": times,
    }
    if floors:
        out["irreducible_s"] = float(np.median(floors))
        out["steady_over_irreducible"] = steady / out["irreducible_s"]
    return out


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


def run_case(spec: dict) -> dict:
    import jax
    import jax.numpy as jnp

    import netutility_jax as nu

    layers = spec["layers"]
    kind = spec["kind"]
    out = {**spec}
    if kind == "merge":
        ads = make_adapters(layers)
        ads = [
            {k: {kk: jnp.asarray(vv) for kk, vv in m.items()} for k, m in ad.items()} for ad in ads
        ]
        size = adapter_bytes(ads)
        method, space, opts = spec["method"], spec["space"], spec["options"]
        scope = "local" if method in ("ties", "dare", "dare_ties") else "global"
        t0 = time.perf_counter()
        masks = nu.allocate(nu.score(ads), BUDGET, scope=scope)
        _block(masks)
        out["score_allocate_s"] = time.perf_counter() - t0
        sub = spec.get("subset")
        if sub:  # dense full-space methods: a few modules, scaled by module count
            names = [
                n for n in ads[0] if any(n.endswith(f"{m}_proj") for m in sub) and ".layers.0." in n
            ]
            ads = [{n: ad[n] for n in names} for ad in ads]
            masks = {n: masks[n] for n in names}
        key = jax.random.key(0)
        base = _rss_kb("VmRSS")
        reset = _reset_peak()

        def call():
            return nu.merge(ads, masks, method=method, space=space, key=key, **opts)

        floor = None if sub else _irreducible(ads)
        out.update(_timed(call, spec["repeat"], floor))
        del floor
        peak_all = _rss_kb("VmHWM")
        _trim_heap()
        base_steady = _rss_kb("VmRSS")
        if _reset_peak():
            res = call()
            _block(res)
            inc = (_rss_kb("VmHWM") - base_steady) / 1024
            out["steady_peak_increase_mb"] = inc
            out["steady_increase_over_adapters"] = inc * 2**20 / size
        else:
            res = call()
        ranks = [m["lora_a"].shape[1] for m in res.values() if "lora_a" in m]
        out["mean_rank"] = float(np.mean(ranks)) if ranks else None
        out["dense_modules"] = sum("delta" in m for m in res.values())
    else:  # dense baseline: one module per distinct shape, reference route
        size = None
        out.update(dense_baseline(spec))
        base = _rss_kb("VmRSS")
        reset = False
    peak = _rss_kb("VmHWM")
    if kind == "merge":  # the larger of the two windows (timed calls, then one steady call)
        peak = max(peak, peak_all)
    out["rss_before_mb"] = base / 1024
    out["peak_rss_mb"] = peak / 1024
    out["peak_increase_mb"] = (peak - base) / 1024 if reset else None
    if size:
        out["adapter_mb"] = size / 2**20
        out["peak_over_adapters"] = peak * 1024 / size
        out["increase_over_adapters"] = (peak - base) * 1024 / size if reset else None
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
            t = _timed(lambda fn=fn, a=a, b=b: fn(a, b), reps)
            res[f"{name}_{shape_key}_steady_s"] = t["steady_s"]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="4 layers instead of 36")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/merging.json")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per case")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma list of method:space to run")
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return
    results = []
    only = set(args.only.split(",")) if args.only else None
    for spec in cases(args):
        tag = f"{spec.get('method', spec['kind'])}:{spec.get('space', '-')}"
        if spec.get("options", {}).get("isotropize"):
            tag += "+iso"
        if spec.get("options", {}).get("scope") == "model":
            tag += "+model"
        if only and tag not in only:
            continue
        load = os.getloadavg()
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--case", json.dumps(spec)],
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
        except subprocess.TimeoutExpired:
            print(f"{tag}: TIMEOUT after {args.timeout} s", file=sys.stderr)
            results.append({**spec, "tag": tag, "error": f"timeout after {args.timeout} s"})
            continue
        if proc.returncode != 0:
            print(f"{tag}: FAILED\n{proc.stderr[-2000:]}", file=sys.stderr)
            results.append({**spec, "error": proc.stderr[-2000:]})
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["tag"] = tag
        r["load_average_at_start"] = load
        if r.get("subset"):  # one q and one k module measured: 72 q/o- and 72 k/v-shaped modules
            r["model_steady_s_scaled"] = 72 * r["steady_s"]
        results.append(r)
        show = {
            k: (round(v, 3) if isinstance(v, float) else v)
            for k, v in r.items()
            if k.endswith(("_s", "_mb", "scaled", "_adapters")) or k.startswith("peak")
        }
        print(tag, json.dumps(show), flush=True)
        doc = {
            "machine": _machine(),
            "shapes": SHAPES,
            "tasks": M,
            "rank": R,
            "budget": BUDGET,
            "layers": 4 if args.quick else 36,
            "results": results,
        }
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:  # after every case: partial results survive a timeout
            json.dump(doc, f, indent=1)
        os.replace(tmp, args.out)


def _machine() -> dict:
    import platform

    import jax

    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        head = None
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "git_head": head,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


if __name__ == "__main__":
    main()
