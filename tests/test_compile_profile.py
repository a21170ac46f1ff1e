"""The tests' compile profile (``NETUTILITY_COMPILE_PROFILE``, tests/conftest.py) and its summary
(``scripts/compile_profile.py``): a probe test suite run in a subprocess compiles known programs,
and the profile counts exactly those."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import compile_profile  # noqa: E402  (scripts/ is not a package)

PROBE = """
import jax, jax.numpy as jnp

def probe_twice(x):
    return jnp.sin(x) * 2

def test_two_shapes():
    f = jax.jit(probe_twice)
    f(jnp.ones(3)).block_until_ready()
    f(jnp.ones(3)).block_until_ready()  # cached: no second compile
    f(jnp.ones(5)).block_until_ready()  # a new shape: a second program

def test_nothing_compiled():
    assert 1 + 1 == 2
"""


def test_the_profile_counts_each_compiled_program(tmp_path, capsys):
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", suite / "conftest.py")
    (suite / "test_probe.py").write_text(PROBE)
    prof = tmp_path / "prof"
    env = {**os.environ, "NETUTILITY_COMPILE_PROFILE": str(prof)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         str(suite)],
        cwd=suite, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (path,) = prof.glob("compile_*.json")
    data = json.loads(path.read_text())
    rows = {r["test"].split("::")[-1]: r for r in data["tests"]}
    assert set(rows) == {"test_two_shapes", "test_nothing_compiled"}
    assert rows["test_nothing_compiled"]["programs"] == 0
    assert data["programs"]["probe_twice"]["programs"] == 2
    assert rows["test_two_shapes"]["programs"] >= 2  # (and jnp.ones' own small programs)
    for key in ("backend_s", "lowering_s", "tracing_s"):
        assert data["programs"]["probe_twice"][key] > 0
    # the summary sums the same numbers per file and per program
    s = compile_profile.summarise(str(prof))
    assert s["total"]["tests"] == 2
    assert s["files"]["test_probe.py"]["programs"] == sum(r["programs"] for r in rows.values())
    assert s["programs"]["probe_twice"]["programs"] == 2
    assert compile_profile.main([str(prof), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "2 tests in 1 processes" in out and "probe_twice" in out


def test_the_summary_refuses_an_empty_folder(tmp_path):
    try:
        compile_profile.summarise(str(tmp_path))
    except SystemExit as e:
        assert "no compile_*.json" in str(e) and "NETUTILITY_COMPILE_PROFILE" in str(e)
    else:
        raise AssertionError("an empty folder was summarised")
