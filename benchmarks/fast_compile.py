"""XLA:CPU compile options of the library's programs: first call, compile and steady time, with
the library's choice (``fast``) and with XLA's defaults for every program (``default``).

The library compiles its scoring and allocation programs on the CPU with LLVM at optimisation
level 0 (``_core.executables.FAST_COMPILE``: their run time is XLA's dots and LAPACK, which the
level does not touch), and its merge programs so only for a merge of at most
``_core.executables.SMALL_BYTES`` of factors (their elementwise loops do slow down). This
measures what that buys and costs, each case in a fresh interpreter (no compile cache):

* sets: ``smollm2`` (30 layers x q, o 576->576 and k, v 576->192, 3 tasks, r = 16 with one k
  at r = 24: three buckets, 34 MB, the shapes of the command line's small merge) and ``qwen3_4b`` (12
  layers x q 2560->4096, k, v 2560->1024, o 4096->2560, 6 tasks, r = 16: 90 MB, over
  ``SMALL_BYTES``, so its merges keep XLA's defaults under ``fast`` and only its scoring
  changes);
* stages: ``score`` (``nu.score``, alpha 1), ``ta:core``, ``ties:knots`` (density 0.2) and
  ``tsv:core`` (``nu.merge_adapters``, budget 16, scoring included);
* arms: ``fast`` (the library as it is) and ``default`` (every kernel's default jit).

Reported per case: the first call (trace, compile, run), the seconds XLA spent compiling
(JAX's ``backend_compile`` events), the programs compiled, and the steady median over
``--repeats`` calls.

Usage:
  python benchmarks/fast_compile.py [--sets smollm2,qwen3_4b] [--stages score,ta:core]
      [--repeats 3] [--out benchmarks/results/fast_compile.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# This checkout's library, not whichever one is installed (a second worktree measures its own code).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _harness as h
import numpy as np

SETS = {
    "smollm2": {
        "layers": 30,
        "tasks": 3,
        "shapes": {"q": (576, 576), "k": (576, 192), "v": (576, 192), "o": (576, 576)},
        "wide": ("l1.k", 24),  # one module at a larger rank: a third bucket
    },
    "qwen3_4b": {
        "layers": 12,
        "tasks": 6,
        "shapes": {"q": (2560, 4096), "k": (2560, 1024), "v": (2560, 1024), "o": (4096, 2560)},
        "wide": None,
    },
}
STAGES = {
    "score": None,
    "ta:core": {"method": "ta", "space": "core"},
    "ties:knots": {"method": "ties", "space": "knots", "density": 0.2},
    "tsv:core": {"method": "tsv", "space": "core"},
}


def make_set(name: str) -> list[dict]:
    """The set's adapters (numpy float32, seeded): ``lora_a`` at a LoRA init's scale, ``lora_b``
    trained-sized."""
    spec = SETS[name]
    rng = np.random.default_rng(0)
    out = []
    for _ in range(spec["tasks"]):
        ad = {}
        for layer in range(spec["layers"]):
            for kind, (d_in, d_out) in spec["shapes"].items():
                nm = f"l{layer}.{kind}"
                r = spec["wide"][1] if spec["wide"] and spec["wide"][0] == nm else 16
                a = rng.standard_normal((d_in, r), dtype=np.float32) / np.sqrt(d_in)
                b = rng.standard_normal((r, d_out), dtype=np.float32) / 50
                ad[nm] = {"lora_a": a, "lora_b": b, "scale": 2.0}
        out.append(ad)
    return out


def case(set_name: str, stage: str, arm: str, repeats: int) -> dict:
    """One case in this (fresh) interpreter."""
    from jax import monitoring

    import netutility_jax as nu
    from netutility_jax._core import executables as ex

    if arm == "default":  # every kernel's default jit (the benchmark's switch, not an option)
        ex.Kernel._jit = property(lambda self: self._default)
    compiles = {"s": 0.0, "n": 0}

    def on_event(name: str, secs: float, **_: object) -> None:
        if name.endswith("backend_compile_duration"):
            compiles["s"] += secs
            compiles["n"] += 1

    monitoring.register_event_duration_secs_listener(on_event)
    ads = make_set(set_name)
    opts = STAGES[stage]
    if opts is None:

        def fn():
            return nu.score(ads, alpha=1.0).lam
    else:

        def fn():
            return nu.merge_adapters(ads, budget=16, alpha=1.0, **opts)[0]

    m = h.measure(fn, repeats=repeats)
    first_compile = dict(compiles)
    return {
        "set": set_name,
        "stage": stage,
        "arm": arm,
        "factor_mb": h.adapter_bytes(ads) / 2**20,
        "small_merge": h.adapter_bytes(ads) <= ex.SMALL_BYTES,
        "first_call_s": m.main.first_s,
        "compile_s": first_compile["s"],
        "programs_compiled": first_compile["n"],
        "steady_median_s": m.main.median_s,
        "steady_all_s": m.main.all_s,
        "recompiled_on_steady_call": compiles["n"] - first_compile["n"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="smollm2,qwen3_4b")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--arms", default="fast,default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default="benchmarks/results/fast_compile.json")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # set:stage:arm (worker)
    ap.add_argument("--record", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case:
        parts = args.case.split(":")
        set_name, stage, arm = parts[0], ":".join(parts[1:-1]), parts[-1]
        rec = case(set_name, stage, arm, args.repeats)
        h.write_json(args.record, rec)
        return 0
    cases = []
    payload = {
        "benchmark": "fast_compile",
        "command": "python benchmarks/fast_compile.py " + " ".join(argv or sys.argv[1:]),
        "cases": cases,
        "machine": h.machine_info(),
        "code": h.code_info(),
    }
    t0 = time.perf_counter()
    for set_name in args.sets.split(","):
        for stage in args.stages.split(","):
            for arm in args.arms.split(","):
                res = h.run_worker(
                    __file__,
                    ["--case", f"{set_name}:{stage}:{arm}", "--repeats", str(args.repeats)],
                    record_flag="--record",
                    timeout=args.timeout,
                )
                rec = res.record or {
                    "set": set_name,
                    "stage": stage,
                    "arm": arm,
                    "error": "timed out" if res.timed_out else res.stderr[-2000:],
                }
                cases.append(rec)
                print(json.dumps({k: v for k, v in rec.items() if k != "steady_all_s"}), flush=True)
                payload["seconds"] = time.perf_counter() - t0
                payload["machine"]["load_avg_end"] = h.load_average()
                h.write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
