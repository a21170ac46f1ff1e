"""The engine's fixed costs, the proxies a CPU can measure for a GPU.

On a CPU the library's arithmetic hides what an accelerator pays for: programs compiled on a first
call, argument buffers and dispatches per call, host<->device transfers, host Python time. This
script measures those at tiny dimensions (so that arithmetic is negligible) and at two depths,
32 and 80 layers of the seven Llama module kinds (q, k, v, o, gate, up, down) x 8 tasks, r 16:

* ``score+allocate``: ``nu.allocate(nu.score(adapters), budget)``;
* ``merge``: ``nu.merge_adapters(adapters, budget=, method="ta", space="core")``;
* ``merge@METHOD-SPACE``: the same with another method and space (e.g. ``merge@tsv-core``,
  ``merge@ties-knots``; DARE with ``p=0.5`` and ``jax.random.key(0)``);
* ``merge_jit``: the same merge inside one ``jax.jit`` (``merge_jit@METHOD-SPACE`` as above);
* ``...:stacked``: the same stage given ``nu.stack_adapters(adapters)``, stacked once before.

Per case, each in a fresh interpreter with no compile cache (``run_worker``): programs compiled and
seconds of XLA compiling on the first call (``jax.monitoring``'s backend-compile events), the first
call's wall time, then over steady calls the median wall time, the time until the call returns
(host work: tracing-cache lookups, Python, transfers it waits on), and the counts of one steady
call: jitted dispatches, argument buffers handed to them, its host time (the call's wall time
less the time inside its programs, each waited for where it is dispatched; the median of
``--repeats`` counted calls) (for ``merge_jit``, also the traced
program's top-level jaxpr equations, a size no machine load changes), host->device placements
(``jax.device_put``, which the library's ``host_constant`` ends in, and its ``put_views``, plus
numpy arguments of a jitted call) and device->host reads (arrays first materialised on the host).

Counting dispatches and buffers needs JAX's Python dispatch path: after the steady calls, JAX's
dispatch and compile caches are cleared (``jax.clear_caches``; the library's own, such as its
placed constants, are kept, as they are in a steady call) and one more call is counted with
``pjit._get_fastpath_data`` patched (private) so that every dispatch goes through
``ExecuteReplicated``; the timings come from the unpatched steady calls. (Until the library kept
its small constants placed, the first call was the one counted: a steady call made the same
placements then.) Private hooks are used here only, never in the library or the tests.

    python benchmarks/fixed_cost.py                 # 32 and 80 layers, JSON to benchmarks/results/
    python benchmarks/fixed_cost.py --tiny          # 4 and 10 layers, M 3 (the slow test tier)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

import jax
import numpy as np

from benchmarks import _harness

KINDS = {  # Llama module kinds at tiny dims: (d_in, d_out)
    "q_proj": (64, 64),
    "k_proj": (64, 16),
    "v_proj": (64, 16),
    "o_proj": (64, 64),
    "gate_proj": (64, 128),
    "up_proj": (64, 128),
    "down_proj": (128, 64),
}
COMPILE = "/jax/core/compile/backend_compile_duration"


def make_adapters(layers: int, tasks: int, rank: int, seed: int = 0) -> list[dict]:
    """``tasks`` adapters of ``layers`` x the seven kinds, as jax arrays on the device."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(tasks):
        ad = {}
        for i in range(layers):
            for kind, (d_in, d_out) in KINDS.items():
                ad[f"model.layers.{i}.{kind}"] = {
                    "lora_a": rng.normal(size=(d_in, rank)).astype(np.float32) / np.sqrt(d_in),
                    "lora_b": rng.normal(size=(rank, d_out)).astype(np.float32) / np.sqrt(rank),
                    "scale": 2.0,
                }
        out.append(jax.device_put(ad))
    return out


class Counts:
    """Dispatches, argument buffers, placements and reads inside a ``with`` block."""

    def __init__(self):
        self.dispatches = self.buffers = self.h2d = self.d2h = 0
        self.run_s = 0.0  # inside the programs (each waited for where it is dispatched)

    @contextlib.contextmanager
    def counting(self):
        from jax._src import array as array_mod
        from jax._src import pjit
        from jax._src.interpreters import pxla

        import netutility_jax._core.host as host_mod

        saved = []

        def patch(obj, name, new):
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, new)

        counts = self
        exe_call = pxla.ExecuteReplicated.__call__

        def execute(self_, *args):
            counts.dispatches += 1
            counts.buffers += len(args)
            t0 = time.perf_counter()
            out = exe_call(self_, *args)
            jax.block_until_ready(out)
            counts.run_s += time.perf_counter() - t0
            return out

        patch(pjit, "_get_fastpath_data", lambda *a, **k: None)
        patch(pxla.ExecuteReplicated, "__call__", execute)
        shard = pxla.shard_args

        def shard_args(shardings, layouts, copy, args, *a, **k):
            counts.h2d += sum(not isinstance(x, jax.Array) for x in args)
            return shard(shardings, layouts, copy, args, *a, **k)

        patch(pxla, "shard_args", shard_args)
        put = jax.device_put

        def device_put(x, *a, **k):
            out = put(x, *a, **k)
            # host values only (a device array's copy on its device, or a value inside a trace,
            # which becomes part of the program, crosses nothing)
            counts.h2d += sum(not isinstance(v, jax.Array) for v in jax.tree.leaves(x))
            return out

        patch(jax, "device_put", device_put)
        import sys as _sys

        for name in ("put_views",):  # (host_constant's placements: jax.device_put, above)
            orig = getattr(host_mod, name)

            def wrapped(x, *a, _fn=orig, **k):
                counts.h2d += len(x)
                return _fn(x, *a, **k)

            # every module that imported it by name
            for mod in list(_sys.modules.values()):
                if getattr(mod, "__name__", "").startswith("netutility_jax") and (
                    getattr(mod, name, None) is orig
                ):
                    patch(mod, name, wrapped)
        value = array_mod.ArrayImpl._value

        def _value(self_):
            if self_._npy_value is None:
                counts.d2h += 1
            return value.fget(self_)

        patch(array_mod.ArrayImpl, "_value", property(_value))
        try:
            yield self
        finally:
            for obj, name, old in reversed(saved):
                setattr(obj, name, old)


def _ready(x):
    """Block on ``x``'s device arrays. nu.allocate's masks are held on the host until a module's
    mask is read (MaskTable): reading them here would time placements no pipeline makes."""
    from netutility_jax._core.tables import MaskTable

    if isinstance(x, MaskTable):
        return x.host_dict()
    return jax.block_until_ready(x)


def _compile_events():
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda ev, secs, **kw: events.append(secs) if ev == COMPILE else None
    )
    return events


def run_case(stage: str, layers: int, tasks: int, rank: int, repeats: int) -> dict:
    """One stage at one depth, in this (fresh) interpreter."""
    import netutility_jax as nu

    adapters = make_adapters(layers, tasks, rank)
    budget = rank
    name = stage
    stage, _, form = stage.partition(":")
    if form == "stacked":  # stacked once where the adapters enter (not timed)
        adapters = jax.block_until_ready(nu.stack_adapters(adapters))
    elif form:
        raise SystemExit(f"unknown input form {form!r}")
    stage, _, how = stage.partition("@")  # merge@METHOD-SPACE (default ta-core)
    method, _, space = (how or "ta-core").partition("-")
    opts = {"p": 0.5} if method.startswith("dare") else {}
    key = jax.random.key(0) if method.startswith("dare") else None
    equations = None
    if stage == "score+allocate":
        fn = lambda: nu.allocate(nu.score(adapters), budget)
    elif stage == "merge":
        fn = lambda: nu.merge_adapters(
            adapters, budget=budget, method=method, space=space or "core", key=key, **opts
        )[0]
    elif stage == "merge_jit":
        def merged(ads):
            return nu.merge_adapters(
                ads, budget=budget, method=method, space=space or "core", key=key, **opts
            )[0]

        jitted = jax.jit(merged)
        fn = lambda: jitted(adapters)
        # the traced program's size, which a machine's load does not change (top-level
        # equations of the jaxpr; XLA's compile time follows it)
        equations = len(jax.make_jaxpr(merged)(adapters).jaxpr.eqns)
    else:
        raise SystemExit(f"unknown stage {stage!r}")
    events = _compile_events()
    t0 = time.perf_counter()
    try:
        _ready(fn())
    except Exception as e:  # e.g. a merge that cannot be traced: recorded, not hidden
        return {"stage": name, "layers": layers, "error": f"{type(e).__name__}: {e}"[:400]}
    first = time.perf_counter() - t0
    programs, compile_s = len(events), sum(events)
    n_before = len(events)  # (programs compiled by any later call: a retrace the first missed)
    for _ in range(2):
        _ready(fn())
    walls, returns = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        _ready(out)
        walls.append(time.perf_counter() - t0)
        returns.append(t1 - t0)
    recompiled = len(events) - n_before
    # One more call on JAX's Python dispatch path (its caches cleared, so that no C++ fast path
    # hides a dispatch; the library's own caches kept, as in any steady call): the counting
    # hooks see every dispatch, placement and read of a steady call, compiling aside; its time
    # outside the programs (each waited for where it is dispatched) is the host's work
    # (Python, checks, transfers' set-up) on this dispatch path, a little above the C++ one's.
    jax.clear_caches()
    with Counts().counting():  # (compiled again, on the Python path: not counted)
        _ready(fn())
    hosts = []  # (the counts of every counted call are the same; the host time is noisy)
    for _ in range(repeats):
        counts = Counts()
        with counts.counting():
            t0 = time.perf_counter()
            _ready(fn())
            hosts.append(time.perf_counter() - t0 - counts.run_s)  # outside the programs
    host = statistics.median(hosts)
    n_modules = layers * len(KINDS)
    return {
        "stage": name,
        "layers": layers,
        "modules": n_modules,
        "tasks": tasks,
        "rank": rank,
        "buckets": len(set(KINDS.values())),
        "first_call_s": first,
        "programs_compiled": programs,
        "compile_s": compile_s,
        "steady_median_s": statistics.median(walls),
        "steady_min_s": min(walls),
        "returns_after_median_s": statistics.median(returns),
        "dispatches": counts.dispatches,
        "argument_buffers": counts.buffers,
        "host_to_device": counts.h2d,
        "device_to_host": counts.d2h,
        "recompiled_on_steady_call": recompiled,
        "host_s": host,
        **({} if equations is None else {"jaxpr_equations": equations}),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="4 and 10 layers, 3 tasks (a quick check)")
    p.add_argument(
        "--stages",
        default="score+allocate,score+allocate:stacked,merge,merge:stacked,merge_jit,merge_jit:stacked",
        help="stages (':stacked': the adapters given as nu.stack_adapters' set)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--depths", default=None, help="layers to run, e.g. 32,80 (default by --tiny)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument(
        "--case", nargs=4, metavar=("STAGE", "LAYERS", "TASKS", "RANK"), help=argparse.SUPPRESS
    )
    p.add_argument("--record", help=argparse.SUPPRESS)
    p.add_argument(
        "--equations-only",
        action="store_true",
        help="only the merge_jit stages' traced program size (jaxpr equations; nothing compiled, "
        "so no machine load changes it)",
    )
    a = p.parse_args(argv)
    if a.equations_only:
        return _equations(a, argv)
    if a.case:  # a worker: one case, its record to --record
        stage, layers, tasks, rank = a.case
        rec = run_case(stage, int(layers), int(tasks), int(rank), a.repeats)
        _harness.write_json(a.record, rec)
        return 0
    depths, tasks = ((4, 10), 3) if a.tiny else ((32, 80), 8)
    if a.depths:
        depths = tuple(int(x) for x in a.depths.split(","))
    out = a.out or str(
        Path(__file__).parent
        / "results"
        / ("fixed_cost_tiny.json" if a.tiny else "fixed_cost.json")
    )
    records = []
    for stage in a.stages.split(","):
        for layers in depths:
            res = _harness.run_worker(
                __file__,
                ["--repeats", str(a.repeats), "--case", stage, str(layers), str(tasks), "16"],
                record_flag="--record",
                timeout=a.timeout,
            )
            rec = res.record or {
                "stage": stage, "layers": layers, "error": f"exit {res.status}: {res.stderr[-400:]}",
            }  # fmt: skip
            records.append(rec)
            print(_line(rec), flush=True)
    growth = {}
    for stage in a.stages.split(","):
        r = [x for x in records if x["stage"] == stage and "error" not in x]
        if len(r) == 2 and r[0]["compile_s"] > 0:
            growth[stage] = {
                "compile_s": r[1]["compile_s"] / r[0]["compile_s"],
                "argument_buffers": r[1]["argument_buffers"] / max(1, r[0]["argument_buffers"]),
            }
    payload = {
        "benchmark": "fixed_cost",
        "command": " ".join(["python", "benchmarks/fixed_cost.py", *(argv or sys.argv[1:])]),
        "cases": records,
        "growth_deep_over_shallow": growth,
        "machine": _harness.machine_info(),
        "code": _harness.code_info(),
    }
    _harness.write_json(out, payload)
    print(f"wrote {out}")
    return 0


def _equations(a: argparse.Namespace, argv) -> int:
    """``--equations-only``: each ``merge_jit`` stage's top-level jaxpr equations at each depth,
    traced in this process (no compile), to ``--out``."""
    import netutility_jax as nu

    depths, tasks = ((4, 10), 3) if a.tiny else ((32, 80), 8)
    if a.depths:
        depths = tuple(int(x) for x in a.depths.split(","))
    stages = [s for s in a.stages.split(",") if s.partition(":")[0].partition("@")[0] == "merge_jit"]
    records = []
    for stage in stages:
        for layers in depths:
            base, _, variant = stage.partition(":")
            method, _, space = (base.partition("@")[2] or "ta-core").partition("-")
            adapters = make_adapters(layers, tasks, 16)
            if variant == "stacked":
                adapters = nu.stack_adapters(adapters)

            def merged(ads, method=method, space=space):
                return nu.merge_adapters(ads, budget=16, method=method, space=space or "core")[0]

            n = len(jax.make_jaxpr(merged)(adapters).jaxpr.eqns)
            records.append({"stage": stage, "layers": layers, "tasks": tasks,
                            "modules": layers * len(KINDS), "jaxpr_equations": n})  # fmt: skip
            print(f"{stage:>22} L={layers:<3} equations {n}", flush=True)
    out = a.out or str(Path(__file__).parent / "results" / "fixed_cost_equations.json")
    _harness.write_json(out, {
        "benchmark": "fixed_cost --equations-only",
        "command": " ".join(["python", "benchmarks/fixed_cost.py", *(argv or sys.argv[1:])]),
        "cases": records,
        "machine": _harness.machine_info(),
        "code": _harness.code_info(),
    })  # fmt: skip
    print(f"wrote {out}")
    return 0


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['stage']:>15} L={r['layers']:<3} error: {r['error']}"
    return (
        f"{r['stage']:>15} L={r['layers']:<3} programs {r['programs_compiled']:>3} "
        f"compile {r['compile_s']:6.2f}s first {r['first_call_s']:6.2f}s "
        f"steady {1e3 * r['steady_median_s']:8.1f}ms returns {1e3 * r['returns_after_median_s']:7.1f}ms "
        f"dispatches {r['dispatches']:>4} buffers {r['argument_buffers']:>5} "
        f"h2d {r['host_to_device']:>5} d2h {r['device_to_host']:>4} "
        f"host {1e3 * r['host_s']:5.1f}ms"
    )


if __name__ == "__main__":
    raise SystemExit(main())
