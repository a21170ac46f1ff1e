"""benchmarks/fixed_cost.py --tiny: the engine's fixed costs for a stacked set are counts that
depth does not change and that stay within the targets (programs, argument buffers, reads).
Counts only: no timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = "score+allocate:stacked,merge:stacked,merge_jit:stacked"


# ~40 s (six fresh interpreters, each compiling its stage); the slow tier runs in CI
@pytest.mark.slow
def test_a_stacked_set_pays_fixed_costs_independent_of_depth(tmp_path):
    out = tmp_path / "fixed_cost.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "fixed_cost.py"), "--tiny",
         "--stages", STAGES, "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    cases = json.loads(out.read_text())["cases"]
    assert not [c for c in cases if "error" in c], cases
    by = {(c["stage"], c["layers"]): c for c in cases}
    assert sorted({layers for _, layers in by}) == [4, 10]
    for stage in STAGES.split(","):
        shallow, deep = by[stage, 4], by[stage, 10]
        for key in ("programs_compiled", "argument_buffers", "device_to_host", "dispatches"):
            assert shallow[key] == deep[key], (stage, key, shallow[key], deep[key])
        for c in (shallow, deep):
            assert c["argument_buffers"] <= 4 * c["buckets"] + 16, c
            assert c["recompiled_on_steady_call"] == 0, c
            # a steady call of a stacked set places nothing: its settings were placed once
            assert c["host_to_device"] == 0, c
    # score + allocate: two programs, two reads (the scoring's status, the masks)
    assert by["score+allocate:stacked", 10]["programs_compiled"] <= 2
    assert by["score+allocate:stacked", 10]["device_to_host"] <= 2
    # the eager TA merge: one program (scores, lambda, allocation, merge) and one read
    merge = by["merge:stacked", 10]
    assert merge["programs_compiled"] == merge["dispatches"] == merge["device_to_host"] == 1
    # under jax.jit: one program, nothing read or placed
    jitted = by["merge_jit:stacked", 10]
    assert jitted["programs_compiled"] == 1
    assert jitted["device_to_host"] == jitted["host_to_device"] == 0
