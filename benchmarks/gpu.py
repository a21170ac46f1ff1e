"""Accelerator benchmark: scoring and merging at real model shapes, and the suites' throughput.

One prepared run on whatever device JAX sees (``benchmarks/gpu.sh`` runs it; it also runs on a
CPU with ``--tiny``). Sections, each timed apart (first call = trace + compile + run; steady =
median of ``--repeats`` calls after a warm-up), each written to the JSON as soon as it is done so
that a run stopped by its time limit keeps what it measured:

* ``device``: kind, memory, the nominal peak bf16 FLOP/s and memory bandwidth of known
  accelerators (a table below, from the vendors' data sheets; ``null`` when unknown), and the
  *measured* read bandwidth: a jitted sum over a 2 GiB float32 array.
* ``scoring``: ``nu.score`` + global ``nu.allocate`` on random factors (already on the device) at
  the Qwen3-4B attention shapes of the paper's NLI setting (36 layers x q, k, v, o = 144 modules x
  6 tasks x r 16), and all seven projections of Llama-3-8B (224 modules x 8 tasks) and Llama-3-70B
  (560 modules x 8 tasks); against the memory floor of reading every factor once at the measured
  bandwidth (``floor_s``) and the irreducible arithmetic, the Grams ``X^T X`` of every module's
  task-stacked input factors (one jitted call on pre-stacked arrays, ``grams_s``).
* ``merge``: ``nu.merge_adapters`` (TA and TSV in Core space, budget 16) on the same factors.
  Scoring and merging are timed twice: on the list of adapters, and on ``nu.stack_adapters`` of
  it (stacked once, timed apart), which is what the engine's programs take.
* ``train`` / ``eval``: the language suite's own training step (``lang_train.Trainer``: LoRA r 16
  on q, k, v, o, AdamW, the loss on the label tokens after the last real token) and forward on a
  random-initialised Qwen3-4B-shaped decoder in bf16, tokens per second and the fraction of the
  nominal peak (model FLOPs: 2 x matmul parameters x tokens forward plus attention; a step counts
  twice the forward, as the frozen base needs no weight gradients); the same for CLIP ViT-B/32's
  vision tower (images per second; LoRA r 16 on q, k, v, out; cross-entropy against a fixed
  zero-shot head).

Usage::

    python benchmarks/gpu.py [--out FILE] [--repeats 5] [--only device,scoring,merge,qwen,clip]
                             [--tiny] [--budget-s 420]

``--tiny`` shrinks every shape (a CPU check of the script). Sections start only while the elapsed
time is under ``--budget-s``, and so do the scoring cases; one that would start later is
recorded as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any

# This checkout's library, not whichever one is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np

import netutility_jax as nu

# device_kind prefix -> (peak dense bf16 FLOP/s, memory bandwidth B/s), vendors' data sheets.
NOMINAL = {
    "NVIDIA H200": (989.4e12, 4.8e12),
    "NVIDIA H100 80GB HBM3": (989.4e12, 3.35e12),  # SXM
    "NVIDIA H100 PCIe": (756.0e12, 2.0e12),
    "NVIDIA H100 NVL": (835.0e12, 3.9e12),
    "NVIDIA A100-SXM4-80GB": (312.0e12, 2.039e12),
    "NVIDIA A100-SXM4-40GB": (312.0e12, 1.555e12),
    "NVIDIA A100-PCIE-40GB": (312.0e12, 1.555e12),
}

# Per layer: module -> (d_in, d_out) (HF names), layers, tasks.
QWEN3_4B = dict(hidden=2560, heads=32, kv_heads=8, head_dim=128, ffn=9728, layers=36, vocab=151936)


def _llama_modules(hidden: int, q: int, kv: int, ffn: int, attn_only: bool) -> dict:
    mods = {
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
    }
    if not attn_only:
        mods |= {
            "mlp.gate_proj": (hidden, ffn),
            "mlp.up_proj": (hidden, ffn),
            "mlp.down_proj": (ffn, hidden),
        }
    return mods


SCORING_CASES = {
    # name: (per-layer modules, layers, tasks, rank)
    "qwen3-4b-attn": (_llama_modules(2560, 4096, 1024, 9728, True), 36, 6, 16),
    "llama3-8b": (_llama_modules(4096, 4096, 1024, 14336, False), 32, 8, 16),
    "llama3-70b": (_llama_modules(8192, 8192, 1024, 28672, False), 80, 8, 16),
}
TINY_SCORING = {
    "tiny-attn": (_llama_modules(64, 64, 16, 128, True), 4, 6, 16),
    "tiny-all": (_llama_modules(64, 64, 16, 128, False), 3, 4, 8),
}


_T0 = time.perf_counter()


def _say(text: str) -> None:
    """A progress line with the seconds since the start (what a run cut by its limit shows)."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {text}", flush=True)


@dataclasses.dataclass
class Timing:
    first_s: float
    steady_s: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.steady_s)

    def as_dict(self) -> dict[str, Any]:
        return {"first_s": self.first_s, "median_s": self.median_s, "steady_s": self.steady_s}


def time_calls(fn, *, repeats: int, warmup: int = 1) -> tuple[Timing, Any]:
    """First call (compile + run), ``warmup`` untimed calls, ``repeats`` timed ones; every output
    blocked on."""
    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = time.perf_counter() - t
    for _ in range(warmup):
        out = jax.block_until_ready(fn())
    steady = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = jax.block_until_ready(fn())
        steady.append(time.perf_counter() - t)
    return Timing(first, steady), out


# ----------------------------------------------------------------------------- device


def device_section(args) -> dict[str, Any]:
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", str(dev))
    peak = next((v for k, v in NOMINAL.items() if kind.startswith(k)), (None, None))
    stats = {}
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # CPU devices may not report
        stats = {}
    n = (2**29) if not args.tiny else (2**22)  # 2 GiB / 16 MiB of float32
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    total = jax.jit(jnp.sum)
    t, _ = time_calls(functools.partial(total, x), repeats=args.repeats)
    del x
    return {
        "platform": dev.platform,
        "device_kind": kind,
        "device_count": jax.device_count(),
        "memory_bytes_limit": stats.get("bytes_limit"),
        "nominal_peak_bf16_flops": peak[0],
        "nominal_bandwidth_Bps": peak[1],
        "read_bandwidth_Bps": 4 * n / t.median_s,
        "read_bandwidth_timing": t.as_dict(),
    }


# ----------------------------------------------------------------------------- scoring / merge


def make_adapters(modules: dict, layers: int, tasks: int, rank: int, seed: int = 0) -> list[dict]:
    """``tasks`` adapters of random factors on the default device, PEFT names."""
    key = jax.random.key(seed)
    normal = jax.jit(jax.random.normal, static_argnums=(1,))
    out = []
    for t in range(tasks):
        ad = {}
        for layer in range(layers):
            for name, (d_in, d_out) in modules.items():
                key, ka, kb = jax.random.split(key, 3)
                ad[f"model.layers.{layer}.{name}"] = {
                    "lora_a": normal(ka, (d_in, rank)) / math.sqrt(d_in),
                    "lora_b": normal(kb, (rank, d_out)) * (0.5 + t / tasks),
                    "scale": 1.0,
                }
        out.append(ad)
    return out


def _grams(modules: dict, layers: int, tasks: int, rank: int):
    """The irreducible arithmetic: per distinct shape, the Gram of the task-stacked input factors
    ``(n, d_in, M r)`` and every task's ``b b^T``, on pre-stacked device arrays."""
    shapes: dict[tuple[int, int], int] = {}
    for d in modules.values():
        shapes[d] = shapes.get(d, 0) + layers
    key = jax.random.key(1)
    arrays = []
    for (d_in, d_out), n in shapes.items():
        key, ka, kb = jax.random.split(key, 3)
        arrays.append(
            (
                jax.random.normal(ka, (n, d_in, tasks * rank)),
                jax.random.normal(kb, (n, tasks, rank, d_out)),
            )
        )

    @jax.jit
    def grams(arrs):
        return [
            (jnp.einsum("nik,nil->nkl", a, a), jnp.einsum("ntrd,ntsd->ntrs", b, b)) for a, b in arrs
        ]

    return lambda: grams(arrays)


def factor_bytes(modules: dict, layers: int, tasks: int, rank: int) -> int:
    return 4 * layers * tasks * rank * sum(a + b for a, b in modules.values())


# seconds of every XLA backend compile since the start (jax.monitoring's public listener)
_COMPILES: list[float] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda ev, secs, **kw: (
        _COMPILES.append(secs) if ev == "/jax/core/compile/backend_compile_duration" else None
    )
)


def kernel_summary(fn, calls: int, top: int = 25) -> dict[str, Any]:
    """``calls`` steady calls of a compiled ``fn`` under ``jax.profiler``: the device ops'
    (kernels') total time per call, their count and the ``top`` names by time (from the trace's
    Perfetto export: events of the processes whose name says GPU/TPU, or of all on a CPU)."""
    import glob
    import gzip
    import json
    import tempfile

    jax.block_until_ready(fn())  # compiled and warm
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(fn())
        files = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        if not files:
            return {"error": "no perfetto trace written"}
        with gzip.open(files[0]) as f:
            data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    dev = {p for p, n in procs.items() if "GPU" in n or "TPU" in n or "gpu" in n}
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in events:
        if e.get("ph") != "X" or (dev and e.get("pid") not in dev):
            continue
        nm = str(e.get("name", ""))
        total[nm] = total.get(nm, 0.0) + float(e.get("dur", 0.0))
        count[nm] = count.get(nm, 0) + 1
    ranked = sorted(total, key=total.get, reverse=True)
    return {
        "calls": calls,
        "device_processes": sorted(procs[p] for p in dev),
        "events_per_call": sum(count.values()) / calls,
        "event_us_per_call": sum(total.values()) / calls,
        "top": [
            {
                "name": nm[:160],
                "us_per_call": total[nm] / calls,
                "count_per_call": count[nm] / calls,
            }
            for nm in ranked[:top]
        ],
    }


def scoring_section(args, cases, bandwidth: float | None) -> dict[str, Any]:
    """Per case, stacked and jitted forms first (what the engine is built for), the per-module
    list forms last: each measurement starts only while the time budget lasts, and one that would
    start later is recorded as skipped."""
    out = {}
    traced_once: list[str] = []
    for name, (modules, layers, tasks, rank) in cases.items():
        elapsed = time.perf_counter() - _T0
        if elapsed > args.budget_s:  # a case is minutes at the 70B shapes: keep what was measured
            out[name] = {"skipped": f"time budget: {elapsed:.0f} s elapsed"}
            args.partial(out)
            _say(f"scoring {name}: skipped (time budget)")
            continue
        adapters = make_adapters(modules, layers, tasks, rank)
        jax.block_until_ready(adapters)
        nbytes = factor_bytes(modules, layers, tasks, rank)
        budget = 16 if rank >= 16 else rank
        rec: dict[str, Any] = {
            "modules": layers * len(modules),
            "tasks": tasks,
            "rank": rank,
            "factor_bytes": nbytes,
        }
        if bandwidth:
            rec["floor_s"] = nbytes / bandwidth
        out[name] = rec

        def measure(key, fn, repeats=args.repeats, rec=rec, name=name):
            """Time ``fn`` into ``rec[key]`` (first call with its compiles, then steady calls)."""
            form = (
                "jit"
                if key.endswith("_jit")
                else "stacked"
                if key.endswith("_stacked")
                else ("list")
            )
            if key not in ("stack_adapters", "grams") and form not in args.forms:
                return None
            elapsed = time.perf_counter() - _T0
            if elapsed > args.budget_s:
                rec[key] = {"skipped": f"time budget: {elapsed:.0f} s elapsed"}
                args.partial(out)
                return None
            n = len(_COMPILES)
            timing, res = time_calls(fn, repeats=repeats)
            done = _COMPILES[n:]
            rec[key] = {
                **timing.as_dict(),
                "programs_compiled": len(done),
                "compile_s": float(sum(done)),
            }
            if "grams" in rec and "median_s" in rec["grams"]:
                rec[key]["ratio_to_grams"] = timing.median_s / rec["grams"]["median_s"]
            if bandwidth:
                rec[key]["ratio_to_floor"] = timing.median_s / rec["floor_s"]
            args.partial(out)
            _say(f"{name} {key}: first {timing.first_s:.2f} s, steady {timing.median_s:.4f} s")
            return res

        def score_allocate(ads, budget=budget):
            scores = nu.score(ads, alpha=1.0, lam="auto")
            return nu.allocate(scores, budget, scope="global")

        def merge(ads, method, budget=budget):
            return nu.merge_adapters(ads, budget=budget, method=method, space="core")[0]

        # stacked once where the adapters enter (nu.stack_adapters), then every stage on it
        stacked = measure("stack_adapters", functools.partial(nu.stack_adapters, adapters), 1)
        measure("grams", _grams(modules, layers, tasks, rank))
        masks = measure("score_allocate_stacked", functools.partial(score_allocate, stacked))
        if masks is not None:
            rec["kept_directions"] = int(sum(int(jnp.sum(m)) for m in masks.values()))
        jit_score = jax.jit(score_allocate)
        measure("score_allocate_jit", functools.partial(jit_score, stacked))
        if "merge" in args.only:
            for method in args.merge_methods:
                jit_merge = jax.jit(functools.partial(merge, method=method))
                measure(f"merge_{method}_core_jit", functools.partial(jit_merge, stacked))
                measure(
                    f"merge_{method}_core_stacked",
                    functools.partial(merge, stacked, method),
                    max(1, args.repeats // 2),
                )
        if args.trace and not traced_once:  # the first case's jitted stages, kernel by kernel
            traced_once.append(name)
            fns = {"score_allocate_jit": functools.partial(jit_score, stacked)}
            if "merge" in args.only:
                for method in args.merge_methods:
                    fns[f"merge_{method}_core_jit"] = functools.partial(
                        jax.jit(functools.partial(merge, method=method)), stacked
                    )
            rec["trace"] = {k: kernel_summary(fn, args.trace) for k, fn in fns.items()}
            args.partial(out)
        # the per-module list forms (a list of trees, as PEFT readers give them)
        measure("score_allocate", functools.partial(score_allocate, adapters))
        if "merge" in args.only:
            for method in args.merge_methods:
                measure(
                    f"merge_{method}_core",
                    functools.partial(merge, adapters, method),
                    max(1, args.repeats // 2),
                )
        if "median_s" in rec.get("score_allocate", {}) and "median_s" in rec["grams"]:
            rec["ratio_to_grams"] = rec["score_allocate"]["median_s"] / rec["grams"]["median_s"]
        if bandwidth and "median_s" in rec.get("score_allocate", {}):
            rec["ratio_to_floor"] = rec["score_allocate"]["median_s"] / rec["floor_s"]
        args.partial(out)
        del adapters, masks, stacked
    return out


# ----------------------------------------------------------------------------- Qwen3-4B shapes


def qwen_flops_forward(cfg, batch: int, seq: int) -> float:
    """Matmul FLOPs of a forward over ``batch x seq`` tokens, the LM head on the last token of
    each row only (as the suite scores), attention scores and values included."""
    d, q, kv, f = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f
    tokens = batch * seq
    attn = 4 * batch * seq * seq * q  # QK^T and AV, per layer
    return cfg.num_layers * (2 * per_layer * tokens + attn)


def qwen_section(args, peak: float | None) -> dict[str, Any]:
    from flax import nnx

    from netutility_jax.experiments.models import llama
    from netutility_jax.experiments.suites import lang_train

    shape = (
        QWEN3_4B
        if not args.tiny
        else dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, layers=2, vocab=512)
    )
    cfg = llama.LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        num_layers=shape["layers"],
        num_heads=shape["heads"],
        num_kv_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        intermediate_size=shape["ffn"],
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        qk_norm=True,
        model_type="qwen3",
    )
    t0 = time.perf_counter()
    model = nnx.jit(
        lambda: llama.Llama(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    )()
    init_s = time.perf_counter() - t0
    tcfg = lang_train.LanguageTrainConfig(lora_rank=16, lora_alpha=16.0, learning_rate=3e-5)
    trainer = lang_train.Trainer(tcfg, model, tokenizer=None)
    lora = trainer.init("bench")
    base = trainer.base_state
    n_labels = 3
    token_ids = jnp.arange(10, 10 + n_labels)
    out: dict[str, Any] = {"config": dataclasses.asdict(cfg), "init_s": init_s, "dtype": "bfloat16"}
    rng = np.random.default_rng(0)
    for batch, seq in args.qwen_batches:
        ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, seq)), jnp.int32)
        mask = jnp.ones((batch, seq), jnp.int32)
        labels = jnp.asarray(rng.integers(0, n_labels, (batch,)), jnp.int32)
        valid = jnp.ones((batch,), bool)
        tx, step = trainer._optimizer(tcfg.max_steps)
        # A copy: the step donates its inputs, and the next batch starts from the same init.
        state = {"lora": jax.tree.map(jnp.array, lora)}
        state["opt"] = tx.init(state["lora"])

        batch_args = (ids, mask, token_ids, n_labels, labels, valid)

        def train_step(state=state, step=step, batch_args=batch_args):
            state["lora"], state["opt"], loss = step(state["lora"], state["opt"], base, *batch_args)
            return loss

        t_train, loss = time_calls(train_step, repeats=args.repeats)
        t_eval, _ = time_calls(
            lambda state=state, batch_args=batch_args: trainer._loss(
                state["lora"], base, *batch_args
            ),
            repeats=args.repeats,
        )
        fwd = qwen_flops_forward(cfg, batch, seq)
        tokens = batch * seq
        rec = {
            "batch": batch,
            "seq": seq,
            "train_step": t_train.as_dict(),
            "train_tokens_per_s": tokens / t_train.median_s,
            "eval": t_eval.as_dict(),
            "eval_tokens_per_s": tokens / t_eval.median_s,
            "forward_flops": fwd,
            "loss": float(loss),
        }
        if peak:
            rec["train_fraction_of_peak"] = 2 * fwd / t_train.median_s / peak
            rec["eval_fraction_of_peak"] = fwd / t_eval.median_s / peak
        out[f"b{batch}_t{seq}"] = rec
        args.partial(out)
        _say(
            f"qwen b{batch} t{seq}: train {rec['train_tokens_per_s']:.0f} tok/s, "
            f"eval {rec['eval_tokens_per_s']:.0f} tok/s"
        )
    return out


# ----------------------------------------------------------------------------- CLIP ViT-B/32


def clip_flops_forward(cfg, batch: int) -> float:
    """Matmul FLOPs of the vision tower's forward on ``batch`` images (patch embedding, every
    layer's projections, MLP and attention, the visual projection)."""
    v = cfg.vision_config
    tokens = (v.image_size // v.patch_size) ** 2 + 1
    d, f = v.hidden_size, v.intermediate_size
    patch = 2 * tokens * v.num_channels * v.patch_size**2 * d
    per_layer = 2 * tokens * (4 * d * d + 2 * d * f) + 4 * tokens * tokens * d
    return batch * (patch + v.num_layers * per_layer + 2 * d * cfg.projection_dim)


def clip_section(args, peak: float | None) -> dict[str, Any]:
    import optax
    from flax import nnx

    from netutility_jax.experiments.models import clip

    if args.tiny:
        cfg = clip.CLIPConfig(
            vision_config=clip.CLIPVisionConfig(
                hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, image_size=32,
                patch_size=8,
            ),
            text_config=clip.CLIPTextConfig(
                hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, vocab_size=99,
                max_position_embeddings=16,
            ),
            projection_dim=16,
        )  # fmt: skip
    else:
        cfg = clip.CLIPConfig()  # ViT-B/32 (openai/clip-vit-base-patch32's shapes)
    t0 = time.perf_counter()
    model = nnx.jit(
        lambda: clip.CLIPModel(
            cfg, lora=clip.LoRAConfig(16, 16.0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
            rngs=nnx.Rngs(0),
        )
    )()  # fmt: skip
    init_s = time.perf_counter() - t0
    graphdef, lora, base = nnx.split(model, nnx.LoRAParam, ...)
    n_classes = 10
    head = jax.random.normal(jax.random.key(3), (cfg.projection_dim, n_classes))
    head = head / jnp.linalg.norm(head, axis=0, keepdims=True)

    def loss_fn(lora, x, y):
        m = nnx.merge(graphdef, lora, base)
        f = m.get_image_features(x).astype(jnp.float32)
        f = f / jnp.linalg.norm(f, axis=-1, keepdims=True)
        logits = 100.0 * f @ head  # CLIP's logit scale
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    tx = optax.adamw(3e-4)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(lora, opt, x, y):
        loss, g = jax.value_and_grad(loss_fn)(lora, x, y)
        with jax.numpy_dtype_promotion("standard"):
            upd, opt = tx.update(g, opt, lora)
            lora = optax.apply_updates(lora, upd)
        return lora, opt, loss

    evaluate = jax.jit(loss_fn)
    v = cfg.vision_config
    out: dict[str, Any] = {
        "config": "ViT-B/32" if not args.tiny else "tiny",
        "init_s": init_s,
        "dtype": "bfloat16",
        "lora": "r 16 on q, k, v, out_proj of every vision layer",
    }
    rng = np.random.default_rng(0)
    for batch in args.clip_batches:
        x = jnp.asarray(rng.normal(size=(batch, 3, v.image_size, v.image_size)), jnp.float32)
        y = jnp.asarray(rng.integers(0, n_classes, (batch,)), jnp.int32)
        state = {"lora": jax.tree.map(jnp.array, lora)}
        state["opt"] = tx.init(state["lora"])

        def train_step(state=state, x=x, y=y):
            state["lora"], state["opt"], loss = step(state["lora"], state["opt"], x, y)
            return loss

        t_train, loss = time_calls(train_step, repeats=args.repeats)
        t_eval, _ = time_calls(
            lambda state=state, x=x, y=y: evaluate(state["lora"], x, y), repeats=args.repeats
        )
        fwd = clip_flops_forward(cfg, batch)
        rec = {
            "batch": batch,
            "train_step": t_train.as_dict(),
            "train_images_per_s": batch / t_train.median_s,
            "eval": t_eval.as_dict(),
            "eval_images_per_s": batch / t_eval.median_s,
            "forward_flops": fwd,
            "loss": float(loss),
        }
        if peak:
            rec["train_fraction_of_peak"] = 2 * fwd / t_train.median_s / peak
            rec["eval_fraction_of_peak"] = fwd / t_eval.median_s / peak
        out[f"b{batch}"] = rec
        args.partial(out)
        _say(
            f"clip b{batch}: train {rec['train_images_per_s']:.0f} img/s, "
            f"eval {rec['eval_images_per_s']:.0f} img/s"
        )
    return out


# ----------------------------------------------------------------------------- main


def _pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in p.split("x")) for p in text.split(",") if p]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--out", default=None, help="JSON path (default: benchmarks/results/gpu_<device>.json)"
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--only", default="device,scoring,merge,qwen,clip")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU check of the script")
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--merge-methods", default="ta,tsv")
    p.add_argument("--qwen-batches", default="1x128,16x128", help="BxT pairs")
    p.add_argument("--clip-batches", default="128", help="images per step")
    p.add_argument("--cases", default=None, help="scoring cases to run (default: all)")
    p.add_argument(
        "--forms", default="stacked,jit,list",
        help="scoring and merge forms: stacked (eager on nu.stack_adapters), jit, list",
    )  # fmt: skip
    p.add_argument(
        "--trace", type=int, default=0, metavar="CALLS",
        help="profile CALLS steady calls of the first case's jitted stages (kernel summary)",
    )  # fmt: skip
    args = p.parse_args(argv)
    args.only = set(args.only.split(","))
    args.merge_methods = [m for m in args.merge_methods.split(",") if m]
    args.forms = set(args.forms.split(","))
    if args.forms - {"stacked", "jit", "list"}:
        p.error(f"--forms: unknown {', '.join(sorted(args.forms - {'stacked', 'jit', 'list'}))}")
    args.qwen_batches = _pairs(args.qwen_batches)
    args.clip_batches = [int(b) for b in args.clip_batches.split(",") if b]
    if args.tiny:
        args.qwen_batches = [(2, 16), (1, 16)]  # two: the second starts from the same init
        args.clip_batches = [4]
    kind = getattr(jax.devices()[0], "device_kind", "cpu").replace(" ", "_")
    path = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"gpu_{kind}.json"
    )
    started = time.perf_counter()
    payload: dict[str, Any] = {
        "machine": h.machine_info(),
        "code": h.code_info(),
        "command": " ".join(
            ["python", "benchmarks/gpu.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "tiny": args.tiny,
        "repeats": args.repeats,
        "sections": {},
    }

    def run(name: str, fn) -> Any:
        if name not in args.only:
            return None
        elapsed = time.perf_counter() - started
        if elapsed > args.budget_s:
            payload["sections"][name] = {"skipped": f"time budget: {elapsed:.0f} s elapsed"}
            h.write_json(path, payload)
            return None
        t = time.perf_counter()
        _say(f"section {name}")

        def partial(res: dict[str, Any]) -> None:  # each finished case is written at once
            payload["sections"][name] = {"partial": True, **res}
            h.write_json(path, payload)

        args.partial = partial
        try:
            res = fn()
            payload["sections"][name] = {"wall_s": time.perf_counter() - t, **res}
        except Exception as e:  # a failed section is recorded (with its finished cases)
            payload["sections"][name] = {  # and the next one runs
                **payload["sections"].get(name, {}),
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=8),
            }
            res = None
            print(f"section {name} failed: {type(e).__name__}: {e}", flush=True)
        payload["elapsed_s"] = time.perf_counter() - started
        h.write_json(path, payload)
        return res

    dev = run("device", functools.partial(device_section, args)) or {}
    bandwidth = dev.get("read_bandwidth_Bps")
    peak = dev.get("nominal_peak_bf16_flops")
    cases = TINY_SCORING if args.tiny else SCORING_CASES
    if args.cases:
        wanted = args.cases.split(",")
        unknown = sorted(set(wanted) - set(cases))
        if unknown:
            p.error(f"--cases: unknown {', '.join(unknown)} (known: {', '.join(cases)})")
        cases = {k: cases[k] for k in wanted}
    if "merge" in args.only and "scoring" not in args.only:
        args.only.add("scoring")
    run("clip", lambda: clip_section(args, peak))
    run("qwen", lambda: qwen_section(args, peak))
    run("scoring", lambda: scoring_section(args, cases, bandwidth))
    print(f"wrote {path} ({time.perf_counter() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
