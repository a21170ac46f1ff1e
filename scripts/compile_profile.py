"""Summarise a test run's compile profile (``NETUTILITY_COMPILE_PROFILE=DIR python -m pytest ...``):
where the tests' time goes, by test file and by compiled program.

    NETUTILITY_COMPILE_PROFILE=/tmp/prof python -m pytest -q -n 2 --dist loadfile
    python scripts/compile_profile.py /tmp/prof [--top 30] [--json OUT]

Reads every ``compile_*.json`` in DIR (one per pytest process, written by tests/conftest.py)
and prints: the totals (tests, wall seconds summed over the processes, programs compiled, and
JAX's tracing, lowering and backend-compiling seconds); the test files by wall seconds, with
their JAX seconds and programs; the programs by JAX seconds, with how often each was compiled.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys

_JAX = ("tracing_s", "lowering_s", "backend_s")


def summarise(directory: str) -> dict:
    """The totals, per-file and per-program sums of the run's ``compile_*.json`` files."""
    paths = sorted(glob.glob(os.path.join(directory, "compile_*.json")))
    if not paths:
        raise SystemExit(
            f"compile_profile: no compile_*.json in {directory!r}; run the tests with "
            f"NETUTILITY_COMPILE_PROFILE={directory} first."
        )
    files: dict[str, dict[str, float]] = collections.defaultdict(collections.Counter)
    programs: dict[str, dict[str, float]] = collections.defaultdict(collections.Counter)
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for row in data["tests"]:
            entry = files[row["test"].split("::")[0]]
            entry["tests"] += 1
            for key in ("wall_s", "programs", *_JAX):
                entry[key] += row[key]
        for name, row in data["programs"].items():
            for key, value in row.items():
                programs[name][key] += value
    total = collections.Counter()
    for entry in files.values():
        total.update(entry)
    return {
        "processes": len(paths),
        "total": dict(total),
        "files": {k: dict(v) for k, v in files.items()},
        "programs": {k: dict(v) for k, v in programs.items()},
    }


def _jax_s(entry: dict) -> float:
    return sum(entry.get(k, 0.0) for k in _JAX)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", help="the NETUTILITY_COMPILE_PROFILE folder of a test run")
    p.add_argument("--top", type=int, default=30, help="rows per table (default 30)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the summary as JSON")
    args = p.parse_args(argv)
    s = summarise(args.directory)
    t = s["total"]
    print(
        f"{int(t.get('tests', 0))} tests in {s['processes']} processes: "
        f"{t.get('wall_s', 0):.0f} s of test time, {int(t.get('programs', 0))} programs "
        f"compiled; JAX {_jax_s(t):.0f} s (tracing {t.get('tracing_s', 0):.0f}, lowering "
        f"{t.get('lowering_s', 0):.0f}, backend {t.get('backend_s', 0):.0f})"
    )
    print(f"\n{'wall s':>8} {'JAX s':>8} {'programs':>8} {'tests':>6}  file")
    for name, e in sorted(s["files"].items(), key=lambda kv: -kv[1]["wall_s"])[: args.top]:
        print(
            f"{e['wall_s']:8.1f} {_jax_s(e):8.1f} {int(e['programs']):8d} "
            f"{int(e['tests']):6d}  {name}"
        )
    print(f"\n{'JAX s':>8} {'backend':>8} {'compiles':>8}  program")
    for name, e in sorted(s["programs"].items(), key=lambda kv: -_jax_s(kv[1]))[: args.top]:
        print(
            f"{_jax_s(e):8.1f} {e.get('backend_s', 0):8.1f} {int(e.get('programs', 0)):8d}  {name}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
