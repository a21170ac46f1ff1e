"""Distributed benchmark: ``netutility merge --distributed`` with P processes on this machine.

A synthetic set of PEFT folders is written with ``scale.py``'s writer (Llama-3-8B shapes: q, k,
v, o, gate, up, down; r = 16, float32; ``--layers`` x ``--tasks``). Then, for each process count
P (``--processes``, default ``1,2``), the merge (TA in Core space, budget 16, no plots) runs as P
processes on localhost, all started at once: P = 1 is a plain ``netutility merge``, P > 1 adds
``--distributed --coordinator localhost:PORT --num-processes P --process-id I``. Reported per P:
the wall time from the first start to the last exit, each process's peak RSS and CPU time
(``os.wait4``), and a SHA-256 of the written ``adapter_model.safetensors`` and
``adapter_config.json`` (the distributed outputs must equal the one-process output byte for
byte). The floor is ``scale.py``'s: every file read once, tensor by tensor, in the same run.

This machine has 2 cores, so P processes share them; on a cluster each process has its own host.
Every process opens every header and holds the per-direction statistics of the whole model;
process 0 also receives and writes the merged adapter.

Usage:
  python benchmarks/distributed.py [--layers 8] [--tasks 8] [--processes 1,2]
      [--data DIR] [--timeout 3600] [--out benchmarks/results/distributed.json]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

# This checkout's library, not whichever one is installed (a second worktree measures its own code).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness as h
import scale

__all__ = ["main", "run_processes"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def run_processes(paths: list[str], out: str, count: int, timeout: float) -> dict:
    """One merge as ``count`` processes started together; their wall time, peak RSS and CPU."""
    argv = [sys.executable, "-m", "netutility_jax.cli", "merge", *paths, "--budget", "16"]
    argv += ["--space", "core", "--no-plots", "--quiet", "--out", out]
    port = _free_port()
    env = {**os.environ, "NETUTILITY_COMPILE_CACHE": "off"}
    t0 = time.perf_counter()
    procs = []
    for i in range(count):
        extra = []
        if count > 1:
            extra = ["--distributed", "--coordinator", f"localhost:{port}"]
            extra += ["--num-processes", str(count), "--process-id", str(i)]
        procs.append(subprocess.Popen([*argv, *extra], env=env))
    deadline = t0 + timeout
    rows = []
    for p in procs:
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                for q in procs:
                    q.kill()
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status)
        rows.append(
            {
                "status": p.returncode,
                "end_s": time.perf_counter() - t0,
                "peak_rss_mb": usage.ru_maxrss / 1024,
                "cpu_s": usage.ru_utime + usage.ru_stime,
            }
        )
    result = {"processes": count, "wall_s": max(r["end_s"] for r in rows), "per_process": rows}
    if all(r["status"] == 0 for r in rows):
        result["adapter_sha256"] = _sha(os.path.join(out, "adapter_model.safetensors"))
        result["config_sha256"] = _sha(os.path.join(out, "adapter_config.json"))
    return result


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--processes", default="1,2")
    ap.add_argument("--data", default=None, help="keep the adapters here (reused if they match)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default="benchmarks/results/distributed.json")
    return ap.parse_args()


def main() -> None:
    args = _args()
    spec = {
        "layers": args.layers,
        "tasks": args.tasks,
        "rank": args.rank,
        "dtype": "float32",
        "shapes": scale.SHAPES,
        "seed": 0,
    }
    data = args.data or tempfile.mkdtemp(prefix="nu-distributed-")
    os.makedirs(data, exist_ok=True)
    payload: dict = {"machine": h.machine_info(), "code": h.code_info(), "set": spec, "runs": []}
    try:
        paths = scale.write_adapters(data, spec)
        payload["floor"] = scale._floor(paths)
        payload["set_bytes"] = payload["floor"]["bytes"]
        for count in (int(x) for x in args.processes.split(",")):
            out = os.path.join(data, f"merged-{count}")
            shutil.rmtree(out, ignore_errors=True)
            run = run_processes(paths, out, count, args.timeout)
            run["over_floor"] = run["wall_s"] / payload["floor"]["read_s"]
            payload["runs"].append(run)
            print(f"distributed: P={count} {run}", file=sys.stderr, flush=True)
            h.write_json(args.out, payload)
        shas = {r.get("adapter_sha256") for r in payload["runs"]}
        payload["outputs_identical"] = len(shas) == 1 and None not in shas
        h.write_json(args.out, payload)
    finally:
        if args.data is None:
            shutil.rmtree(data, ignore_errors=True)
    print(f"distributed: outputs identical: {payload.get('outputs_identical')}")


if __name__ == "__main__":
    main()
