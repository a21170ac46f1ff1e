"""The command's compile cache is JAX's own (with the traced programs of ``_core.exports``, no
compiled code of the library's own): ordinary use never poisons it.

The sequence that broke an earlier version (a fresh cache; ``inspect``, then ``merge --dry-run``
twice: the third run failed with ``NOT_FOUND: Function ... not found`` from an executable the
library had stored, and so did every later merge of those shapes) is run in fresh processes, with
a real merge after it, and with a leftover ``executables`` folder of junk that must never be read.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import netutility_jax as nu


def _write_adapters(root):
    rng = np.random.default_rng(0)
    paths = []
    for name, r in (("sql", 4), ("math", 4), ("chat", 8)):
        ad = {
            f"model.layers.{i}.self_attn.{p}": {
                "lora_a": rng.normal(size=(24, r)).astype(np.float32),
                "lora_b": rng.normal(size=(r, 16)).astype(np.float32),
                "scale": 2.0,
            }
            for i in range(2)
            for p in ("q_proj", "v_proj")
        }
        path = root / name
        nu.peft.save_adapter(ad, path)
        paths.append(str(path))
    return paths


def _cli(args, cache):
    env = {**os.environ, "NETUTILITY_COMPILE_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "netutility_jax.cli", *args],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip


@pytest.mark.slow  # (six fresh processes, each starting JAX: about a minute on 2 cores)
def test_inspect_then_dry_runs_then_merges_all_succeed_from_one_cache(tmp_path):
    paths = _write_adapters(tmp_path)
    cache = tmp_path / "cache"
    runs = [
        ["inspect", *paths],
        ["merge", *paths, "--budget", "2", "--dry-run"],
        ["merge", *paths, "--budget", "2", "--dry-run"],
        ["merge", *paths, "--budget", "2", "--out", str(tmp_path / "out1")],
    ]
    for args in runs:
        proc = _cli(args, cache)
        assert proc.returncode == 0, (args, proc.stderr[-3000:])
    assert not (cache / "executables").exists()  # no executables of the library's own
    # the kernels' traced programs, each exported once and read back by the later processes
    from netutility_jax.cli import entry

    def exported():
        return {p.name: p.stat().st_mtime_ns for p in (cache / entry.EXPORTS).iterdir()}

    stamps = exported()
    assert stamps  # (the TA merges' one program at least)
    # a folder an earlier version left behind, with a file that does not load: never read
    (cache / "executables").mkdir()
    (cache / "executables" / "score_impl-0000.exe").write_bytes(b"not an executable")
    proc = _cli(["merge", *paths, "--budget", "2", "--out", str(tmp_path / "out2")], cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert exported() == stamps  # nothing traced again, nothing written over
    one = nu.peft.load_adapter(tmp_path / "out1")
    two = nu.peft.load_adapter(tmp_path / "out2")
    assert one.keys() == two.keys()
    for name in one:
        np.testing.assert_array_equal(
            np.asarray(nu.module_update(one[name])), np.asarray(nu.module_update(two[name]))
        )


def test_the_command_adds_its_cpu_compile_flags_to_what_xla_flags_says(monkeypatch):
    # added where XLA_FLAGS does not name them; a user's own setting and other flags are kept
    from netutility_jax.cli import entry

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    entry.cpu_compile_flags()
    assert os.environ["XLA_FLAGS"].split() == [f"--{f}" for f in entry.CPU_COMPILE_FLAGS]
    mine = "--xla_force_host_platform_device_count=2 --xla_cpu_use_fusion_emitters=true"
    monkeypatch.setenv("XLA_FLAGS", mine)
    entry.cpu_compile_flags()
    assert os.environ["XLA_FLAGS"] == mine
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    entry.cpu_compile_flags()
    assert os.environ["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=2",
        *(f"--{f}" for f in entry.CPU_COMPILE_FLAGS),
    ]


@pytest.mark.parametrize("command", [["demo", "--quick"], ["inspect", "x"]])
def test_the_demo_and_inspect_turn_the_cache_on_unless_told_not_to(command, monkeypatch, tmp_path):
    """The demo keeps its kernels as merge and inspect do (a second demo run compiles less);
    --no-compile-cache and NETUTILITY_COMPILE_CACHE=off leave the cache off. The command itself
    is replaced: only the set-up before it runs is checked (JAX's settings are not touched)."""
    from netutility_jax.cli import entry

    calls: list = []
    monkeypatch.setattr(entry, "enable_compile_cache", lambda folder: calls.append(folder))
    for name in ("cmd_demo", "cmd_inspect"):
        monkeypatch.setattr(entry, name, lambda args: 0)
    monkeypatch.setenv("NETUTILITY_COMPILE_CACHE", str(tmp_path / "c"))
    assert entry.main(command) == 0 and calls == [tmp_path / "c"]
    assert entry.main([*command, "--no-compile-cache"]) == 0 and len(calls) == 1
    monkeypatch.setenv("NETUTILITY_COMPILE_CACHE", "off")
    assert entry.main(command) == 0 and len(calls) == 1
