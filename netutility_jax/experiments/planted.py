"""``python -m netutility_jax.experiments.planted``: the planted-interference study
(pre-registered in docs/experiments.md; :mod:`netutility_jax.experiments.harness.planting`).

Each seed is run, saved (``seed<N>.json``, ``seed<N>.npz``) and the report (``results.json``,
``results.md``) re-rendered from every seed in ``--out``: a seed run later, or by another
process, joins the same report. A seed already in ``--out`` is not run again unless
``--merges`` asks for a merge it lacks; then it is run for what it had and what is asked (the
merges it had come back from the job cache in ``--cache-dir``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

import netutility_jax as nu

from .demo import DemoError, run_planted

__all__ = ["PROG", "main", "parser"]

PROG = "python -m netutility_jax.experiments.planted"


def _seeds(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not out or any(s < 0 for s in out):
        raise argparse.ArgumentTypeError(f"expected non-negative seeds, got {text!r}")
    return out


def _merges(text: str) -> str | tuple[tuple[str, str, int | None], ...]:
    from .harness import planting as pl

    try:
        return pl.parse_merges(text)
    except nu.InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=_seeds, default=(0, 1, 2, 3, 4), metavar="0,1,2,3,4")
    p.add_argument("--out", required=True, metavar="DIR", help="where the seeds and the report go")
    p.add_argument("--cache-dir", default=None, metavar="DIR", help="trained adapters and merges")
    p.add_argument(
        "--merges",
        type=_merges,
        default="primary",
        metavar="primary|all|none|data_weaker|LABELS",
        help="which merges are evaluated for accuracy: primary (the pre-registered comparisons' "
        "merges, gamma 1, R 16 and full capacity), all (every arm, allocation and budget), none "
        "(read-out (a) only: exact, no evaluation), data_weaker (the 12 merges of the "
        "follow-up registered for the asymmetric term with the data-aware shares), or "
        "comma-separated labels "
        "arm/allocation/budget (e.g. conflict_g1/signed_weaker/R16,conflict_g1/all/full)",
    )
    p.add_argument(
        "--init",
        choices=("per_task", "shared"),
        default="per_task",
        help="the adapters' LoRA initialisation: per_task (the registered study) or shared (the "
        "regime study's centre cell: the allocations compared on those adapters too)",
    )
    p.add_argument("--quick", action="store_true", help="the quick preset's 3 tasks (a smoke test)")
    p.add_argument("--render", action="store_true", help="only re-render the report of --out")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    command = shlex.join(["python", "-m", "netutility_jax.experiments.planted", *argv])
    try:
        return run_planted(args, command, prog=PROG)
    except nu.NetUtilityError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.code if isinstance(e, DemoError) else 2


if __name__ == "__main__":
    sys.exit(main())
