"""End-to-end ``netutility merge`` on disk: cold and warm compilation cache, against the floors.

Writes a Qwen3-4B-shaped set of PEFT adapters (36 layers x q 2560->4096, k, v 2560->1024,
o 4096->2560; M = 6 tasks, r = 16, float32 safetensors: 270 MB) into a temporary folder, then
times the command line as a user runs it, from process start to finished output folder:

* ``cold``: an empty compilation cache (every kernel compiled and stored);
* ``warm``: the same cache again, ``--repeat`` times (the median is reported);
* ``no_cache``: ``--no-compile-cache`` (every kernel compiled, nothing stored);

and two floors measured in the same run: ``import`` (a fresh interpreter importing the library
and jax) and ``read`` (a fresh interpreter reading every adapter file once with safetensors).
Each run is its own process; wall time, CPU time (user + system) and the child's peak RSS
(``wait4``) are recorded. Issue 14's target: a warm merge of this set under 5 s.

``--set smollm2``: the small merge of the "small merges are slow" issue. Three PEFT adapters of a
SmolLM2-135M-shaped ``LlamaForCausalLM`` (hidden 576, intermediate 1536, 30 layers, 9 heads, 3 kv
heads; a vocabulary of 256 tokens instead of 49,152, which no LoRA target touches), made by
``peft.get_peft_model(LoraConfig(init_lora_weights=False))`` with seeds 0, 1, 2 and
``save_pretrained``: (1) q, v at r = 8; (2) q, k, v, o at r = 16 with a ``rank_pattern`` (o at 8,
layer 0's q at 4, layer 1's k at 24); (3) q, k, v, o at r = 16 with ``use_rslora`` (15 MB in
all). Cases: TA in full and Core space, TIES in KnOTS space, TSV in Core space (budget 16, no
plots), and TA in Core space with its plots; each ``cold`` and ``warm`` as above. Then, in
the same run: the floors (a bare interpreter, the imports, reading the files); PEFT's
``add_weighted_adapter`` with ``combination_type="cat"`` and ``"ties_svd"`` (density 0.2) on the
same adapters, each in its own process that builds the base model and loads the three adapters
(the call timed alone, and the whole process to the merged adapter saved); and a ``breakdown`` of
one warm merge per case (one more process, timers around each step and JAX's compile events:
imports, checks and planning, opening the headers, the scoring pass, the allocation, the merge
pass, the report, the plots; across them, reading, writing, tracing, lowering and loading the
compiled programs (``programs`` counts those JAX compiled or loaded from its persistent cache).
The target: a warm merge under 1.5 s on 2 idle cores, a cold one under 5 s.

Usage:
  python benchmarks/cli_merge.py [--only ta:core,tsv:core,ties:knots] [--repeat 3]
      [--layers 36] [--out benchmarks/results/cli_merge.json]
  python benchmarks/cli_merge.py --set smollm2 --repeat 3
      [--out benchmarks/results/cli_merge_smollm2.json] [--no-peft]
"""

from __future__ import annotations

import argparse
import json
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

__all__ = ["breakdown", "main", "peft_merge", "run", "write_set", "write_smollm2_set"]

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


def run(argv: list[str], env: dict[str, str], *, stdout: bool = False) -> dict:
    """One process: wall seconds, CPU seconds (user + system) and peak RSS (MB); raises if it
    fails. ``stdout``: its standard output too (``"stdout"``)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        out.seek(0)
        if proc.returncode:
            text = err.read().decode(errors="replace")
            raise RuntimeError(
                f"{' '.join(argv[:4])} ... failed ({proc.returncode}): {text[-2000:]}"
            )
        rec = {
            "wall_s": wall,
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_mb": usage.ru_maxrss / 1024,
        }
        if stdout:
            rec["stdout"] = out.read().decode(errors="replace")
    return rec


# SmolLM2-135M's shapes (the vocabulary cut: no LoRA target touches it)
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 256,
           "max_position_embeddings": 2048, "tie_word_embeddings": True}  # fmt: skip
SMOLLM2_ADAPTERS = (
    {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
     "rank_pattern": {"o_proj": 8, "model.layers.0.self_attn.q_proj": 4,
                      "model.layers.1.self_attn.k_proj": 24}},
    {"r": 16, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
     "use_rslora": True},
)  # fmt: skip
SMOLLM2_CASES = {
    "ta:full": ["--method", "ta", "--space", "full"],
    "ta:core": ["--method", "ta", "--space", "core"],
    "ties:knots": ["--method", "ties", "--space", "knots", "--density", "0.2"],
    "tsv:core": ["--method", "tsv", "--space", "core"],
    "ta:core:plots": ["--method", "ta", "--space", "core"],  # (with its plots)
}
PEFT_COMBINATIONS = {"cat": {}, "ties_svd": {"density": 0.2}}

_SMOLLM2_SET = """
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
cfg, specs, folder = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
for i, spec in enumerate(specs):
    torch.manual_seed(i)
    model = get_peft_model(LlamaForCausalLM(LlamaConfig(**cfg)),
                           LoraConfig(init_lora_weights=False, **spec))
    model.save_pretrained(os.path.join(folder, f"task{i}"))
"""


def write_smollm2_set(folder: str, env: dict[str, str]) -> list[str]:
    """The three PEFT adapters of ``--set smollm2`` (see the module docstring), made by PEFT in
    a child process (torch stays out of this one); returns their folders."""
    argv = [sys.executable, "-c", _SMOLLM2_SET, json.dumps(SMOLLM2),
            json.dumps(SMOLLM2_ADAPTERS), folder]  # fmt: skip
    run(argv, env)
    return [os.path.join(folder, f"task{i}") for i in range(len(SMOLLM2_ADAPTERS))]


# PEFT's add_weighted_adapter on the same adapters: its own process, from start to the merged
# adapter saved; the call itself timed alone
_PEFT = """
import json, sys, time, warnings
t0 = time.perf_counter()
warnings.simplefilter("ignore")
import torch
from peft import PeftModel
from transformers import LlamaConfig, LlamaForCausalLM
cfg, kind, kw, out, paths = (json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]),
                             sys.argv[4], sys.argv[5:])
t_import = time.perf_counter()
torch.manual_seed(0)
model = PeftModel.from_pretrained(LlamaForCausalLM(LlamaConfig(**cfg)), paths[0],
                                  adapter_name="task0")
for i, p in enumerate(paths[1:], 1):
    model.load_adapter(p, adapter_name=f"task{i}")
t_load = time.perf_counter()
names = [f"task{i}" for i in range(len(paths))]
model.add_weighted_adapter(names, [1.0] * len(names), "merged", combination_type=kind, **kw)
t_merge = time.perf_counter()
model.save_pretrained(out, selected_adapters=["merged"])
t_save = time.perf_counter()
print(json.dumps({"import_s": t_import - t0, "load_s": t_load - t_import,
                  "add_weighted_adapter_s": t_merge - t_load, "save_s": t_save - t_merge}))
"""


def peft_merge(kind: str, paths: list[str], work: str, env: dict[str, str]) -> dict:
    """PEFT's ``add_weighted_adapter(combination_type=kind)`` of ``paths`` (weights 1), in its
    own process: the whole process (``wall_s``) and its steps (the call: ``add_weighted_adapter_s``)."""
    argv = [sys.executable, "-c", _PEFT, json.dumps(SMOLLM2), kind,
            json.dumps(PEFT_COMBINATIONS[kind]), os.path.join(work, f"peft-{kind}"), *paths]  # fmt: skip
    rec = run(argv, env, stdout=True)
    steps = json.loads(rec.pop("stdout").strip().splitlines()[-1])
    return {**rec, **steps}


# One warm `netutility merge` with timers around its steps (functions wrapped in this process
# only) and JAX's compile events; prints one JSON line. The steps are exclusive, in the order
# they run; "across" are totals over every step.
_BREAKDOWN = """
import sys, time
t0 = time.perf_counter()
import jax
t1 = time.perf_counter()
import netutility_jax
t2 = time.perf_counter()
import netutility_jax.cli
from netutility_jax.cli import entry
t3 = time.perf_counter()
import collections, functools, json
from jax._src import monitoring
from netutility_jax import peft, streaming
from netutility_jax.folders import _run as fr, _write as fw
events, counts = collections.defaultdict(float), collections.Counter()
def listen(name, secs, **kw):
    events[name] += secs
    counts[name] += 1
monitoring.register_event_duration_secs_listener(listen)
spent = collections.defaultdict(float)
def wrap(owner, attr, key):
    f = getattr(owner, attr)
    @functools.wraps(f)
    def timed(*a, **k):
        s = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spent[key] += time.perf_counter() - s
    setattr(owner, attr, timed)
wrap(fr, "read_adapters", "open the adapters' headers")
wrap(streaming, "_score_pass", "scoring pass")
wrap(fr, "mesh_of", "devices (the backend starts)")
wrap(streaming, "_global_scores", "lambda and utilities")
from netutility_jax.allocation import _min_share
wrap(_min_share, "select", "allocation")
wrap(streaming, "merge_pass", "merge pass")
wrap(streaming, "merge_pass_model_wide", "merge pass")
wrap(fw, "write_extras", "report, model card and plots")
wrap(fw, "write_plots", "plots")
wrap(peft.AdapterSet, "read", "read chunks")
wrap(peft.AdapterWriter, "add", "write chunks")
from netutility_jax.pipeline import _stream_merge
wrap(_stream_merge.merging, "run_plan", "merge kernels")
s = time.perf_counter()
rc = entry.main(sys.argv[1:])
main_s = time.perf_counter() - s
assert rc == 0, rc
steps = {"import jax": t1 - t0, "import netutility_jax": t2 - t1,
         "import netutility_jax.cli": t3 - t2}
for k in ("open the adapters' headers", "devices (the backend starts)", "scoring pass",
          "lambda and utilities", "allocation", "merge pass"):
    steps[k] = spent[k]
steps["report and model card"] = spent["report, model card and plots"] - spent["plots"]
steps["plots"] = spent["plots"]
steps["parsing, checks, plan, staging (the rest)"] = main_s - sum(
    v for k, v in steps.items() if not k.startswith("import"))
ev = "/jax/core/compile/"
across = {"read chunks": spent["read chunks"], "write chunks": spent["write chunks"],
          "merge kernels": spent["merge kernels"],
          "trace (jaxpr)": events[ev + "jaxpr_trace_duration"],
          "lower (MLIR)": events[ev + "jaxpr_to_mlir_module_duration"],
          "compile or load from cache": events[ev + "backend_compile_duration"],
          "of which cache load": events["/jax/compilation_cache/cache_retrieval_time_sec"]}
print(json.dumps({"steps_s": steps, "across_s": across, "main_s": main_s,
                  "programs": counts[ev + "backend_compile_duration"],
                  "cache_hits": counts["/jax/compilation_cache/cache_retrieval_time_sec"],
                  "imported": sorted(m for m in ("matplotlib", "tqdm", "torch", "transformers",
                                                 "scipy", "yaml", "safetensors")
                                     if m in sys.modules)}))
"""


def breakdown(cli_args: list[str], env: dict[str, str]) -> dict:
    """Where one warm ``netutility merge`` spends its time (``_BREAKDOWN``): its own process;
    ``wall_s`` is the whole process, ``steps_s`` (imports, then the command's steps, exclusive)
    plus ``startup_s`` (the interpreter's start and exit, outside the timers) add up to it."""
    rec = run([sys.executable, "-c", _BREAKDOWN, *cli_args], env, stdout=True)
    found = json.loads(rec.pop("stdout").strip().splitlines()[-1])
    out = {**rec, **found}
    out["startup_s"] = out["wall_s"] - sum(out["steps_s"].values())
    return out


_READ = """
import sys, safetensors.numpy as st
n = 0
for p in sys.argv[1:]:
    for k, v in st.load_file(p + "/adapter_model.safetensors").items():
        n += v.nbytes
print(n)
"""


def _case(
    tag: str, paths: list[str], work: str, repeat: int, env: dict[str, str], *,
    cases: dict[str, list[str]] = CASES, no_cache: bool = True, explain: bool = False,
) -> dict:  # fmt: skip
    plots = [] if tag.endswith(":plots") else ["--no-plots"]
    args = ["merge", *paths, "--budget", "16", *plots, "--quiet", *cases[tag]]
    cli = [sys.executable, "-m", "netutility_jax.cli", *args]
    cache = os.path.join(work, f"cache-{tag.replace(':', '-')}")
    env = {**env, "NETUTILITY_COMPILE_CACHE": cache}
    out = {}
    n = 0

    def where() -> str:
        nonlocal n
        n += 1
        return os.path.join(work, f"out-{tag.replace(':', '-')}-{n}")

    def merge(*extra):
        return run([*cli, "--out", where(), *extra], env)

    if no_cache:
        out["no_cache"] = merge("--no-compile-cache")
    out["cold"] = merge()
    warm = [merge() for _ in range(repeat)]
    out["warm"] = {
        "wall_s": statistics.median(w["wall_s"] for w in warm),
        "wall_all_s": [w["wall_s"] for w in warm],
        "cpu_s": statistics.median(w["cpu_s"] for w in warm),
        "peak_rss_mb": max(w["peak_rss_mb"] for w in warm),
    }
    out["cache_mb"] = (
        sum(os.path.getsize(os.path.join(cache, f)) for f in os.listdir(cache)) / 2**20
    )
    if explain:
        out["breakdown"] = breakdown([*args, "--out", where()], env)
    return out


def _table(cases: dict[str, dict]) -> str:
    """The breakdowns of ``cases`` side by side: one row per step, one column per case (s)."""
    tags = [t for t, c in cases.items() if "breakdown" in c]
    if not tags:
        return ""
    first = cases[tags[0]]["breakdown"]
    rows = [("interpreter start and exit", "startup_s", None)]
    rows += [(k, "steps_s", k) for k in first["steps_s"]]
    rows += [("= whole process", "wall_s", None), ("  (CPU, user + system)", "cpu_s", None)]
    rows += [(f"  across: {k}", "across_s", k) for k in first["across_s"]]
    rows += [("  programs (of which cache hits)", "programs", None)]
    lines = [f"{'warm merge, seconds':44s}" + "".join(f"{t:>15s}" for t in tags)]
    for label, field, key in rows:
        cells = []
        for t in tags:
            b = cases[t]["breakdown"]
            if field == "programs":
                cells.append(f"{b['programs']} ({b['cache_hits']})")
            else:
                v = b[field] if key is None else b[field].get(key, 0.0)
                cells.append(f"{v:.2f}")
        lines.append(f"{label:44s}" + "".join(f"{c:>15s}" for c in cells))
    return "\n".join(lines)


def _smollm2(args: argparse.Namespace, tags: list[str], env: dict[str, str]) -> int:
    """``--set smollm2``: the cases, the floors, PEFT's merges and the breakdowns."""
    result = {"machine": h.machine_info(), "code": h.code_info(), "set": "smollm2",
              "model": SMOLLM2, "adapters": list(SMOLLM2_ADAPTERS), "budget": 16,
              "repeat": args.repeat, "cases": {}, "peft": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="netutility-cli-bench-") as work:
        paths = write_smollm2_set(work, env)
        result["adapter_mb"] = [
            os.path.getsize(os.path.join(p, "adapter_model.safetensors")) / 2**20 for p in paths
        ]
        result["floor_python"] = run([sys.executable, "-c", "pass"], env)
        imp = [sys.executable, "-c", "import jax, netutility_jax, netutility_jax.peft"]
        result["floor_import"] = run(imp, env)
        result["floor_import_cli"] = run([sys.executable, "-c", "import netutility_jax.cli"], env)
        result["floor_read"] = run([sys.executable, "-c", _READ, *paths], env)
        print(
            f"floors: python {result['floor_python']['wall_s']:.2f} s, import "
            f"{result['floor_import']['wall_s']:.2f} s (with the CLI "
            f"{result['floor_import_cli']['wall_s']:.2f} s), read the files "
            f"{result['floor_read']['wall_s']:.2f} s ({sum(result['adapter_mb']):.1f} MB)",
            flush=True,
        )
        for tag in tags:
            c = _case(tag, paths, work, args.repeat, env, cases=SMOLLM2_CASES, no_cache=False,
                      explain=True)  # fmt: skip
            result["cases"][tag] = c
            print(
                f"{tag:14s} cold {c['cold']['wall_s']:5.1f} s (CPU {c['cold']['cpu_s']:5.1f} s)"
                f"  warm {c['warm']['wall_s']:5.1f} s (CPU {c['warm']['cpu_s']:5.1f} s)  peak "
                f"{c['warm']['peak_rss_mb']:.0f} MB  cache {c['cache_mb']:.1f} MB",
                flush=True,
            )
            h.write_json(args.out, result)
        if not args.no_peft:
            for kind in PEFT_COMBINATIONS:
                r = result["peft"][kind] = peft_merge(kind, paths, work, env)
                print(
                    f"PEFT add_weighted_adapter {kind:9s} call {r['add_weighted_adapter_s']:6.2f} s"
                    f"  whole process {r['wall_s']:6.1f} s (CPU {r['cpu_s']:.1f} s)",
                    flush=True,
                )
                h.write_json(args.out, result)
    print(_table(result["cases"]))
    result["load_avg_end"] = h.load_average()
    h.write_json(args.out, result)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", choices=("qwen3", "smollm2"), default="qwen3",
                    help="the adapters: Qwen3-4B-shaped (default) or the SmolLM2 set")  # fmt: skip
    ap.add_argument("--only", default=None, help="comma list of method:space (default: all)")
    ap.add_argument("--repeat", type=int, default=3, help="warm runs per case (median)")
    ap.add_argument("--layers", type=int, default=36, help="decoder layers (default 36; qwen3)")
    ap.add_argument("--no-peft", action="store_true", help="smollm2: skip PEFT's merges")
    ap.add_argument("--out", default=None, help="JSON (default benchmarks/results/cli_merge"
                    "[_smollm2].json)")  # fmt: skip
    args = ap.parse_args(argv)
    cases = CASES if args.set == "qwen3" else SMOLLM2_CASES
    if args.out is None:
        name = "cli_merge.json" if args.set == "qwen3" else "cli_merge_smollm2.json"
        args.out = os.path.join(ROOT, "benchmarks/results", name)
    tags = [t for t in (args.only or ",".join(cases)).split(",") if t]
    bad = [t for t in tags if t not in cases]
    if bad or args.repeat < 1 or args.layers < 1:
        ap.error(f"unknown cases {bad} (known: {list(cases)}), or --repeat/--layers < 1")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if args.set == "smollm2":
        return _smollm2(args, tags, env)
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
