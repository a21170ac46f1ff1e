"""``netutility demo``'s command line (:mod:`netutility_jax.experiments.demo`): the
``--model-devices`` flag, declared through ``suites.FLAGS`` and checked before any work.

This process has one CPU device (the 8-device runs of a suite on a mesh are the slow tests of
``tests/experiments/test_sharding.py``).
"""

from __future__ import annotations

import jax
import pytest

from netutility_jax.experiments import demo
from netutility_jax.experiments.harness import suites

N = len(jax.local_devices())
HAVE = f"this machine has {N} cpu device{'s' * (N > 1)}"


def test_model_devices_is_a_flag_of_the_suites_that_load_a_model_folder():
    assert "model_devices" in suites.FLAGS
    assert "model_devices" in suites.get("nli").flags
    assert "model_devices" in suites.get("vision").flags
    for name in ("encoder", "language"):
        assert "model_devices" not in suites.get(name).flags


@pytest.mark.parametrize("text, want", [("all", N), ("ALL", N), ("1", 1), (f" {N} ", N)])
def test_model_devices_values(text, want):
    assert demo.model_devices(text) == want


@pytest.mark.parametrize(
    "text, match",
    [
        ("0", rf"--model-devices 0: expected at least 1 device \(or all; {HAVE}\)"),
        ("-2", rf"--model-devices -2: expected at least 1 device \(or all; {HAVE}\)"),
        (str(N + 1), rf"--model-devices {N + 1}: {HAVE}; give 1 to {N}, or all"),
        ("two", rf"--model-devices 'two': expected all or a whole number of devices \(1 to {N}"),
        ("1.5", r"--model-devices '1.5': expected all or a whole number of devices"),
        ("", r"--model-devices '': expected all or a whole number of devices"),
    ],
)
def test_a_bad_model_devices_names_the_flag(text, match):
    with pytest.raises(demo.DemoError, match=match) as e:
        demo.model_devices(text)
    assert e.value.code == 2


def _demo(capsys, *argv: str) -> tuple[int, str]:
    rc = demo.main(list(argv))
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("suite", ["encoder", "language"])
def test_a_suite_without_a_model_folder_refuses_model_devices(suite, tmp_path, capsys):
    rc, err = _demo(capsys, "--suite", suite, "--quick", "--model-devices", "1",
                    "--out", str(tmp_path / "out"))  # fmt: skip
    assert rc == 2
    assert f"--model-devices is not used by the {suite} suite" in err and "drop it" in err
    assert not (tmp_path / "out").exists()  # refused before any work


def test_a_study_refuses_model_devices(tmp_path, capsys):
    rc, err = _demo(capsys, "--study", "regime", "--quick", "--model-devices", "all",
                    "--out", str(tmp_path / "out"))  # fmt: skip
    assert rc == 2 and "which takes no --model-devices" in err


@pytest.mark.parametrize("value", ["0", str(N + 1), "many"])
@pytest.mark.parametrize("suite", ["nli", "vision"])
def test_a_bad_model_devices_is_a_usage_error_before_any_work(suite, value, tmp_path, capsys):
    """The folders exist (but hold no model): the flag is refused before anything is read."""
    rc, err = _demo(capsys, "--suite", suite, "--quick", "--model-dir", str(tmp_path),
                    "--data-dir", str(tmp_path), "--model-devices", value,
                    "--out", str(tmp_path / "out"))  # fmt: skip
    assert rc == 2
    assert err.startswith("netutility demo: error: --model-devices ") and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def _given_to(suite, monkeypatch, capsys, *argv) -> dict:
    """The keywords ``netutility demo --suite SUITE --quick ARGV`` passes to the suite's
    ``spec.requires`` (which stops the run there)."""
    seen = {}

    def requires(**given):
        seen.update(given)
        raise suites.SuiteUnavailable("stop here")

    spec = suites.get(suite)
    monkeypatch.setitem(suites.SUITES, suite, suites.SuiteSpec(
        name=suite, summary=spec.summary, presets=spec.presets, build=spec.build,
        requires=requires, grids=spec.grids, flags=spec.flags,
    ))  # fmt: skip
    rc, err = _demo(capsys, "--suite", suite, "--quick", *argv)
    assert rc == 2 and "stop here" in err
    return seen


def test_model_devices_reaches_the_suite_as_a_number(tmp_path, monkeypatch, capsys):
    """A valid value reaches ``spec.requires`` and ``spec.build`` as an int."""
    seen = _given_to("nli", monkeypatch, capsys, "--model-dir", str(tmp_path), "--data-dir",
                     str(tmp_path), "--model-devices", "all", "--out", str(tmp_path / "out"))  # fmt: skip
    assert seen["model_devices"] == N and isinstance(seen["model_devices"], int)


# ------------------------------------------------------------------------------- --min-bytes


def test_min_bytes_is_a_flag_of_the_suites_that_split_a_model():
    assert "min_bytes" in suites.FLAGS
    for name in ("nli", "vision"):
        assert {"model_devices", "min_bytes"} <= set(suites.get(name).flags)
    for name in ("encoder", "language", "language_head"):
        assert "min_bytes" not in suites.get(name).flags


@pytest.mark.parametrize(
    "text, want",
    [("0", 0), ("4096", 4096), ("1MiB", 2**20), ("64 KiB", 64 * 2**10), ("2gib", 2 * 2**30),
     ("3MB", 3 * 10**6), ("5kB", 5000), ("7B", 7), (" 12 ", 12)],
)  # fmt: skip
def test_min_bytes_values(text, want):
    assert demo.min_bytes(text) == want


@pytest.mark.parametrize("text", ["-1", "1.5MiB", "MiB", "", "12 parsecs", "1e6", "0x10"])
def test_a_bad_min_bytes_names_the_flag(text):
    with pytest.raises(
        demo.DemoError, match=rf"--min-bytes {text!r}: expected a whole number"
    ) as e:
        demo.min_bytes(text)
    assert e.value.code == 2


@pytest.mark.parametrize("suite", ["nli", "vision"])
def test_min_bytes_without_model_devices_is_refused_before_any_work(suite, tmp_path, capsys):
    rc, err = _demo(capsys, "--suite", suite, "--quick", "--model-dir", str(tmp_path),
                    "--data-dir", str(tmp_path), "--min-bytes", "0",
                    "--out", str(tmp_path / "out"))  # fmt: skip
    assert rc == 2 and len(err.splitlines()) == 1
    assert (
        "--min-bytes sets which weights a split model replicates; it needs --model-devices" in err
    )
    assert not (tmp_path / "out").exists()


def test_a_suite_that_splits_nothing_refuses_min_bytes(tmp_path, capsys):
    rc, err = _demo(capsys, "--suite", "language", "--quick", "--min-bytes", "0",
                    "--out", str(tmp_path / "out"))  # fmt: skip
    assert rc == 2 and "--min-bytes is not used by the language suite" in err


def test_min_bytes_reaches_the_suite_in_bytes(tmp_path, monkeypatch, capsys):
    seen = _given_to("vision", monkeypatch, capsys, "--model-dir", str(tmp_path), "--data-dir",
                     str(tmp_path), "--adapters", str(tmp_path), "--model-devices", "1",
                     "--min-bytes", "64KiB", "--out", str(tmp_path / "out"))  # fmt: skip
    assert seen["min_bytes"] == 65536 and seen["model_devices"] == 1
