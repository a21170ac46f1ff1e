"""The duration guard of ``conftest.py``: default-tier tests over the limit are named, and fail the
session only with NETUTILITY_DURATION_GUARD=fail. The inner runs load the guard's part of
conftest.py alone (no JAX to import in their processes) and a 0.05 s limit, to stay fast."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

_TESTS = """
import time
import pytest

def test_quick():
    pass

def test_sleepy():
    time.sleep(0.2)

@pytest.mark.slow
def test_sleepy_but_slow():
    time.sleep(0.2)
"""


@pytest.fixture
def guarded(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("NETUTILITY_DURATION_LIMIT", "0.05")
    monkeypatch.delenv("NETUTILITY_DURATION_GUARD", raising=False)
    conftest = Path(__file__).with_name("conftest.py").read_text()
    guard = conftest[conftest.index("# Duration guard") :]
    pytester.makeconftest("from __future__ import annotations\nimport os\nimport pytest\n" + guard)
    pytester.makeini("[pytest]\nmarkers =\n    slow: long-running\n")
    pytester.makepyfile(test_timed=_TESTS)
    return pytester


def _named(result: pytest.RunResult) -> list[str]:
    """The test names listed in the guard's section (its lines end in a node id)."""
    lines = result.outlines
    start = next(i for i, line in enumerate(lines) if "default-tier tests over 0.05 s" in line)
    return [line.split("::")[-1] for line in lines[start + 1 :] if " s  test_timed.py::" in line]


def test_guard_names_a_slow_default_tier_test_without_failing(guarded: pytest.Pytester) -> None:
    result = guarded.runpytest()
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.OK
    assert _named(result) == ["test_sleepy"]  # neither the quick one nor the one marked slow


def test_guard_fails_the_session_when_asked(
    guarded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NETUTILITY_DURATION_GUARD", "fail")
    result = guarded.runpytest()
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert _named(result) == ["test_sleepy"]
    result.stdout.fnmatch_lines(["*NETUTILITY_DURATION_GUARD=fail: failing the session*"])


def test_guard_is_silent_and_passes_when_nothing_is_over(
    guarded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NETUTILITY_DURATION_GUARD", "fail")
    result = guarded.runpytest("-m", "not slow", "-k", "quick")
    result.assert_outcomes(passed=1, deselected=2)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.no_fnmatch_line("*default-tier tests over*")


def test_guard_works_under_xdist(guarded: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    # the workers' reports reach the controller, which prints the section once and sets the status
    # (xdist alone: the other plugins would double the three processes' start-up)
    monkeypatch.setenv("NETUTILITY_DURATION_GUARD", "fail")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = guarded.runpytest_subprocess("-p", "xdist", "-n", "2")
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert _named(result) == ["test_sleepy"]
    assert sum("default-tier tests over" in line for line in result.outlines) == 1
