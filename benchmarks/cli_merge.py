"""End-to-end ``netutility merge`` on disk: cold and warm compilation cache, against the floors.

Writes a Qwen3-4B-shaped set of PEFT adapters (36 layers x q 2560->4096, k, v 2560->1024,
o 4096->2560; M = 6 tasks, r = 16, float32 safetensors: 270 MB) into a temporary folder, then
times the command line as a user runs it, from process start to finished output folder:

* ``cold``: an empty compilation cache (every kernel compiled and stored);
* ``warm``: the same cache again, ``--repeat`` times (the median is reported);
* ``no_cache``: ``--no-compile-cache`` (every kernel compiled, nothing stored);

and two floors measured in the same run: ``import`` (a fresh interpreter importing the library
and jax) and ``read`` (a fresh interpreter reading every adapter file once with safetensors).
Each run is its own process; wall time and the child's peak RSS (``wait4``) are recorded.
Issue 14's target: a warm merge of this set under 5 s.

Usage:
  python benchmarks/cli_merge.py [--only ta:core,tsv:core,ties:knots] [--repeat 3]
      [--layers 36] [--out benchmarks/results/cli_merge.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

# This checkout's library, not whichever one is installed (a second worktree measures its own code).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _harness as h
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["main", "run", "write_set"]

SHAPES = {"q_proj": (2560, 4096), "k_proj": (2560, 1024), "v_proj": (2560, 1024),
          "o_proj": (4096, 2560)}  # fmt: skip
M, R = 6, 16
CASES = {
    "ta:core": ["--method", "ta", "--space", "core"],
    "tsv:core": ["--method", "tsv", "--space", "core"],
    "ties:knots": ["--method", "ties", "--space", "knots", "--density", "0.2"],
}


def write_set(folder: str, layers: int) -> list[str]:
    """M PEFT adapter folders of random LoRA factors (``lora_a`` at its init scale, ``lora_b``
    near 1e-2 with a decaying spectrum and a per-task magnitude)."""
    import netutility_jax as nu

    rng = np.random.default_rng(0)
    paths = []
    for t in range(M):
        mag = float(np.exp(rng.normal(0, 0.5)))
        ad = {}
        for layer in range(layers):
            for name, (d_in, d_out) in SHAPES.items():
                a = rng.standard_normal((d_in, R), np.float32) / np.sqrt(d_in)
                decay = np.exp(-np.arange(R) / 4.0)[:, None]
                b = (1e-2 * mag * decay * rng.standard_normal((R, d_out))).astype(np.float32)
                ad[f"model.layers.{layer}.self_attn.{name}"] = {"lora_a": a, "lora_b": b,
                                                                 "scale": 2.0}  # fmt: skip
        path = os.path.join(folder, f"task{t}")
        nu.peft.save_adapter(ad, path, base_model_name_or_path="qwen3-4b-shaped")
        paths.append(path)
    return paths


def run(argv: list[str], env: dict[str, str]) -> dict:
    """One process: wall seconds and peak RSS (MB); raises if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({proc.returncode}): {err[-2000:]}")
    return {"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024}


_READ = """
import sys, safetensors.numpy as st
n = 0
for p in sys.argv[1:]:
    for k, v in st.load_file(p + "/adapter_model.safetensors").items():
        n += v.nbytes
print(n)
"""


def _case(tag: str, paths: list[str], work: str, repeat: int, env: dict[str, str]) -> dict:
    cli = [sys.executable, "-m", "netutility_jax.cli", "merge", *paths, "--budget", "16",
           "--no-plots", "--quiet", *CASES[tag]]  # fmt: skip
    cache = os.path.join(work, f"cache-{tag.replace(':', '-')}")
    env = {**env, "NETUTILITY_COMPILE_CACHE": cache}
    out = {}
    n = 0

    def merge(*extra):
        nonlocal n
        n += 1
        return run(
            [*cli, "--out", os.path.join(work, f"out-{tag.replace(':', '-')}-{n}"), *extra], env
        )

    out["no_cache"] = merge("--no-compile-cache")
    out["cold"] = merge()
    warm = [merge() for _ in range(repeat)]
    out["warm"] = {
        "wall_s": statistics.median(w["wall_s"] for w in warm),
        "wall_all_s": [w["wall_s"] for w in warm],
        "peak_rss_mb": max(w["peak_rss_mb"] for w in warm),
    }
    out["cache_mb"] = (
        sum(os.path.getsize(os.path.join(cache, f)) for f in os.listdir(cache)) / 2**20
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(CASES), help="comma list of method:space")
    ap.add_argument("--repeat", type=int, default=3, help="warm runs per case (median)")
    ap.add_argument("--layers", type=int, default=36, help="decoder layers (default 36)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/cli_merge.json"))
    args = ap.parse_args(argv)
    tags = [t for t in args.only.split(",") if t]
    bad = [t for t in tags if t not in CASES]
    if bad or args.repeat < 1 or args.layers < 1:
        ap.error(f"unknown cases {bad} (known: {list(CASES)}), or --repeat/--layers < 1")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = {"machine": h.machine_info(), "code": h.code_info(), "layers": args.layers,
              "tasks": M, "rank": R, "budget": 16, "cases": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="netutility-cli-bench-") as work:
        paths = write_set(work, args.layers)
        result["adapter_mb"] = (
            sum(os.path.getsize(os.path.join(p, "adapter_model.safetensors")) for p in paths)
            / 2**20
        )
        imp = [sys.executable, "-c", "import jax, netutility_jax, netutility_jax.peft"]
        result["floor_import"] = run(imp, env)
        result["floor_read"] = run([sys.executable, "-c", _READ, *paths], env)
        for tag in tags:
            result["cases"][tag] = _case(tag, paths, work, args.repeat, env)
            c = result["cases"][tag]
            print(
                f"{tag:11s} cold {c['cold']['wall_s']:6.1f} s  warm {c['warm']['wall_s']:6.1f} s"
                f"  no-cache {c['no_cache']['wall_s']:6.1f} s  peak {c['warm']['peak_rss_mb']:.0f}"
                f" MB  cache {c['cache_mb']:.1f} MB",
                flush=True,
            )
            h.write_json(args.out, result)
    print(
        f"floors: import {result['floor_import']['wall_s']:.1f} s, read the files "
        f"{result['floor_read']['wall_s']:.1f} s ({result['adapter_mb']:.0f} MB)"
    )
    h.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
