"""Compare an experiment's ``results.json`` with a stored baseline of its estimates.

CI runs ``netutility demo --quick`` and then this script against
``tests/experiments/quick_baseline.json``. Every estimate of the results' ``table`` (each
method, space, budget and allocation, and the deltas) and ``controls`` is compared with the
baseline's value at the same path. The check fails when the set of estimates differs (a cell
gained or lost), when one is missing on one side only (None: not finite), or when one moved by
more than ``--fail`` points; moves over ``--warn`` points are listed without failing. The
quick demo trains small LoRAs on small splits, so rounding differences between CPUs move its
numbers by a little: ``--fail`` catches a broken merge or evaluation, not noise.

    python scripts/check_baseline.py RESULTS BASELINE            # compare (exit 1 on failure)
    python scripts/check_baseline.py RESULTS BASELINE --write    # store RESULTS' estimates
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SECTIONS = ("table", "controls")


def estimates(results: dict[str, Any]) -> dict[str, float | None]:
    """``{path: estimate}`` for every mapping with an ``"estimate"`` under :data:`SECTIONS`
    (paths joined by ``/``; list entries named by their ``key`` and ``space`` when they have
    them, else by their index)."""

    def walk(x: Any, path: str) -> Iterator[tuple[str, float | None]]:
        if isinstance(x, dict):
            if "estimate" in x:
                v = x["estimate"]
                yield path, None if v is None or not math.isfinite(float(v)) else float(v)
                return
            for k, v in x.items():
                yield from walk(v, f"{path}/{k}")
        elif isinstance(x, list):
            for i, v in enumerate(x):
                name = (
                    f"{v['space']}:{v['key']}"
                    if isinstance(v, dict) and "key" in v and "space" in v
                    else str(i)
                )
                yield from walk(v, f"{path}/{name}")

    out: dict[str, float | None] = {}
    for section in SECTIONS:
        if section not in results:
            raise SystemExit(f"check_baseline: the results have no {section!r} section")
        out.update(walk(results[section], section))
    return out


def compare(
    now: dict[str, float | None], base: dict[str, float | None], *, warn: float, fail: float
) -> tuple[list[str], list[str]]:
    """``(failures, warnings)``: one line per estimate that is missing on one side, not finite
    on one side only, or moved by more than ``fail`` (failures) or ``warn`` points (warnings)."""
    failures, warnings = [], []
    for path in sorted(set(base) - set(now)):
        failures.append(f"{path}: in the baseline ({base[path]}), not in the results")
    for path in sorted(set(now) - set(base)):
        failures.append(f"{path}: in the results ({now[path]}), not in the baseline")
    for path in sorted(set(now) & set(base)):
        a, b = base[path], now[path]
        if a is None or b is None:
            if (a is None) != (b is None):
                failures.append(f"{path}: baseline {a}, now {b}")
            continue
        d = b - a
        line = f"{path}: baseline {a:.2f}, now {b:.2f} ({d:+.2f})"
        if abs(d) > fail:
            failures.append(line)
        elif abs(d) > warn:
            warnings.append(line)
    return failures, warnings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="the run's results.json")
    p.add_argument("baseline", type=Path, help="the stored baseline (JSON)")
    p.add_argument("--warn", type=float, default=2.0, help="list moves over this (points)")
    p.add_argument("--fail", type=float, default=10.0, help="fail on moves over this (points)")
    p.add_argument("--write", action="store_true", help="store the results' estimates instead")
    a = p.parse_args(argv)
    if not 0 <= a.warn <= a.fail:
        p.error("--warn and --fail must satisfy 0 <= --warn <= --fail")
    try:
        results = json.loads(a.results.read_text())
    except (OSError, ValueError) as e:
        p.error(f"cannot read the results {a.results}: {e}")
    now = estimates(results)
    if a.write:
        doc = {
            "what": "estimates of `netutility demo --quick`'s results.json (scripts/check_baseline.py)",
            "command": results.get("command"),
            "commit": results.get("commit"),
            "versions": results.get("versions") or results.get("environment"),
            "estimates": now,
        }
        import netutility_jax as nu  # (only to write: the check itself needs the JSON alone)

        nu.provenance.write_json(a.baseline, doc)
        print(f"wrote {len(now)} estimates to {a.baseline}")
        return 0
    try:
        base = json.loads(a.baseline.read_text())["estimates"]
    except (OSError, ValueError, KeyError) as e:
        p.error(f"cannot read the baseline {a.baseline}: {e}")
    failures, warnings = compare(now, base, warn=a.warn, fail=a.fail)
    for line in warnings:
        print(f"moved: {line}")
    for line in failures:
        print(f"FAILED: {line}", file=sys.stderr)
    print(
        f"{len(now)} estimates against {len(base)} in {a.baseline}: {len(failures)} failed "
        f"(over {a.fail:g} points or missing), {len(warnings)} moved over {a.warn:g}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
