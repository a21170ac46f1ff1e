"""The supervisor of ``netutility merge --distributed`` (``netutility_jax.pipeline._supervise``): a child
that dies of a fatal JAX error or a signal ends in one line and exit status 2; everything the
child writes itself (progress bars with carriage returns included) passes through unchanged;
JAX's C++ log lines, Gloo's and stack traces are held back."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from netutility_jax.pipeline import _supervise

# The lines a process of a real 2-process run printed when its peer was killed with -9
# (jaxlib 0.8, TF_CPP_MIN_LOG_LEVEL=3), shortened.
FATAL = [
    "F1126 14:28:52.432802   20868 client.h:80] Terminating process because the JAX "
    "distributed service detected fatal errors. This most likely indicates that another task "
    "died; see the other task logs for more details.",
    "Barrier result: 'INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 1 "
    "heartbeat timeout. This indicates that the remote task has failed",
    "*** Check failure stack trace: ***",
    "    @     0x7faf37c40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()",
]


def test_reason_names_the_process_that_stopped():
    assert _supervise.reason(FATAL, -6).startswith("process 1 of the distributed run stopped")
    unhealthy = ["E1126 14:28:07.641994   20631 coordination_service.cc:1549] x: UNAVAILABLE: "
                 "The following tasks are unhealthy (stopped sending heartbeats): 2, 3"]  # fmt: skip
    assert _supervise.reason(unhealthy, -6).startswith("processes 2, 3 of the distributed run")
    assert "another process" in _supervise.reason(FATAL[:1], -6)
    assert _supervise.reason([], -9) == "the merge process ended with SIGKILL"


def _child(code: str, capfd) -> tuple[int, str, str]:
    rc = _supervise.run([], "netutility merge", cmd=[sys.executable, "-c", textwrap.dedent(code)])
    out, err = capfd.readouterr()
    return rc, out, err


def test_a_fatal_jax_error_becomes_one_line(capfd):
    lines = "\n".join(FATAL)
    rc, out, err = _child(
        f"""
        import os, signal, sys
        print("merged so far", flush=True)
        sys.stderr.write("progress 1/3\\r" "progress 2/3\\r" "[Gloo] Rank 0 is connected\\n")
        sys.stderr.write({lines!r} + "\\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGABRT)
        """,
        capfd,
    )
    assert rc == 2
    assert out == "merged so far\n"
    assert err == (
        "progress 1/3\rprogress 2/3\rnetutility merge: error: process 1 of the distributed run "
        "stopped responding (killed, out of memory or crashed; see its own output)\n"
    )


def test_the_childs_own_errors_and_status_pass_through(capfd):
    rc, out, err = _child(
        """
        import sys
        sys.stderr.write("netutility merge: error: --budget: expected a positive integer\\n")
        sys.exit(2)
        """,
        capfd,
    )
    assert (rc, out) == (2, "")
    assert err == "netutility merge: error: --budget: expected a positive integer\n"
    rc, _, err = _child("print('ok')", capfd)
    assert (rc, err) == (0, "")


def test_a_killed_child_ends_in_one_line(capfd):
    rc, _, err = _child("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", capfd)
    assert rc == 2
    assert err == "netutility merge: error: the merge process ended with SIGKILL\n"


def test_the_child_is_marked_and_keeps_the_users_log_level(monkeypatch, capfd):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    code = "import os; print(os.environ['TF_CPP_MIN_LOG_LEVEL'], os.environ['{}'])"
    rc, out, _ = _child(code.format(_supervise.CHILD_ENV), capfd)
    assert (rc, out) == (0, "1 1\n")
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")
    rc, out, _ = _child(code.format(_supervise.CHILD_ENV), capfd)
    assert (rc, out) == (0, "3 1\n")


@pytest.mark.parametrize("bad", ["localhost", "localhost:0", "localhost:70000", "h:p", ":80",
                                 "[zz]:80", "no-such-host.invalid:1234"])  # fmt: skip
def test_coordinator_addresses_are_checked_before_joining(bad):
    from netutility_jax.errors import InputError
    from netutility_jax.pipeline import _exchange

    with pytest.raises(InputError, match="coordinator"):
        _exchange.check_coordinator("nu.f", bad)
    assert _exchange.check_coordinator("nu.f", "localhost:1234") == ("localhost", 1234)
    assert _exchange.check_coordinator("nu.f", "[::1]:80") == ("::1", 80)


def test_a_process_that_cannot_join_ends_in_one_line_within_its_timeout():
    # process 1 of 2, with nobody at the coordinator: JAX alone would wait 300 s then abort
    code = textwrap.dedent(
        """
        import socket
        from netutility_jax.pipeline import _exchange
        with socket.socket() as s:
            s.bind(("localhost", 0)); port = s.getsockname()[1]
        _exchange.initialize("nu.f", f"localhost:{port}", 2, 1, timeout_s=2)
        """
    )
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=env)  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "did not all join within 2 s" in lines[0], r.stderr
    assert "this is process 1" in lines[0]
