"""The shared benchmark harness (``benchmarks/_harness.py``): timing, JSON output, provenance,
memory and the one-process-per-case runner."""

from __future__ import annotations

import datetime
import math
import os
import statistics
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import netutility_jax as nu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import _harness as h

__all__: list[str] = []


class FakeArray:
    """An output whose ``block_until_ready`` records that it was called (on which call)."""

    def __init__(self, log: list, label: str) -> None:
        self.log, self.label = log, label

    def block_until_ready(self):
        self.log.append(("block", self.label))
        return self


def sleeper(log: list, label: str, first_s: float, steady_s: float):
    """A callable that sleeps ``first_s`` on its first call (a compile) and ``steady_s`` after."""
    calls = []

    def fn():
        time.sleep(first_s if not calls else steady_s)
        calls.append(None)
        log.append(("call", label))
        return {"out": FakeArray(log, label), "n": len(calls)}

    return fn


def test_measure_splits_compile_from_steady_and_blocks_every_call():
    log: list = []
    fn = sleeper(log, "fn", 0.25, 0.01)
    ref = sleeper(log, "ref", 0.1, 0.005)
    m = h.measure(fn, repeats=3, warmup=1, references=lambda: {"ref": ref})
    s = m.main
    assert len(s.all_s) == 3 and len(m.refs["ref"].all_s) == 3
    assert min(s.all_s) <= s.median_s <= max(s.all_s)
    assert s.median_s == statistics.median(s.all_s) and s.min_s == min(s.all_s)
    assert s.first_s >= 0.25 and s.median_s >= 0.01
    assert s.first_s >= s.median_s and s.compile_s == s.first_s - s.median_s > 0
    assert m.refs["ref"].first_s >= 0.1 and m.refs["ref"].median_s >= 0.005
    assert m.result is None  # outputs dropped once ready
    # Every call was blocked on before the next one started: call, block, call, block, ...
    calls = [label for kind, label in log if kind == "call"]
    assert log == [entry for label in calls for entry in (("call", label), ("block", label))]
    # First + warm-up of fn, then first + warm-up of the reference, then interleaved rounds.
    assert calls == ["fn", "fn", "ref", "ref", "fn", "ref", "fn", "ref", "fn", "ref"]


def test_measure_laps_keep_output_and_a_jitted_function():
    f = jax.jit(lambda x: jnp.sin(x) @ jnp.cos(x).T)
    x = jnp.ones((64, 64), jnp.float32)

    def two_steps(sw):
        y = sw.lap(f(x))
        return f(y)

    m = h.measure(two_steps, repeats=3, laps=True, keep_output=True)
    s = m.main
    assert len(s.first_laps) == 2 and all(len(laps) == 2 for laps in s.laps)
    for laps, total in zip(s.laps, s.all_s, strict=True):
        assert math.isclose(sum(laps), total, rel_tol=1e-9, abs_tol=1e-12)
    assert s.lap_median_s(0) == statistics.median(laps[0] for laps in s.laps)
    assert s.first_s > s.median_s  # the first call traced and compiled
    np.testing.assert_allclose(np.asarray(m.result), np.asarray(f(f(x))), rtol=1e-6)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        h.measure(lambda: None, repeats=0)


def test_stopwatch_laps_end_when_their_value_is_ready():
    log: list = []
    sw = h.Stopwatch()
    value = FakeArray(log, "a")
    assert sw.lap({"x": [value]}) == {"x": [value]}
    time.sleep(0.02)
    sw.lap(None)
    assert log == [("block", "a")]
    assert len(sw.laps) == 2 and sw.laps[1] >= 0.02
    assert math.isclose(sw.total, sum(sw.laps), rel_tol=1e-9)


def test_write_json_is_atomic(tmp_path):
    out = tmp_path / "sub" / "r.json"
    h.write_json(out, {"a": np.float32(1.5), "b": float("nan"), "c": (1, 2)})
    assert out.read_text() == '{\n "a": 1.5,\n "b": null,\n "c": [\n  1,\n  2\n ]\n}\n'
    with pytest.raises(TypeError):
        h.write_json(out, {"a": object()})
    assert out.read_text().startswith('{\n "a": 1.5')  # the old file is untouched
    assert os.listdir(out.parent) == ["r.json"]  # no temporary file left
    fresh = tmp_path / "fresh.json"
    with pytest.raises(TypeError):
        h.write_json(fresh, [object()])
    assert sorted(os.listdir(tmp_path)) == ["sub"]  # no file, no temporary file


def test_machine_and_code_info_have_their_fields():
    info = h.machine_info()
    assert info["jax"] == jax.__version__ and info["netutility_jax"] == nu.__version__
    assert info["backend"] == jax.default_backend()
    assert info["devices"] == [str(d) for d in jax.devices()]
    assert info["cpu_count"] == os.cpu_count() >= info["cpu_usable"] >= 1
    assert info["jaxlib"] and info["platform"] and info["python"]
    assert info["mem_total_gib"] > 0 and info["xla_flags"] == os.environ.get("XLA_FLAGS", "")
    assert len(info["load_avg"]) == 3
    assert datetime.datetime.fromisoformat(info["date"]).tzinfo is not None
    code = h.code_info()
    assert code["package_dir"] == os.path.dirname(os.path.abspath(nu.__file__))
    assert len(code["sources_sha256"]) == 16 and int(code["sources_sha256"], 16) >= 0
    assert {"git_head", "git_dirty"} <= set(code)


def test_memory_counters_see_an_allocation():
    assert h.rss_mb() > 0 and h.hwm_mb() >= h.rss_mb() and h.peak_rss_mb() > 0
    out, inc = h.working_memory(lambda: np.ones(64 * 2**20 // 8))  # 64 MB, touched
    assert out.nbytes == 64 * 2**20
    if inc is None:
        pytest.skip("the peak RSS counter cannot be reset here (/proc/self/clear_refs)")
    assert 60 <= inc < 200
    assert h.adapter_bytes([{"m": {"lora_a": np.zeros((3, 2)), "lora_b": np.zeros((2, 5))}}]) == 128


def test_run_worker_reads_the_record_and_kills_at_the_time_limit(tmp_path):
    script = tmp_path / "case.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, sys, time
            args = sys.argv[1:]
            print("progress", args[0], file=sys.stderr)
            if args[0] == "sleep":
                time.sleep(30)
            if args[0] == "fail":
                sys.exit(3)
            with open(args[args.index("--rec") + 1], "w") as f:
                json.dump({"case": args[0]}, f)
            """
        )
    )
    ok = h.run_worker(str(script), ["a"], record_flag="--rec")
    assert ok.status == 0 and ok.record == {"case": "a"} and ok.stderr == "progress a\n"
    failed = h.run_worker(str(script), ["fail"], record_flag="--rec")
    assert failed.status == 3 and failed.record is None and not failed.timed_out
    t0 = time.perf_counter()
    hung = h.run_worker(str(script), ["sleep"], record_flag="--rec", timeout=1.0)
    assert hung.timed_out and hung.record is None and time.perf_counter() - t0 < 10
    assert hung.stderr == "progress sleep\n"
