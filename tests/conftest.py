"""Shared pytest configuration; helpers and the dense reference live in ``_reference.py``.

The whole suite runs under strict dtype promotion (``jax_numpy_dtype_promotion="strict"``): an
implicit promotion in the library is a bug (STYLE.md). The ``test_strict_promotion_*`` tests also
check it explicitly for bf16/fp16/float32/float64 inputs.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import time

import hypothesis
import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")

# No example database, and Hypothesis' other caches (it keeps one of source constants even without
# a database) go to the temp dir: the suite writes nothing into the repository.
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "netutility-jax-hypothesis")
)
# The CLI's persistent compilation cache is a global JAX setting: off for in-process CLI tests
# (tests/cli/test_cli.py::test_compile_cache_* turn it on in their own processes).
os.environ["NETUTILITY_COMPILE_CACHE"] = "off"
hypothesis.settings.register_profile(
    "netutility", max_examples=15, deadline=None, database=None, derandomize=True
)
hypothesis.settings.load_profile("netutility")


def pytest_configure(config: pytest.Config) -> None:
    """Both test tiers compile for speed of compiling, as the suite is mostly compilation of
    small programs: XLA's backend optimisation off, LLVM's expensive passes skipped, XLA CPU's
    legacy (IR) emitters instead of its MLIR fusion emitters, one LLVM module per program.
    Measured on 50 compile-bound merge tests in one process on the 2-core machine: 71.5 s at
    XLA's defaults, 62.6 s with the first two flags, 31.9 s with all four. The flags change
    how code is generated, not what it computes (every test passes under both). The demos
    and the notebook in ``.ci/run`` compile with XLA's defaults, as users' programs do, and
    any test run does so with ``NETUTILITY_TEST_XLA_OPT=default``. Set here, before the first
    computation starts the backend; subprocesses of the tests inherit it."""
    del config
    if os.environ.get("NETUTILITY_TEST_XLA_OPT", "") != "default":
        flags = os.environ.get("XLA_FLAGS", "")
        for flag in (
            "xla_backend_optimization_level=0",
            "xla_llvm_disable_expensive_passes=true",
            "xla_cpu_use_fusion_emitters=false",
            "xla_cpu_parallel_codegen_split_count=1",
        ):
            if flag.split("=")[0] not in flags:
                flags = f"{flags} --{flag}".strip()
        os.environ["XLA_FLAGS"] = flags


@pytest.fixture(params=[3, 4], ids=lambda m: f"M{m}")
def m_tasks(request) -> int:
    return request.param


# Compile profile: with NETUTILITY_COMPILE_PROFILE=DIR, each pytest process writes
# DIR/compile_<worker>.json: per test its wall seconds and the programs JAX compiled for it
# (count, and seconds of tracing, lowering and XLA backend compiling, from jax.monitoring's
# events), and per program name the same summed over the run. `python
# scripts/compile_profile.py DIR` summarises it by test file and by program. Off by default.
_PROFILE_DIR = os.environ.get("NETUTILITY_COMPILE_PROFILE")
_EVENTS = {
    "/jax/core/compile/backend_compile_duration": "backend_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering_s",
    "/jax/core/compile/jaxpr_trace_duration": "tracing_s",
}
_test_cost: dict[str, float] = {}
_programs: dict[str, dict[str, float]] = collections.defaultdict(
    lambda: {"programs": 0, "backend_s": 0.0, "lowering_s": 0.0, "tracing_s": 0.0}
)
_tests: list[dict] = []


def _on_jax_event(event: str, duration: float, **kwargs) -> None:
    field = _EVENTS.get(event)
    if field is None:
        return
    # tracing reports the function's name, lowering and compiling "jit(name)": one key for both
    name = str(kwargs.get("fun_name", "?"))
    name = name[4:-1] if name.startswith("jit(") and name.endswith(")") else name
    entry = _programs[name]
    entry[field] += duration
    _test_cost[field] = _test_cost.get(field, 0.0) + duration
    if field == "backend_s":
        entry["programs"] += 1
        _test_cost["programs"] = _test_cost.get("programs", 0) + 1


if _PROFILE_DIR:
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_jax_event)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _test_cost.clear()
        start = time.perf_counter()
        yield
        row = {"programs": 0, "backend_s": 0.0, "lowering_s": 0.0, "tracing_s": 0.0}
        _tests.append({"test": item.nodeid, "wall_s": time.perf_counter() - start,
                       **row, **_test_cost})  # fmt: skip

    def pytest_unconfigure(config: pytest.Config) -> None:
        worker = getattr(config, "workerinput", {}).get("workerid", "main")
        os.makedirs(_PROFILE_DIR, exist_ok=True)
        path = os.path.join(_PROFILE_DIR, f"compile_{worker}.json")
        with open(path, "w") as f:
            json.dump({"tests": _tests, "programs": dict(_programs)}, f, indent=0)


# (This block stays last: tests/test_conftest_guard.py runs it, from here on, alone.)
# Duration guard: name every default-tier (not `slow`) test whose call phase took over
# NETUTILITY_DURATION_LIMIT seconds (10), so a developer sees which tests to move to the slow tier.
# Report only by default (timings on a loaded machine are not asserted); with
# NETUTILITY_DURATION_GUARD=fail such a test fails the session. Under pytest-xdist the workers'
# reports reach the controller's pytest_runtest_logreport, and the controller prints the summary.
_DURATION_LIMIT_S = float(os.environ.get("NETUTILITY_DURATION_LIMIT", "10"))
_DURATION_GUARD_FAILS = os.environ.get("NETUTILITY_DURATION_GUARD") == "fail"
_over_limit: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and "slow" not in report.keywords:
        if report.duration > _DURATION_LIMIT_S:
            _over_limit[report.nodeid] = report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    on_worker = hasattr(session.config, "workerinput")
    if _over_limit and _DURATION_GUARD_FAILS and not on_worker and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if not _over_limit or hasattr(config, "workerinput"):
        return
    terminalreporter.section(f"default-tier tests over {_DURATION_LIMIT_S:g} s")
    for nodeid, seconds in sorted(_over_limit.items(), key=lambda item: -item[1]):
        terminalreporter.line(f"{seconds:7.2f} s  {nodeid}")
    if _DURATION_GUARD_FAILS:
        terminalreporter.line("NETUTILITY_DURATION_GUARD=fail: failing the session")
    else:
        terminalreporter.line("move them to the slow tier or make them faster")
