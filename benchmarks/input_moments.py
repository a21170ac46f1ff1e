"""Cost of the data-aware score: ``nu.score(..., input_moments=...)`` against the data-free one.

For each case of ``scoring.CASES`` (model shapes x tasks x rank) and each number of samples ``n``,
this builds random adapters and random activations ``(n, d_in)`` per task and module, turns them
into moments with ``input_moments`` (timed: a host-side Cholesky when ``n > 2 d_in``), and times
``nu.score`` with and without them (first call, which compiles, and the steady-state median over
repeats, every output blocked on). The data-aware work added is one product ``(F a)^T (F a)``
per task-module, ``O(min(n, 2 d_in) d_in r)``, and an ``O(M^2 r^3)`` interference per module.

Usage::

    python benchmarks/input_moments.py [--cases vit] [--samples 64,256] [--repeats 5] [--out x.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _harness as h
import jax
import numpy as np
import scoring

import netutility_jax as nu
from netutility_jax.scoring.moments import input_moments

__all__ = ["main", "run_case"]

_DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "input_moments.json"
)


def _timed(fn, repeats: int) -> tuple[float, float]:
    """(first call s, steady median s)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def run_case(case: scoring.Case, samples: list[int], repeats: int) -> dict:
    ads = scoring.make_adapters(case)
    rng = np.random.default_rng(0)
    free_first, free_steady = _timed(lambda: nu.score(ads), repeats)
    out = {
        "case": case.name,
        "title": case.title,
        "modules": len(case.module_names()),
        "tasks": case.tasks,
        "rank": case.rank,
        "data_free_first_s": free_first,
        "data_free_steady_s": free_steady,
        "data_aware": [],
    }
    for n in samples:
        mom, moments_s = [], 0.0
        for _ in range(case.tasks):
            acts = {
                name: rng.normal(size=(n, case.shape_of(name)[0])).astype(np.float32)
                for name in case.module_names()
            }
            t0 = time.perf_counter()
            mom.append(input_moments(acts))
            moments_s += time.perf_counter() - t0
        first, steady = _timed(lambda mom=mom: nu.score(ads, input_moments=mom), repeats)
        out["data_aware"].append(
            {
                "samples": n,
                "input_moments_s": moments_s,
                "first_s": first,
                "steady_s": steady,
                "steady_over_data_free": steady / free_steady,
            }
        )
        print(
            f"[{case.name}] n={n}: input_moments {moments_s:.2f} s; score first {first:.2f} s, "
            f"steady {steady:.4f} s (data-free {free_steady:.4f} s, x{steady / free_steady:.2f})",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="vit", help="comma-separated subset of vit,qwen,large")
    p.add_argument("--samples", default="64,256", help="comma-separated numbers of samples n")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions (default 5)")
    p.add_argument("--out", default=_DEFAULT_OUT, help="JSON output path")
    args = p.parse_args(argv)
    samples = [int(x) for x in args.samples.split(",")]
    cases = [run_case(scoring.CASES[c], samples, args.repeats) for c in args.cases.split(",")]
    payload = {
        "benchmark": "input_moments",
        "machine": h.machine_info(),
        "code": h.code_info(),
        "argv": sys.argv[1:] if argv is None else argv,
        "cases": cases,
    }
    h.write_json(args.out, payload)
    print(f"wrote {args.out}")
    return payload


if __name__ == "__main__":
    main()
