"""Mesh benchmark: scoring and merging Qwen3-4B-shaped adapters with ``mesh=`` over D devices.

Case table: ``merging.py``'s (36 layers of q, k, v, o; M = 6 tasks, r = 16, budget R = 16,
net-utility masks). Each device count runs in its own interpreter with
``XLA_FLAGS=--xla_force_host_platform_device_count=D`` (it must be set before JAX starts). In it,
for each operation (``nu.score``; ``nu.merge_adapters`` TA in Core space, TSV in full space, TIES
in KnOTS space), the one-device call (``mesh=None``) and the mesh call (``mesh=nu.module_mesh()``,
every forced device) are timed interleaved (first call = trace + compile + run, then ``--repeat``
steady calls), with the irreducible work of the same run as a reference (per bucket, the Grams
of the task-stacked factors: one pass over every factor, ``merging.py``'s). The mesh result is
checked against the one-device result: masks and ranks equal, merged updates bit for bit.

On this CPU the "devices" share the machine's cores: D devices run D threads of the batched
LAPACK calls (one thread per device), which is where a speed-up can come from; on a GPU or TPU
host each device is a real accelerator.

Usage:
  python benchmarks/mesh.py [--devices 2] [--layers 36] [--repeat 3]
      [--out benchmarks/results/mesh.json] [--timeout 1800]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# This checkout's library, not whichever one is installed (a second worktree measures its own code).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h
import numpy as np

__all__ = ["OPS", "main", "run_case"]

OPS = {
    "score": None,
    "ta/core": ("ta", "core", {}),
    "tsv/full": ("tsv", "full", {}),
    "ties/knots": ("ties", "knots", {"density": 0.2}),
}


def _same(ref, out, rep_ref, rep_out) -> dict:
    import netutility_jax as nu

    return {
        "masks_equal": all(np.array_equal(rep_ref.masks[n], rep_out.masks[n]) for n in ref),
        "ranks_equal": rep_ref.ranks == rep_out.ranks,
        "bit_identical": all(
            np.array_equal(
                np.asarray(nu.module_update(ref[n])), np.asarray(nu.module_update(out[n]))
            )
            for n in ref
        ),
    }


def run_case(layers: int, repeat: int) -> dict:
    """In a child with D forced devices: every operation, one device vs the mesh."""
    import merging as mb

    import netutility_jax as nu

    ads = mb.make_adapters(layers)
    mesh = nu.module_mesh()
    record: dict = {"machine": h.machine_info(), "devices": mesh.size, "ops": {}}
    for name, op in OPS.items():
        if op is None:
            fns = {m: (lambda m=m: nu.score(ads, mesh=m).lam) for m in (None, mesh)}
        else:
            kw = {"budget": mb.BUDGET, "method": op[0], "space": op[1], **op[2]}
            fns = {
                m: (lambda m=m, kw=kw: nu.merge_adapters(ads, mesh=m, **kw)[0])
                for m in (None, mesh)
            }
        res = h.measure(
            fns[mesh],
            repeats=repeat,
            references=lambda fns=fns: {
                "one_device": fns[None],
                "irreducible": mb._irreducible(ads),
            },
        )
        entry = {
            "mesh": {"compile_s": res.main.compile_s, "median_s": res.main.median_s},
            "one_device": {
                "compile_s": res.refs["one_device"].compile_s,
                "median_s": res.refs["one_device"].median_s,
            },
            "irreducible_median_s": res.refs["irreducible"].median_s,
        }
        entry["speedup"] = entry["one_device"]["median_s"] / entry["mesh"]["median_s"]
        if op is not None:
            ref, rep_ref = nu.merge_adapters(ads, **kw)
            out, rep_out = nu.merge_adapters(ads, mesh=mesh, **kw)
            entry["check"] = _same(ref, out, rep_ref, rep_out)
        else:
            a, b = nu.score(ads), nu.score(ads, mesh=mesh)
            entry["check"] = {
                "lam_rel_diff": float(abs(a.lam - b.lam) / abs(a.lam)),
                "masks_equal": all(
                    np.array_equal(x, y)
                    for x, y in zip(
                        nu.allocate(a, mb.BUDGET).values(),
                        nu.allocate(b, mb.BUDGET).values(),
                        strict=True,
                    )
                ),
            }
        record["ops"][name] = entry
        print(f"D={mesh.size} {name}: {json.dumps(entry)}", file=sys.stderr, flush=True)
    return record


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", default="2", help="comma-separated device counts (default 2)")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/mesh.json")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--case", help=argparse.SUPPRESS)  # in a child: the device count
    ap.add_argument("--record", help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = _args()
    if args.case:
        rec = run_case(args.layers, args.repeat)
        h.write_json(args.record, rec)
        return
    payload = {"code": h.code_info(), "layers": args.layers, "runs": {}}
    for d in (int(x) for x in args.devices.split(",")):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={d}")
        env.setdefault("NETUTILITY_COMPILE_CACHE", "off")
        res = h.run_worker(
            __file__,
            ["--case", str(d), "--layers", str(args.layers), "--repeat", str(args.repeat)],
            record_flag="--record",
            env=env,
            timeout=args.timeout,
            echo=True,
        )
        payload["runs"][str(d)] = res.record or {"status": res.status, "stderr": res.stderr[-3000:]}
        h.write_json(args.out, payload)
    print(json.dumps({d: r.get("ops") for d, r in payload["runs"].items()}, indent=1))


if __name__ == "__main__":
    main()
