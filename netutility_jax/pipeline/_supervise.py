"""``netutility merge --distributed`` run under a supervisor: one line instead of a C++ abort.

When a process of a ``jax.distributed`` run dies (killed, out of memory, a crashed host), JAX's
coordination service ends every other process with a fatal C++ error: an abort and some sixty
lines of log and stack trace, after the heartbeat timeout. Python cannot intercept that, so the
command runs its work in a child process (:func:`run`) and this parent, which never imports JAX,
reads the child's standard error: the child's own lines pass through as they come; JAX's C++ log
lines, Gloo's connection lines and stack traces are held back, and when the child dies of a
signal the parent prints one line naming what happened (read from the held lines) and exits
with status 2. ``NETUTILITY_SUPERVISED_CHILD=1`` marks the child, which runs the command itself.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

__all__ = ["CHILD_ENV", "is_child", "reason", "run"]

CHILD_ENV = "NETUTILITY_SUPERVISED_CHILD"

# JAX's C++ (absl) log lines: "E1126 14:28:07.641879   20631 coordination_service.cc:1520] ..."
_ABSL = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s+\S+:\d+\]")
_NOISE = (
    re.compile(r"^\[Gloo\]"),
    re.compile(r"^\s*@\s+0x[0-9a-f]+"),  # stack frames
    re.compile(r"^\*\*\* (Check failure|SIG[A-Z]+|Begin stack)"),
)
_HEARTBEAT = re.compile(r"Task (\d+) heartbeat timeout")
_UNHEALTHY = re.compile(r"tasks are unhealthy \(stopped sending heartbeats\):\s*([\d, ]+)")


def is_child() -> bool:
    """Whether this process is the supervised child (it runs the command itself)."""
    return os.environ.get(CHILD_ENV) == "1"


def _held(line: str) -> bool:
    return bool(_ABSL.match(line)) or any(p.match(line) for p in _NOISE)


def reason(held: Sequence[str], returncode: int) -> str:
    """What ended the child, in one phrase, from JAX's held log lines and its exit status."""
    text = "\n".join(held)
    dead = sorted({int(m) for m in _HEARTBEAT.findall(text)})
    for m in _UNHEALTHY.finditer(text):
        dead = sorted({*dead, *(int(t) for t in re.findall(r"\d+", m.group(1)))})
    if dead:
        who = ", ".join(map(str, dead))
        return (
            f"process{'es' if len(dead) > 1 else ''} {who} of the distributed run stopped "
            "responding (killed, out of memory or crashed; see its own output)"
        )
    if "detected fatal errors" in text or "another task died" in text:
        return (
            "another process of the distributed run stopped (killed, out of memory or "
            "crashed; see its output)"
        )
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"the merge process ended with {name}"
    return f"the merge process ended with status {returncode}"


def run(argv: Sequence[str], prog: str, *, cmd: Sequence[str] | None = None) -> int:
    """Run ``python -m netutility_jax.cli ARGV`` (or ``cmd``) as a supervised child; its exit
    status, or 2 with one line on standard error when it dies of a signal or a fatal JAX
    error."""
    # JAX's C++ log below fatal is off in the child (its multi-line errors before an abort
    # would otherwise reach the terminal); a user's own setting is kept
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", **os.environ, CHILD_ENV: "1"}
    if cmd is None:
        cmd = [sys.executable, "-m", "netutility_jax.cli", *argv]
    child = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    held: list[str] = []
    pump = threading.Thread(target=_pump, args=(child.stderr.fileno(), held), daemon=True)
    pump.start()
    forwarded = {}

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            forwarded[sig] = signal.signal(sig, forward)
        except ValueError:  # (not the main thread: signals stay as they are)
            pass
    try:
        rc = child.wait()
        pump.join()
        child.stderr.close()
    finally:
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
    fatal = any(line.startswith("F") and _ABSL.match(line) for line in held)
    if rc < 0 or fatal or rc == 128 + signal.SIGABRT:
        sys.stderr.write(f"{prog}: error: {reason(held, rc)}\n")
        sys.stderr.flush()
        return 2
    return rc


def _pump(fd: int, held: list[str]) -> None:
    """The child's standard error as it comes (``\\r``-ended progress bars included): JAX's
    own lines, and everything after a fatal one (its message and stack trace), held; the
    rest passed on."""
    buf, fatal = b"", False

    def emit(seg: bytes) -> None:
        nonlocal fatal
        text = seg.decode(errors="replace")
        line = text.rstrip("\r\n")
        if fatal or _held(line):
            fatal = fatal or bool(line.startswith("F") and _ABSL.match(line))
            held.append(line)
        else:
            sys.stderr.write(text)
            sys.stderr.flush()

    while chunk := os.read(fd, 1 << 16):
        buf += chunk
        while (ends := [i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0]) != []:
            cut = min(ends) + 1
            emit(buf[:cut])
            buf = buf[cut:]
    if buf:
        emit(buf)
