"""Scale benchmark: merging PEFT folders from disk, in memory against streamed (issue 14).

A synthetic set of PEFT adapter folders is written (default: Llama-3-8B-shaped, 32 layers of
q 4096->4096, k, v 4096->1024, o 4096->4096, gate, up 4096->14336, down 14336->4096; r = 16,
float32, 16 tasks: about 2.7 GB of factors), then each case runs in a fresh interpreter:

* ``floor``: every file read once with ``safe_open``, tensor by tensor (nothing kept): the
  irreducible I/O of any merge;
* ``compute_floor``: every chunk read once as the streamed merge reads it, plus the Grams of
  each module's task-stacked factors (one pass of arithmetic over every factor): the irreducible
  compute of any factored merge, compiles included (one per chunk shape);
* ``in_memory``: ``nu.peft.load_adapters`` + ``nu.merge_adapters`` (TA in core space);
* ``stream_ta``, ``stream_tsv``: ``nu.peft.open_adapters`` + ``merge_adapters_streaming`` (TA and
  TSV in core space, ``--chunk-mb`` per chunk);
* ``cli_ties_knots``, ``cli_dare_ties_knots``, ``cli_ta_core``, ``cli_tsv_core``: ``netutility
  merge`` with TIES (density 0.2) or DARE-TIES (p 0.5, seed 0) in KnOTS space, TA or TSV in Core
  space (streamed, ``--chunk-mb``, no compilation cache, each chunk's merged modules written as
  they come), output written and its size recorded.

Reported per case: wall time of the child process and its peak RSS from ``os.wait4`` (the
kernel's ``ru_maxrss`` of the child, whatever it allocated), plus the child's own timings (open or
load, merge) and, for the merges, ``lam``, ``budget_spent``, the total merged rank and a digest of
the masks, so that the in-memory and streamed TA merges can be compared at full size. The files
are in the page cache after being written (the times are not disk-bound); the peak RSS of the
floor includes the file pages mapped while they are read.

Timing, machine and code info and the JSON writer come from ``_harness.py``.

Usage:
  python benchmarks/scale.py [--model llama3-8b|llama3-70b] [--layers 32] [--tasks 16] [--rank 16] [--dtype float32]
      [--budget 16] [--chunk-mb 64] [--data DIR] [--only floor,in_memory,stream_ta,stream_tsv]
      [--timeout 7200] [--out benchmarks/results/scale.json] [--keep-out DIR]

A quick check: ``python benchmarks/scale.py --layers 2 --tasks 4``. ``--data DIR`` keeps the
folders there and reuses them when they match the flags; by default they go to a temporary
folder, removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

# This checkout's library, not whichever one is installed (a second worktree measures its own code).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _harness as h
import numpy as np

__all__ = ["CASES", "MODELS", "SHAPES", "main", "run_case", "spawn", "write_adapters"]

MODELS = {  # module -> (d_in, d_out)
    "llama3-8b": {
        "self_attn.q_proj": (4096, 4096),
        "self_attn.k_proj": (4096, 1024),
        "self_attn.v_proj": (4096, 1024),
        "self_attn.o_proj": (4096, 4096),
        "mlp.gate_proj": (4096, 14336),
        "mlp.up_proj": (4096, 14336),
        "mlp.down_proj": (14336, 4096),
    },
    "llama3-70b": {  # hidden 8192, 8 key/value heads of 128, MLP 28672 (80 layers)
        "self_attn.q_proj": (8192, 8192),
        "self_attn.k_proj": (8192, 1024),
        "self_attn.v_proj": (8192, 1024),
        "self_attn.o_proj": (8192, 8192),
        "mlp.gate_proj": (8192, 28672),
        "mlp.up_proj": (8192, 28672),
        "mlp.down_proj": (28672, 8192),
    },
}
SHAPES = MODELS["llama3-8b"]
CASES = (
    "floor", "compute_floor", "in_memory", "stream_ta", "stream_tsv", "cli_ties_knots",
    "cli_dare_ties_knots", "cli_ta_core", "cli_tsv_core",
)  # fmt: skip


# ----------------------------------------------------------------------------- data


def _manifest(args) -> dict:
    spec = {
        "layers": args.layers,
        "tasks": args.tasks,
        "rank": args.rank,
        "dtype": args.dtype,
        "shapes": MODELS[args.model],
        "seed": 0,
    }
    if args.model != "llama3-8b":  # (manifests written before --model existed stay valid)
        spec["model"] = args.model
    return spec


def write_adapters(folder: str, spec: dict) -> list[str]:
    """PEFT folders ``task0 .. task{M-1}`` in ``folder`` (reused if its manifest matches):
    random factors with a decaying spectrum, ``lora_alpha = 2 r``; returns their paths."""
    import safetensors.numpy
    from ml_dtypes import bfloat16

    from netutility_jax import peft

    paths = [os.path.join(folder, f"task{i}") for i in range(spec["tasks"])]
    manifest = os.path.join(folder, "manifest.json")
    if os.path.exists(manifest):
        with open(manifest) as f:
            if json.load(f) == json.loads(json.dumps(spec)):
                return paths
    r = spec["rank"]
    store = {"float32": np.float32, "bfloat16": bfloat16, "float16": np.float16}[spec["dtype"]]
    decay = (0.85 ** np.arange(r)).astype(np.float32)
    for i, p in enumerate(paths):
        rng = np.random.default_rng([spec["seed"], i])
        tensors = {}
        for layer in range(spec["layers"]):
            for mod, (d_in, d_out) in spec["shapes"].items():
                key = f"{peft.PREFIX}model.layers.{layer}.{mod}"
                a = rng.standard_normal((r, d_in), dtype=np.float32) / np.sqrt(d_in)
                b = rng.standard_normal((d_out, r), dtype=np.float32) * (0.01 * decay)
                tensors[f"{key}.lora_A.weight"] = a.astype(store)
                tensors[f"{key}.lora_B.weight"] = b.astype(store)
        os.makedirs(p, exist_ok=True)
        safetensors.numpy.save_file(tensors, os.path.join(p, peft.WEIGHTS_NAME))
        del tensors
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": f"synthetic/{spec.get('model', 'llama3-8b')}",
            "r": r,
            "lora_alpha": 2 * r,
            "target_modules": sorted({m.split(".")[-1] for m in spec["shapes"]}),
        }
        with open(os.path.join(p, peft.CONFIG_NAME), "w") as f:
            json.dump(config, f)
        print(f"scale: wrote {p}", file=sys.stderr, flush=True)
    h.write_json(manifest, spec)
    return paths


# ----------------------------------------------------------------------------- cases


def _floor(paths: list[str]) -> dict:
    import safetensors

    from netutility_jax import peft

    n = 0
    sw = h.Stopwatch()
    for p in paths:
        with safetensors.safe_open(os.path.join(p, peft.WEIGHTS_NAME), framework="numpy") as fh:
            for k in fh.keys():
                n += fh.get_tensor(k).nbytes
    sw.lap(None)
    return {"read_s": sw.total, "bytes": n}


def _compute_floor(paths: list[str], chunk_bytes: int) -> dict:
    """The irreducible work of any factored merge, streamed as the merge streams: every chunk
    read once (``AdapterSet.read``) and, per module, the Grams of the task-stacked factors
    ``[a_1 .. a_M]`` and ``[b_1; ..; b_M]`` (one pass over every factor; ``merging.py``'s
    reference), jitted once per chunk shape."""
    import jax
    import jax.numpy as jnp

    from netutility_jax import peft
    from netutility_jax.pipeline.streaming import plan_chunks

    hi = jax.lax.Precision.HIGHEST

    @jax.jit
    def grams(a_l, b_l):
        a = jnp.stack([jnp.concatenate(row, 1) for row in a_l])  # (n, d_in, M r)
        b = jnp.stack([jnp.concatenate(row, 0) for row in b_l])  # (n, M r, d_out)
        return jnp.einsum("ndk,ndl->nkl", a, a, precision=hi), jnp.einsum(
            "nkd,nld->nkl", b, b, precision=hi
        )

    sw = h.Stopwatch()
    source = peft.open_adapters(paths)
    chunks = plan_chunks(source.shapes, len(paths), chunk_bytes=chunk_bytes, itemsize=4)
    for names in chunks:
        ads = source.read(names)
        a_l = [[np.asarray(ad[n]["lora_a"], np.float32) for ad in ads] for n in names]
        b_l = [[np.asarray(ad[n]["lora_b"], np.float32) for ad in ads] for n in names]
        jax.block_until_ready(grams(a_l, b_l))
    sw.lap(None)
    return {"read_and_grams_s": sw.total, "chunks": len(chunks), "vm_hwm_mb": h.hwm_mb()}


def _merge_summary(merged, report) -> dict:
    digest = hashlib.sha256()
    for name in sorted(report.masks):
        digest.update(name.encode() + np.packbits(np.asarray(report.masks[name])).tobytes())
    ranks = [r for r in report.ranks.values() if r is not None]
    merged_digest = hashlib.sha256()  # the merged factors, bit for bit
    for name in sorted(merged):
        for f in ("lora_a", "lora_b"):
            merged_digest.update(np.ascontiguousarray(np.asarray(merged[name][f])).tobytes())
        merged_digest.update(np.float64(merged[name]["scale"]).tobytes())
    return {
        "lam": report.lam,
        "alpha": report.alpha,
        "budget_spent": report.budget_spent,
        "rank_total": int(sum(ranks)),
        "modules": len(merged),
        "masks_sha256": digest.hexdigest()[:16],
        "merged_sha256": merged_digest.hexdigest()[:16],
    }


#: the command-line cases: their method flags
CLI_CASES = {
    "cli_ties_knots": ["--method", "ties", "--space", "knots", "--density", "0.2"],
    "cli_dare_ties_knots": [
        "--method",
        "dare_ties",
        "--space",
        "knots",
        "--p",
        "0.5",
        "--seed",
        "0",
    ],
    "cli_ta_core": ["--method", "ta", "--space", "core"],
    "cli_tsv_core": ["--method", "tsv", "--space", "core"],
}


def _cli_case(
    paths: list[str], budget: int, chunk_bytes: int, flags: list[str], keep: str | None = None
) -> dict:
    """``netutility merge`` with ``flags`` (streamed, no compilation cache) in this process, as
    a user runs it: checks, passes, the written output (kept at ``keep`` if given)."""
    from netutility_jax import cli

    with tempfile.TemporaryDirectory() as d:
        out = keep or os.path.join(d, "merged")
        argv = ["merge", *paths, "--budget", str(budget), *flags,
                "--chunk-mb", str(chunk_bytes / 2**20), "--out", out,
                "--no-plots", "--quiet", "--no-compile-cache"]  # fmt: skip
        sw = h.Stopwatch()
        code = sw.lap(cli.main(argv))
        if code != 0:
            raise RuntimeError(f"netutility merge exited {code}")
        with open(os.path.join(out, "netutility_report.json")) as f:
            report = json.load(f)
        written = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    summary = {k: report[k] for k in ("lam", "alpha", "budget_spent") if k in report}
    return {"merge_s": sw.laps[0], "vm_hwm_mb": h.hwm_mb(), "written_bytes": written, **summary}


def run_case(
    case: str, paths: list[str], budget: int, chunk_bytes: int, keep_out: str | None = None
) -> dict:
    """One case in this process: its timings and, for merges, a summary of the result
    (``keep_out``: keep a command-line case's output in ``keep_out/<case>``)."""
    import netutility_jax as nu
    from netutility_jax import peft
    from netutility_jax.pipeline.streaming import bound_heap, merge_adapters_streaming

    if case == "floor":
        return _floor(paths)
    if case == "compute_floor":
        return _compute_floor(paths, chunk_bytes)
    if case in CLI_CASES:
        keep = os.path.join(keep_out, case) if keep_out else None
        return _cli_case(paths, budget, chunk_bytes, CLI_CASES[case], keep)
    sw = h.Stopwatch()
    phases = None
    if case == "in_memory":
        loaded = sw.lap(peft.load_adapters(paths))
        merged, report = sw.lap(
            nu.merge_adapters(loaded.adapters, budget=budget, method="ta", space="core")
        )
    else:
        method = {"stream_ta": "ta", "stream_tsv": "tsv"}[case]
        bound_heap()  # as `netutility merge` does before it streams (the library never does)
        phases = _Phases()
        source = sw.lap(peft.open_adapters(paths))
        phases.opened(source, chunk_bytes)
        merged, report = sw.lap(
            merge_adapters_streaming(
                source, budget=budget, method=method, space="core", chunk_bytes=chunk_bytes,
                progress=phases,
            )
        )  # fmt: skip
        phases.returned(merged)
    return {
        "open_or_load_s": sw.laps[0],
        "merge_s": sw.laps[1],
        "vm_hwm_mb": h.hwm_mb() if phases is None else phases.peak(),
        **({} if phases is None else {"phases": phases.record}),
        **_merge_summary(merged, report),
    }


class _Phases:
    """A streamed merge's resident memory by phase, read from ``/proc/self/status`` through its
    ``progress`` callback: after the imports (the Python, JAX and XLA runtime), after opening the
    headers, then each pass's peak (``VmHWM``, reset when the pass starts; the second pass's
    includes lambda and the allocation, between the passes) and its resident set once its last
    chunk is dropped, and the resident set with the merged result returned (``merged_mb``: its
    factors' bytes). Resetting ``VmHWM`` also resets the kernel's ``ru_maxrss``, so the process's
    peak is the largest of the phases' (:meth:`peak`), which :func:`_run_all` reports."""

    def __init__(self) -> None:
        self.record: dict = {"imports_rss_mb": h.rss_mb()}
        self.chunks = 0
        self.peaks: list[float] = []

    def peak(self) -> float:
        return max([*self.peaks, h.hwm_mb()])

    def opened(self, source, chunk_bytes: int) -> None:
        from netutility_jax.pipeline.streaming import plan_chunks

        self.chunks = len(plan_chunks(source.shapes, len(source.paths), chunk_bytes=chunk_bytes,
                                      itemsize=4))  # fmt: skip
        self.record.update(open_rss_mb=h.rss_mb(), chunks=self.chunks, passes=[])
        self.peaks.append(h.hwm_mb())
        h.reset_peak()

    def __call__(self, done: int, total: int) -> None:
        if done and done % self.chunks == 0:  # a pass's last chunk is dropped
            self.peaks.append(h.hwm_mb())
            self.record["passes"].append({"peak_rss_mb": self.peaks[-1], "end_rss_mb": h.rss_mb()})
            h.reset_peak()

    def returned(self, merged) -> None:
        nbytes = sum(np.asarray(m[f]).nbytes for m in merged.values() for f in ("lora_a", "lora_b"))
        self.record.update(returned_rss_mb=h.rss_mb(), merged_mb=nbytes / 2**20)


def spawn(argv: list[str], timeout: float | None) -> dict:
    """Run ``python THIS_SCRIPT *argv`` and wait for it with ``os.wait4``: its exit status,
    wall time and peak RSS (``ru_maxrss``, the child's own, in MB); killed after ``timeout``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv])
    timer = threading.Timer(timeout, proc.kill) if timeout else None
    if timer is not None:
        timer.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        if timer is not None:
            timer.cancel()
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    return {
        "status": proc.returncode,
        "wall_s": wall,
        "peak_rss_mb": usage.ru_maxrss / 1024,  # KiB on Linux
        "user_s": usage.ru_utime,
        "sys_s": usage.ru_stime,
    }


# ----------------------------------------------------------------------------- main


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS),
                    help="module shapes (llama3-70b: pass --layers 80)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--chunk-mb", type=float,
                    help="streamed chunk size, MiB (default: the library's, CHUNK_BYTES)")  # fmt: skip
    ap.add_argument("--data", help="keep the adapter folders here (reused if they match)")
    ap.add_argument("--only", help=f"comma list of cases ({', '.join(CASES)})")
    ap.add_argument("--timeout", type=float, default=7200, help="seconds per case")
    ap.add_argument("--out", default="benchmarks/results/scale.json")
    ap.add_argument("--keep-out", help="keep each command-line case's merged output in DIR/<case>")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # in a child: run this case
    ap.add_argument("--paths", help=argparse.SUPPRESS)  # with --case: JSON list of folders
    ap.add_argument("--record", help=argparse.SUPPRESS)  # with --case: write its record there
    return ap.parse_args()


def _run_all(args, paths: list[str]) -> list[dict]:
    cases = args.only.split(",") if args.only else list(CASES)
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"scale: unknown case(s) {unknown}; choose from {CASES}")
    results = []
    for case in cases:
        with tempfile.TemporaryDirectory() as d:
            rec_path = os.path.join(d, "case.json")
            argv = [
                "--case", case, "--paths", json.dumps(paths), "--record", rec_path,
                "--budget", str(args.budget), "--chunk-mb", str(args.chunk_mb),
            ]  # fmt: skip
            if args.keep_out:
                argv += ["--keep-out", os.path.abspath(args.keep_out)]
            run = spawn(argv, args.timeout)
            rec = None
            if run["status"] == 0 and os.path.exists(rec_path):
                with open(rec_path) as f:
                    rec = json.load(f)
            if rec and "phases" in rec:  # (the child reset its counter by phase: see _Phases)
                run["peak_rss_mb"] = max(run["peak_rss_mb"], rec["vm_hwm_mb"])
        results.append({"case": case, **run, "record": rec})
        print(
            f"scale: {case:>10}: {run['wall_s']:8.1f} s, peak RSS {run['peak_rss_mb']:8.0f} MB"
            + ("" if run["status"] == 0 else f" (exit status {run['status']})"),
            file=sys.stderr,
            flush=True,
        )
    return results


def main() -> None:
    args = _args()
    if args.chunk_mb is None:
        from netutility_jax.pipeline.streaming import CHUNK_BYTES

        args.chunk_mb = CHUNK_BYTES / 2**20
    if args.case:
        chunk = int(args.chunk_mb * 2**20)
        rec = run_case(args.case, json.loads(args.paths), args.budget, chunk, args.keep_out)
        h.write_json(args.record, rec)
        return
    spec = _manifest(args)
    folder = args.data or tempfile.mkdtemp(prefix="netutility-scale-")
    try:
        paths = write_adapters(folder, spec)
        from netutility_jax import peft

        nbytes = peft.open_adapters(paths).nbytes
        results = _run_all(args, paths)
    finally:
        if not args.data:
            shutil.rmtree(folder, ignore_errors=True)
    by = {r["case"]: r for r in results}
    mem, ta = by.get("in_memory", {}).get("record"), by.get("stream_ta", {}).get("record")
    doc = {
        "machine": h.machine_info(),
        "code": h.code_info(),
        "settings": {**spec, "budget": args.budget, "chunk_mb": args.chunk_mb},
        "adapter_bytes": nbytes,
        "results": results,
        # the streamed TA merge must keep what the in-memory one keeps
        "ta_masks_agree": None if not (mem and ta) else mem["masks_sha256"] == ta["masks_sha256"],
    }
    h.write_json(args.out, doc)
    print(f"scale: wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
