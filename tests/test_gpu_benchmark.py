"""benchmarks/gpu.py on a CPU with tiny shapes: every section runs and its derived numbers are
what its measurements say (the GPU run itself is prepared, not tested, here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ~1 min (compiles of tiny CLIP, decoder and merges); the slow tier runs in CI
@pytest.mark.slow
def test_gpu_benchmark_runs_tiny_on_cpu_and_its_ratios_agree(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--tiny", "--repeats", "1",
         "--merge-methods", "ta", "--trace", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    sec = res["sections"]
    assert set(sec) == {"device", "clip", "qwen", "scoring"}
    assert not any("error" in s or s.get("partial") for s in sec.values())
    bw = sec["device"]["read_bandwidth_Bps"]
    assert bw > 0
    # the tiny cases' shapes, written out here (benchmarks/gpu.py's TINY_SCORING)
    attn = {"q": (64, 64), "k": (64, 16), "v": (64, 16), "o": (64, 64)}
    allm = {**attn, "gate": (64, 128), "up": (64, 128), "down": (128, 64)}
    tiny = {"tiny-attn": (attn, 4, 6, 16), "tiny-all": (allm, 3, 4, 8)}
    for name, (modules, layers, tasks, rank) in tiny.items():
        rec = sec["scoring"][name]
        nbytes = 4 * layers * tasks * rank * sum(a + b for a, b in modules.values())
        assert rec["factor_bytes"] == nbytes
        assert rec["modules"] == layers * len(modules) and rec["tasks"] == tasks
        med = rec["score_allocate"]["median_s"]
        assert rec["ratio_to_grams"] == pytest.approx(med / rec["grams"]["median_s"])
        assert rec["floor_s"] == pytest.approx(nbytes / bw)
        assert 0 < rec["kept_directions"] <= rec["modules"] * 16
        assert "merge_ta_core" in rec
        # the stacked and jitted forms, each with its compiles counted; a jitted stage is one
        # program, compiled on its first call and never again
        for key in ("score_allocate_jit", "merge_ta_core_jit"):
            assert rec[key]["programs_compiled"] == 1, (name, key, rec[key])
            assert rec[key]["median_s"] > 0 and rec[key]["first_s"] >= rec[key]["compile_s"]
            assert rec[key]["ratio_to_grams"] == pytest.approx(
                rec[key]["median_s"] / rec["grams"]["median_s"]
            )
        assert rec["stack_adapters"]["median_s"] > 0
    # the first case's jitted stages profiled: each names its ops with their time per call
    trace = sec["scoring"]["tiny-attn"]["trace"]
    assert set(trace) == {"score_allocate_jit", "merge_ta_core_jit"}
    assert "trace" not in sec["scoring"]["tiny-all"]
    for summary in trace.values():
        assert summary["events_per_call"] > 0 and summary["top"]
        assert sum(t["us_per_call"] for t in summary["top"]) <= summary["event_us_per_call"] + 1
    for key in ("clip", "qwen"):
        cases = [v for v in sec[key].values() if isinstance(v, dict) and "train_step" in v]
        assert cases and all(c["train_step"]["median_s"] > 0 for c in cases)
    # two batches, the second from the same initial LoRA as the first (the step donates it)
    qcases = [v for v in sec["qwen"].values() if isinstance(v, dict) and "batch" in v]
    assert [(q["batch"], q["seq"]) for q in qcases] == [(2, 16), (1, 16)]
    for qcase in qcases:
        tokens = qcase["batch"] * qcase["seq"]
        assert qcase["train_tokens_per_s"] == pytest.approx(
            tokens / qcase["train_step"]["median_s"]
        )
